"""torchrun worker: scripts.base_train where a SIGTERM reaches every rank during the final evaluation, rank 1 first
and rank 0 while it waits in the evaluation's collective for rank 1: rank 1 leaves on its signal, and rank 0's
collective then fails (its partner is gone) with its own signal latched, the order a scheduler's cancel can take."""

import os
import signal
import sys
import threading
import time

from scripts import base_train

rank = int(os.environ["RANK"])
real_eval = base_train.run_split_bpb


def sigterm_after(seconds: float) -> None:
    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM)).start()


def run_split_bpb(*args, **kwargs):  # the final evaluation's (the flags have no periodic evals)
    if rank == 1:
        sigterm_after(1.0)
        time.sleep(30)  # the handler raises in here
        raise AssertionError("SIGTERM did not interrupt rank 1's final evaluation")
    sigterm_after(0.3)  # while rank 0 waits in the evaluation's all-reduce for rank 1
    return real_eval(*args, **kwargs)


base_train.run_split_bpb = run_split_bpb
sys.exit(base_train.main(sys.argv[1:]))
