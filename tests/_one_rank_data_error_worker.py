"""torchrun worker: scripts.base_train (--synthetic-data) where rank 1's loader raises DataError in its 3rd step, as
a data file only that rank reads (each rank reads its own row groups) that turns out unreadable mid-run; FAIL_AT picks
the micro-batch (default 4, the step's first), FAIL_RANKS the ranks (default "1"). The ranks that read fine must still
stop with it (data_error, exit 2, no checkpoint of the broken step)."""

import os
import sys

from nanochat import train_loop
from nanochat.dataset import DataError
from scripts import base_train

rank = int(os.environ["RANK"])
real_next = train_loop.SyntheticLoader.__next__


def next_batch(self):
    # 2 micro-batches per step (the test's BATCH): count 4 is the first of step 3, count 5 its last
    if str(rank) in os.environ.get("FAIL_RANKS", "1").split(",") and self.count == int(os.environ.get("FAIL_AT", "4")):
        raise DataError("/data/train_00042.parquet: row group 7 cannot be read (OSError: test); the file is corrupt")
    return real_next(self)


train_loop.SyntheticLoader.__next__ = next_batch
sys.exit(base_train.main(sys.argv[1:]))
