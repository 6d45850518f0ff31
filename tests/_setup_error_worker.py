"""torchrun worker: scripts.base_train (--synthetic-data) whose set-up raises an unplanned error on the ranks named
by FAIL_RANKS ("0", "1", "0,1") at the point FAIL_AT names: "model" (building the model, as a CUDA OOM would),
"restore" (loading the --resume checkpoint, as a corrupt file would: pickle's error), "resume_point" (before the
resume check's first collective: a rank failing alone outside any shared step, as a bug would). A rank that does not
fail goes on to the set-up's next collective."""

import os
import pickle
import sys

from nanochat import train_resume
from scripts import base_train

rank = int(os.environ["RANK"])
failing = str(rank) in os.environ.get("FAIL_RANKS", "").split(",")
fail_at = os.environ.get("FAIL_AT", "")
real_build_model, real_restore, real_resume_point = base_train.build_model, train_resume.restore, \
    train_resume.resume_point


def build_model(*args, **kwargs):
    if failing and fail_at == "model":
        raise RuntimeError(f"simulated CUDA out of memory (rank {rank})")
    return real_build_model(*args, **kwargs)


def restore(run, point):
    if failing and fail_at == "restore":
        raise pickle.UnpicklingError(f"simulated corrupt checkpoint (rank {rank})")
    return real_restore(run, point)


def resume_point(*args, **kwargs):
    if failing and fail_at == "resume_point":
        raise RuntimeError(f"simulated bug (rank {rank})")
    return real_resume_point(*args, **kwargs)


base_train.build_model = build_model
train_resume.resume_point = resume_point
train_resume.restore = restore
sys.exit(base_train.main(sys.argv[1:]))
