"""Worker for test_dataloader: build the eval rows with the tokenization split across the torchrun ranks; rank 0
saves them (and how many documents each rank tokenized) to OUT. Arguments: DATA TOKENIZER CASE [CASE ...], each CASE
``OUT`` (the val rows) or ``OUT,SPLIT,SEED`` (those of SPLIT in the order a loader of --data-seed SEED reads it
first), then optionally ``--stops ROUNDS OUT``: tests/_eval_rows_stop_worker.py's scenarios, in the same launch (a
torchrun start-up costs more of the CI's 2 cores than all of these cases)."""
import sys

import torch
import torch.distributed as dist

from nanochat import dataloader
from nanochat.common import compute_cleanup, compute_init
from nanochat.tokenizer import Tokenizer

from _eval_rows_stop_worker import stop_rounds  # noqa: E402 - tests/ is the script's directory


def rows_case(data_dir, tok, info, out, split="val", seed=None) -> None:
    tokenized = {"docs": 0}
    real = dataloader._tokenize_docs

    def counting(tokenizer, texts):
        tokenized["docs"] += len(texts)
        return real(tokenizer, texts)

    dataloader._tokenize_docs = counting
    try:
        rows = dataloader.build_eval_rows(data_dir, split, tok, 128, 20000, rank=info.rank,
                                          world_size=info.world_size, first_read_seed=seed)
    finally:
        dataloader._tokenize_docs = real
    counts = [None] * info.world_size
    dist.all_gather_object(counts, tokenized["docs"])
    every = [None] * info.world_size
    dist.all_gather_object(every, rows)
    if info.rank == 0:
        assert all(torch.equal(r, rows) for r in every)  # every rank packed the same rows
        torch.save({"rows": rows, "docs_tokenized": counts}, out)


data_dir, tok_dir, *cases = sys.argv[1:]
stops = None
if "--stops" in cases:
    at = cases.index("--stops")
    cases, stops = cases[:at], cases[at + 1:]
info, _ = compute_init("cpu")
tok = Tokenizer.load(tok_dir)
for case in cases:
    out, *split_seed = case.split(",")
    rows_case(data_dir, tok, info, out, *([split_seed[0], int(split_seed[1])] if split_seed else []))
if stops:
    stop_rounds(data_dir, tok, info.rank, info.world_size, *stops)
dist.barrier()
compute_cleanup()
