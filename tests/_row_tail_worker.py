"""test_optim_shard's row-shard tail check, run in the test's process: on 1 rank, and on 3 ranks as threads
(tests/_thread_ranks.py; it was a 3-process torchrun launch).

One AdamW group of two large tables, one with a row count that W does not divide (37 rows: Engram's table is a sum
of primes, 6,249,886 rows at d24) and one that it does (36), driven for 3 steps by dyadic gradients that every world
size averages to the same numbers exactly (see _shard_worker.py). ``run`` returns the tables, the full state dict,
the bucket kinds and every rank's optimizer-state size. With ``load``, that state dict is loaded first.
"""
import torch
import torch.distributed as dist

from nanochat import optim_shard
from nanochat.optim import MuonAdamW, OptimConfig, adamw_group

VIRTUAL, STEPS = 4, 3


def run(load=None) -> dict:
    world, rank = optim_shard.world_info()
    if world > 1:  # (the caller puts it back) so the tiny tables take the row-sharded path
        optim_shard.SHARD_MIN_NUMEL = 1024
    gen = torch.Generator().manual_seed(0)
    tables = [torch.nn.Parameter(torch.randn(rows, 64, generator=gen)) for rows in (37, 36)]
    group = adamw_group("tables", tables, 0.01, OptimConfig(), wd=0.1)
    group["initial_lr"] = group["lr"]
    opt = MuonAdamW([group])
    if load is not None:
        opt.load_state_dict(torch.load(load, weights_only=False)["state_dict"])
    mine = range(rank * VIRTUAL // world, (rank + 1) * VIRTUAL // world)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 + step)
        for p in tables:
            virtual = [torch.randint(-8, 9, p.shape, generator=gen).float() / 8 for _ in range(VIRTUAL)]
            p.grad = sum(virtual[v] for v in mine) * (world / VIRTUAL)
        opt.step()
        for p in tables:
            p.grad = None
    numel = sum(v.numel() for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim())
    local = sum(v.numel() for st in opt.local_state().values() for v in st.values() if torch.is_tensor(v) and v.dim())
    sizes, local_sizes = [numel] * world, [local] * world
    if world > 1:
        dist.all_gather_object(sizes, numel)
        dist.all_gather_object(local_sizes, local)
    return {"tables": [p.detach().clone() for p in tables], "state_dict": opt.state_dict(), "state_numel": sizes,
            "local_state_numel": local_sizes,
            "bucket_kinds": sorted(type(b).__name__ for b in opt.buckets), "grad_norm": float(opt.grad_norm)}

