"""torchrun worker: scripts.base_train where only rank 1's weights turn non-finite after its 2nd step (the loss
of that step is still finite), so rank 0 alone sees finite weights at the step-2 save. With a first argument
``--poison-optimizer`` it is instead rank 1's own shard of the optimizer state (a matrix of a Muon group that
rank 0 holds no state for), just before the step-2 save: rank 0's parameters and optimizer shards stay finite.
With ``--runs-out DIR`` first, several runs in one launch (a launch costs more of the CI's 2 cores than a tiny run),
separated by ``--next-run``, each with its own leading ``--poison-optimizer`` or none, each run whatever the code of
the one before (tests/_train_runs_worker.run_each, every_run: run N's output in DIR/runN.rank<r>.out, its exit code
in DIR/runN.rank<r>.code, its run dir as it left it in DIR/runN)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nanochat.optim_shard import MuonBucket
from scripts import base_train

real_step, calls = base_train.train_step, {"n": 0}


def poisoned(model, *args, **kwargs):
    out = real_step(model, *args, **kwargs)
    calls["n"] += 1
    if calls["n"] == 2 and dist.get_rank() == 1:
        with torch.no_grad():
            model.wte.weight[0, 0] = float("nan")
    return out


real_save = base_train.save


def poisoned_save(run, *args, **kwargs):
    if run.loop["step"] == 2 and dist.get_rank() == 1:
        bucket = next(b for b in run.optimizer.buckets if isinstance(b, MuonBucket) and b.owned)
        run.optimizer.state[bucket.params[0]]["momentum_buffer"][0, 0, 0] = float("nan")
    return real_save(run, *args, **kwargs)


def run_one(args: list[str]) -> int:
    calls["n"] = 0
    if args[:1] == ["--poison-optimizer"]:
        args = args[1:]
        base_train.save = poisoned_save
    else:
        base_train.train_step = poisoned
    return base_train.main(args)


if sys.argv[1] == "--runs-out":
    from _train_runs_worker import run_each  # reads torchrun's environment on import

    sys.exit(run_each(sys.argv[3:], run_one, Path(sys.argv[2]),
                      stand_ins=[(base_train, "save"), (base_train, "train_step")], every_run=True))
sys.exit(run_one(sys.argv[1:]))
