"""Inference latency of the memory designs vs Base (paper appendix "Full Inference Latency Results").

    python bench/latency.py [--device cpu|cuda|cuda:N] [--widths 256,512,1024] [--mem-layers 2,3] [--reps 20]
        [--mode decode|forward|both] [--context 512] [--seq-len 512] [--depth 0] [--out FILE]
    python bench/latency.py --archs mobilellm350,mobilellm1b,qwen3_0p6b,qwen3_4b,qwen3_8b   # the paper's table

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

``--archs`` replaces the nanochat width sweep by the paper's backbones (``nanochat.families``: MobileLLM 350M/1B,
Qwen3 0.6B/4B/8B layer geometry, GQA, SwiGLU, each family's RoPE and norms); MoME routes from the hidden state
there (value injection into the KV heads), and the hidden-state injection variant splits the residual stream
into C/d groups of head_dim channels (= the heads when H*d == C).

Prints the appendix table (baseline ms, then per design "+delta ms (+x%)") and writes JSON (--out).
"""

import argparse
import contextlib
import dataclasses
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

from nanochat.cli_types import device_choice  # noqa: E402
from nanochat.common import note_slow_cpu_bf16  # noqa: E402
from nanochat.families import FAMILIES, build_model  # noqa: E402
from nanochat.gpt import GPTConfig  # noqa: E402
from nanochat.kv_cache import KVCache  # noqa: E402
from nanochat.memory import MEMORY_BLOCKS  # noqa: E402
from nanochat.memory.base import default_memory_layers  # noqa: E402
from nanochat.memory.mome import MoMEMemory  # noqa: E402

HIDDEN = "mome-hidden"
DESIGNS = [("ve", "VE"), ("bigram", "Bigram"), ("mome", "MoME"), (HIDDEN, "MoME (hidden-state injection)")]


class MoMEHiddenInjection(MoMEMemory):
    """MoME read from and written to the residual stream: route and gate from norm(x) of the block input, add
    gamma * m~ (C/d groups of d = head_dim channels, i.e. the heads when H*d == C) to x. Values are untouched."""

    def __init__(self, config):
        if config.n_embd % config.head_dim:
            raise ValueError(f"hidden-state injection needs n_embd {config.n_embd} divisible by head_dim {config.head_dim}")
        groups = config.n_embd // config.head_dim
        super().__init__(dataclasses.replace(config, n_head=groups, n_kv_head=groups))

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


# layer geometry of the paper's latency backbones: (family, C, H, H_kv, d, F); vocab and depth come from the flags
ARCHS = {
    "mobilellm350": ("mobilellm", 960, 15, 5, 64, 2560),
    "mobilellm1b": ("mobilellm", 1280, 20, 5, 64, 3584),
    "qwen3_0p6b": ("qwen3", 1024, 16, 8, 128, 3072),
    "qwen3_4b": ("qwen3", 2560, 32, 8, 128, 9728),
    "qwen3_8b": ("qwen3", 4096, 32, 8, 128, 12288),
}


def make_config(args, width: int, l_mem: int, design: str, arch: str = "nanochat"):
    n_head = max(1, width // args.head_dim)
    depth = args.depth or l_mem
    if args.depth and l_mem > len(default_memory_layers(depth)):
        raise ValueError(f"--mem-layers {l_mem} exceeds the {len(default_memory_layers(depth))} alternating "
                         f"layers of --depth {depth}")
    layers = tuple(range(depth)) if not args.depth else default_memory_layers(depth)[-l_mem:]
    memory = "mome" if design == HIDDEN else design
    options = {"base": {}, "ve": {}, "bigram": {"factor": args.bigram_factor},
               "mome": {"slots": args.mome_slots, "topk": args.mome_topk}}[memory]
    if arch != "nanochat":
        family, C, H, H_kv, d, ffn = ARCHS[arch]
        return FAMILIES[family].config_cls(
            sequence_len=max(args.seq_len, args.context + 1), vocab_size=args.vocab_size, n_layer=depth, n_head=H,
            n_kv_head=H_kv, n_embd=C, head_dim=d, ffn_hidden=ffn, memory=design,
            memory_layers=layers if design != "base" else (), memory_options=options)
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


def build(args, device, width: int, l_mem: int, design: str, arch: str = "nanochat"):
    model = build_model(make_config(args, width, l_mem, design, arch), device=device, seed=0)
    model.eval()
    if args.dtype != "bfloat16":
        return model
    if device.type == "cpu":  # bf16 weights, not autocast: the note autocast_context gives such a CPU, all the same
        note_slow_cpu_bf16()
    return model.to(torch.bfloat16)


def run(args) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    with hidden_variant_registered():
        for mode in (("decode", "forward") if args.mode == "both" else (args.mode,)):
            for arch, width in arch_widths(args):
                for l_mem in args.mem_list:
                    models = {d: build(args, device, width, l_mem, d, arch) for d in ["base"] + [k for k, _ in DESIGNS]}
                    ms = time_interleaved({d: make_step(m, args, device, mode) for d, m in models.items()}, args, device)
                    del models
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    base = ms["base"]
                    row = {"mode": mode, "arch": arch, "width": width, "n_head": models_head(args, arch, width),
                           "depth": args.depth or l_mem, "mem_layers": l_mem, "baseline_ms": base,
                           "designs": {k: {"ms": ms[k], "delta_ms": ms[k] - base, "pct": 100.0 * (ms[k] - base) / base}
                                       for k, _ in DESIGNS}}
                    rows.append(row)
                    print(format_row(row), flush=True)
    return rows


def arch_widths(args) -> list[tuple[str, int]]:
    """(arch, width) pairs: the --widths sweep of the nanochat backbone, or the --archs backbones."""
    if args.arch_list == ["nanochat"]:
        return [("nanochat", w) for w in args.width_list]
    return [(a, ARCHS[a][1]) for a in args.arch_list]


def models_head(args, arch: str, width: int) -> int:
    return max(1, width // args.head_dim) if arch == "nanochat" else ARCHS[arch][2]


def format_header() -> str:
    return f"{'Mode':<8} {'Arch':<14} {'L_mem':>5} {'Baseline ms':>12} " + " ".join(f"{n:>22}" for _, n in DESIGNS)


def format_row(r: dict) -> str:
    cells = [f"{d['delta_ms']:+.3f} ({d['pct']:+.2f}%)" for d in (r["designs"][k] for k, _ in DESIGNS)]
    arch = f"w{r['width']}-d{r['depth']}" if r.get("arch", "nanochat") == "nanochat" else r["arch"]
    return f"{r['mode']:<8} {arch:<14} {r['mem_layers']:>5} {r['baseline_ms']:>12.3f} " + " ".join(f"{c:>22}" for c in cells)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=device_choice("cuda", "cuda:N", "cpu"), default="cpu",
                    metavar="{cuda,cuda:N,cpu}")
    ap.add_argument("--archs", default="nanochat",
                    help=f"nanochat (the --widths sweep) or a comma list of: {', '.join(ARCHS)}")
    ap.add_argument("--widths", default="256,512,1024", help="model widths (n_embd), comma-separated (nanochat)")
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
    args.arch_list = [a for a in args.archs.split(",") if a]
    bad = [a for a in args.arch_list if a not in ARCHS and a != "nanochat"]
    if bad or not args.arch_list or ("nanochat" in args.arch_list and len(args.arch_list) > 1):
        ap.error(f"--archs {args.archs!r}: either nanochat alone or a list of {', '.join(ARCHS)}")
    if any(w < args.head_dim or w % args.head_dim for w in args.width_list):
        ap.error(f"--widths {args.widths}: every width must be a positive multiple of --head-dim {args.head_dim}")
    if any(m < 1 for m in args.mem_list) or args.reps < 1 or args.warmup < 0:
        ap.error("--mem-layers entries and --reps must be >= 1, --warmup >= 0")
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
    meta = {k: v for k, v in vars(args).items() if k not in ("width_list", "mem_list", "arch_list")}
    out.write_text(json.dumps({"args": meta, "torch": torch.__version__, "threads": torch.get_num_threads(),
                               "rows": rows}, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
