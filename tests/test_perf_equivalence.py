"""The optimised MoME paths equal the plain implementation (fp32, outputs and gradients), and a tiny MoME model
traces in training mode without graph breaks. No timing here: speed is measured by bench/step.py."""

import pytest
import torch

from conftest import tiny_config
from nanochat.gpt import build_model
from nanochat.memory import mome as mome_module
from nanochat.memory.mome import MoMEMemory, mome_mix_fused, mome_mix_reference
from mome_fixtures import C, GROUP, HEADS, VOCAB, mome_config, random_block


def _config(tmp_path, M, K, index, **extra):
    return mome_config(tmp_path, M, K, index, **extra)


def _block(cfg, seed=0):
    return random_block(cfg, seed)


def _run(block, fused, capture, tokens, xn, v):
    """value() of the first memory layer and the gradients of a random projection of it."""
    block.capture = {} if capture else None
    old = mome_module.FUSED_MIX
    mome_module.FUSED_MIX = fused
    try:
        out = block.value(block.layers[0], xn, v, block.prepare(tokens, None))
    finally:
        mome_module.FUSED_MIX = old
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    params = [p for p in block.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * proj).sum(), [xn, v, *params], allow_unused=True)
    grads = [g.to_dense() if g is not None and g.is_sparse else g for g in grads]  # shared bigram table: sparse
    return out, grads, block.capture


def assert_same_sums(fast, plain, g_fast, g_plain, n_out, n_grad):
    """The two paths sum the same float32 terms in different orders (embedding_bag vs gather-mul-sum, fused vs
    separate GEMMs), so an element may differ by up to n u * sum|terms|, u = 2^-24, whatever its own size: where
    terms cancel (e.g. the router gradient for K = 1 with a normalised gate, mathematically ~0, float noise of
    ~1e-6 in both paths) only an absolute bound holds. Terms are taken as no larger than the largest output or
    gradient; n_out / n_grad: terms per output / gradient element. Plus rtol 1e-5 for the rest."""
    u = 2.0**-24
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=n_out * u * plain.abs().max().item())
    scale = max(g.abs().max().item() for g in g_plain if g is not None)
    for a, b in zip(g_fast, g_plain):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-5, atol=n_grad * u * scale)


def _inputs(cfg, B=3, T=9):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 8, (B, T), generator=g)  # few distinct tokens: many duplicate table rows
    xn = torch.randn(B, T, cfg.n_embd, generator=g, requires_grad=True)
    v = torch.randn(B, T, cfg.n_kv_head, cfg.head_dim, generator=g, requires_grad=True)
    return tokens, xn, v


@pytest.mark.parametrize("index", ["token", "grouped", "bigram"])
@pytest.mark.parametrize("M,K", [(6, 1), (6, 2), (3, 3)])
@pytest.mark.parametrize("extra", [{}, {"router_input": "value"}, {"gate": "softmax-norm"}], ids=["hidden", "value", "softmax"])
def test_fast_path_equals_plain(tmp_path, index, M, K, extra):
    """Fused embedding_bag mix + gate-on-top-K-only routing (no capture) == plain gather-mul-sum with capture."""
    cfg = _config(tmp_path, M, K, index, **extra)
    block = _block(cfg)
    tokens, xn, v = _inputs(cfg)
    fast, g_fast, _ = _run(block, fused=True, capture=False, tokens=tokens, xn=xn, v=v)
    plain, g_plain, cap = _run(block, fused=False, capture=True, tokens=tokens, xn=xn, v=v)
    # an output element sums K rows (+ v); a gradient element at most one term per (token, head, slot)
    assert_same_sums(fast, plain, g_fast, g_plain, K + 1, tokens.numel() * HEADS * K)
    assert set(cap[block.layers[0]]) >= {"slots", "weights", "gamma", "inject_norm", "rows", "probs"}


@pytest.mark.parametrize("routing", ["fixed-random", "token-only"])
def test_other_routings_fast_equals_plain(tmp_path, routing):
    cfg = _config(tmp_path, 6, 2, "token", routing=routing)
    block = _block(cfg)
    tokens, xn, v = _inputs(cfg)
    fast, g_fast, _ = _run(block, True, False, tokens, xn, v)
    plain, g_plain, _ = _run(block, False, True, tokens, xn, v)
    assert_same_sums(fast, plain, g_fast, g_plain, 2 + 1, tokens.numel() * HEADS * 2)  # K = 2


def test_sigmoid_fast_route_equals_full_route(tmp_path):
    """route(probs=False) gates only the K selected logits: the same slots (top-K of the same logits) and the same
    weights up to the last bits. Not bit for bit: torch's vectorised sigmoid and its scalar loop (used for the
    tail of a tensor, whose extent depends on the numel and the CPU's vector width) differ by up to 1 ulp on some
    inputs, and the K and M gates put a logit in different places. 1 ulp per gate, through the normalisation
    w / sum(w), moves a weight by < 4 ulp relative: rtol 2^-20 (~1e-6)."""
    cfg = _config(tmp_path, 8, 3, "token")
    block = _block(cfg)
    tokens, xn, v = _inputs(cfg)
    row = block.prepare(tokens, None)[1]
    sel_a, w_a, p_a = block.route(0, xn, v, tokens, row, probs=True)
    sel_b, w_b, p_b = block.route(0, xn, v, tokens, row, probs=False)
    assert p_b is None and p_a.shape[-1] == 8
    order_a, order_b = sel_a.argsort(-1), sel_b.argsort(-1)  # topk(sorted=False) order is unspecified
    assert torch.equal(sel_a.gather(-1, order_a), sel_b.gather(-1, order_b))
    torch.testing.assert_close(w_a.gather(-1, order_a), w_b.gather(-1, order_b), rtol=2**-20, atol=0)


@pytest.mark.parametrize("M,K", [(6, 1), (6, 2), (8, 3), (4, 4)])
def test_topk_by_argmax_selects_the_same_slots_as_topk(M, K):
    g = torch.Generator().manual_seed(M * 10 + K)
    scores = torch.randn(5, 7, 3, M, generator=g)  # continuous: no ties
    want = scores.topk(K, dim=-1, sorted=False).indices.sort(-1).values
    old = mome_module.TOPK_BY_ARGMAX
    try:
        mome_module.TOPK_BY_ARGMAX = True
        got = mome_module.topk_indices(scores, K)
    finally:
        mome_module.TOPK_BY_ARGMAX = old
    assert got.shape == (5, 7, 3, K) and torch.equal(got.sort(-1).values, want)
    ties = torch.zeros(2, M)  # zero-initialised routers: every logit ties -> the first K slots
    mome_module.TOPK_BY_ARGMAX = True
    try:
        assert torch.equal(mome_module.topk_indices(ties, K), torch.arange(K).expand(2, K))
    finally:
        mome_module.TOPK_BY_ARGMAX = old


@pytest.mark.parametrize("index", ["token", "bigram"])
def test_cuda_paths_equal_cpu_paths_on_the_cpu(tmp_path, index, monkeypatch):
    """The CUDA fast paths (plain mix, argmax selection) forced on the CPU compute the CPU paths' function."""
    cfg = _config(tmp_path, 6, 2, index)
    block = _block(cfg)
    tokens, xn, v = _inputs(cfg)
    cpu, g_cpu, _ = _run(block, fused=True, capture=False, tokens=tokens, xn=xn, v=v)
    monkeypatch.setattr(mome_module, "TOPK_BY_ARGMAX", True)
    block.sparse_shared_grad = False  # as on CUDA
    cuda_like, g_cuda, _ = _run(block, fused=False, capture=False, tokens=tokens, xn=xn, v=v)
    assert_same_sums(cuda_like, cpu, g_cuda, g_cpu, 2 + 1, tokens.numel() * HEADS * 2)  # K = 2


def test_fused_mix_table_gradient_with_duplicate_ids():
    """Repeated flat ids (same row picked by several heads/tokens) accumulate the same table gradient."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(10, 5, generator=g, requires_grad=True)
    flat = torch.randint(0, 3, (2, 4, 3, 2), generator=g)  # (B, T, H, K), ids in 0..2 only
    w = torch.rand(2, 4, 3, 2, generator=g, requires_grad=True)
    cot = torch.randn(2, 4, 3, 5, generator=g)
    outs = [mix(table, flat, w) for mix in (mome_mix_fused, mome_mix_reference)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    grads = [torch.autograd.grad((o * cot).sum(), [table, w]) for o in outs]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (grads[0][0][3:] == 0).all()  # untouched rows: exactly zero (dense grad, sparse support)


@pytest.mark.parametrize("opts", [{}, {"index": "bigram", "bigram_factor": 2}, {"topk": 1, "router_input": "value"}])
def test_training_forward_has_no_graph_breaks(opts):
    """Dynamo trace only (no inductor): cheap, and the inductor compile is covered by the slow test in
    tests/test_memory_train.py."""
    model = build_model(tiny_config(memory="mome", memory_options=opts, n_layer=2), seed=0)
    model.train()
    data = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(data[:, :-1], data[:, 1:])
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
