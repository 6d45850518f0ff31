"""torchrun worker: scripts.base_train (--synthetic-data) whose set-up raises an unplanned error on the ranks named
by FAIL_RANKS ("0", "1", "0,1") at the point FAIL_AT names: "model" (building the model, as a CUDA OOM would),
"restore" (loading the --resume checkpoint, as a corrupt file would: pickle's error), "resume_point" (before the
resume check's first collective: a rank failing alone outside any shared step, as a bug would), "resolve" (rank 0's
choice of the --resume step, which it makes alone in a shared step: rank0_decides). A rank that does not fail goes on
to the set-up's next collective, after SLOW_S seconds of local work if set (data, eval rows, a model build);
AGREEMENT_WAIT_S, if set, replaces final_eval's (a test knob: the old bound of a lone rank's wait, shortened)."""

import os
import pickle
import sys
import time

from nanochat import checkpoint as ckpt
from nanochat import final_eval, train_resume
from scripts import base_train

rank = int(os.environ["RANK"])
failing = str(rank) in os.environ.get("FAIL_RANKS", "").split(",")
fail_at = os.environ.get("FAIL_AT", "")
slow_s = float(os.environ.get("SLOW_S", "0"))
if "AGREEMENT_WAIT_S" in os.environ:
    final_eval.AGREEMENT_WAIT_S = float(os.environ["AGREEMENT_WAIT_S"])
real_build_model, real_restore, real_resume_point = base_train.build_model, train_resume.restore, \
    train_resume.resume_point
real_resolve = ckpt.resolve_resume_step


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
    time.sleep(slow_s)
    return real_resume_point(*args, **kwargs)


def resolve_resume_step(*args, **kwargs):
    if failing and fail_at == "resolve":
        raise RuntimeError(f"simulated bug in the resume choice (rank {rank})")
    return real_resolve(*args, **kwargs)


base_train.build_model = build_model
train_resume.resume_point = resume_point
train_resume.restore = restore
ckpt.resolve_resume_step = resolve_resume_step
sys.exit(base_train.main(sys.argv[1:]))
