"""torchrun worker for test_base_eval: scripts.base_eval under gloo. ``--sigterm-at-task K R[,R...]`` first: the
ranks R send themselves SIGTERM when they start CORE task K (0-based): every rank, as a Slurm time limit reaches
them, or one alone."""

import os
import signal
import sys

import torch

from nanochat import core_eval
from scripts.base_eval import main


def sigterm_at_task(k: int, ranks: set[int]) -> None:
    real, calls = core_eval.evaluate_task, []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) > k and int(os.environ["RANK"]) in ranks:
            os.kill(os.getpid(), signal.SIGTERM)  # latched: every rank stops at the task's first batch vote
        return real(*args, **kwargs)

    core_eval.evaluate_task = wrapped


if __name__ == "__main__":
    torch.set_num_threads(1)
    argv = sys.argv[1:]
    if argv[:1] == ["--sigterm-at-task"]:
        sigterm_at_task(int(argv[1]), {int(r) for r in argv[2].split(",")})
        argv = argv[3:]
    sys.exit(main(argv))
