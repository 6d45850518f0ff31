"""Worker for test_dataloader: build the eval rows with the tokenization split across the torchrun ranks; rank 0
saves them (and how many documents this rank tokenized) to OUT. Arguments: DATA TOKENIZER OUT [SPLIT SEED]: the val
rows, or those of SPLIT in the order a loader of --data-seed SEED reads it first."""
import sys

import torch
import torch.distributed as dist

from nanochat import dataloader
from nanochat.common import compute_cleanup, compute_init
from nanochat.tokenizer import Tokenizer

data_dir, tok_dir, out = sys.argv[1:4]
split, seed = (sys.argv[4], int(sys.argv[5])) if len(sys.argv) > 5 else ("val", None)
info, _ = compute_init("cpu")
tok = Tokenizer.load(tok_dir)
tokenized = {"docs": 0}
real = dataloader._tokenize_docs


def counting(tokenizer, texts):
    tokenized["docs"] += len(texts)
    return real(tokenizer, texts)


dataloader._tokenize_docs = counting
rows = dataloader.build_eval_rows(data_dir, split, tok, 128, 20000, rank=info.rank, world_size=info.world_size,
                                  first_read_seed=seed)
counts = [None] * info.world_size
dist.all_gather_object(counts, tokenized["docs"])
every = [None] * info.world_size
dist.all_gather_object(every, rows)
if info.rank == 0:
    assert all(torch.equal(r, rows) for r in every)  # every rank packed the same rows
    torch.save({"rows": rows, "docs_tokenized": counts}, out)
dist.barrier()
compute_cleanup()
