"""Session 33's review of the MoME GPU path (the row-mix kernels, the mix and the selection they serve): one test
per finding or suspicion that the other MoME kernel tests did not pin down.

The selection tests run everywhere; the kernel tests need triton and ``TRITON_INTERPRET=1`` (set before the import)
and skip without them, as tests/test_mome_triton.py's:

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest tests/test_mome_kernels33.py
"""

import pytest
import torch

from memory_grads import FP32_REL, assert_grads_close, reach_the_memory
from nanochat.memory import mome_mix as mix_paths
from nanochat.memory import mome_triton as mt
from test_mome_triton import _close, _reference, needs_interpreter

INF = float("inf")


# -- the top-K selection (mome_mix.topk_indices) ---------------------------------------------------------------
@pytest.mark.parametrize("by_argmax", [True, False], ids=["argmax", "topk"])
def test_topk_never_picks_a_slot_twice_with_minus_inf_scores(by_argmax, monkeypatch):
    """Overflowed (-inf) logits: the masked-argmax passes (CUDA's path) masked a picked slot with -inf, so once only
    -inf scores were left a pass picked slot 0 again, and slot_weights then counted its weight twice. Now every
    path picks K distinct slots holding the K largest scores, as torch.topk does."""
    monkeypatch.setattr(mix_paths, "TOPK_BY_ARGMAX", by_argmax)
    scores = torch.tensor([[5.0, -INF, -INF, 1.0],  # 2 finite scores for K = 3: one -inf slot must be added
                           [-INF, -INF, -INF, -INF],  # nothing finite
                           [-INF, 2.0, -INF, -INF],
                           [0.5, 0.5, 0.5, 0.5]])  # exact ties (a zero-initialised router)
    for k in (1, 2, 3, 4):
        sel = mix_paths.topk_indices(scores, k)
        assert sel.shape == (4, k)
        assert all(len(set(r.tolist())) == k for r in sel), sel  # K distinct slots per row
        want = scores.topk(k, dim=-1).values  # sorted, descending
        torch.testing.assert_close(scores.gather(-1, sel).sort(dim=-1, descending=True).values, want)
    # the weights over M (what the row-mix kernels read): each selected slot's weight once
    sel = mix_paths.topk_indices(scores, 3)
    dense = mix_paths.slot_weights(sel, torch.ones(4, 3), 4)
    assert torch.equal(dense.sum(dim=-1), torch.full((4,), 3.0)) and dense.max() == 1.0


def test_topk_by_argmax_keeps_nan_first_and_the_dtype(monkeypatch):
    """NaN scores are picked first, as torch.topk ranks them; bf16 scores (the router's under autocast) work."""
    monkeypatch.setattr(mix_paths, "TOPK_BY_ARGMAX", True)
    scores = torch.tensor([[1.0, float("nan"), 3.0, -INF]])
    assert mix_paths.topk_indices(scores, 2).tolist() == [[1, 2]]
    assert mix_paths.topk_indices(scores.bfloat16(), 3).tolist() == [[1, 2, 0]]


# -- the row-mix kernels at the edges of their shapes (the interpreter) ----------------------------------------------
def _edge_inputs(N, H, M, d, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(rows * M, d, generator=g)
    row = torch.randint(0, rows, (N,), generator=g)  # fewer rows than tokens: the atomics collide
    return table, row, torch.rand(N, H, M, generator=g), torch.randn(N, H, d, generator=g), g


# K == M == 1 (one slot, one head, d of 2: every tile masked down to 1 x 2), the most slots the kernels take (64),
# and a tile of exactly MAX_TILE accumulators whose d is not a power of 2 (16 heads x 1000 -> 16 x 1024)
EDGE_SHAPES = {"one_slot": dict(N=9, H=1, M=1, d=2, rows=2), "max_slots": dict(N=2, H=1, M=64, d=4, rows=1),
               "max_tile": dict(N=3, H=16, M=2, d=1000, rows=2)}


@needs_interpreter
@pytest.mark.parametrize("shape", list(EDGE_SHAPES.values()), ids=list(EDGE_SHAPES))
def test_row_mix_kernels_at_the_edges_of_their_shapes(shape):
    """Forward, dw and the colliding table gradient against the float64 reference, and the fused injection pair's
    outputs and three gradients against the op's torch math (fp32: the same roundings up to the sum's order)."""
    table, row, w, grad, g = _edge_inputs(**shape)
    assert mt._tile_fits(shape["H"], shape["d"], shape["M"])  # shapes the kernels take (applies: on CUDA)
    want, want_table, want_w = _reference(table, row, w, grad)
    _close(mt.row_mix_forward_triton(table, row, w, torch.float32), want, 1e-6)
    d_table, dw = mt.row_mix_backward_triton(grad, table, row, w)
    _close(d_table, want_table, 1e-6)
    _close(dw, want_w, 1e-6)
    gamma, v = 2 * torch.rand(shape["N"], shape["H"], generator=g), torch.randn(grad.shape, generator=g)
    _close(mt.row_mix_inject_forward_triton(table, row, w, gamma, v),
           mt.row_mix_inject_torch(table, row, w, gamma, v).double(), 1e-6)
    got = mt.row_mix_inject_backward_triton(grad, table, row, w, gamma)
    for a, b in zip(got, mt.row_mix_inject_backward_torch(grad, table, row, w, gamma)):
        assert a.dtype == b.dtype
        _close(a, b.double(), 1e-6)


@needs_interpreter
def test_row_mix_kernels_take_strided_inputs():
    """Non-contiguous operands (a table sliced from a wider one, transposed weights, a strided grad, int64 ids
    read every other element) give the contiguous operands' results: the launchers copy what the kernels'
    row-major offsets need."""
    table, row, w, grad, g = _edge_inputs(N=6, H=3, M=4, d=24, rows=3)
    wide = torch.randn(table.size(0), 40, generator=g)
    wide[:, 5:29] = table
    s_table = wide[:, 5:29]
    s_row = torch.stack([row, torch.full_like(row, 99)], dim=1)[:, 0]  # stride 2; 99 would be out of range
    s_w = w.transpose(1, 2).contiguous().transpose(1, 2)
    s_grad = grad.new_empty(6, 3, 48)[..., ::2]
    s_grad.copy_(grad)
    assert not any(x.is_contiguous() for x in (s_table, s_row, s_w, s_grad))
    assert torch.equal(mt.row_mix_forward_triton(s_table, s_row, s_w, torch.float32),
                       mt.row_mix_forward_triton(table, row, w, torch.float32))
    for a, b in zip(mt.row_mix_backward_triton(s_grad, s_table, s_row, s_w),
                    mt.row_mix_backward_triton(grad, table, row, w)):
        assert torch.equal(a, b)
    gamma = torch.rand(6, 6, generator=g)[:, ::2]
    v = torch.randn(3, 6, 24, generator=g).transpose(0, 1)[:, :3]  # (6, 3, 24), non-contiguous
    assert torch.equal(mt.row_mix_inject_forward_triton(s_table, s_row, s_w, gamma, v),
                       mt.row_mix_inject_forward_triton(table, row, w, gamma.contiguous(), v.contiguous()))


# -- the kernels inside a model: every gradient, the memory's included (the interpreter) -------------------------------
# name -> (memory options, mome_mix settings, the kernel path the model then takes)
MODEL_CASES = {
    # K == 1 (softmax over all M, the paper's rule) with a causal conv1d router on the values
    "top1_softmax_conv_value": ({"slots": 4, "topk": 1, "router_type": "conv1d", "router_input": "value",
                                 "conv_kernel_size": 3}, {}, "fused"),
    "top3_of_5_hidden": ({"slots": 5, "topk": 3}, {}, "fused"),
    "row_pair": ({"slots": 5, "topk": 2}, {"FUSE_INJECT": False}, "row"),
    "shared_expert": ({"slots": 4, "topk": 2, "shared_expert": True}, {}, "row"),
    # the shared bigram-indexed table on its rows gathered once: unique_rows, the stores in place of the atomics
    "shared_table_fused": ({"slots": 4, "topk": 2, "index": "bigram", "bigram_factor": 2},
                           {"SHARED_TABLE_KERNEL": True}, "fused"),
    "shared_table_row": ({"slots": 4, "topk": 2, "index": "bigram", "bigram_factor": 2},
                         {"SHARED_TABLE_KERNEL": True, "FUSE_INJECT": False}, "row"),
}


def _model_with_memory_gradients(opts):
    """A one-layer MoME model (the memory layer) with random routers (real selections, no ties), gates away from
    1 and a nonzero attention output projection (zero at init: then no gradient reaches v), and a batch (x, y)
    of 20 tokens at 16 positions (rows repeat)."""
    from conftest import tiny_config
    from nanochat.gpt import build_model

    model = build_model(tiny_config(memory="mome", memory_options=opts, n_layer=1), seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for router in model.memory.routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
            router.bias.copy_(torch.randn(router.bias.shape, generator=g))
        for gate in model.memory.gates:
            gate.proj.weight.copy_(0.3 * torch.randn(gate.proj.weight.shape, generator=g))
    reach_the_memory(model, g)
    idx = torch.randint(0, 20, (2, 9), generator=g)
    return model, idx[:, :-1], idx[:, 1:]


@pytest.mark.parametrize("interpreted", [False, pytest.param(True, marks=needs_interpreter)],
                         ids=["op_cpu_math", "interpreted"])
@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_model_on_the_kernel_ops_equals_the_cpu_path(name, interpreted, monkeypatch):
    """The kernel ops in the memory layer (the CPU added to KERNEL_DEVICES: their torch math; ``interpreted``: the
    Triton kernels in the interpreter) against the CPU path as shipped (no op: embedding_bag over the K rows, or
    the shared table's torch row mix): the loss and every gradient, with the attention's output projection made
    nonzero -- at init it is zero, so no gradient reaches v and a comparison of the memory's gradients (tables,
    routers, gates: all reached through the ops' d_table, dw and d_gamma) compares zeros."""
    from test_mome_triton import _InterpretedRowMix, _loss_and_grads
    from test_mome_triton_inject import _InterpretedInject

    opts, settings, path = MODEL_CASES[name]
    model, x, y = _model_with_memory_gradients(opts)
    want = _loss_and_grads(model, x, y, False)  # the CPU as shipped: no kernel
    calls = []

    def counted(fn):
        return lambda *args: calls.append(1) or fn(*args)

    for key, value in settings.items():
        monkeypatch.setattr(mix_paths, key, value)
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cpu",))
    row_op, inject_op = ((_InterpretedRowMix.apply, _InterpretedInject.apply) if interpreted
                         else (mt.mome_row_mix_op, mt.mome_row_mix_inject_op))
    monkeypatch.setattr(mt, "mome_row_mix_op", counted(row_op))
    monkeypatch.setattr(mt, "mome_row_mix_inject_op", counted(inject_op))
    assert model.memory.kernel_path() == path
    got = _loss_and_grads(model, x, y, False)
    assert len(calls) == len(model.memory.layers)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    memory = [n for n in want[1] if n.startswith("memory.")]
    assert any("routers" in n for n in memory) and any("gates" in n for n in memory)
    assert_grads_close(got[1], want[1], FP32_REL)  # the memory's nonzero, each relative to its norm (~1e-6 here)


@pytest.mark.parametrize("name", ["top3_of_5_hidden", "row_pair", "shared_table_fused"])
def test_model_on_the_kernel_ops_under_bf16_autocast(name, monkeypatch):
    """bf16 autocast, the ops' CPU math (the kernels' roundings: mem and the injection as the eager model's) against
    the CPU path as shipped: the loss within a bf16 rounding, every memory gradient within 2^-7 of its norm -- two
    bf16 roundings (unit roundoff 2^-8): the fused pair's backward keeps in fp32 the products grad * gamma and
    grad * mem that autograd rounds to bf16 (measured: 0.06-0.33% of the norm; the row pair's: equal)."""
    from test_mome_triton import _loss_and_grads

    opts, settings, _ = MODEL_CASES[name]
    model, x, y = _model_with_memory_gradients(opts)
    want = _loss_and_grads(model, x, y, True)
    for key, value in settings.items():
        monkeypatch.setattr(mix_paths, key, value)
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cpu",))
    got = _loss_and_grads(model, x, y, True)
    torch.testing.assert_close(got[0], want[0], rtol=2**-8, atol=0)
    memory = [n for n in want[1] if n.startswith("memory.")]
    assert memory and all(float(want[1][n].abs().max()) > 0 for n in memory)
    for n in memory:
        _close(got[1][n], want[1][n].double(), 2**-7)
