"""Inference latency of the memory designs vs Base (paper appendix "Full Inference Latency Results").

    python bench/latency.py [--device cpu|cuda] [--widths 256,512,1024] [--mem-layers 2,3] [--reps 20]
        [--mode decode|forward|both] [--context 512] [--seq-len 512] [--depth 0] [--out FILE]

What is timed (median of --reps after --warmup calls, synchronised on CUDA; the reps of Base and the four
designs are interleaved so that load drift on a shared machine does not bias one design):
* ``decode``: ONE single-token decode step (batch --batch) against a KV cache already holding --context tokens
  (the cache position is rewound before every call, so every rep sees the same cache length);
* ``forward``: one full-sequence forward of --seq-len tokens without a cache.

The benchmark model has --depth layers (default 0 = exactly L_mem layers, all with memory: the paper's baselines
scale with L_mem, e.g. 3.07 ms at L_mem=2 vs 4.53 ms at L_mem=3) of width W, head dim --head-dim; with --depth N
the memory sits on the last L_mem layers of the alternating pattern. Designs: VE, Bigram, MoME (value injection,
--mome-slots/--mome-topk) and "MoME (hidden-state injection)": the same router/table/gate, but the router and gate
read the block input norm(x) and the H x d memory mixture is added to the residual stream before the block
instead of to the values (an injection-site ablation; registered only inside this script).

Prints the appendix table (baseline ms, then per design "+delta ms (+x%)") and writes JSON (--out).
"""

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as `python bench/latency.py` from anywhere
    sys.path.insert(0, str(REPO))

from nanochat.gpt import GPTConfig, build_model  # noqa: E402
from nanochat.kv_cache import KVCache  # noqa: E402
from nanochat.memory import MEMORY_BLOCKS  # noqa: E402
from nanochat.memory.base import default_memory_layers  # noqa: E402
from nanochat.memory.mome import MoMEMemory  # noqa: E402

HIDDEN = "mome-hidden"
DESIGNS = [("ve", "VE"), ("bigram", "Bigram"), ("mome", "MoME"), (HIDDEN, "MoME (hidden-state injection)")]


class MoMEHiddenInjection(MoMEMemory):
    """MoME read from and written to the residual stream: route and gate from norm(x) of the block input, add
    gamma * m~ (H heads x d = C channels) to x. Value heads are left untouched."""

    def __init__(self, config):
        if config.n_kv_head * config.head_dim != config.n_embd:
            raise ValueError("hidden-state injection needs n_kv_head * head_dim == n_embd")
        super().__init__(config)

    def value(self, layer, xn, v, ctx):
        return v

    def residual(self, layer, x, ctx):
        if layer not in self.layer_pos:
            return x
        B, T, C = x.shape
        xn = F.rms_norm(x, (C,))
        # MoMEMemory.value returns v + gamma*m~; with v = 0 that is exactly the injection (same kernels)
        inject = MoMEMemory.value(self, layer, xn, x.new_zeros(B, T, self.H, self.d), ctx)
        return x + inject.view(B, T, C)


@contextlib.contextmanager
def hidden_variant_registered():
    """Register the ablation block for the duration of the benchmark only (never in the main registry)."""
    MEMORY_BLOCKS[HIDDEN] = MoMEHiddenInjection
    try:
        yield
    finally:
        MEMORY_BLOCKS.pop(HIDDEN, None)


def make_config(args, width: int, l_mem: int, design: str) -> GPTConfig:
    n_head = max(1, width // args.head_dim)
    depth = args.depth or l_mem
    if args.depth and l_mem > len(default_memory_layers(depth)):
        raise ValueError(f"--mem-layers {l_mem} exceeds the {len(default_memory_layers(depth))} alternating "
                         f"layers of --depth {depth}")
    layers = tuple(range(depth)) if not args.depth else default_memory_layers(depth)[-l_mem:]
    memory = "mome" if design == HIDDEN else design
    options = {"base": {}, "ve": {}, "bigram": {"factor": args.bigram_factor},
               "mome": {"slots": args.mome_slots, "topk": args.mome_topk}}[memory]
    return GPTConfig(sequence_len=max(args.seq_len, args.context + 1), vocab_size=args.vocab_size, n_layer=depth,
                     n_head=n_head, n_kv_head=n_head, n_embd=n_head * args.head_dim, memory=design,
                     memory_layers=layers if design != "base" else (), memory_options=options)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def make_step(model, args, device, mode: str):
    """A closure running one decode step (against a rewound cache of --context tokens) or one full forward."""
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    if mode == "forward":
        idx = torch.randint(V, (args.batch, args.seq_len), generator=g).to(device)
        return lambda: model(idx)
    cache = KVCache.for_model(model, args.batch, args.context + 1)
    model(torch.randint(V, (args.batch, args.context), generator=g).to(device), kv_cache=cache)  # prefill
    tok = torch.randint(V, (args.batch, 1), generator=g).to(device)

    def step():
        cache.pos = args.context  # rewind: every rep decodes against the same cache length
        return model(tok, kv_cache=cache)

    return step


@torch.no_grad()
def time_interleaved(steps: dict, args, device) -> dict[str, float]:
    """Median ms per design. Reps are interleaved across designs (rotating the order each round), so drift in
    machine load (shared CPUs, clocks) hits every design alike instead of biasing whichever ran last."""
    names = list(steps)
    for _ in range(args.warmup):
        for n in names:
            steps[n]()
    times = {n: [] for n in names}
    for r in range(args.reps):
        for n in names[r % len(names):] + names[: r % len(names)]:
            _sync(device)
            t0 = time.perf_counter()
            steps[n]()
            _sync(device)
            times[n].append(1000.0 * (time.perf_counter() - t0))
    return {n: statistics.median(t) for n, t in times.items()}


def build(args, device, width: int, l_mem: int, design: str):
    model = build_model(make_config(args, width, l_mem, design), device=device, seed=0)
    model.eval()
    return model.to(torch.bfloat16) if args.dtype == "bfloat16" else model


def run(args) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    with hidden_variant_registered():
        for mode in (("decode", "forward") if args.mode == "both" else (args.mode,)):
            for width in args.width_list:
                for l_mem in args.mem_list:
                    models = {d: build(args, device, width, l_mem, d) for d in ["base"] + [k for k, _ in DESIGNS]}
                    ms = time_interleaved({d: make_step(m, args, device, mode) for d, m in models.items()}, args, device)
                    del models
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    base = ms["base"]
                    row = {"mode": mode, "width": width, "n_head": max(1, width // args.head_dim),
                           "depth": args.depth or l_mem, "mem_layers": l_mem, "baseline_ms": base,
                           "designs": {k: {"ms": ms[k], "delta_ms": ms[k] - base, "pct": 100.0 * (ms[k] - base) / base}
                                       for k, _ in DESIGNS}}
                    rows.append(row)
                    print(format_row(row), flush=True)
    return rows


def format_header() -> str:
    return f"{'Mode':<8} {'Arch':<14} {'L_mem':>5} {'Baseline ms':>12} " + " ".join(f"{n:>22}" for _, n in DESIGNS)


def format_row(r: dict) -> str:
    cells = [f"{d['delta_ms']:+.3f} ({d['pct']:+.2f}%)" for d in (r["designs"][k] for k, _ in DESIGNS)]
    arch = f"w{r['width']}-d{r['depth']}"
    return f"{r['mode']:<8} {arch:<14} {r['mem_layers']:>5} {r['baseline_ms']:>12.3f} " + " ".join(f"{c:>22}" for c in cells)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--widths", default="256,512,1024", help="model widths (n_embd), comma-separated")
    ap.add_argument("--mem-layers", default="2,3", help="numbers of memory layers L_mem, comma-separated")
    ap.add_argument("--depth", type=int, default=0, help="layers (0 = L_mem layers, all with memory)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--mode", default="decode", choices=("decode", "forward", "both"))
    ap.add_argument("--context", type=int, default=512, help="KV-cache length of the decode step")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens of the full forward")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mome-slots", type=int, default=6)
    ap.add_argument("--mome-topk", type=int, default=2)
    ap.add_argument("--bigram-factor", type=int, default=6)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = leave torch's default)")
    ap.add_argument("--out", default=None, help="JSON output (default: runs/bench/latency_<device>_<mode>.json)")
    args = ap.parse_args(argv)
    try:
        args.width_list = [int(w) for w in args.widths.split(",")]
        args.mem_list = [int(m) for m in args.mem_layers.split(",")]
    except ValueError:
        ap.error(f"--widths {args.widths!r} / --mem-layers {args.mem_layers!r}: expected comma-separated integers")
    if any(w < args.head_dim or w % args.head_dim for w in args.width_list):
        ap.error(f"--widths {args.widths}: every width must be a positive multiple of --head-dim {args.head_dim}")
    if any(m < 1 for m in args.mem_list) or args.reps < 1 or args.warmup < 0:
        ap.error("--mem-layers entries and --reps must be >= 1, --warmup >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available on this machine")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"# {args.mode} latency, device {args.device} ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads), torch {torch.__version__}, batch {args.batch}, "
          f"context {args.context}, seq_len {args.seq_len}, vocab {args.vocab_size}, dtype {args.dtype}, "
          f"median of {args.reps} after {args.warmup} warm-up; MoME M={args.mome_slots} K={args.mome_topk}")
    print(format_header())
    try:
        rows = run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else REPO / "runs" / "bench" / f"latency_{args.device.replace(':', '')}_{args.mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k not in ("width_list", "mem_list")}
    out.write_text(json.dumps({"args": meta, "torch": torch.__version__, "threads": torch.get_num_threads(),
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
