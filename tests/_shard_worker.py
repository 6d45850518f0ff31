"""Worker for test_optim_shard (run under torchrun with 2 gloo processes, in the test's process for 1, and as 4
threads of it: ``threads``).

    python -m torch.distributed.run --nproc_per_node=W tests/_shard_worker.py OUT[,LOAD] [OUT[,LOAD] ...]

Drives MuonAdamW on a tiny MoME model with gradients set directly: 4 "virtual ranks" draw dyadic gradients
(multiples of 1/8 in [-1, 1]) and each real rank holds (W/4) x the sum of its virtual ranks' gradients, so the
averaged gradient every world size sees is the same number, exactly (sums and power-of-2 scalings of small
dyadic values are exact in fp32). Whatever differs between world sizes is then the sharding itself, not
summation order. With LOAD, the optimizer first loads that state dict (saved by another world size).
Rank 0 writes OUT: parameters, the full state dict (and state_dict_on_rank0's, with both as torch.save bytes and
what every rank got from it), collective counts/bytes per step, per-rank state sizes,
the grad norm, and whether the gradient hooks launched every bucket during backward.
Several OUT[,LOAD] runs go one after the other in one process group (each from a fresh model and optimizer): a
torchrun start-up costs more than such a run on the CI's 2 cores. Every FutureWarning the runs raise is recorded
in OUT (torch 2.13 deprecated the collectives' old names: a warning on every rank, every run). The runs after an
argument ``--old-names`` run where torch.distributed lacks the new names, as in torch before 2.13: the names are
deleted and nanochat.optim_shard, reloaded, chooses its collectives again, as its import under such a torch does.
``--grad-order OUT`` (last) runs tests/_grad_order_worker.py's scenario in the same launch, before the
old-names runs.
"""
import contextlib
import importlib
import io
import sys
import threading
import warnings

import torch
import torch.distributed as dist

from nanochat import optim_shard
from nanochat.common import compute_cleanup, compute_init
from nanochat.gpt import GPTConfig, build_model
from nanochat.optim import build_optimizer

VIRTUAL = 4
STEPS = 3


def count_collectives(calls: dict, counted_names: set) -> None:
    """Wrap each collective the optimizer issues (under its current names) to count its calls and bytes."""
    for name in ("all_reduce", optim_shard.REDUCE_SCATTER, optim_shard.ALL_GATHER):
        if name in counted_names:
            continue
        counted_names.add(name)
        real = getattr(dist, name)

        def counted(*args, _real=real, **kwargs):
            calls["n"] += 1
            calls["bytes"] += args[1].numel() * args[1].element_size() if len(args) > 1 else \
                args[0].numel() * args[0].element_size()
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
        setattr(optim_shard.dist, name, counted)


def take_the_old_names() -> None:
    """torch.distributed without the new names (as torch before 2.13), and optim_shard's choice made again."""
    for new in ("reduce_scatter_single", "all_gather_single"):
        if hasattr(dist, new):
            delattr(dist, new)
    importlib.reload(optim_shard)  # its module code chooses the names; SHARD_MIN_NUMEL is reset too


def main(runs: list[tuple], old_name_runs: list[tuple] = (), grad_order_out=None) -> None:
    """Each (OUT, LOAD or None) of ``runs`` in turn, then the grad-order scenario into ``grad_order_out``, then each
    of ``old_name_runs`` with the old collective names; importable so that the 1-process case runs inside the test
    (no torchrun start-up)."""
    info, _ = compute_init("cpu")
    W = info.world_size
    calls, counted_names = {"n": 0, "bytes": 0}, set()
    for part, batch in (("new names", runs), ("grad order", grad_order_out), ("old names", old_name_runs)):
        if not batch:
            continue
        if part == "grad order":  # with the new names, as in a launch of its own
            from _grad_order_worker import grad_order

            grad_order(info.rank, grad_order_out)  # sets SHARD_MIN_NUMEL for its own tables
            continue
        if part == "old names":
            take_the_old_names()
        if W > 1:  # (its own process) so the tiny tables and the embeddings take the row-sharded path
            optim_shard.SHARD_MIN_NUMEL = 1024
            count_collectives(calls, counted_names)  # every collective the optimizer issues
        run_all(batch, info, W, calls)
    if dist.is_initialized():
        dist.barrier()
    compute_cleanup()


def run_all(runs, info, W: int, calls: dict) -> None:
    for out_path, load_path in runs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FutureWarning)  # each one, not once per code line
            result = run(load_path, info.rank, W, calls)
        future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        for w in caught:  # the others shown as usual
            if not issubclass(w.category, FutureWarning):
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        if info.rank == 0:
            names = (optim_shard.REDUCE_SCATTER, optim_shard.ALL_GATHER)
            torch.save({**result, "future_warnings": future, "collective_names": names}, out_path)


def run(load_path, rank: int, W: int, calls: dict, build_lock=contextlib.nullcontext()) -> dict:
    """What rank 0 writes to OUT (without the warnings); None on the other ranks. ``build_lock``: held while the
    model is built (seeded from torch's global RNG, one for all the threads of thread ranks)."""
    cfg = GPTConfig(sequence_len=16, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, memory="mome",
                    memory_options={"slots": 4, "topk": 2})
    with build_lock:
        model = build_model(cfg, seed=0)
    opt = build_optimizer(model)
    if load_path:
        opt.load_state_dict(torch.load(load_path, weights_only=False)["state_dict"])

    mine = range(rank * VIRTUAL // W, (rank + 1) * VIRTUAL // W)
    per_step = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 + step)
        for p in model.parameters():
            virtual = [torch.randint(-8, 9, p.shape, generator=gen).float() / 8 for _ in range(VIRTUAL)]
            p.grad = sum(virtual[v] for v in mine) * (W / VIRTUAL)
        before = dict(calls)
        opt.step()
        per_step.append({"collectives": calls["n"] - before["n"], "bytes": calls["bytes"] - before["bytes"]})
        model.zero_grad(set_to_none=True)

    state_numel = sum(v.numel() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    local = opt.local_state()  # what this rank checks for non-finite values at a save
    local_info = ({str(i): sorted(st) for i, st in local.items()},
                  sum(v.numel() for st in local.values() for v in st.values() if torch.is_tensor(v)))
    sizes, locals_ = [None] * W, [None] * W
    if W > 1:
        dist.all_gather_object(sizes, state_numel)
        dist.all_gather_object(locals_, local_info)
    else:
        sizes, locals_ = [state_numel], [local_info]
    state_dict = opt.state_dict()  # collective
    on_rank0 = opt.state_dict_on_rank0()  # collective: the same dict, gathered onto rank 0 only
    # (a W-process job's rank 0 compares the two; the others report what they got)
    got_rank0 = [None] * W
    if W > 1:
        dist.all_gather_object(got_rank0, None if on_rank0 is None else type(on_rank0).__name__)
    else:
        got_rank0 = [type(on_rank0).__name__]
    saved_bytes = {}
    if rank == 0:
        for name, sd in (("state_dict", state_dict), ("state_dict_on_rank0", on_rank0)):
            buf = io.BytesIO()
            torch.save(sd, buf)
            saved_bytes[name] = buf.getvalue()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grad_norm = float(opt.grad_norm)

    # the hooks: armed before a real backward, every bucket is launched before step() is called
    model.zero_grad(set_to_none=True)
    idx = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(7 + rank))
    opt.arm_grad_hooks()
    model(idx[:, :-1], idx[:, 1:]).backward()
    launched_in_backward = [b.launched for b in opt.buckets]
    opt.step()

    if rank == 0:
        return {"params": params, "state_dict": state_dict, "grad_norm": grad_norm, "on_rank0": on_rank0,
                "got_rank0": got_rank0, "saved_bytes": saved_bytes, "local_state": locals_,
                "per_step": per_step, "state_numel": sizes, "buckets": len(opt.buckets),
                "bucket_kinds": [type(b).__name__ for b in opt.buckets], "n_params": len(list(model.parameters())),
                "launched_in_backward": launched_in_backward}
    return None


class _ThreadCalls(threading.local):
    """count_collectives' counts, one set per thread: each thread rank counts its own collectives, as a process
    does."""

    def __init__(self):
        self.counts = {"n": 0, "bytes": 0}

    def __getitem__(self, key):
        return self.counts[key]

    def __setitem__(self, key, value):
        self.counts[key] = value

    def keys(self):
        return self.counts.keys()


def threads(world: int, runs: list[tuple]) -> None:
    """Each (OUT, LOAD or None) of ``runs`` in turn on ``world`` ranks as threads of this process
    (tests/_thread_ranks.py: the same collectives, ~1 s where a 4-process torchrun start-up is ~17 s of the CI's 2
    cores); rank 0's result goes to OUT as under torchrun. Sets optim_shard.SHARD_MIN_NUMEL and wraps
    torch.distributed's collectives (count_collectives) for good: the caller puts them back. The FutureWarnings of
    all the runs (warnings are recorded per process, not per thread) are in each OUT."""
    from _thread_ranks import BUILD_LOCK, run_ranks

    calls = _ThreadCalls()
    optim_shard.SHARD_MIN_NUMEL = 1024  # as main does for W > 1
    count_collectives(calls, set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        results = run_ranks(world, lambda rank, W: [run(load, rank, W, calls, BUILD_LOCK) for _, load in runs])
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    for w in caught:  # the others shown as usual
        if not issubclass(w.category, FutureWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    names = (optim_shard.REDUCE_SCATTER, optim_shard.ALL_GATHER)
    for (out_path, _), result in zip(runs, results[0]):
        torch.save({**result, "future_warnings": future, "collective_names": names}, out_path)


if __name__ == "__main__":
    args, grad_order_out = sys.argv[1:], None
    if "--grad-order" in args:
        args, grad_order_out = args[:args.index("--grad-order")], args[args.index("--grad-order") + 1]
    old = args.index("--old-names") if "--old-names" in args else len(args)
    main(*([(*arg.split(","), None)[:2] for arg in part] for part in (args[:old], args[old + 1:])), grad_order_out)
