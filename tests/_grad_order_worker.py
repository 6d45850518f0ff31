"""Worker for test_optim_shard: two same-shape row-sharded AdamW tables U and V plus a frozen parameter; on rank 1
U gets NO gradient in the armed backward, so its bucket is ready on rank 0 only. Rank 0 writes the gathered Adam
first moments after each of two steps (the second step runs with the launch order learned in the first).
tests/_shard_worker.py runs ``grad_order`` in its own launch (``--grad-order OUT``)."""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from nanochat import optim_shard
from nanochat.common import compute_cleanup, compute_init
from nanochat.optim import MuonAdamW


def grad_order(rank: int, out_path) -> None:
    """The scenario, in an initialized 2-rank process group."""
    optim_shard.SHARD_MIN_NUMEL = 16  # 4 x 4 tables are row-sharded (one reduce-scatter bucket each)
    U, V = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4, 4))
    frozen = nn.Parameter(torch.ones(3), requires_grad=False)
    opt = MuonAdamW([dict(kind="adamw", name="t", params=[U, V, frozen], lr=0.0, betas=(0.8, 0.95), eps=1e-10,
                          weight_decay=0.0)])
    out = []
    for step in range(2):
        opt.arm_grad_hooks()
        loss = (V * (10.0 + rank)).sum()  # V: gradient 10 on rank 0, 11 on rank 1 -> averaged 10.5
        if rank == 0:
            loss = loss + U.sum()  # U: gradient 1 on rank 0, none on rank 1 -> averaged 0.5
        loss.backward()
        opt.step()
        state = opt.state_dict()["state"]  # collective: full (unsharded) moments on every rank
        out.append({"U": state[0]["exp_avg"].unique().tolist(), "V": state[1]["exp_avg"].unique().tolist()})
        for p in (U, V):
            p.grad = None
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"steps": out}, f)
    dist.barrier()


if __name__ == "__main__":
    info, _ = compute_init("cpu")
    grad_order(info.rank, sys.argv[1])
    compute_cleanup()
