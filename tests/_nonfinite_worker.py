"""torchrun worker: scripts.base_train where only rank 1's weights turn non-finite after its 2nd step (the loss
of that step is still finite), so rank 0 alone sees finite weights at the step-2 save."""

import sys

import torch
import torch.distributed as dist

from scripts import base_train

real_step, calls = base_train.train_step, {"n": 0}


def poisoned(model, *args, **kwargs):
    out = real_step(model, *args, **kwargs)
    calls["n"] += 1
    if calls["n"] == 2 and dist.get_rank() == 1:
        with torch.no_grad():
            model.wte.weight[0, 0] = float("nan")
    return out


base_train.train_step = poisoned
sys.exit(base_train.main(sys.argv[1:]))
