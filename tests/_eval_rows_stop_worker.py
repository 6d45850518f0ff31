"""torchrun worker (2 ranks) for test_dataloader: build_eval_rows under ``interrupts_raise`` (as base_eval builds a
split's rows) in chunks of 4 documents, so that the val split takes many rounds of tokenization. Rank 1 sends
itself SIGTERM while it tokenizes its chunk of round R (1-based; 0: never), for each R of ROUNDS (a comma list).
Rank 0 writes {R: [[rank 0's rounds, outcome], [rank 1's ...]]} to OUT. Arguments: DATA TOKENIZER ROUNDS OUT
(tests/_eval_rows_worker.py runs ``stop_rounds`` in its launch too)."""
import json
import os
import signal
import sys

import torch.distributed as dist

from nanochat import dataloader
from nanochat.common import compute_cleanup, compute_init
from nanochat.eval_resume import Interrupted, interrupts_raise
from nanochat.tokenizer import Tokenizer


def stop_rounds(data_dir, tok, rank: int, world_size: int, signal_rounds: str, out) -> None:
    """Each scenario of ``signal_rounds`` in turn, in the process group (initialized); rank 0 writes OUT."""
    real = dataloader._tokenize_docs
    results = {}
    for signal_round in map(int, signal_rounds.split(",")):
        rounds = []

        def tokenize(tokenizer, texts):
            rounds.append(1)
            if rank == 1 and len(rounds) == signal_round:
                os.kill(os.getpid(), signal.SIGTERM)
            return real(tokenizer, texts)

        dataloader._tokenize_docs = tokenize
        try:
            with interrupts_raise():
                dataloader.build_eval_rows(data_dir, "val", tok, 128, 20000, rank=rank, world_size=world_size,
                                           chunk_docs=4)
            outcome = "finished"
        except Interrupted as e:
            outcome = str(e)
        finally:
            dataloader._tokenize_docs = real
        both = [None, None]
        dist.all_gather_object(both, [len(rounds), outcome])
        results[signal_round] = both
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    info, _ = compute_init("cpu")
    stop_rounds(sys.argv[1], Tokenizer.load(sys.argv[2]), info.rank, info.world_size, sys.argv[3], sys.argv[4])
    compute_cleanup()
