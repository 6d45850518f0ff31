"""torchrun worker: scripts.base_train where only rank 1's weights turn non-finite after its 2nd step (the loss
of that step is still finite), so rank 0 alone sees finite weights at the step-2 save. With a first argument
``--poison-optimizer`` it is instead rank 1's own shard of the optimizer state (a matrix of a Muon group that
rank 0 holds no state for), just before the step-2 save: rank 0's parameters and optimizer shards stay finite."""

import sys

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


args = sys.argv[1:]
if args[:1] == ["--poison-optimizer"]:
    args = args[1:]
    base_train.save = poisoned_save
else:
    base_train.train_step = poisoned
sys.exit(base_train.main(args))
