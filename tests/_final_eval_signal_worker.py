"""torchrun worker: scripts.base_train where SIGTERM reaches the ranks named by ``--sigterm-ranks R[,R...]`` (the
first two arguments; "" names none) during the final evaluation, once the rank has scored the first batch of its val
bpb: one rank alone (rare, as torchrun and Slurm signal every rank, but it must not leave the other ranks waiting in
the evaluation's collectives) or every rank. The signal is sent from inside the evaluation loop, so it is certain to
land in it, between the collectives the ranks take together.

With ``--in-core`` (the third argument) the final evaluation has a stand-in CORE of two tasks ("a", "b": each an
all-reduce, kept like evaluate_core's tasks) after the val bpb, and the signal comes in task a instead: the val bpb
and task a are finished and kept for a --resume. Each rank prints "rank R scores task T" for each task it computes.
With FULL_DISK_IN_TASK_A=1 in the environment rank 0's write that keeps task a fails (ENOSPC).

With ``--after-last-step`` (the third argument) instead the signal comes after the run's last step (--num-iterations),
its stop votes taken (e.g. while the final checkpoint is written), before the final evaluation: a rank that has a
latched signal and one that has none must still agree on whether the final evaluation runs.

With ``--runs-out DIR`` first, several runs in one launch (a launch costs more of the CI's 2 cores than a tiny run),
separated by ``--next-run``, each with its own leading ``--sigterm-ranks R [--in-core | --after-last-step]``
(tests/_train_runs_worker.run_each: run N's output in DIR/runN.rank<r>.out, its run dir as it left it in DIR/runN)."""

import errno
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from _train_runs_worker import run_each
from nanochat import dataloader, eval_resume, final_eval
from scripts import base_train

rank = int(os.environ["RANK"])
real_batches = dataloader.iter_eval_batches
real_resolve_bundle, real_run_core = base_train.resolve_bundle, final_eval.run_core
real_train_step = base_train.train_step
WHERE = {"--in-core": "core", "--after-last-step": "last_step"}  # the third argument: where the signal comes


def iter_eval_batches(*args, **kwargs):  # the final evaluation's (the flags have no periodic evals)
    for index, batch in enumerate(real_batches(*args, **kwargs)):
        yield batch
        if index == 0 and rank in signalled and where == "val_bpb":
            os.kill(os.getpid(), signal.SIGTERM)


def run_core(model, data, args, device, autocast, finished=None):
    tasks = {}
    for name in ("a", "b"):
        def score():
            print(f"rank {rank} scores task {name}", flush=True)
            total = torch.tensor([rank + 1.0])
            dist.all_reduce(total)
            if name == "a" and rank in signalled:  # latched: the write of task a is the step every rank stops at
                os.kill(os.getpid(), signal.SIGTERM)
            return {"accuracy": total.item() / 4}
        tasks[name] = finished.get_or_run(name, lambda: {"task": name}, score)
    return {"core": sum(t["accuracy"] for t in tasks.values()) / 2, "label": "CORE", "tasks": tasks}


def train_step(*args, **kwargs):  # --after-last-step's
    global steps
    out = real_train_step(*args, **kwargs)  # its stop votes are agreed: the signal below is in none of them
    steps += 1
    if rank in signalled and steps == last_step:
        os.kill(os.getpid(), signal.SIGTERM)
    return out


def set_up(argv: list[str]) -> list[str]:
    """This run's leading flags (``--sigterm-ranks R [--in-core | --after-last-step]``) applied; the rest, base_train's
    flags."""
    global signalled, where, steps, last_step
    assert argv[0] == "--sigterm-ranks", argv
    signalled = {int(r) for r in argv[1].split(",") if r}
    where = WHERE.get(argv[2], "val_bpb")
    flags = argv[2:] if where == "val_bpb" else argv[3:]
    # the repo's root stands in for a CORE bundle
    base_train.resolve_bundle = (lambda args: Path(__file__).resolve().parents[1]) if where == "core" else \
        real_resolve_bundle
    final_eval.run_core = run_core if where == "core" else real_run_core
    base_train.train_step = train_step if where == "last_step" else real_train_step
    steps, last_step = 0, (int(flags[flags.index("--num-iterations") + 1]) if where == "last_step" else None)
    return flags


if os.environ.get("FULL_DISK_IN_TASK_A") and rank == 0:  # keeping task a fails on rank 0 (the only writer)
    real_write = eval_resume.write_text_atomic

    def write_text_atomic(path, text):
        if '"a"' in text:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, text)
    eval_resume.write_text_atomic = write_text_atomic
dataloader.iter_eval_batches = iter_eval_batches
if sys.argv[1] == "--runs-out":
    sys.exit(run_each(sys.argv[3:], lambda argv: base_train.main(set_up(argv)), Path(sys.argv[2])))
sys.exit(base_train.main(set_up(sys.argv[1:])))
