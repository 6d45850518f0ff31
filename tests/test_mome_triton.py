"""The row-mix custom op of nanochat.memory.mome_triton (ROW_SUM "triton"), in three tiers:

* always (no triton needed): the op's CPU math against a float64 reference (forward, dw, d_table, repeated rows),
  its registration (``torch.library.opcheck``), ``torch.compile(fullgraph=True)`` of the model through it (of a
  function calling it alone: slow), and MoMEMemory.value's routing: the op for a per-layer table only, the same
  losses and gradients as "unrolled";
* with triton importable and ``TRITON_INTERPRET=1`` (Triton's interpreter, CPU tensors): the real kernels against
  the float64 reference, alone and inside a MoME model; with triton importable and no TRITON_INTERPRET: both
  kernels compiled for sm_90 by Triton's real compiler (no GPU needed);
* marker ``gpu`` (CUDA): the kernels on the GPU, and a compiled MoME model with ROW_SUM "triton" against
  "unrolled", fp32 and bf16 autocast.

Every test here runs with ``mome_mix.FUSE_INJECT`` off: by default the model takes the fused row mix + injection
pair (tests/test_mome_triton_inject.py) wherever this pair would serve, and this pair where that one does not
(a shared expert, ``capture``).

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest tests/test_mome_triton.py   # + kernels
    PYTHONPATH=$PWD:/path/to/triton python -m pytest tests/test_mome_triton.py                      # + sm_90 build
    python -m pytest -m gpu tests/test_mome_triton.py                                             # on a GPU
"""

import contextlib
import os
import re

import pytest
import torch

from conftest import tiny_config
from memory_grads import FP32_REL, assert_grads_close, reach_the_memory
from nanochat.gpt import build_model
from nanochat.memory import mome as mome_module
from nanochat.memory import mome_mix as mix_paths
from nanochat.memory import mome_triton as mt

INTERPRETED = mt.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
COMPILABLE = mt.triton is not None and not INTERPRETED  # the kernels are JITFunctions: they compile for a GPU


@pytest.fixture(autouse=True)
def _row_mix_pair_alone(monkeypatch):
    monkeypatch.setattr(mix_paths, "FUSE_INJECT", False)


needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs triton and TRITON_INTERPRET=1 (set before "
                                       "the import) to run the Triton kernels on the CPU")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu there)")
# the CUDA op tests' shapes (both kernel pairs): d12's (H 6, M 6, d 128), and non-powers of 2 that the tiles mask
cuda_op_shapes = pytest.mark.parametrize("shape", [dict(N=4096, rows=50), dict(N=999, H=3, M=5, d=48, rows=7)],
                                         ids=["d128", "non_pow2"])


# -- inputs and the float64 reference ------------------------------------------------------------------------
def _inputs(N=64, H=6, M=6, d=128, rows=5, device="cpu", seed=0):
    """table (rows*M, d) fp32, row ids (N,) from only ``rows`` rows (every row is read by many tokens: the
    backward's scatter collides), dense weights (N, H, M) with zeros off a top-2 (as slot_weights gives)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(rows * M, d, generator=g)
    row = torch.randint(0, rows, (N,), generator=g)
    w = torch.rand(N, H, M, generator=g)
    keep = torch.rand(N, H, M, generator=g).argsort(-1) < min(2, M)
    w = torch.where(keep, w, 0.0)
    grad = torch.randn(N, H, d, generator=g)
    return [x.to(device) for x in (table, row, w, grad)]


def _reference(table, row, w, grad):
    """float64, written independently of the op: out (N, H, d), d_table (R, d), dw (N, H, M)."""
    table, w, grad = table.double(), w.double(), grad.double()
    M = w.size(-1)
    rows = torch.stack([table[row * M + m] for m in range(M)], dim=1)  # (N, M, d)
    out = (w[..., None] * rows[:, None]).sum(dim=2)
    dw = (grad[:, :, None, :] * rows[:, None]).sum(dim=-1)
    d_table = torch.zeros_like(table)
    for t in range(row.numel()):  # one token at a time: repeated rows accumulate
        for m in range(M):
            d_table[int(row[t]) * M + m] += (w[t, :, m, None] * grad[t]).sum(dim=0)
    return out, d_table, dw


def _close(got, want, tol):
    got = got.detach().double().cpu()
    assert got.shape == want.shape
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    assert err < tol, err


# -- (a) the op's CPU math and its plumbing, always ------------------------------------------------------------
@pytest.mark.parametrize("shape", [dict(), dict(N=30, H=3, M=5, d=48, rows=1)], ids=["d128", "odd_one_row"])
def test_op_cpu_matches_the_float64_reference(shape):
    table, row, w, grad = _inputs(**shape)
    table.requires_grad_()
    w.requires_grad_()
    out = mt.mome_row_mix_op(table, row, w, torch.float32)
    d_table, dw = torch.autograd.grad(out, (table, w), grad)
    want, want_table, want_w = _reference(table.detach(), row, w.detach(), grad)
    _close(out, want, 1e-6)
    _close(d_table, want_table, 1e-6)
    _close(dw, want_w, 1e-6)
    # bf16 output: the fp32 mix rounded once (what the model's mem.to(v.dtype) does)
    assert torch.equal(mt.mome_row_mix_op(table, row, w, torch.bfloat16), out.detach().bfloat16())


def test_row_mix_wrapper_shapes_and_weight_cast():
    """row_mix: (B, T) ids and (B, T, H, M) weights in, (B, T, H, d) out; w's gradient reaches a bf16 w."""
    table, row, w, grad = _inputs(N=12, H=2, M=3, d=8)
    w16 = w.view(3, 4, 2, 3).bfloat16().requires_grad_()
    out = mt.row_mix(table, row.view(3, 4), w16, torch.float32)
    assert out.shape == (3, 4, 2, 8) and out.dtype == torch.float32
    (dw,) = torch.autograd.grad(out, w16, grad.view(3, 4, 2, 8))
    assert dw.dtype == torch.bfloat16
    want = mt.mome_row_mix_op(table, row, w16.detach().float().view(12, 2, 3), torch.float32)
    assert torch.equal(out.view(12, 2, 8), want)


def test_custom_ops_pass_opcheck():
    table, row, w, grad = _inputs(N=8, H=2, M=3, d=16)
    torch.library.opcheck(mt.mome_row_mix_op, (table.requires_grad_(), row, w.requires_grad_(), torch.float32))
    torch.library.opcheck(mt.mome_row_mix_backward_op, (grad, table.detach(), row, w.detach()))


# slow: the op compiled alone; test_defaults_compile_fullgraph_through_the_op (default suite) compiles it fullgraph
# in the model's memory layer (FUSE_INJECT off: this op) and compares the loss and every gradient with eager
@pytest.mark.slow
def test_compile_fullgraph_of_the_op_on_cpu():
    """Opaque inside one inductor graph (fake impl for the shapes), its backward the second custom op."""
    torch._dynamo.reset()
    table, row, w, grad = _inputs(N=10, H=2, M=3, d=16)
    table.requires_grad_()
    w.requires_grad_()

    def f(table, row, w):
        return mt.row_mix(table, row.view(2, 5), w.view(2, 5, 2, 3), torch.float32) * 2.0

    out = torch.compile(f, fullgraph=True, dynamic=False)(table, row, w)
    got = torch.autograd.grad(out, (table, w), grad.view(2, 5, 2, 16))
    want_out = f(table, row, w)
    want = torch.autograd.grad(want_out, (table, w), grad.view(2, 5, 2, 16))
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


def test_unknown_row_sum_is_refused_by_the_model(monkeypatch):
    monkeypatch.setattr(mix_paths, "ROW_SUM", "bmm")
    model = build_model(tiny_config(memory="mome", memory_options={"slots": 4, "topk": 4}), seed=0)
    with pytest.raises(ValueError, match="ROW_SUM 'bmm' is unknown; allowed: triton, unrolled, reduce"):
        model(torch.zeros(1, 4, dtype=torch.long))


MODEL_OPTIONS = {  # memory options -> whether ROW_SUM "triton" takes the op (where the op runs)
    "per_layer": ({"slots": 6, "topk": 2}, True),
    "full_routing": ({"slots": 4, "topk": 4}, True),
    "shared_expert": ({"slots": 6, "topk": 2, "shared_expert": True}, True),
    "per_head": ({"slots": 6, "topk": 2, "per_head_table": True}, False),
    "bigram_shared": ({"slots": 4, "topk": 2, "index": "bigram", "bigram_factor": 2}, False),
}


def _loss_and_grads(model, x, y, autocast, run=None):
    """Loss and gradients of ``run`` (default: the model; e.g. its compiled wrapper), keyed by the model's names."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = (model if run is None else run)(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
                           for n, p in model.named_parameters() if p.grad is not None}


def _spy(monkeypatch):
    calls = []
    real = mome_module.kernel_row_mix

    def spy(table, row, w, out_dtype, unique_rows):
        calls.append(out_dtype)
        assert unique_rows is False  # a per-layer table: its row ids repeat
        return real(table, row, w, out_dtype, unique_rows)

    monkeypatch.setattr(mome_module, "kernel_row_mix", spy)
    return calls


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("op_on_cpu", [False, True], ids=["cpu_default", "op_on_cpu"])
@pytest.mark.parametrize("name", list(MODEL_OPTIONS))
def test_model_row_sum_triton_equals_unrolled(name, op_on_cpu, autocast, monkeypatch):
    """ROW_SUM "triton" with MIX "row" (eager, CPU): with the default KERNEL_DEVICES (CUDA) the CPU keeps today's
    path; with the CPU added, the op (its torch math) serves per-layer tables only, storing mem in v's dtype (the
    table's with a shared expert); losses and gradients equal "unrolled"'s."""
    opts, takes_op = MODEL_OPTIONS[name]
    monkeypatch.setattr(mix_paths, "MIX", "row")
    model = build_model(tiny_config(memory="mome", memory_options=opts), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random routers: real selections, no ties
        for router in model.memory.routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
    reach_the_memory(model, g)
    idx = torch.randint(0, 512, (2, 17), generator=g)
    x, y = idx[:, :-1], idx[:, 1:]
    monkeypatch.setattr(mix_paths, "ROW_SUM", "unrolled")
    want = _loss_and_grads(model, x, y, autocast)
    calls = _spy(monkeypatch)
    monkeypatch.setattr(mix_paths, "ROW_SUM", "triton")
    if op_on_cpu:
        monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    got = _loss_and_grads(model, x, y, autocast)
    expect_calls = len(model.memory.layers) if op_on_cpu and takes_op else 0
    v_dtype = torch.bfloat16 if autocast else torch.float32
    assert calls == [torch.float32 if "shared_expert" in name else v_dtype] * expect_calls
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert_grads_close(got[1], want[1], FP32_REL)


def _random_router_model(opts, n_layer=2):
    """A tiny MoME model with random routers (real selections, no ties), gradients reaching the memory
    (tests/memory_grads.py) and a batch (x, y)."""
    model = build_model(tiny_config(memory="mome", memory_options=opts, n_layer=n_layer), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in model.memory.routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
    reach_the_memory(model, g)
    idx = torch.randint(0, 512, (2, 17), generator=g)
    return model, idx[:, :-1], idx[:, 1:]


@pytest.mark.parametrize("name", list(MODEL_OPTIONS))
def test_defaults_take_the_op_for_per_layer_tables_where_it_applies(name, monkeypatch):
    """MIX None and ROW_SUM at its default ("triton"), FUSE_INJECT off: where the op applies (here the CPU, added to KERNEL_DEVICES)
    a per-layer table takes the row mix through the op in every memory layer, whatever K, with the same loss and
    gradients as the forced plain K-row mix; per-head and shared tables never take it. With the CPU's default
    devices (CUDA only), no layer does."""
    opts, takes_op = MODEL_OPTIONS[name]
    assert mix_paths.ROW_SUM == "triton" and mix_paths.MIX is None
    model, x, y = _random_router_model(opts)
    calls = _spy(monkeypatch)
    _loss_and_grads(model, x, y, False)
    assert calls == []  # CPU: KERNEL_DEVICES is CUDA only
    monkeypatch.setattr(mix_paths, "MIX", "plain")
    want = _loss_and_grads(model, x, y, False)
    monkeypatch.setattr(mix_paths, "MIX", None)
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    got = _loss_and_grads(model, x, y, False)
    assert len(calls) == (len(model.memory.layers) if takes_op else 0)
    if model.memory.K < model.memory.M and not takes_op:
        return  # the shared table's default is the row mix already, per-head tables the K-row mix: nothing to check
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert_grads_close(got[1], want[1], FP32_REL)


def test_defaults_compile_fullgraph_through_the_op(monkeypatch):
    """The default selection (``mome_triton.applies`` included; FUSE_INJECT off) traced by dynamo into one graph, as on CUDA: the
    compiled model calls the op in every memory layer and gives the eager model's loss and gradients."""
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    # one layer, the memory layer (tiny_config's 2 layers have memory on layer 1 alone): the same memory path in the
    # graph without a plain layer to compile (the four such tests: 96 -> 83 s, cold inductor cache: dev/LOG.md)
    model, x, y = _random_router_model(MODEL_OPTIONS["per_layer"][0], n_layer=1)
    calls = assert_compiled_equals_eager(model, x, y, lambda: _spy(monkeypatch))
    assert len(calls) == len(model.memory.layers)  # traced once per memory layer


def assert_compiled_equals_eager(model, x, y, install_spy) -> list:
    """The model's loss and gradients eager, then compiled fullgraph on the CPU with ``install_spy()``'s spy in
    place: equal to float rounding. Returns the spy's calls (those of the compiled run only)."""
    want = _loss_and_grads(model, x, y, False)
    torch._dynamo.reset()
    calls = install_spy()
    try:
        got = _loss_and_grads(model, x, y, False, run=torch.compile(model, fullgraph=True, dynamic=False))
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert_grads_close(got[1], want[1], FP32_REL)
    return calls


class _FakeTable:
    """What ``applies`` reads of a table: device, dtype, size (a CUDA tensor cannot be made without a GPU)."""

    def __init__(self, device, dtype=torch.float32, d=128):
        self.device, self.dtype, self.d = torch.device(device), dtype, d

    def size(self, dim):
        return self.d


def test_applies_only_where_the_kernels_can_run(monkeypatch):
    assert mt.applies(_FakeTable("cuda"), 6, 6) == (mt.triton is not None)
    monkeypatch.setattr(mt, "triton", None)
    assert not mt.applies(_FakeTable("cuda"), 6, 6)  # CUDA without triton: the plain mix, not a failed launch
    monkeypatch.setattr(mt, "triton", object())
    assert mt.applies(_FakeTable("cuda"), 6, 6)
    assert mt.applies(_FakeTable("cuda", d=48), 3, 5)  # padded to (4, 64) inside the kernels
    assert not mt.applies(_FakeTable("cuda", dtype=torch.bfloat16), 6, 6)
    assert not mt.applies(_FakeTable("cuda", d=4096), 6, 6)  # (8, 4096) > MAX_TILE accumulators
    assert mt.applies(_FakeTable("cuda", d=2048), 8, 6)  # exactly MAX_TILE
    assert not mt.applies(_FakeTable("cuda"), 6, 65)
    assert not mt.applies(_FakeTable("cpu"), 6, 6)  # KERNEL_DEVICES is CUDA only


# -- (b) the Triton kernels in the interpreter ---------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("shape", [dict(), dict(N=40, H=3, M=5, d=48, rows=3), dict(N=16, H=6, M=6, d=128, rows=1)],
                         ids=["d128", "non_pow2", "one_row"])
def test_kernels_match_the_float64_reference(shape):
    table, row, w, grad = _inputs(**shape)
    out = mt.row_mix_forward_triton(table, row, w, torch.float32)
    d_table, dw = mt.row_mix_backward_triton(grad, table, row, w)
    want, want_table, want_w = _reference(table, row, w, grad)
    assert out.dtype == d_table.dtype == dw.dtype == torch.float32
    _close(out, want, 1e-6)
    _close(d_table, want_table, 1e-6)
    _close(dw, want_w, 1e-6)


@needs_interpreter
def test_kernels_bf16_output_and_bf16_grad():
    """Under autocast: mem stored as bf16 (the fp32 sum rounded once), grad_mem arriving in bf16. Within 1 bf16
    ulp only: the interpreter truncates fp32 -> bf16, the GPU rounds to nearest even (checked by the gpu test)."""
    table, row, w, grad = _inputs(N=24, H=6, M=6, d=64)
    out = mt.row_mix_forward_triton(table, row, w, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    want = mt.row_mix_torch(table, row, w, torch.float32)
    torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=0)  # under 1 ulp of bf16 (8 significant bits)
    g16 = grad.bfloat16()
    d_table, dw = mt.row_mix_backward_triton(g16, table, row, w)
    _, want_table, want_w = _reference(table, row, w, g16.float())
    _close(d_table, want_table, 1e-6)
    _close(dw, want_w, 1e-6)


@needs_interpreter
def test_kernels_refuse_what_they_do_not_take():
    table, row, w, _ = _inputs(N=4, H=2, M=3, d=8)
    with pytest.raises(ValueError, match="fp32 table"):
        mt.row_mix_forward_triton(table.double(), row, w, torch.float32)
    with pytest.raises(ValueError, match="int64 row ids"):
        mt.row_mix_forward_triton(table, row.int(), w, torch.float32)
    with pytest.raises(ValueError, match="unsupported"):
        mt.row_mix_forward_triton(torch.zeros(3, 8192), row.clamp_max(0), torch.zeros(4, 4, 3), torch.float32)


def sm90_ptx(kernels: dict, shape, options: dict | None = None, constants: dict | None = None) -> dict:
    """{name: PTX} of each (kernel, pointer types) in ``kernels`` built by Triton's real compiler for an H100 (what
    the GPU runs; the interpreter skips it), with the launch config of shape (H, M, d), the extra constexprs
    ``constants`` (the backward kernels' UNIQUE_ROWS) and the compile ``options`` the launch passes. Triton
    versions whose ahead-of-time API differs skip the calling test."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"this triton has no ASTSource/GPUTarget: {e}")
    H, M, d = shape
    cfg = mt._launch_config(torch.zeros(M, d), torch.zeros(1, dtype=torch.long), torch.zeros(1, H, M))
    warps = cfg.pop("num_warps")
    cfg |= constants or {}
    consts = {k: "constexpr" for k in cfg}
    out = {}
    for name, (kernel, ptrs) in kernels.items():
        sig = {**dict(zip(kernel.arg_names, ptrs)), **consts}
        aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))}  # as the JIT specialises them
        try:
            out[name] = mt.triton.compile(ASTSource(kernel, sig, cfg, aligned), target=GPUTarget("cuda", 90, 32),
                                          options={"num_warps": warps, **(options or {})}).asm["ptx"]
        except TypeError as e:  # another signature convention
            pytest.skip(f"this triton's ahead-of-time API differs: {e}")
    return out


@pytest.mark.skipif(not COMPILABLE, reason="needs triton, not in interpreter mode (TRITON_INTERPRET unset)")
@pytest.mark.parametrize("shape", [(6, 6, 128), (3, 5, 48)], ids=["d12", "non_pow2"])
def test_kernels_compile_for_sm90_without_a_gpu(shape):
    """Both kernels build for an H100 from the launch config, the table-gradient atomics relaxed fp32 reductions;
    with UNIQUE_ROWS the backward's table gradient is plain stores as wide as those atomics (128-bit at d12)."""
    ptx = sm90_ptx({"fwd": (mt._row_mix_fwd_kernel, ["*fp32", "*i64", "*fp32", "*bf16"])}, shape)
    bwd = (mt._row_mix_bwd_kernel, ["*bf16", "*fp32", "*i64", "*fp32", "*fp32", "*fp32"])
    ptx |= sm90_ptx({"bwd": bwd}, shape, constants={"UNIQUE_ROWS": False})
    ptx |= sm90_ptx({"bwd_unique": bwd}, shape, constants={"UNIQUE_ROWS": True})
    assert "ld.global" in ptx["fwd"] and "ld.global" in ptx["bwd"]
    assert re.search(TABLE_ATOMICS, ptx["bwd"]) and "f32" in ptx["bwd"]
    assert "red.global" not in ptx["bwd_unique"] and "atom." not in ptx["bwd_unique"]
    assert f"st.global{atomics_width(ptx['bwd'])}.b32" in ptx["bwd_unique"]


# the table gradient's relaxed fp32 atomics: "red" (no result; triton 3.9) or "atom" with its result unused (triton
# 3.6, the one torch 2.11 installs: the GPU machine's image)
TABLE_ATOMICS = r"(?:red|atom)\.global\.gpu\.relaxed\.add"


def atomics_width(ptx: str) -> str:
    """The vector suffix (".v4", ".v2" or "") of the table-gradient atomics in ``ptx``."""
    return re.search(TABLE_ATOMICS + r"(\.v\d)?\.f32", ptx).group(1) or ""


class _InterpretedRowMix(torch.autograd.Function):
    """The op's contract with the Triton launchers (in the interpreter) in place of its CPU math."""

    @staticmethod
    def forward(ctx, table, row, w, out_dtype, unique_rows=False):
        ctx.save_for_backward(table, row, w)
        ctx.unique_rows = unique_rows
        return mt.row_mix_forward_triton(table, row, w, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        d_table, dw = mt.row_mix_backward_triton(grad, *ctx.saved_tensors, ctx.unique_rows)
        return d_table, None, dw, None, None


@needs_interpreter
@pytest.mark.parametrize("name", ["per_layer", "shared_expert"])
def test_model_with_interpreted_kernels_equals_unrolled(name, monkeypatch):
    """The kernels inside a MoME model (eager, fp32, CPU): the loss and every gradient of "unrolled"."""
    monkeypatch.setattr(mix_paths, "MIX", "row")
    model = build_model(tiny_config(memory="mome", memory_options=MODEL_OPTIONS[name][0]), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in model.memory.routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
    reach_the_memory(model, g)
    idx = torch.randint(0, 40, (2, 17), generator=g)  # 40 distinct tokens of 32 positions: repeated rows
    want = _loss_and_grads(model, idx[:, :-1], idx[:, 1:], False)
    calls = _spy(monkeypatch)
    monkeypatch.setattr(mt, "mome_row_mix_op", _InterpretedRowMix.apply)
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(mix_paths, "ROW_SUM", "triton")
    got = _loss_and_grads(model, idx[:, :-1], idx[:, 1:], False)
    assert len(calls) == len(model.memory.layers)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert_grads_close(got[1], want[1], FP32_REL)


# -- (c) CUDA --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@cuda_op_shapes
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cuda_op_matches_the_float64_reference(shape, out_dtype):
    table, row, w, grad = _inputs(device="cuda", **shape)
    table.requires_grad_()
    w.requires_grad_()
    out = mt.row_mix(table, row.view(1, -1), w.view(1, *w.shape), out_dtype)
    assert out.dtype == out_dtype
    d_table, dw = torch.autograd.grad(out, (table, w), grad.to(out_dtype).view(out.shape))
    want, want_table, want_w = _reference(table.detach().cpu(), row.cpu(), w.detach().cpu(),
                                          grad.to(out_dtype).float().cpu())
    _close(out.view(want.shape), want, 1e-6 if out_dtype == torch.float32 else 4e-3)
    if out_dtype == torch.bfloat16:  # the same fp32 sums rounded to nearest even, as mem.to(bf16) (not truncated:
        # that would move ~half the elements; a few may differ where the two compilations contract FMAs apart)
        fp32 = mt.row_mix(table, row.view(1, -1), w.view(1, *w.shape), torch.float32)
        assert (out != fp32.bfloat16()).float().mean() < 0.01
    _close(d_table, want_table, 1e-6)
    _close(dw.view(want_w.shape), want_w, 1e-6)


@pytest.mark.gpu
@needs_cuda
def test_cuda_kernels_take_int64_offsets_past_2_31():
    """A table of more than 2^31 values (R*d): row ids near its end read and scatter the right rows."""
    M, d, H = 6, 128, 6
    R = (2**31 // d + 4096) // M * M  # rows of M slots: R*d > 2^31
    if torch.cuda.mem_get_info()[0] < 3 * R * d * 4:
        pytest.skip("needs ~26 GB free GPU memory")
    table = torch.zeros(R, d, device="cuda")
    row = torch.tensor([R // M - 1, R // M - 2, 0, R // M - 1], device="cuda")
    table[-2 * M:] = torch.randn(2 * M, d, device="cuda")
    table[:M] = torch.randn(M, d, device="cuda")
    w = torch.rand(4, H, M, device="cuda")
    grad = torch.randn(4, H, d, device="cuda")
    out = mt.row_mix_forward_triton(table, row, w, torch.float32)
    d_table, dw = mt.row_mix_backward_triton(grad, table, row, w)
    small = torch.cat([table[:M], table[-2 * M:]]).cpu()  # rows 0, R/M - 2, R/M - 1 as a 3-row table
    small_row = torch.tensor([2, 1, 0, 2])
    want, want_table, want_w = _reference(small, small_row, w.cpu(), grad.cpu())
    _close(out, want, 1e-6)
    _close(dw, want_w, 1e-6)
    _close(torch.cat([d_table[:M], d_table[-2 * M:]]), want_table, 1e-6)
    assert float(d_table[M:-2 * M].abs().max()) == 0.0


def _cuda_model(opts):
    """A tiny MoME model on CUDA with routers at the scale training gives them (logits O(1): no saturated
    sigmoids, whose slopes would amplify the bf16 rounding differences of two fusions) -- as test_gpu.py's
    compiled-vs-eager test."""
    model = build_model(tiny_config(memory="mome", memory_options=opts), device="cuda", seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in model.memory.routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=g) / router.weight.size(1) ** 0.5)
        for block in model.blocks:
            block.attn.c_proj.weight.copy_(0.02 * torch.randn(block.attn.c_proj.weight.shape, generator=g))
    idx = torch.randint(0, 512, (4, 33), generator=g).cuda()
    return model, idx[:, :-1], idx[:, 1:]


def compiled_run_with(model, x, y, autocast, monkeypatch, settings: dict, install_spy):
    """Loss and gradients of torch.compile(model, fullgraph=True) with the mome_mix ``settings`` (name -> value),
    and the number of calls ``install_spy(monkeypatch)``'s spy saw (traced once per memory layer). The settings and
    the spy are undone after; the caller's other settings stay."""
    torch._dynamo.reset()
    with monkeypatch.context() as m:
        for name, value in settings.items():
            m.setattr(mix_paths, name, value)
        calls = install_spy(m)
        out = _loss_and_grads(model, x, y, autocast, run=torch.compile(model, fullgraph=True, dynamic=False))
    return out, len(calls)


def _compiled_run(model, x, y, row_sum, autocast, monkeypatch):
    """compiled_run_with ROW_SUM = row_sum and the row-mix op's spy; the fixture's FUSE_INJECT = False and the
    caller's MIX stay."""
    return compiled_run_with(model, x, y, autocast, monkeypatch, {"ROW_SUM": row_sum}, _spy)


@contextlib.contextmanager
def _fp32_matmuls():
    """TF32 off for the block (the fp32 reference must be fp32), restored after; dynamo's caches dropped."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch._dynamo.reset()


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def assert_equal_to_fp32_rounding(got, want):
    """(loss, {name: grad}) pairs of two fp32 paths: the same loss and gradients up to float rounding."""
    assert abs(got[0].item() - want[0].item()) < 1e-5 * want[0].item()
    assert_grads_close(got[1], want[1], FP32_REL)


def assert_as_close_as(new, old, ref):
    """(loss, {name: grad}) of a new and an old bf16 path and of the fp32 reference: the new path's loss and every
    gradient no further from the reference than the old's (x2 + 5e-3: two fusions round differently), and the two
    paths within 5e-2 of each other (a wrong kernel is off by O(1))."""
    loss_new, loss_old = abs(new[0].item() - ref[0].item()), abs(old[0].item() - ref[0].item())
    assert loss_new <= 2 * loss_old + 1e-3 * ref[0].item(), (loss_new, loss_old)
    errs = {n: (_rel(new[1][n], ref[1][n]), _rel(old[1][n], ref[1][n]), _rel(new[1][n], old[1][n])) for n in ref[1]}
    bad = {n: e for n, e in errs.items() if not (e[0] <= 2 * e[1] + 5e-3 and e[2] < 5e-2)}
    assert not bad, bad  # (new vs fp32, old vs fp32, new vs old)


def test_compiled_run_keeps_the_row_mix_pair_alone(monkeypatch):
    """The CUDA model tests' harness on the CPU (the op's torch math): two compiled runs in a row, "unrolled" then
    "triton", the second through the row-mix op in every memory layer (FUSE_INJECT stays off after the first)."""
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    model, x, y = _random_router_model(MODEL_OPTIONS["per_layer"][0], n_layer=1)  # as in the test above
    monkeypatch.setattr(mix_paths, "MIX", "row")
    (want, n0) = _compiled_run(model, x, y, "unrolled", False, monkeypatch)
    (got, n1) = _compiled_run(model, x, y, "triton", False, monkeypatch)
    assert (n0, n1) == (0, len(model.memory.layers)) and mix_paths.FUSE_INJECT is False
    assert_equal_to_fp32_rounding(got, want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["per_layer", "full_routing", "shared_expert"])
def test_cuda_compiled_model_fp32_triton_equals_unrolled(name, monkeypatch):
    """fp32 (TF32 off), compiled fullgraph: ROW_SUM "triton" takes the kernels in every memory layer and gives
    the compiled "unrolled" model's loss and gradients to float rounding (the atomics' order is free)."""
    model, x, y = _cuda_model(MODEL_OPTIONS[name][0])
    with _fp32_matmuls():
        monkeypatch.setattr(mix_paths, "MIX", "row")
        (want, _) = _compiled_run(model, x, y, "unrolled", False, monkeypatch)
        (got, calls) = _compiled_run(model, x, y, "triton", False, monkeypatch)
    assert calls == len(model.memory.layers)  # traced once per memory layer into the one graph
    assert_equal_to_fp32_rounding(got, want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["per_layer", "shared_expert"])
def test_cuda_compiled_model_bf16_triton_as_close_as_unrolled(name, monkeypatch):
    """bf16 autocast, compiled fullgraph: "triton" and "unrolled" each against the fp32 eager model (TF32 off);
    the kernels' loss and every gradient no further from it than today's path (x2 + 5e-3: two fusions round
    differently, and inductor may skip the bf16 rounding of mem that the kernel's bf16 store does, as eager
    mode does), and the two paths within 5e-2 of each other: a wrong kernel is off by O(1)."""
    model, x, y = _cuda_model(MODEL_OPTIONS[name][0])
    with _fp32_matmuls():
        monkeypatch.setattr(mix_paths, "MIX", "row")
        ref = _loss_and_grads(model, x, y, False)
        (unrolled, _) = _compiled_run(model, x, y, "unrolled", True, monkeypatch)
        (triton_, calls) = _compiled_run(model, x, y, "triton", True, monkeypatch)
    assert calls == len(model.memory.layers)
    assert_as_close_as(triton_, unrolled, ref)
