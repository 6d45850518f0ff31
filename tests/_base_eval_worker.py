"""torchrun worker for test_base_eval: scripts.base_eval under gloo. ``--sigterm-at-task K`` first: every rank
sends itself SIGTERM when it starts CORE task K (0-based), as a Slurm time limit reaches every rank."""

import os
import signal
import sys
import time

import torch

from nanochat import core_eval
from scripts.base_eval import main


def sigterm_at_task(k: int) -> None:
    real, calls = core_eval.evaluate_task, []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) > k:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # base_eval's handler raises in here
        return real(*args, **kwargs)

    core_eval.evaluate_task = wrapped


if __name__ == "__main__":
    torch.set_num_threads(1)
    argv = sys.argv[1:]
    if argv[:1] == ["--sigterm-at-task"]:
        sigterm_at_task(int(argv[1]))
        argv = argv[2:]
    sys.exit(main(argv))
