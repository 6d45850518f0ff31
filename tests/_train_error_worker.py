"""torchrun worker: scripts.base_train (--synthetic-data) whose loader raises an unplanned error (a RuntimeError, as
an OOM or a bug would) in the first micro-batch of step 3 on the ranks named by FAIL_RANKS ("0", "1", "0,1"). A
rank that does not fail goes on into the step's gradient all-reduce and waits there for the failed rank; with
SIGTERM_RANKS it gets a SIGTERM first (latched by base_train), as from torchrun once the failed rank has exited."""

import os
import signal
import sys

from nanochat import train_loop
from scripts import base_train

rank = int(os.environ["RANK"])
real_next = train_loop.SyntheticLoader.__next__


def next_batch(self):
    # 2 micro-batches per step (the test's BATCH): count 4 is the first of step 3
    if str(rank) in os.environ.get("SIGTERM_RANKS", "").split(",") and self.count == 4:
        os.kill(os.getpid(), signal.SIGTERM)
    if str(rank) in os.environ["FAIL_RANKS"].split(",") and self.count == 4:
        raise RuntimeError(f"simulated out of memory (rank {rank})")
    return real_next(self)


train_loop.SyntheticLoader.__next__ = next_batch
sys.exit(base_train.main(sys.argv[1:]))
