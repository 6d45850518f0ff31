"""MoME's per-layer ops in isolation at d12 shapes: variants of each op that compute the same function, each
checked against a float64 reference (forward and gradients; a disagreeing variant is FAILED, not timed), then
timed forward and forward + backward.

    python bench/mome_ops.py --out bench/results/mome_ops_cuda_h100.json   # CUDA: bf16 autocast, compiled
    python bench/mome_ops.py --ops rowmix,gate                            # a subset of the ops
    python bench/mome_ops.py --device cpu --small                         # smoke test (eager, fp32)

Ops (B=32, T=2048, H=6 heads of d=128, M=6 slots, K=2, vocab V=32768). The first variant of each op, the
baseline, is the model's path when this bench was written; since 2026-11-26 the compiled row mix is the
``unrolled`` variant (docs/performance.md):
* ``rowmix``: rows (B, T, M, d) fp32 (n_t's slots, shared by the heads), sel/w (B, T, H, K) -> (B, T, H, d).
* ``gate_rowmix``: logits (B, T, H, M) + rows -> (B, T, H, d), the gate and the row mix as inductor fuses them
  in the model (the profile's 0.71 ms row-mix kernel has the gate's sigmoid in its name).
* ``gate``: logits -> the top-K slots and their normalised sigmoid weights (MoMEMemory.route's fast path), or
  the weights spread over M (``*_dense``, the row mix's input); compared in the dense form (slot order free).
* ``kmix``: a per-layer table (V*M, d) fp32, token ids (B, T), sel/w -> the K-row mix; its backward is the
  table-gradient scatter. ``shared``: the same on the bigram-indexed table (6V*M, d), one layer's worth.
* ``inject``: the per-layer row mix and the value injection, v (B, T, H, d) + gamma (B, T, H) * mem (both in the
  compute dtype, as v and the gate's output under autocast) -> v_out; gradients of table, w, gamma and v. Its
  baseline is ROW_SUM "unrolled"; ``triton`` is FUSE_INJECT off, ``triton_fused`` the model's default (on).
* ``shared_inject``: ``inject`` on the shared bigram-indexed table (6V*M, d), one layer's worth (the gather of
  n_t's M slots, once per forward in the model, is counted in every call here). Its baseline is today's shared
  path (gather + unrolled row mix + injection); ``rows_triton`` / ``rows_triton_fused`` are the row-mix / fused
  kernel pair on the gathered rows (mome_mix.SHARED_TABLE_KERNEL with FUSE_INJECT off / on). ``shared`` has the
  row mix alone that way (``rowmix_rows_triton``) beside today's ``rowmix_unrolled``.
Token ids are Zipf over the vocabulary (scatter collisions as in text), bigram rows nanochat's hash of them;
logits are tie-free (0.3 apart), so every selection variant picks the same slots; nothing is zero.

Timing: ``triton.testing.do_bench`` (median, warm-up, L2 flush) on CUDA, else a host clock; each call takes the
next of --sets input sets. Forward with grad enabled (the training forward), forward + backward as
``torch.autograd.grad`` with random output gradients. On CUDA also the kernels' device time per call
(torch.profiler), free of the host's launch gaps. A compiled variant is ONE graph (fullgraph, dynamic=False);
``*_eager`` variants run aten's kernels (embedding's sort-based CUDA backward). Floor: compulsory bytes /
--bw (``floor_bytes``; FLOPs are negligible). JSON is rewritten after every variant; --budget-s skips the
variants left after that many seconds, so a cut-short run keeps what it measured.
The ``*triton`` variants call the custom op of nanochat.memory.mome_triton (Triton kernels on CUDA, opaque inside
the compiled graph; its torch math on the CPU).
The variants live in bench/mome_ops_variants.py; this file holds the inputs, references, floors and the harness.
"""

import argparse
import itertools
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters

REPO = Path(__file__).resolve().parents[1]
# the repository (nanochat) and this directory (the variants module beside this file, importable as when the file
# runs as a script; tests load this file by path)
for path in (str(REPO), str(REPO / "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)
import mome_ops_variants as mv  # noqa: E402
from kernel_table import PROFILER_OVERHEAD  # noqa: E402  (the profiler's own stalls, as in the step profiles)
from nanochat.cli_types import device_name  # noqa: E402
from nanochat.common import autocast_context  # noqa: E402
from nanochat.memory.hashing import bigram_hash  # noqa: E402
from nanochat.memory.mome_mix import slot_weights  # noqa: E402


@dataclass(frozen=True)
class Shape:
    B: int = 32
    T: int = 2048
    C: int = 768  # model width (the router GEMM C -> H*M is not benchmarked: its logits are the gate's input)
    H: int = 6
    d: int = 128
    M: int = 6
    K: int = 2
    V: int = 32768
    n: int = 6  # bigram rows per vocabulary entry: the shared table has n*V rows of M slots


D12 = Shape()
SMALL = Shape(B=2, T=64, C=96, H=6, d=16, M=6, K=2, V=512, n=6)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # norm-wise relative error vs float64, by compute dtype
# HBM bandwidth (bytes/s, datasheets) by device-name pattern, first match wins, so variants precede their family
# (as nanochat.metrics.PEAK_BF16_FLOPS); --bw overrides. None: a GPU sold with several memories (GH200: 96 GB HBM3
# at 4.0 TB/s or 144 GB HBM3e at 4.9); that and an unlisted GPU need --bw (a guess would skew every "x floor").
BANDWIDTH: tuple[tuple[str, float | None], ...] = (
    (r"H100.*NVL", 3.9e12),  # H100 NVL, 94 GB HBM3
    (r"H100.*PCIe", 2.0e12),  # H100 PCIe, 80 GB HBM2e
    (r"H100", 3.35e12),  # H100 SXM, 80 GB HBM3
    (r"GH200", None),
    (r"H200", 4.8e12),  # H200 SXM and NVL, 141 GB HBM3e
    (r"A100.*40GB", 1.555e12),  # A100 40 GB (SXM and PCIe), HBM2
    (r"A100", 2.0e12),  # A100 80 GB: 2.039 (SXM), 1.935 (PCIe)
)


# -- inputs, references, floors ----------------------------------------------------------------------------------
def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def token_ids(S: Shape, device, g) -> torch.Tensor:
    """(B, T) ids, Zipf (s = 1) over a shuffled vocabulary: a few ids take several % of the positions."""
    probs = 1.0 / torch.arange(1, S.V + 1, dtype=torch.float32, device=device)
    perm = torch.randperm(S.V, device=device, generator=g)
    return perm[torch.multinomial(probs, S.B * S.T, replacement=True, generator=g)].view(S.B, S.T)


def _sel_w(S: Shape, device, g):
    """K distinct slots per (token, head) and positive normalised weights (as the sigmoid-norm gate's)."""
    sel = torch.rand(S.B, S.T, S.H, S.M, device=device, generator=g).argsort(dim=-1)[..., :S.K].contiguous()
    w = mv._norm(torch.rand(S.B, S.T, S.H, S.K, device=device, generator=g) + 0.1)
    return sel, w.requires_grad_()


def make_gate(S, device, cdt, g):
    # tie-free: a random order of M levels 0.5 apart plus jitter under 0.2, far above bf16's rounding
    order = torch.rand(S.B, S.T, S.H, S.M, device=device, generator=g).argsort(dim=-1).float()
    jitter = 0.2 * torch.rand(order.shape, device=device, generator=g)
    return [((order - (S.M - 1) / 2) * 0.5 + jitter).to(cdt).requires_grad_()]


def make_rowmix(S, device, cdt, g):
    rows = torch.randn(S.B, S.T, S.M, S.d, device=device, generator=g)  # fp32: gathered from an fp32 table
    return [rows.requires_grad_(), *_sel_w(S, device, g)]


def make_gate_rowmix(S, device, cdt, g):
    return [make_rowmix(S, device, cdt, g)[0], *make_gate(S, device, cdt, g)]


def make_kmix(S, device, cdt, g):
    table = torch.randn(S.V * S.M, S.d, device=device, generator=g).requires_grad_()
    return [table, token_ids(S, device, g), *_sel_w(S, device, g)]


def make_shared(S, device, cdt, g):
    table = torch.randn(S.n * S.V * S.M, S.d, device=device, generator=g).requires_grad_()
    return [table, bigram_hash(token_ids(S, device, g), S.n * S.V), *_sel_w(S, device, g)]


def _gamma_v(S, device, cdt, g):
    """gamma = 2 sigmoid(.) in (0, 2) as the gate's, and v, both in the compute dtype."""
    gamma = 2 * torch.sigmoid(torch.randn(S.B, S.T, S.H, device=device, generator=g))
    v = torch.randn(S.B, S.T, S.H, S.d, device=device, generator=g)
    return [gamma.to(cdt).requires_grad_(), v.to(cdt).requires_grad_()]


def make_inject(S, device, cdt, g):
    return [*make_kmix(S, device, cdt, g), *_gamma_v(S, device, cdt, g)]


def make_shared_inject(S, device, cdt, g):
    return [*make_shared(S, device, cdt, g), *_gamma_v(S, device, cdt, g)]


def _ref_sel_w(logits, S):
    sel = logits.topk(S.K, dim=-1).indices
    return sel, mv._norm(torch.sigmoid(logits.gather(-1, sel)))


def ref_gate(logits, S):
    return slot_weights(*_ref_sel_w(logits, S), S.M)


def ref_rowmix(rows, sel, w, S):
    B, T, M, d = rows.shape
    picked = rows[:, :, None].expand(B, T, sel.size(2), M, d).gather(3, sel[..., None].expand(*sel.shape, d))
    return (w[..., None] * picked).sum(dim=-2)


def ref_gate_rowmix(rows, logits, S):
    return ref_rowmix(rows, *_ref_sel_w(logits, S), S)


def ref_table(table, row, sel, w, S):
    return (w[..., None] * table[mv._flat(row, sel, S.M)]).sum(dim=-2)


def ref_inject(table, row, sel, w, gamma, v, S):
    return v + gamma[..., None] * ref_table(table, row, sel, w, S)


def canonical(out, m: int) -> torch.Tensor:
    """float64 form compared with the reference: (sel, w) pairs as dense (..., M) weights, order-free."""
    if isinstance(out, tuple):
        sel, w = out
        return slot_weights(sel, w.double(), m)
    return out.double()


def floor_bytes(op: str, S: Shape, inputs, cb: int) -> tuple[int, int, int]:
    """(fwd bytes, fwd+bwd bytes, fwd+bwd FLOPs), compulsory traffic. N = B*T, cb = compute-dtype bytes, ids int64,
    weights and tables fp32. gate: fwd reads logits N*H*M*cb, writes sel + w N*H*K*(8+4); bwd reads grad w and
    the logits, writes grad logits. rowmix: fwd reads rows N*M*d*4, sel + w, writes out N*H*d*cb; bwd reads grad
    out, rows, sel + w, writes grad rows and grad w. gate_rowmix: rowmix's, the logits in place of sel + w.
    kmix/shared(_inject): fwd reads ids N*8, sel + w, each DISTINCT selected table row once (u rows, counted on the inputs),
    writes out; bwd reads grad out and the u rows (for grad w), writes the dense table gradient once (its
    zero-fill and scatter fused) and grad w. inject: kmix's, plus v N*H*d*cb and gamma N*H*cb read forward, gamma
    read again and its gradient written backward (grad v is grad out itself, no traffic). FLOPs 2*N*H*K*d forward,
    twice that backward."""
    N, H, M, K, d = S.B * S.T, S.H, S.M, S.K, S.d
    sw = N * H * K * 12  # sel int64 + w fp32
    flops = 6 * N * H * K * d
    if op == "gate":
        fwd = N * H * M * cb + sw
        return fwd, fwd + N * H * K * 4 + N * H * M * cb * 2, 0
    if op == "rowmix":
        fwd = N * M * d * 4 + sw + N * H * d * cb
        return fwd, fwd + N * H * d * cb + N * M * d * 8 + sw + N * H * K * 4, flops
    if op == "gate_rowmix":  # rowmix's counts with the logits N*H*M*cb in place of sel + w
        fwd = N * M * d * 4 + N * H * M * cb + N * H * d * cb
        return fwd, fwd + N * H * d * cb + N * M * d * 8 + N * H * M * cb * 2, flops
    table, row, sel = inputs[0], inputs[1], inputs[2]
    u = int(torch.unique(mv._flat(row, sel, M)).numel()) * d * 4
    fwd = N * 8 + sw + u + N * H * d * cb
    full = fwd + N * H * d * cb + u + table.numel() * 4 + N * H * K * 4
    if op in ("inject", "shared_inject"):  # + read v and gamma; bwd: read gamma again, write its gradient (grad v
        # IS grad out: free)
        return fwd + N * H * d * cb + N * H * cb, full + N * H * d * cb + 3 * N * H * cb, flops
    return fwd, full, flops


@dataclass
class Op:
    make: object  # (Shape, device, compute dtype, generator) -> inputs; grad inputs are leaves requiring grad
    names: tuple  # the inputs' names
    grad_args: tuple  # indices of the inputs that get gradients
    reference: object  # (*float64 inputs, Shape) -> the canonical output
    variants: dict  # name -> (function, compiled?); the first is the baseline


def default_ops() -> dict[str, Op]:
    """In the order of their share of MoME's extra step time on the H100 (a run cut short loses the last)."""
    return {
        "rowmix": Op(make_rowmix, ("rows", "sel", "w"), (0, 2), ref_rowmix, {
            "bcast_sum": (mv.rowmix_bcast_sum, True), "unrolled": (mv.rowmix_unrolled, True),
            "unrolled_fn": (mv.rowmix_unrolled_fn, True), "einsum": (mv.rowmix_einsum, True),
            "kgather": (mv.rowmix_kgather, True), "triton": (mv.rowmix_triton, True)}),
        "gate_rowmix": Op(make_gate_rowmix, ("rows", "logits"), (0, 1), ref_gate_rowmix, {
            "today": (mv.gate_rowmix_today, True), "mask_unrolled": (mv.gate_rowmix_mask_unrolled, True),
            "unrolled_fn": (mv.gate_rowmix_unrolled_fn, True), "kgather": (mv.gate_rowmix_kgather, True)}),
        "shared": Op(make_shared, ("table", "row", "sel", "w"), (0, 3), ref_table, {
            "rowmix": (mv.table_rowmix, True), "rowmix_index_add": (mv.table_rowmix_index_add, True),
            "plain": (mv.table_plain, True), "rowmix_eager": (mv.table_rowmix_eager, False),
            "rowmix_unrolled": (mv.table_rowmix_unrolled, True),
            "rowmix_rows_triton": (mv.table_rowmix_rows_triton, True)}),
        "gate": Op(make_gate, ("logits",), (0,), ref_gate, {
            "argmax": (mv.gate_argmax, True), "topk": (mv.gate_topk, True), "max_pass": (mv.gate_max_pass, True),
            "argmax_dense": (mv.gate_argmax_dense, True), "mask_dense": (mv.gate_mask_dense, True)}),
        "kmix": Op(make_kmix, ("table", "row", "sel", "w"), (0, 3), ref_table, {
            "plain": (mv.table_plain, True), "index_add": (mv.table_index_add, True), "bag": (mv.table_bag, True),
            "rowmix": (mv.table_rowmix, True), "plain_eager": (mv.table_plain, False),
            "rowmix_unrolled": (mv.table_rowmix_unrolled, True), "rowmix_triton": (mv.table_rowmix_triton, True)}),
        # last: a run of the ops above is unchanged by it
        "inject": Op(make_inject, ("table", "row", "sel", "w", "gamma", "v"), (0, 3, 4, 5), ref_inject, {
            "rowmix_unrolled": (mv.inject_rowmix_unrolled, True), "triton": (mv.inject_triton, True),
            "triton_fused": (mv.inject_triton_fused, True)}),
        "shared_inject": Op(make_shared_inject, ("table", "row", "sel", "w", "gamma", "v"), (0, 3, 4, 5), ref_inject, {
            "rowmix_unrolled": (mv.inject_rowmix_unrolled, True), "rows_triton": (mv.inject_rows_triton, True),
            "rows_triton_fused": (mv.inject_rows_triton_fused, True)}),
    }


OPS = default_ops()


# -- check and timing --------------------------------------------------------------------------------------------
def _autocast(device, cdt):
    """Training's autocast (bf16 on a CPU without native bf16 notes once that it is slow there)."""
    return autocast_context(device.type, str(cdt).removeprefix("torch."))


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def _grad_outs(out) -> list[torch.Tensor]:
    return [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]


def check_variant(op: Op, fn, S: Shape, device, cdt, seed: int) -> dict[str, float]:
    """Norm-wise relative errors of the output and of every input gradient against the float64 reference, on
    fresh inputs (the loss is <canonical output, G> for a random G, so every output element is tested)."""
    inputs = op.make(S, device, cdt, _gen(device, seed))
    with _autocast(device, cdt):
        out = fn(*inputs)
    y = canonical(out, S.M)
    G = torch.randn(y.shape, dtype=torch.float64, device=device, generator=_gen(device, seed + 1))
    grads = torch.autograd.grad((y * G).sum(), [inputs[i] for i in op.grad_args])
    ref_in = [x.detach().double().requires_grad_(x.requires_grad) if x.is_floating_point() else x for x in inputs]
    y_ref = op.reference(*ref_in, S)
    ref_grads = torch.autograd.grad((y_ref * G).sum(), [ref_in[i] for i in op.grad_args])
    return {"out": _rel(y.detach(), y_ref.detach()),
            **{f"d_{op.names[i]}": _rel(g, r) for i, g, r in zip(op.grad_args, grads, ref_grads)}}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, device, a) -> tuple[float, str]:
    """Median ms per call and the timer used: do_bench on CUDA, CUDA events without triton, else a host clock."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            try:
                return float(do_bench(fn, warmup=a.warmup_ms, rep=a.rep_ms, return_mode="median")), "do_bench"
            except TypeError:  # older triton: no return_mode
                return float(do_bench(fn, warmup=a.warmup_ms, rep=a.rep_ms, quantiles=[0.5])[0]), "do_bench"
    for _ in range(a.warmup):
        fn()
    times = []
    for _ in range(a.reps):
        if device.type == "cuda":
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            events[0].record()
            fn()
            events[1].record()
            torch.cuda.synchronize()
            times.append(events[0].elapsed_time(events[1]))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), "cuda_events" if device.type == "cuda" else "host_clock"


def time_variant(op: Op, fn, sets, device, cdt, a) -> dict:
    """Forward (grad enabled) and forward + backward, each call on the next input set."""
    grads = []
    for inputs in sets:  # random output gradients shaped like this variant's outputs
        with _autocast(device, cdt):
            outs = _grad_outs(fn(*inputs))
        grads.append([torch.randn_like(o) for o in outs])
    fwd_sets, full_sets = itertools.cycle(sets), itertools.cycle(list(zip(sets, grads)))

    def fwd():
        with _autocast(device, cdt):
            fn(*next(fwd_sets))

    def fwd_bwd():
        inputs, gout = next(full_sets)
        with _autocast(device, cdt):
            out = fn(*inputs)
        torch.autograd.grad(_grad_outs(out), [inputs[i] for i in op.grad_args], gout)

    fwd_ms, timer = bench_ms(fwd, device, a)
    full_ms, _ = bench_ms(fwd_bwd, device, a)
    rec = {"fwd_ms": fwd_ms, "fwd_bwd_ms": full_ms, "timer": timer}
    if device.type == "cuda" and a.kernels:
        try:
            rec["kernel_fwd_ms"] = kernel_profile(fwd)[0]
            rec["kernel_fwd_bwd_ms"], rec["top_kernels"] = kernel_profile(fwd_bwd)
        except Exception as e:  # the profiler is a second opinion: its failure must not lose the timings
            rec["kernel_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return rec


def kernel_profile(fn, calls: int = 3) -> tuple[float, list]:
    """Device time per call summed over its kernels (torch.profiler), free of host overhead: do_bench's events
    also count the GPU's idle gaps when an op's kernels are shorter than its Python and dispatch cost; and the
    three longest kernels per call, named as in the training-step profiles."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_call = sorted(((getattr(e, "self_device_time_total", 0) / calls / 1e3, e.key) for e in prof.key_averages()),
                      reverse=True)
    # kernels, memsets, copies: the device's work (not the profiler's own "Command Buffer Full" stalls, which the
    # 2026-11-26 step profiles list with device time)
    per_call = [(ms, name) for ms, name in per_call if ms > 0 and name not in PROFILER_OVERHEAD]
    if not per_call:
        raise RuntimeError("the profiler recorded no device time")
    return sum(ms for ms, _ in per_call), [[name[:100], ms] for ms, name in per_call[:3]]


def bind(fn0, S: Shape, cdt, compiled: bool):
    """The variant called on the inputs alone. Compiled: torch.compile of the variant function ITSELF, one graph
    (fullgraph), its constants passed as keywords: dynamo caches per code object, so a compiled wrapper shared
    by the variants (a functools.partial, a closure) would hit the recompile limit (8) after 8 variants and run
    the rest eagerly without an error."""
    kw = dict(m=S.M, k=S.K, out_dtype=cdt)
    target = torch.compile(fn0, dynamic=False, fullgraph=True) if compiled else fn0
    return lambda *inputs: target(*inputs, **kw)


def run_op(name: str, op: Op, S: Shape, device, cdt, a, result: dict, save, t_start: float) -> None:
    cb = torch.finfo(cdt).bits // 8
    sets = [op.make(S, device, cdt, _gen(device, 100 + i)) for i in range(a.sets)]
    fwd_b, full_b, flops = floor_bytes(name, S, sets[0], cb)
    floor = {"fwd_bytes": fwd_b, "fwd_bwd_bytes": full_b, "fwd_bwd_flops": flops,
             "fwd_ms": fwd_b / a.bw * 1e3, "fwd_bwd_ms": full_b / a.bw * 1e3}
    rows = {}
    result["ops"][name] = {"floor": floor, "variants": rows}
    for i, (vname, (fn0, compiled)) in enumerate(op.variants.items()):
        rec = rows[vname] = {"compiled": compiled and a.compile}
        _sync(device)
        if time.perf_counter() - t_start > a.budget_s:
            rec["status"] = "SKIPPED (budget)"
            continue
        fn = bind(fn0, S, cdt, rec["compiled"])
        graphs, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        try:
            rec["errors"] = errors = check_variant(op, fn, S, device, cdt, seed=1000 + 10 * i)
            _sync(device)
            rec["check_s"] = time.perf_counter() - t0  # the compile happens here
            rec["graphs"] = counters["stats"]["unique_graphs"] - graphs
            if rec["compiled"] and rec["graphs"] != 1:  # guards against timing eager code as compiled
                raise RuntimeError(f"{rec['graphs']} graphs compiled, not 1")
            bad = [k for k, e in errors.items() if not e <= TOL[cdt]]  # NaN fails too
            if bad:
                rec["status"] = f"FAILED ({', '.join(bad)} over {TOL[cdt]:g})"
            else:
                rec.update(time_variant(op, fn, sets, device, cdt, a), status="ok")
                rec.update({f"{k}_ratio": rec[f"{k}_ms"] / floor[f"{k}_ms"] for k in ("fwd", "fwd_bwd")})
        except Exception as e:  # one variant's failure (e.g. a lowering missing on this torch) must not end the run
            rec["status"] = f"ERROR ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        rec["variant_s"] = time.perf_counter() - t0
        print(f"  {name}/{vname}: {rec['status']} ({rec['variant_s']:.1f} s)", flush=True)
        save()
    del sets
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- command line --------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help=f"toy shapes for a smoke test: {SMALL}")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="autocast compute dtype; default bf16 on CUDA, fp32 (no autocast) on CPU")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the compiled variants; default on CUDA only")
    p.add_argument("--sets", type=int, default=3, help="input sets rotated through the timed calls")
    p.add_argument("--bw", type=float, default=None, help="memory bandwidth for the floor, bytes/s")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up (CUDA)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench measuring time (CUDA)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up calls of the host or event timer")
    p.add_argument("--reps", type=int, default=5, help="timed calls of the host or event timer")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: also sum the kernels' device time per call with torch.profiler")
    p.add_argument("--budget-s", type=float, default=200.0, help="variants left after this many seconds are skipped")
    p.add_argument("--out", default=None, help="write the JSON here (rewritten after every variant)")
    a = p.parse_args(argv)
    unknown = [o for o in a.ops.split(",") if o not in OPS]
    if unknown:
        p.error(f"--ops: unknown {unknown}; allowed: {','.join(OPS)}")
    return a


def device_info(device) -> tuple[str, float | None]:
    """The device's name and its bandwidth for the floor (a CPU guess of 20 GB/s: the CPU ratios mean little);
    None for a GPU not in BANDWIDTH."""
    if device.type != "cuda":
        return "cpu", 20e9
    name = torch.cuda.get_device_name(device)
    return name, next((bw for pattern, bw in BANDWIDTH if re.search(pattern, name, flags=re.IGNORECASE)), None)


def print_table(result: dict) -> None:
    """ms per call (do_bench or host clock; on CUDA also the kernels' device time) and multiples of the floor."""
    print(f"\n{result['device_name']} | torch {result['torch']} | {result['dtype']} | compile {result['compile']}"
          f" | floor at {result['bw'] / 1e9:,.0f} GB/s | fwd, fwd+bwd: ms per call (x floor)")
    print(f"{'op/variant':<24} {'fwd':>16} {'fwd+bwd':>16} {'kernels fwd':>16} {'kernels fwd+bwd':>16}  status")
    for name, op in result["ops"].items():
        f = op["floor"]
        print(f"{name + ' floor':<24} {f['fwd_ms']:>16.3f} {f['fwd_bwd_ms']:>16.3f}")
        for vname, r in op["variants"].items():
            cells = [f"{r[k]:.3f} ({r[k] / f[k.removeprefix('kernel_')]:.1f}x)" if k in r else "-"
                     for k in ("fwd_ms", "fwd_bwd_ms", "kernel_fwd_ms", "kernel_fwd_bwd_ms")]
            print(f"  {vname:<22} " + " ".join(f"{c:>16}" for c in cells) + f"  {r.get('status')}")


def main(argv=None) -> dict:
    t_start = time.perf_counter()
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda":  # the timers (synchronize, Event.record, do_bench) act on the current device: cuda:N's
        torch.cuda.set_device(device)
    cdt = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    a.compile = device.type == "cuda" if a.compile is None else a.compile
    name, bw = device_info(device)
    a.bw = a.bw or bw
    if a.bw is None:
        raise SystemExit(f"--bw: no HBM bandwidth known for {name} (bench/mome_ops.py BANDWIDTH); pass the datasheet's "
                         "figure in bytes/s, e.g. --bw 8e12")
    S = SMALL if a.small else D12
    result = {"device_name": name, "device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
              "command": " ".join(["python", "bench/mome_ops.py", *(sys.argv[1:] if argv is None else argv)]),
              "dtype": str(cdt).removeprefix("torch."), "compile": a.compile, "shape": asdict(S), "bw": a.bw,
              "sets": a.sets, "ops": {}}

    def save():
        result["wall_s"] = time.perf_counter() - t_start
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    for op_name in a.ops.split(","):
        print(f"{op_name}:", flush=True)
        run_op(op_name, OPS[op_name], S, device, cdt, a, result, save, t_start)
    save()
    print_table(result)
    print(f"wall {result['wall_s']:.1f} s")
    return result


if __name__ == "__main__":
    main()
