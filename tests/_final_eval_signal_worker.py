"""torchrun worker: scripts.base_train where SIGTERM reaches the ranks named by ``--sigterm-ranks R[,R...]`` (the
first two arguments) during the final evaluation, once the rank has scored the first batch of its val bpb: one rank
alone (rare, as torchrun and Slurm signal every rank, but it must not leave the other ranks waiting in the
evaluation's collectives) or every rank. The signal is sent from inside the evaluation loop, so it is certain to
land in it, between the collectives the ranks take together."""

import os
import signal
import sys

from nanochat import dataloader
from scripts import base_train

rank = int(os.environ["RANK"])
real_batches = dataloader.iter_eval_batches


def iter_eval_batches(*args, **kwargs):  # the final evaluation's (the flags have no periodic evals)
    for index, batch in enumerate(real_batches(*args, **kwargs)):
        yield batch
        if index == 0 and rank in signalled:
            os.kill(os.getpid(), signal.SIGTERM)


assert sys.argv[1] == "--sigterm-ranks", sys.argv
signalled = {int(r) for r in sys.argv[2].split(",")}
dataloader.iter_eval_batches = iter_eval_batches
sys.exit(base_train.main(sys.argv[3:]))
