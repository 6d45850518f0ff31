"""``unique_rows`` of the row-mix kernel pairs (nanochat.memory.mome_triton): where every table row is read by exactly
one token (the shared table's rows gathered once, ``MoMEMemory._kernel_operands``), the backward kernels store each
row's table gradient into an unfilled tensor in place of fp32 atomics into a zero-filled one: no R*d*4-byte fill, no
atomics, and bitwise the values the atomics give (each row's sum is added once into a zero; ``+ 0.0`` turns -0.0 into
+0.0 as that add does).

* always: the ops' CPU math with the flag (the same values; its contract checked: R == N*M and distinct ids), the
  flag reaching the backward op, ``torch.library.opcheck``, ``torch.compile(fullgraph=True)``;
* triton with ``TRITON_INTERPRET=1``: stores against atomics bit for bit, both pairs, fp32 and bf16, into a
  NaN-filled gradient (every row must be stored); the model with ``SHARED_TABLE_KERNEL`` on, stores against atomics;
* marker ``gpu`` (CUDA): stores against atomics bit for bit through the ops.

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest tests/test_mome_triton_unique.py
    python -m pytest -m gpu tests/test_mome_triton_unique.py                                      # on a GPU
"""

import re

import pytest
import torch

from nanochat.memory import mome_mix as mix_paths
from nanochat.memory import mome_triton as mt
from test_mome_shared_kernel import BIGRAM, _model
from test_mome_triton import (COMPILABLE, _InterpretedRowMix, _loss_and_grads, needs_cuda, needs_interpreter,
                              sm90_ptx)
from test_mome_triton_inject import INJECT_BWD_PTRS, ROW_BWD_PTRS, _InterpretedInject

PAIRS = ("row", "fused")


def _unique_inputs(N=48, H=6, M=6, d=128, dtype=torch.float32, device="cpu", seed=0):
    """table (N*M, d) fp32 read at the N ids of a permutation (each row by one token), w (N, H, M) zero off a
    top-2 and zero for slot 0 of every 4th token (its gradient rows: sums of signed zeros), gamma (N, H) and v,
    grad (N, H, d) in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(N * M, d, generator=g)
    row = torch.randperm(N, generator=g)
    w = torch.rand(N, H, M, generator=g)
    w = torch.where(torch.rand(N, H, M, generator=g).argsort(-1) < 2, w, 0.0)
    w[::4, :, 0] = 0.0
    gamma = 2 * torch.rand(N, H, generator=g)
    v, grad = torch.randn(N, H, d, generator=g), torch.randn(N, H, d, generator=g)
    return [x.to(device) for x in (table, row, w, gamma.to(dtype), v.to(dtype), grad.to(dtype))]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (torch.equal calls -0.0 and +0.0 equal, and NaN unequal to itself)."""
    return x.contiguous().view({2: torch.int16, 4: torch.int32}[x.element_size()])


def _assert_bitwise_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))


def _nan_filled(monkeypatch):
    """The unfilled table gradient filled with NaN: a row the store path missed (or added into) stays NaN."""
    real = mt._table_grad

    def table_grad(table, w, unique_rows):
        out = real(table, w, unique_rows)
        return out.fill_(float("nan")) if unique_rows else out

    monkeypatch.setattr(mt, "_table_grad", table_grad)


def _op_grads(pair, table, row, w, gamma, v, grad, unique_rows):
    """The op's output and gradients (table, w, and gamma for the fused pair) through its autograd."""
    leaves = [x.clone().requires_grad_() for x in ((table, w) if pair == "row" else (table, w, gamma))]
    if pair == "row":
        out = mt.mome_row_mix_op(leaves[0], row, leaves[1], v.dtype, unique_rows)
    else:
        out = mt.mome_row_mix_inject_op(leaves[0], row, leaves[1], leaves[2], v, unique_rows)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


# -- (a) the ops' CPU math and their plumbing, always ---------------------------------------------------------
@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_cpu_math_with_the_flag_gives_the_same_values(pair, dtype):
    inputs = _unique_inputs(dtype=dtype)
    _assert_bitwise_equal(_op_grads(pair, *inputs, True), _op_grads(pair, *inputs, False))


@pytest.mark.parametrize("pair", PAIRS)
def test_the_flag_reaches_the_backward_op_which_checks_the_ids(pair):
    """Repeated ids declared unique: the forward is fine (it ignores the flag), the backward's CPU math refuses."""
    table, row, w, gamma, v, grad = _unique_inputs(N=8, H=2, M=3, d=8)
    row = row.clone()
    row[1] = row[0]
    with pytest.raises(ValueError, match="unique_rows: the 8 row ids repeat"):
        _op_grads(pair, table, row, w, gamma, v, grad, True)
    _op_grads(pair, table, row, w, gamma, v, grad, False)  # the atomics' contract: any ids


def test_the_contract_needs_every_table_row_read_once():
    """R == N*M (checked from the shapes alone, as the kernels' launchers do on the GPU) and distinct ids."""
    table, row, w, *_ = _unique_inputs(N=8, H=2, M=3, d=8)
    mt.check_unique_rows(table, w, row)
    with pytest.raises(ValueError, match="R == N\\*M; got a table of 27 rows for N=8 tokens of M=3 slots"):
        mt.check_unique_rows(torch.cat([table, table[:3]]), w)
    with pytest.raises(ValueError, match="R == N\\*M"):
        mt._table_grad(table[:21], w, True)
    assert torch.equal(mt._table_grad(table, w, False), torch.zeros_like(table))  # the atomics' zero fill
    with pytest.raises(ValueError, match="row ids repeat"):
        mt.check_unique_rows(table, w, torch.zeros_like(row))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_custom_ops_with_the_flag_pass_opcheck(dtype):
    table, row, w, gamma, v, grad = _unique_inputs(N=8, H=2, M=3, d=16, dtype=dtype)
    leaf = [x.clone().requires_grad_() for x in (table, w, gamma, v)]
    torch.library.opcheck(mt.mome_row_mix_op, (leaf[0], row, leaf[1], dtype, True))
    torch.library.opcheck(mt.mome_row_mix_backward_op, (grad, table, row, w, True))
    torch.library.opcheck(mt.mome_row_mix_inject_op, (leaf[0], row, leaf[1], leaf[2], leaf[3], True))
    torch.library.opcheck(mt.mome_row_mix_inject_backward_op, (grad, table, row, w, gamma, True))


def test_compile_fullgraph_with_the_flag_on_cpu():
    """Both ops with unique_rows=True inside one graph (the bool a constant of the schema), forward and backward:
    the eager values."""
    table, row, w, gamma, v, grad = _unique_inputs(N=16, H=2, M=3, d=8)

    def f(table, w, gamma):
        mem = mt.mome_row_mix_op(table, row, w, torch.float32, True)
        return mt.mome_row_mix_inject_op(table, row, w, gamma, v, True) + mem

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (table, w, gamma)]
        out = fn(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad)]

    torch._dynamo.reset()
    got, want = run(torch.compile(f, fullgraph=True, dynamic=False)), run(f)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# -- (b) the Triton kernels in the interpreter ---------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(), dict(H=4), dict(N=40, H=3, M=5, d=48)], ids=["d128", "h4", "non_pow2"])
def test_kernels_store_the_atomics_values_bitwise(pair, dtype, shape, monkeypatch):
    """The backward kernels with UNIQUE_ROWS into a NaN-filled gradient (no row missed, none added into) against
    the atomics into zeros: every output bit for bit. Rows whose H terms are all -0.0 are among the inputs, but the
    interpreter's sums (numpy's, from +0.0) never give -0.0: the stores' ``+ 0.0`` is pinned by the gpu test (H=8,
    no masked heads, whose +0.0 terms would hide it)."""
    _nan_filled(monkeypatch)
    table, row, w, gamma, _, grad = _unique_inputs(dtype=dtype, **shape)
    args = (grad, table, row, w) if pair == "row" else (grad, table, row, w, gamma)
    backward = mt.row_mix_backward_triton if pair == "row" else mt.row_mix_inject_backward_triton
    atomics, stores = backward(*args, False), backward(*args, True)
    _assert_bitwise_equal(stores, atomics)
    g = grad.float() * (1.0 if pair == "row" else gamma.float()[..., None])
    terms = w[..., None] * g[:, :, None, :]  # (N, H, M, d): a row's sum is -0.0 iff all its H terms are, any order
    assert ((terms == 0) & terms.signbit()).all(dim=1).any()  # sums of -0.0 in exact arithmetic
    assert not stores[0].isnan().any() and not stores[0][stores[0] == 0].signbit().any()


@needs_interpreter
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "row"])
def test_model_with_the_switch_on_stores_the_atomics_gradients(fuse, monkeypatch):
    """SHARED_TABLE_KERNEL on, the real kernels interpreted in every memory layer, eager fp32: with unique_rows (as
    _kernel_operands passes it) the loss and every gradient bit for bit those of the atomics (the flag dropped)."""
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(mix_paths, "FUSE_INJECT", fuse)
    monkeypatch.setattr(mix_paths, "SHARED_TABLE_KERNEL", True)
    _nan_filled(monkeypatch)
    flags = []

    def interpreted(function):
        def call(*args):
            flags.append(args[-1])
            return function.apply(*args[:-1], args[-1] and not atomics)
        return call

    monkeypatch.setattr(mt, "mome_row_mix_inject_op", interpreted(_InterpretedInject))
    monkeypatch.setattr(mt, "mome_row_mix_op", interpreted(_InterpretedRowMix))
    model, x, y = _model(BIGRAM)
    runs = []
    for atomics in (True, False):
        loss, grads = _loss_and_grads(model, x, y, False)
        runs.append([loss, *(grads[n] for n in sorted(grads))])
    assert flags == [True] * 2 * len(model.memory.layers)
    _assert_bitwise_equal(runs[1], runs[0])


def test_model_declares_only_the_gathered_rows_unique(monkeypatch):
    """_kernel_operands: the shared table's gathered rows (ids 0..B*T-1) unique, a per-layer table's (n_t) not."""
    model, x, _ = _model(BIGRAM)
    B, T = x.shape
    rows = torch.randn(B, T, model.memory.M, model.memory.d)
    table, row, unique = model.memory._kernel_operands(model.memory.table.weight, x, rows)
    assert unique is True and table.shape == (B * T * model.memory.M, model.memory.d)
    mt.check_unique_rows(table, torch.zeros(B * T, 1, model.memory.M), row.reshape(-1))
    per_layer, _, _ = _model({"slots": 4, "topk": 2})
    assert not hasattr(per_layer.memory, "table")
    table = per_layer.memory._table(0)
    got = per_layer.memory._kernel_operands(table, x, None)
    assert got[0] is table and got[1] is x and got[2] is False


@pytest.mark.skipif(not COMPILABLE, reason="needs triton, not in interpreter mode (TRITON_INTERPRET unset)")
@pytest.mark.parametrize("fusion", [True, False], ids=["fp_fusion", "no_fp_fusion"])
def test_the_stores_plus_zero_survives_the_sm90_build(fusion):
    """``+ 0.0`` is no identity in IEEE arithmetic (-0.0 + 0.0 = +0.0), so the compiler must keep it: one fp32 add
    of 0f00000000 per stored value, in both backward kernels, with Triton's FP fusion on or off (its default turns
    off in 3.10); the atomics' build has none. The interpreter cannot show this (its sums never give -0.0) and the
    gpu test only on a GPU. (On 2026-11-26 the SASS, read with triton's cuobjdump, kept them as FADD R, RZ, R.)"""
    shape, options = (6, 6, 128), {"enable_fp_fusion": fusion}
    zero_add = re.compile(r"\badd(\.rn)?\.f32\s+%r\d+, %r\d+, 0f00000000;")
    for kernel, ptrs in ((mt._row_mix_bwd_kernel, ROW_BWD_PTRS), (mt._row_mix_inject_bwd_kernel, INJECT_BWD_PTRS)):
        stores = sm90_ptx({"k": (kernel, ptrs)}, shape, options, {"UNIQUE_ROWS": True})["k"]
        atomics = sm90_ptx({"k": (kernel, ptrs)}, shape, options, {"UNIQUE_ROWS": False})["k"]
        assert len(zero_add.findall(stores)) >= shape[1] and not zero_add.findall(atomics), kernel.__name__
        assert ".ftz.f32" not in stores  # its add keeps subnormals (which the atomics flush, per the PTX ISA)


# -- (c) CUDA --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [dict(N=4096), dict(N=4096, H=8), dict(N=999, H=3, M=5, d=48)],
                         ids=["d128", "h8", "non_pow2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pair", PAIRS)
def test_cuda_stores_equal_the_atomics_bitwise(pair, dtype, shape, monkeypatch):
    """Through the ops (their CUDA kernels and autograd): with unique_rows, a NaN-filled table gradient, the output
    and every gradient bit for bit those of the atomics into zeros (at H=8, where rows of -0.0 terms sum to -0.0
    in registers, the stores' ``+ 0.0`` gives the atomic add's +0.0)."""
    _nan_filled(monkeypatch)
    inputs = _unique_inputs(dtype=dtype, device="cuda", **shape)
    stores, atomics = _op_grads(pair, *inputs, True), _op_grads(pair, *inputs, False)
    assert not stores[1].isnan().any()
    _assert_bitwise_equal(stores, atomics)
