"""torchrun worker (2 ranks) for test_dataloader: build_eval_rows under ``interrupts_raise`` (as base_eval builds a
split's rows) in chunks of 4 documents, so that the val split takes many rounds of tokenization. Rank 1 sends
itself SIGTERM while it tokenizes its chunk of round R (1-based; 0: never), for each R of ROUNDS (a comma list).
Rank 0 writes {R: [[rank 0's rounds, outcome], [rank 1's ...]]} to OUT."""
import json
import os
import signal
import sys

import torch.distributed as dist

from nanochat import dataloader
from nanochat.common import compute_cleanup, compute_init
from nanochat.eval_resume import Interrupted, interrupts_raise
from nanochat.tokenizer import Tokenizer

data_dir, tok_dir, signal_rounds, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
info, _ = compute_init("cpu")
tok = Tokenizer.load(tok_dir)
real = dataloader._tokenize_docs
results = {}
for signal_round in map(int, signal_rounds.split(",")):
    rounds = []

    def tokenize(tokenizer, texts):
        rounds.append(1)
        if info.rank == 1 and len(rounds) == signal_round:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(tokenizer, texts)

    dataloader._tokenize_docs = tokenize
    try:
        with interrupts_raise():
            dataloader.build_eval_rows(data_dir, "val", tok, 128, 20000, rank=info.rank, world_size=info.world_size,
                                       chunk_docs=4)
        outcome = "finished"
    except Interrupted as e:
        outcome = str(e)
    both = [None, None]
    dist.all_gather_object(both, [len(rounds), outcome])
    results[signal_round] = both
if info.rank == 0:
    with open(out, "w") as f:
        json.dump(results, f)
compute_cleanup()
