"""torchrun worker: scripts.base_train (--synthetic-data) whose loader raises an unplanned error (a RuntimeError, as
an OOM or a bug would) in the first micro-batch of step 3 on the ranks named by FAIL_RANKS ("0", "1", "0,1"). A
rank that does not fail goes on into the step's gradient all-reduce and waits there for the failed rank; with
SIGTERM_RANKS it gets a SIGTERM first (latched by base_train), as from torchrun once the failed rank has exited.
FAIL_DELAY_S: rank 1 waits that long before it raises (it fails after rank 0 has posted its error). FAIL_WRITE: the
name of a file in the run dir whose write by base_train's set-up fails on rank 0 like a full disk (before step 1).
AGREEMENT_WAIT_S replaces nanochat.final_eval's bound on rank 0's wait for the other ranks' errors."""

import os
import signal
import sys
import time

from nanochat import final_eval, train_loop
from scripts import base_train

rank = int(os.environ["RANK"])
real_next = train_loop.SyntheticLoader.__next__
real_write_json = base_train.write_json


def next_batch(self):
    # 2 micro-batches per step (the test's BATCH): count 4 is the first of step 3
    if str(rank) in os.environ.get("SIGTERM_RANKS", "").split(",") and self.count == 4:
        os.kill(os.getpid(), signal.SIGTERM)
    if str(rank) in os.environ.get("FAIL_RANKS", "").split(",") and self.count == 4:
        if rank == 1:
            time.sleep(float(os.environ.get("FAIL_DELAY_S", "0")))
        raise RuntimeError(f"simulated out of memory (rank {rank})")
    return real_next(self)


def write_json(path, obj):
    if path.name == os.environ.get("FAIL_WRITE"):
        raise OSError(28, "No space left on device", str(path))
    return real_write_json(path, obj)


train_loop.SyntheticLoader.__next__ = next_batch
if os.environ.get("AGREEMENT_WAIT_S"):
    final_eval.AGREEMENT_WAIT_S = float(os.environ["AGREEMENT_WAIT_S"])
base_train.write_json = write_json
sys.exit(base_train.main(sys.argv[1:]))
