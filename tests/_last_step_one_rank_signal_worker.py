"""torchrun worker: scripts.base_train where a SIGTERM reaches rank 1 only, after the last step's stop vote (e.g.
while the final checkpoint is written): rank 1 has a latched signal, rank 0 none, and the ranks must still agree on
whether the final evaluation runs."""

import os
import signal
import sys

from scripts import base_train

rank = int(os.environ["RANK"])
real_step = base_train.train_step
steps = []


def train_step(*args, **kwargs):
    out = real_step(*args, **kwargs)  # its stop votes are agreed: the signal below is in none of them
    steps.append(1)
    if rank == 1 and len(steps) == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return out


base_train.train_step = train_step
sys.exit(base_train.main(sys.argv[1:]))
