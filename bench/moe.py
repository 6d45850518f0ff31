"""Cost of the MoE FFN against the dense MLP it replaces: one FFN layer, forward + backward, time and peak memory.

    python bench/moe.py [--device cpu|cuda] [--dtype float32|bfloat16] [--compile] [--tokens 8192] [--width 1536]
        [--experts 6] [--topk 2] [--shared 1] [--reps 10] [--warmup 3] [--out FILE]

Designs, timed round-robin in one process (one step of each per repetition, so load drift hits them alike):
``dense`` (relu^2 4C, ``nanochat.gpt.MLP``), ``moe_grouped`` (``torch._grouped_mm`` segments) and ``moe_looped``
(one F.linear per expert, host-synced segment lengths). The input is (1, --tokens, C) under autocast --dtype; all
weights random (no zero-init c_proj) so every expert gets a gradient. At E6/K2/S1 the MoE layer does the dense
layer's GEMM FLOPs (shared + 2 experts = 4C of width) plus the router, so its ratio to dense is the price of the
routing, sort, gathers and grouped kernels. Times: median ms over --reps after --warmup, [min-max]; on CUDA also
the peak allocated memory of a step over the memory before it. The last stdout line is JSON.
With --compile and --dtype float32 the grouped design is skipped (torch.compile traces _grouped_mm in bf16 only).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanochat import moe as moe_module  # noqa: E402
from nanochat.cli_types import device_choice  # noqa: E402
from nanochat.common import autocast_context  # noqa: E402
from nanochat.gpt import MLP, GPTConfig  # noqa: E402


def build(design: str, cfg: GPTConfig, device) -> torch.nn.Module:
    with torch.device("meta"):
        layer = MLP(cfg) if design == "dense" else moe_module.MoEFFN(cfg, 0)
    layer.to_empty(device=device)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():  # fan-in scaled: O(1) activations
            p.copy_(torch.randn(p.shape, generator=g) / p.size(1) ** 0.5)
        for buf in layer.buffers():
            buf.zero_()
    return layer


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step(layer, x, design: str, device, dtype) -> tuple[float, int]:
    moe_module.GROUPED_MM = {"moe_grouped": True, "moe_looped": False}.get(design)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    sync(device)
    t0 = time.perf_counter()
    with autocast_context(device.type, str(dtype).removeprefix("torch.")):  # bf16 on a CPU: the slow-bf16 note
        out = layer(x)
    out.float().square().mean().backward()
    sync(device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0
    layer.zero_grad(set_to_none=True)
    return dt * 1e3, peak


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # no cuda:N: sync and the peak-memory counters read the current CUDA device (pick one with CUDA_VISIBLE_DEVICES)
    p.add_argument("--device", type=device_choice("cpu", "cuda"), metavar="{cpu,cuda}",
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: bf16 on CUDA, fp32 else")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--width", type=int, default=1536, help="C (d24: 1536)")
    p.add_argument("--experts", type=int, default=6)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--shared", type=int, default=1)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    heads = max(1, a.width // 128)
    cfg = GPTConfig(n_layer=1, n_head=heads, n_kv_head=heads, n_embd=a.width, mlp="moe", moe_experts=a.experts,
                    moe_topk=a.topk, moe_shared=a.shared)
    designs = ["dense", "moe_grouped", "moe_looped"]
    if a.compile and dtype != torch.bfloat16:
        designs.remove("moe_grouped")
    layers = {d: build(d, cfg, device) for d in designs}
    if a.compile:
        layers = {d: torch.compile(m) for d, m in layers.items()}
    x = torch.randn(1, a.tokens, a.width, device=device, generator=torch.Generator(device).manual_seed(1))
    times = {d: [] for d in designs}
    peaks = {d: 0 for d in designs}
    try:
        for rep in range(a.warmup + a.reps):
            for d in designs:
                ms, peak = step(layers[d], x, d, device, dtype)
                if rep >= a.warmup:
                    times[d].append(ms)
                    peaks[d] = max(peaks[d], peak)
    finally:
        moe_module.GROUPED_MM = None
    dense = statistics.median(times["dense"])
    result = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "compile": a.compile,
              "tokens": a.tokens, "width": a.width, "experts": a.experts, "topk": a.topk, "shared": a.shared,
              "hidden": moe_module.moe_hidden_size(a.width, a.shared, a.topk),
              "designs": {}}
    for d in designs:
        med = statistics.median(times[d])
        result["designs"][d] = {"ms": med, "min": min(times[d]), "max": max(times[d]), "ratio_to_dense": med / dense,
                                "peak_mb": peaks[d] / 2**20}
        mem = f" | peak {peaks[d] / 2**20:,.0f} MB" if device.type == "cuda" else ""
        print(f"{d:>12}: {med:8.2f} ms [{min(times[d]):.2f}-{max(times[d]):.2f}] | x{med / dense:.2f} dense{mem}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
