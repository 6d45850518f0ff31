"""The distributed optimizer step, old vs new: collectives per step, bytes sent per rank, optimizer time per rank.

    torchrun --standalone --nproc_per_node=2 bench/dist_optim.py                 # CPU, gloo: d4 MoME, V=32768
    torchrun --standalone --nproc_per_node=4 bench/dist_optim.py --depth 2
    torchrun --standalone --nproc_per_node=8 bench/dist_optim.py --device cuda --depth 12   # GPUs, nccl

* new: ``nanochat.optim.MuonAdamW``: one reduce-scatter + one all-gather per Muon group and per large AdamW
  parameter (+ one all-reduce of its last R mod W rows when W does not divide them), one all-reduce for the small
  parameters, one for the grad norm; each rank updates its shard only.
* old: the optimizer before the sharding (``ReplicatedMuonAdamW`` below): one all-reduce per parameter, then
  every rank runs the full Muon and AdamW update.

Both get the same random gradients (as after backward) and are timed over --steps optimizer steps after --warmup,
once with the real collectives and once with them stubbed out (reduce-scatter = take this rank's slice, all-gather
= write this rank's slice, all-reduce = nothing): the second is the optimizer compute per rank alone.
"bytes sent" is the ring-algorithm estimate per rank: all-reduce 2(W-1)/W x size, reduce-scatter (W-1)/W x input,
all-gather (W-1)/W x output; "payload" is what the collectives were handed.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nanochat import optim_shard  # noqa: E402
from nanochat.cli_types import device_choice  # noqa: E402
from nanochat.common import compute_cleanup, compute_init  # noqa: E402
from nanochat.gpt import GPTConfig, build_model  # noqa: E402
from nanochat.optim import MuonAdamW, build_param_groups, OptimConfig  # noqa: E402

COLLECTIVES = ("all_reduce", optim_shard.REDUCE_SCATTER, optim_shard.ALL_GATHER)  # the names this torch has


class ReplicatedMuonAdamW(MuonAdamW):
    """The pre-sharding optimizer: a blocking all-reduce of every gradient after backward (async, waited on before
    any update), then the full single-process update on every rank (replicated state)."""

    def __init__(self, groups):
        super().__init__(groups)
        self.world, self.rank = 1, 0  # the update itself is the single-process one
        self.buckets = optim_shard.build_buckets(self.param_groups, 1, 0)

    @torch.no_grad()
    def step(self, closure=None):
        world = dist.get_world_size()
        works = [(p, dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True))
                 for g in self.param_groups for p in g["params"]]
        for p, work in works:
            work.wait()
            p.grad.div_(world)
        super().step()


class _Done:
    def wait(self):
        return True


def _stub(name, rank, world):
    """A local stand-in with the collective's shapes and this rank's share of the data movement, no communication."""
    def run(*args, async_op=False, **kwargs):
        if name == optim_shard.REDUCE_SCATTER:
            out, inp = args[0], args[1]
            out.copy_(inp.view(world, *out.shape)[rank])
        elif name == optim_shard.ALL_GATHER:
            out, inp = args[0], args[1]
            out.view(world, *inp.shape)[rank].copy_(inp)
        return _Done() if async_op else None
    return run


class Counter:
    """Wraps the torch.distributed collectives the optimizers call and tallies them (optionally stubbed)."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank, self.calls, self.payload, self.sent = world, rank, 0, 0, 0.0
        self.real = {name: getattr(dist, name) for name in COLLECTIVES}
        self.stubbed = False
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(name))

    def _wrap(self, name):
        real, w, stub = self.real[name], self.world, _stub(name, self.rank, self.world)

        def counted(*args, **kwargs):
            t = args[0] if name == "all_reduce" else args[1]  # all_reduce(t) / rs(out, in) / ag(out, in)
            size = t.numel() * t.element_size()
            self.calls += 1
            self.payload += size
            self.sent += {"all_reduce": 2 * (w - 1) / w * size, optim_shard.REDUCE_SCATTER: (w - 1) / w * size,
                          optim_shard.ALL_GATHER: (w - 1) * size}[name]  # ag input is 1/W of the output
            return (stub if self.stubbed else real)(*args, **kwargs)
        return counted

    def reset(self):
        self.calls, self.payload, self.sent = 0, 0, 0.0


def run(kind: str, args, device, counter: Counter) -> dict:
    cfg = GPTConfig.from_depth(args.depth, sequence_len=args.seq_len, vocab_size=args.vocab_size, memory=args.memory,
                               memory_options={"slots": 6, "topk": 2} if args.memory == "mome" else {})
    model = build_model(cfg, device=device, seed=0)
    groups = build_param_groups(model, OptimConfig())
    opt = MuonAdamW(groups) if kind == "new" else ReplicatedMuonAdamW(groups)
    g = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    times, per_step = [], []
    for i in range(args.warmup + args.steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g, device=device) * 1e-3
        counter.reset()
        if device.type == "cuda":
            torch.cuda.synchronize()
        counter.real["all_reduce"](torch.zeros(1, device=device))  # line the ranks up (barrier)
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
            per_step.append((counter.calls, counter.payload, counter.sent))
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    calls, payload, sent = per_step[-1]
    return {"opt_ms": 1e3 * statistics.median(times), "collectives": calls, "payload_mb": payload / 2**20,
            "sent_mb": sent / 2**20, "state_mb": state / 2**20, "params": sum(1 for _ in model.parameters())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # compute_init refused a missing GPU only after parsing, exit 1, naming base_train's --device-type
    p.add_argument("--device", type=device_choice("cpu", "cuda", per_rank=True), default="cpu", metavar="{cpu,cuda}")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--memory", default="mome", choices=("base", "ve", "bigram", "mome"))
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default="", help="JSON path (default bench/results/dist_optim_<device>_w<W>.json)")
    args = p.parse_args(argv)
    info, device = compute_init(args.device)
    if not dist.is_initialized():
        raise SystemExit("run under torchrun with 2 or more processes: torchrun --nproc_per_node=2 bench/dist_optim.py")
    world = dist.get_world_size()
    counter = Counter(world, info.rank)
    res = {}
    for kind in ("old", "new"):
        res[kind] = run(kind, args, device, counter)
        counter.stubbed = True
        res[kind]["compute_ms"] = run(kind, args, device, counter)["opt_ms"]
        counter.stubbed = False
    rows = {kind: [None] * world for kind in res}
    for kind in res:
        dist.all_gather_object(rows[kind], res[kind])
    if info.rank == 0:
        print(f"\n### optimizer step, d{args.depth} {args.memory}, V={args.vocab_size}, {world} processes on "
              f"{args.device} ({'nccl' if args.device == 'cuda' else 'gloo'}), torch {torch.__version__}\n")
        print("| optimizer | collectives/step | payload MB/step | sent MB/rank/step (ring est.) | "
              "step ms/rank (median over ranks) | compute ms/rank (collectives stubbed) | state MB/rank (max) |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for kind in ("old", "new"):
            r = rows[kind]
            med = statistics.median
            print(f"| {kind} | {r[0]['collectives']} | {r[0]['payload_mb']:.1f} | {r[0]['sent_mb']:.1f} | "
                  f"{med([x['opt_ms'] for x in r]):.1f} | {med([x['compute_ms'] for x in r]):.1f} | "
                  f"{max(x['state_mb'] for x in r):.1f} |")
        old, new = rows["old"], rows["new"]
        print(f"\nparameters: {old[0]['params']}; new/old: collectives {new[0]['collectives'] / old[0]['collectives']:.3f}, "
              f"optimizer time {statistics.median([x['opt_ms'] for x in new]) / statistics.median([x['opt_ms'] for x in old]):.3f}, "
              f"compute {statistics.median([x['compute_ms'] for x in new]) / statistics.median([x['compute_ms'] for x in old]):.3f}, "
              f"state per rank {max(x['state_mb'] for x in new) / max(x['state_mb'] for x in old):.3f}")
        out = Path(args.out) if args.out else REPO / "bench" / "results" / f"dist_optim_{args.device}_w{world}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "world": world, "torch": torch.__version__, **rows}, indent=1),
                       encoding="utf-8")
        print(f"wrote {out}")
    compute_cleanup()


if __name__ == "__main__":
    main()
