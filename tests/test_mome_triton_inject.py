"""The row mix fused with the value injection (nanochat.memory.mome_triton ``mome_row_mix_inject``, switched on by
``mome_mix.FUSE_INJECT``; on by default), in the tiers of tests/test_mome_triton.py:

* always (no triton needed): the op's CPU math against a float64 reference (forward; table, w, gamma and v
  gradients; repeated rows; fp32 and bf16 v), its eager rounding pinned, ``torch.library.opcheck``,
  ``torch.compile(fullgraph=True)`` on CPU (of the op alone: slow), and MoMEMemory.value: the op in every memory
  layer of a per-layer table with FUSE_INJECT on (the CPU added to KERNEL_DEVICES), the same loss and gradients
  as with it off; never with a shared expert, with ``capture`` on, or for per-head / shared tables;
* triton with ``TRITON_INTERPRET=1``: the real kernels against the float64 reference; triton without it: both
  kernels compiled for sm_90;
* marker ``gpu`` (CUDA): the op against float64 on the GPU, and a compiled MoME model with FUSE_INJECT on and off.

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest tests/test_mome_triton_inject.py
    PYTHONPATH=$PWD:/path/to/triton python -m pytest tests/test_mome_triton_inject.py
    python -m pytest -m gpu tests/test_mome_triton_inject.py                                        # on a GPU
"""

import re

import pytest
import torch

from conftest import tiny_config
from memory_grads import BF16_REL, FP32_REL, assert_grads_close, reach_the_memory
from nanochat.gpt import build_model
from nanochat.memory import mome as mome_module
from nanochat.memory import mome_mix as mix_paths
from nanochat.memory import mome_triton as mt
from test_mome_triton import (COMPILABLE, MODEL_OPTIONS, TABLE_ATOMICS, _close, _cuda_model, _fp32_matmuls, _inputs,
                              _loss_and_grads, assert_as_close_as, assert_compiled_equals_eager,
                              assert_equal_to_fp32_rounding, atomics_width, compiled_run_with, cuda_op_shapes,
                              needs_cuda, needs_interpreter, sm90_ptx)

BF16_ULP = 2**-7  # relative spacing of bf16 values (8 significant bits): one ulp is at most this


# -- inputs and the float64 reference ------------------------------------------------------------------------
def _inject_inputs(dtype=torch.float32, device="cpu", seed=0, **shape):
    """_inputs' table, row ids (repeated rows), dense weights, output gradient (in ``dtype``), plus gamma (N, H)
    in (0, 2) as the gate's and v (N, H, d), both in ``dtype``."""
    table, row, w, grad = _inputs(seed=seed, **shape)
    g = torch.Generator().manual_seed(seed + 7)
    gamma = 2 * torch.sigmoid(torch.randn(w.shape[:2], generator=g))
    v = torch.randn(grad.shape, generator=g)
    return [x.to(device) for x in (table, row, w, gamma.to(dtype), v.to(dtype), grad.to(dtype))]


def _reference(table, row, w, gamma, v, grad):
    """float64 autograd of the naive formula (written apart from the op): out (N, H, d) and the gradients of
    table (R, d), w (N, H, M), gamma (N, H), v (N, H, d)."""
    table, w, gamma, v = (x.detach().double().cpu().requires_grad_() for x in (table, w, gamma, v))
    M = w.size(-1)
    rows = torch.stack([table[row.cpu() * M + m] for m in range(M)], dim=1)  # (N, M, d): repeated rows accumulate
    mem = (w[..., None] * rows[:, None]).sum(dim=2)  # (N, H, d)
    out = v + gamma[..., None] * mem
    grads = torch.autograd.grad(out, (table, w, gamma, v), grad.double().cpu())
    return out.detach(), *grads


def _op_with_grads(table, row, w, gamma, v, grad):
    leaves = [x.detach().clone().requires_grad_() for x in (table, w, gamma, v)]
    out = mt.mome_row_mix_inject_op(leaves[0], row, *leaves[1:])
    return out, *torch.autograd.grad(out, leaves, grad)


SHAPES = [dict(), dict(N=30, H=3, M=5, d=48, rows=1)]
SHAPE_IDS = ["d128", "odd_one_row"]


# -- (a) the op's CPU math and its plumbing, always ------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_op_cpu_fp32_matches_the_float64_reference(shape):
    inputs = _inject_inputs(**shape)
    got, want = _op_with_grads(*inputs[:3], *inputs[3:]), _reference(*inputs)
    assert got[0].dtype == torch.float32
    for name, a, b in zip(("out", "d_table", "dw", "d_gamma", "d_v"), got, want):
        assert a.dtype == torch.float32, name
        _close(a, b, 1e-6)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_op_cpu_bf16_rounds_as_the_eager_injection(shape):
    """bf16 v and gamma (autocast): the output equals the eager ``v + gamma.to(bf16) * mem.to(bf16)`` bit for bit
    (mem, gamma, their product and the sum each rounded to bf16); grad v is the output gradient itself; d_gamma
    (bf16) sums grad * the bf16 mem in fp32; dw and d_table (fp32) use gamma rounded to bf16, as the eager
    backward's gamma * grad does."""
    table, row, w, gamma, v, grad = _inject_inputs(torch.bfloat16, **shape)
    out, d_table, dw, d_gamma, d_v = _op_with_grads(table, row, w, gamma, v, grad)
    mem = mt.mome_row_mix_op(table, row, w, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, v + gamma[..., None] * mem)
    assert d_v.dtype == torch.bfloat16 and torch.equal(d_v, grad)
    assert d_gamma.dtype == torch.bfloat16 and dw.dtype == d_table.dtype == torch.float32
    want = _reference(table, row, w, gamma, v, grad)
    _close(out, want[0], BF16_ULP)
    _close(d_table, want[1], 1e-6)
    _close(dw, want[2], 1e-6)
    _close(d_gamma, want[3], BF16_ULP)  # mem and d_gamma rounded to bf16: ~2^-9 each
    torch.testing.assert_close(d_gamma, (grad.float() * mem.float()).sum(-1).bfloat16(), rtol=0, atol=0)


def test_wrapper_shapes_and_dtypes():
    """row_mix_inject: (B, T) ids, (B, T, H, M) weights (bf16 w's gradient reaches it), (B, T, H) gamma and
    (B, T, H, d) v in, (B, T, H, d) out in v's dtype, the same values as the op on flat inputs."""
    table, row, w, gamma, v, grad = _inject_inputs(N=12, H=2, M=3, d=8)
    w16 = w.view(3, 4, 2, 3).bfloat16().requires_grad_()
    out = mt.row_mix_inject(table, row.view(3, 4), w16, gamma.view(3, 4, 2), v.view(3, 4, 2, 8))
    assert out.shape == (3, 4, 2, 8) and out.dtype == torch.float32
    (dw,) = torch.autograd.grad(out, w16, grad.view(out.shape))
    assert dw.dtype == torch.bfloat16
    assert torch.equal(out.view(12, 2, 8), mt.mome_row_mix_inject_op(table, row, w16.detach().float().view(12, 2, 3),
                                                                      gamma, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_custom_ops_pass_opcheck(dtype):
    table, row, w, gamma, v, grad = _inject_inputs(dtype, N=8, H=2, M=3, d=16)
    leaves = [x.requires_grad_() for x in (table, w, gamma, v)]
    torch.library.opcheck(mt.mome_row_mix_inject_op, (leaves[0], row, *leaves[1:]))
    torch.library.opcheck(mt.mome_row_mix_inject_backward_op, (grad, table.detach(), row, w.detach(),
                                                               gamma.detach()))


# slow: the op compiled alone; test_model_fuse_inject_compiles_fullgraph (default suite) compiles it fullgraph in
# the model's memory layer (FUSE_INJECT on: this op) and compares the loss and every gradient with eager
@pytest.mark.slow
def test_compile_fullgraph_of_the_op_on_cpu():
    torch._dynamo.reset()
    table, row, w, gamma, v, grad = _inject_inputs(N=10, H=2, M=3, d=16)
    leaves = [x.requires_grad_() for x in (table, w, gamma, v)]

    def f(table, row, w, gamma, v):
        return mt.row_mix_inject(table, row.view(2, 5), w.view(2, 5, 2, 3), gamma.view(2, 5, 2),
                                 v.view(2, 5, 2, 16)) * 2.0

    try:
        out = torch.compile(f, fullgraph=True, dynamic=False)(table, row, w, gamma, v)
        got = torch.autograd.grad(out, leaves, grad.view(out.shape))
    finally:
        torch._dynamo.reset()
    want_out = f(table, row, w, gamma, v)
    want = torch.autograd.grad(want_out, leaves, grad.view(out.shape))
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fuse_inject_must_be_a_bool(monkeypatch):
    monkeypatch.setattr(mix_paths, "FUSE_INJECT", "yes")
    with pytest.raises(ValueError, match="FUSE_INJECT must be True or False"):
        mix_paths.fuse_inject()


def _model(name, n_layer=2):
    """A tiny MoME model with random routers (real selections, no ties), gates away from 1, gradients reaching the
    memory (tests/memory_grads.py) and a batch with repeated tokens."""
    model = build_model(tiny_config(memory="mome", memory_options=MODEL_OPTIONS[name][0], n_layer=n_layer), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in model.memory.routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        for gate in model.memory.gates:  # gamma away from its init value 1
            gate.proj.weight.copy_(0.3 * torch.randn(gate.proj.weight.shape, generator=g))
    reach_the_memory(model, g)
    idx = torch.randint(0, 40, (2, 17), generator=g)
    return model, idx[:, :-1], idx[:, 1:]


def _spy(monkeypatch):
    calls = []
    real = mome_module.kernel_row_mix_inject

    def spy(table, row, w, gamma, v, unique_rows):
        calls.append(v.dtype)
        assert unique_rows is False  # a per-layer table: its row ids repeat
        return real(table, row, w, gamma, v, unique_rows)

    monkeypatch.setattr(mome_module, "kernel_row_mix_inject", spy)
    return calls


FUSED = ("per_layer", "full_routing")  # MODEL_OPTIONS that take the fused op; the others never do


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("name", list(MODEL_OPTIONS))
def test_model_fuse_inject_equals_the_unfused_path(name, autocast, monkeypatch):
    """Defaults otherwise (MIX None, ROW_SUM "triton"), the CPU added to KERNEL_DEVICES: FUSE_INJECT takes the
    fused op in every memory layer of a per-layer table, with the unfused loss and gradients: fp32 to float
    rounding; bf16 autocast the same loss bit for bit (the same roundings) and gradients within 1e-2 norm-wise
    (d_gamma sums fp32 products where autograd rounds them to bf16 first; gamma * grad is not rounded to bf16
    before the row-mix backward). Per-head, shared-table and shared-expert models never take it."""
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    model, x, y = _model(name)
    calls = _spy(monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(mix_paths, "FUSE_INJECT", False)
        want = _loss_and_grads(model, x, y, autocast)
    assert calls == []
    assert mix_paths.FUSE_INJECT is True  # the default
    got = _loss_and_grads(model, x, y, autocast)
    v_dtype = torch.bfloat16 if autocast else torch.float32
    assert calls == [v_dtype] * (len(model.memory.layers) if name in FUSED else 0)
    if not autocast:
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
        assert_grads_close(got[1], want[1], FP32_REL)
        return
    assert torch.equal(got[0], want[0])
    assert_grads_close(got[1], want[1], BF16_REL)


def test_model_fuse_inject_compiles_fullgraph(monkeypatch):
    """The default path (FUSE_INJECT on) traced by dynamo into one graph (as on CUDA, here through the op's CPU
    math): the op in every memory layer, the eager model's loss and gradients."""
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    # one layer, the memory layer (tiny_config's 2 layers have memory on layer 1 alone): the same memory path in the
    # graph without a plain layer to compile (the four such tests: 96 -> 83 s, cold inductor cache: dev/LOG.md)
    model, x, y = _model("per_layer", n_layer=1)
    calls = assert_compiled_equals_eager(model, x, y, lambda: _spy(monkeypatch))
    assert len(calls) == len(model.memory.layers)


def test_model_fuse_inject_off_while_capturing(monkeypatch):
    """``capture`` records the injection's norm: the unfused path, which records it."""
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(mix_paths, "FUSE_INJECT", True)
    model, x, y = _model("per_layer")
    calls = _spy(monkeypatch)
    model.memory.capture = {}
    with torch.no_grad():
        model(x, y)
    assert calls == [] and all("inject_norm" in model.memory.capture[layer] for layer in model.memory.layers)
    model.memory.capture = None
    with torch.no_grad():
        model(x, y)
    assert len(calls) == len(model.memory.layers)


def test_model_fuse_inject_off_where_the_row_mix_kernels_are(monkeypatch):
    """FUSE_INJECT alone changes nothing where the row-mix op does not serve the table: the CPU's default
    KERNEL_DEVICES (CUDA only), ROW_SUM "unrolled", or a forced K-row mix."""
    monkeypatch.setattr(mix_paths, "FUSE_INJECT", True)
    model, x, y = _model("per_layer")
    calls = _spy(monkeypatch)
    _loss_and_grads(model, x, y, False)
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    for setting, value in (("ROW_SUM", "unrolled"), ("MIX", "plain")):
        with monkeypatch.context() as m:
            m.setattr(mix_paths, setting, value)
            _loss_and_grads(model, x, y, False)
    assert calls == []


# -- (b) the Triton kernels in the interpreter ---------------------------------------------------------------
KERNEL_SHAPES = [dict(), dict(N=40, H=3, M=5, d=48, rows=3), dict(N=16, H=6, M=6, d=128, rows=1)]


@needs_interpreter
@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=["d128", "non_pow2", "one_row"])
def test_kernels_fp32_match_the_float64_reference(shape):
    table, row, w, gamma, v, grad = _inject_inputs(**shape)
    out = mt.row_mix_inject_forward_triton(table, row, w, gamma, v)
    d_table, dw, d_gamma = mt.row_mix_inject_backward_triton(grad, table, row, w, gamma)
    want = _reference(table, row, w, gamma, v, grad)
    for a, b in zip((out, d_table, dw, d_gamma), want):
        assert a.dtype == torch.float32
        _close(a, b, 1e-6)


@needs_interpreter
@pytest.mark.parametrize("shape", KERNEL_SHAPES[:2], ids=["d128", "non_pow2"])
def test_kernels_bf16_match_the_op_within_bf16_ulps(shape):
    """bf16 v, gamma and grad: the output and d_gamma in bf16, dw and d_table fp32. The interpreter truncates
    fp32 -> bf16 where the GPU rounds to nearest (the gpu test checks that): the output within 4 ulps of its
    terms' magnitude |v| + |gamma mem| from the op's CPU math (mem, the product and the sum each truncated; seen:
    2.9), d_gamma within 2 ulps of sum_d |grad mem| (mem and d_gamma truncated); dw and d_table use gamma (bf16
    already) and fp32 sums: to float rounding."""
    table, row, w, gamma, v, grad = _inject_inputs(torch.bfloat16, **shape)
    out = mt.row_mix_inject_forward_triton(table, row, w, gamma, v)
    d_table, dw, d_gamma = mt.row_mix_inject_backward_triton(grad, table, row, w, gamma)
    assert out.dtype == d_gamma.dtype == torch.bfloat16 and dw.dtype == d_table.dtype == torch.float32
    want_out = mt.row_mix_inject_torch(table, row, w, gamma, v)
    want_table, want_w, want_gamma = mt.row_mix_inject_backward_torch(grad, table, row, w, gamma)
    mem = mt.row_mix_torch(table, row, w, torch.float32)  # (N, H, d)
    scale = v.float().abs() + (gamma.float()[..., None] * mem).abs()  # the terms' magnitudes: error bounds
    assert bool(((out.float() - want_out.float()).abs() <= 4 * BF16_ULP * scale).all())
    scale = (grad.float() * mem).abs().sum(dim=-1) + want_gamma.float().abs()  # (N, H)
    assert bool(((d_gamma.float() - want_gamma.float()).abs() <= 2 * BF16_ULP * scale).all())
    ref = _reference(table, row, w, gamma, v, grad)
    _close(out, ref[0], 2 * BF16_ULP)
    _close(d_table, want_table.double(), 1e-6)
    _close(dw, want_w.double(), 1e-6)
    _close(d_gamma, ref[3], 2 * BF16_ULP)


@needs_interpreter
def test_kernels_refuse_mismatched_gamma_or_v():
    table, row, w, gamma, v, _ = _inject_inputs(N=4, H=2, M=3, d=8)
    with pytest.raises(ValueError, match="gamma \\(N, H\\)"):
        mt.row_mix_inject_forward_triton(table, row, w, gamma[:, :1], v)
    with pytest.raises(ValueError, match="floating gamma and v"):
        mt.row_mix_inject_forward_triton(table, row, w, gamma.long(), v)


class _InterpretedInject(torch.autograd.Function):
    """The fused op's contract with the Triton launchers (in the interpreter) in place of its CPU math."""

    @staticmethod
    def forward(ctx, table, row, w, gamma, v, unique_rows=False):
        ctx.save_for_backward(table, row, w, gamma)
        ctx.unique_rows = unique_rows
        return mt.row_mix_inject_forward_triton(table, row, w, gamma, v)

    @staticmethod
    def backward(ctx, grad):
        d_table, dw, d_gamma = mt.row_mix_inject_backward_triton(grad, *ctx.saved_tensors, ctx.unique_rows)
        return d_table, None, dw, d_gamma, grad, None


@needs_interpreter
def test_model_with_interpreted_kernels_equals_the_unfused_path(monkeypatch):
    """The fused kernels inside a MoME model (eager, fp32, CPU, repeated rows): the unfused loss and gradients."""
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cpu",))
    model, x, y = _model("per_layer")
    want = _loss_and_grads(model, x, y, False)
    calls = _spy(monkeypatch)
    monkeypatch.setattr(mt, "mome_row_mix_inject_op", _InterpretedInject.apply)
    monkeypatch.setattr(mix_paths, "FUSE_INJECT", True)
    got = _loss_and_grads(model, x, y, False)
    assert len(calls) == len(model.memory.layers)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert_grads_close(got[1], want[1], FP32_REL)


# the backward kernels' pointer types as the model launches them under autocast (bf16 grad, gamma and d_gamma)
INJECT_BWD_PTRS = ["*bf16", "*fp32", "*i64", "*fp32", "*bf16", "*fp32", "*fp32", "*bf16"]
ROW_BWD_PTRS = ["*bf16", "*fp32", "*i64", "*fp32", "*fp32", "*fp32"]


@pytest.mark.skipif(not COMPILABLE, reason="needs triton, not in interpreter mode (TRITON_INTERPRET unset)")
@pytest.mark.parametrize("shape", [(6, 6, 128), (3, 5, 48)], ids=["d12", "non_pow2"])
def test_kernels_compile_for_sm90_without_a_gpu(shape):
    """Triton's real compiler builds both fused kernels for an H100 (bf16 v, gamma and grad; fp32 atomics), with
    the forward's launch options: its injection rounds the product gamma * mem to bf16 before adding v (as eager),
    not one bf16 FMA (on 2026-11-26, with FP fusion on, a quarter of the H100's outputs differed from the eager
    rounding by 1 ulp), while the mix over M keeps its fp32 FMAs. With UNIQUE_ROWS the backward stores its table
    gradient, as wide as the atomics, with none."""
    ptx = sm90_ptx({"fwd": (mt._row_mix_inject_fwd_kernel, ["*fp32", "*i64", "*fp32", "*bf16", "*bf16", "*bf16"])},
                   shape, mt.INJECT_FWD_OPTIONS)
    bwd = (mt._row_mix_inject_bwd_kernel, INJECT_BWD_PTRS)
    ptx |= sm90_ptx({"bwd": bwd}, shape, constants={"UNIQUE_ROWS": False})
    ptx |= sm90_ptx({"bwd_unique": bwd}, shape, constants={"UNIQUE_ROWS": True})
    for code in ptx.values():
        assert "ld.global" in code and "st.global" in code
        assert "cvt.rn.bf16" in code  # rounded to nearest even on the GPU
    assert re.search(TABLE_ATOMICS, ptx["bwd"]) and "f32" in ptx["bwd"]
    assert "red.global" not in ptx["bwd_unique"] and "atom." not in ptx["bwd_unique"]
    assert f"st.global{atomics_width(ptx['bwd'])}.b32" in ptx["bwd_unique"]
    assert "fma.rn.f32" in ptx["fwd"] and not re.search(r"\bfma\.[a-z.]*bf16", ptx["fwd"])
    # the backward recomputes mem with the forward's FMAs whatever Triton's FP-fusion default (off from Triton 3.10)
    bwd_unfused = sm90_ptx({"bwd": bwd}, shape, {"enable_fp_fusion": False}, {"UNIQUE_ROWS": False})["bwd"]
    assert "fma.rn.f32" in bwd_unfused


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers per thread, spill bytes stored + loaded) of ``ptx`` as ptxas builds it for an H100, with the
    ptxas that Triton ships (it has two; the newer one reads newer PTX). Skips the caller where none reads it."""
    import pathlib
    import subprocess
    import tempfile

    bin_dir = pathlib.Path(mt.triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        for ptxas in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas"):
            if not ptxas.is_file():
                continue
            r = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(src.with_suffix(".o"))],
                               capture_output=True, text=True)
            used = re.search(r"Used (\d+) registers", r.stdout + r.stderr)
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stdout + r.stderr)
            if r.returncode == 0 and used and spills:
                return int(used.group(1)), int(spills.group(1)) + int(spills.group(2))
    pytest.skip(f"no ptxas in {bin_dir} builds this PTX for sm_90a")


@pytest.mark.skipif(not COMPILABLE, reason="needs triton, not in interpreter mode (TRITON_INTERPRET unset)")
@pytest.mark.parametrize("shape", [(6, 6, 128), (16, 8, 1024), (16, 64, 1024)],
                         ids=["d12", "largest_tile", "largest_tile_m64"])
def test_kernels_keep_their_tiles_in_registers_on_sm90(shape):
    """No kernel spills registers to local memory on an H100, up to the largest tile the launch takes (MAX_TILE
    accumulators at 8 warps), at M = 8 and at the largest M (64; the kernels unroll over M; ~1 min to build): the
    fused backward, which holds two (BLOCK_H, BLOCK_D) fp32 tiles (grad and the
    recomputed mem), is the one closest to the 255-register limit (on 2026-11-26 with Triton 3.9's ptxas: 96
    registers at d12, 255 at the largest tile, no spills). The backward kernels with and without UNIQUE_ROWS (stores
    in place of the table gradient's atomics)."""
    ptx = sm90_ptx({"row_fwd": (mt._row_mix_fwd_kernel, ["*fp32", "*i64", "*fp32", "*bf16"])}, shape)
    for unique in (False, True):
        ptx |= sm90_ptx({f"row_bwd_{unique}": (mt._row_mix_bwd_kernel, ROW_BWD_PTRS),
                         f"inject_bwd_{unique}": (mt._row_mix_inject_bwd_kernel, INJECT_BWD_PTRS)}, shape,
                        constants={"UNIQUE_ROWS": unique})
    ptx |= sm90_ptx({"inject_fwd": (mt._row_mix_inject_fwd_kernel,
                                    ["*fp32", "*i64", "*fp32", "*bf16", "*bf16", "*bf16"])}, shape, mt.INJECT_FWD_OPTIONS)
    usage = {name: ptxas_usage(code) for name, code in ptx.items()}
    known = KNOWN_SPILLS.get((mt.triton.__version__.rpartition(".")[0], shape), {})
    assert all(spilled <= known.get(name, 0) for name, (_, spilled) in usage.items()), (usage, known)


# Spills one Triton builds and another does not, measured (bytes stored + loaded, per kernel). Triton 3.6 (what torch
# 2.11, the GPU image's, pins) spills 16 bytes in the fused backward with unique rows at the largest tile and M = 64
# (255 registers; 3.9: none): a speed cost at a shape far from d12's, where neither spills (cudareview34, session 34)
KNOWN_SPILLS = {("3.6", (16, 64, 1024)): {"inject_bwd_True": 16}}


# -- (c) CUDA --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@cuda_op_shapes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_op_matches_the_float64_reference(shape, dtype):
    """The kernels through the op (autograd included) against float64; bf16: the output within 2^-7 norm-wise and
    mostly bit-equal to the op's CPU math (rounded to nearest even, not truncated)."""
    table, row, w, gamma, v, grad = _inject_inputs(dtype, device="cuda", **shape)
    out, d_table, dw, d_gamma, d_v = _op_with_grads(table, row, w, gamma, v, grad)
    assert out.dtype == d_v.dtype == d_gamma.dtype == dtype
    want = _reference(table, row, w, gamma, v, grad)
    tol = 1e-6 if dtype == torch.float32 else BF16_ULP
    _close(out, want[0], tol)
    _close(d_table, want[1], 1e-6)
    _close(dw, want[2], 1e-6)
    _close(d_gamma, want[3], tol)
    assert torch.equal(d_v, grad)
    if dtype == torch.bfloat16:  # a few may differ where the fp32 sums contract FMAs differently from the CPU's
        cpu = mt.row_mix_inject_torch(*(x.cpu() for x in (table, row, w, gamma, v)))
        assert (out.cpu() != cpu).float().mean() < 0.01


def _compiled_run(model, x, y, fuse, autocast, monkeypatch):
    """compiled_run_with FUSE_INJECT = fuse and the fused op's spy."""
    return compiled_run_with(model, x, y, autocast, monkeypatch, {"FUSE_INJECT": fuse}, _spy)


@pytest.mark.gpu
@needs_cuda
def test_cuda_compiled_model_fp32_fused_equals_unfused(monkeypatch):
    model, x, y = _cuda_model(MODEL_OPTIONS["per_layer"][0])
    with _fp32_matmuls():
        (want, n0) = _compiled_run(model, x, y, False, False, monkeypatch)
        (got, n1) = _compiled_run(model, x, y, True, False, monkeypatch)
    assert (n0, n1) == (0, len(model.memory.layers))
    assert_equal_to_fp32_rounding(got, want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["per_layer", "full_routing"])
def test_cuda_compiled_model_bf16_fused_as_close_as_unfused(name, monkeypatch):
    """bf16 autocast, compiled fullgraph: fused and unfused each against the fp32 eager model (TF32 off); the
    fused loss and every gradient no further from it than the unfused path's (x2 + 5e-3: the fused kernel rounds
    mem, gamma and their product to bf16 where inductor may keep fp32), and the two within 5e-2 of each other."""
    model, x, y = _cuda_model(MODEL_OPTIONS[name][0])
    with _fp32_matmuls():
        ref = _loss_and_grads(model, x, y, False)
        (unfused, n0) = _compiled_run(model, x, y, False, True, monkeypatch)
        (fused, n1) = _compiled_run(model, x, y, True, True, monkeypatch)
    assert (n0, n1) == (0, len(model.memory.layers))
    assert_as_close_as(fused, unfused, ref)
