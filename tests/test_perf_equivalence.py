"""The optimised MoME paths equal the plain implementation (fp32, outputs and gradients), and a tiny MoME model
traces in training mode without graph breaks. No timing here: speed is measured by bench/step.py."""

import pytest
import torch

from conftest import tiny_config
from nanochat.gpt import build_model
from nanochat.memory import mome_mix as mix_paths
from nanochat.memory.mome_mix import mome_mix_fused, mome_mix_reference
from mome_fixtures import HEADS, mome_config, random_block


def _config(tmp_path, M, K, index, **extra):
    return mome_config(tmp_path, M, K, index, **extra)


def _block(cfg, seed=0):
    return random_block(cfg, seed)


def _run(block, mix, capture, tokens, xn, v):
    """value() of the first memory layer and the gradients of a random projection of it; mix: mome_mix.MIX."""
    block.capture = {} if capture else None
    old, old_sparse = mix_paths.MIX, block.sparse_shared_grad
    mix_paths.MIX = mix
    # a sparse table gradient (the shared table on CPU) always takes embedding_bag: "plain" must be dense to run
    # the plain mix at all
    block.sparse_shared_grad = old_sparse and mix != "plain"
    try:
        out = block.value(block.layers[0], xn, v, block.prepare(tokens, None))
    finally:
        mix_paths.MIX, block.sparse_shared_grad = old, old_sparse
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
    fast, g_fast, _ = _run(block, "bag", capture=False, tokens=tokens, xn=xn, v=v)
    plain, g_plain, cap = _run(block, "plain", capture=True, tokens=tokens, xn=xn, v=v)
    # an output element sums K rows (+ v); a gradient element at most one term per (token, head, slot)
    assert_same_sums(fast, plain, g_fast, g_plain, K + 1, tokens.numel() * HEADS * K)
    assert set(cap[block.layers[0]]) >= {"slots", "weights", "gamma", "inject_norm", "rows", "probs"}


@pytest.mark.parametrize("routing", ["fixed-random", "token-only"])
def test_other_routings_fast_equals_plain(tmp_path, routing):
    cfg = _config(tmp_path, 6, 2, "token", routing=routing)
    block = _block(cfg)
    tokens, xn, v = _inputs(cfg)
    fast, g_fast, _ = _run(block, "bag", False, tokens, xn, v)
    plain, g_plain, _ = _run(block, "plain", True, tokens, xn, v)
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
    old = mix_paths.TOPK_BY_ARGMAX
    try:
        mix_paths.TOPK_BY_ARGMAX = True
        got = mix_paths.topk_indices(scores, K)
    finally:
        mix_paths.TOPK_BY_ARGMAX = old
    assert got.shape == (5, 7, 3, K) and torch.equal(got.sort(-1).values, want)
    ties = torch.zeros(2, M)  # zero-initialised routers: every logit ties -> the first K slots
    mix_paths.TOPK_BY_ARGMAX = True
    try:
        assert torch.equal(mix_paths.topk_indices(ties, K), torch.arange(K).expand(2, K))
    finally:
        mix_paths.TOPK_BY_ARGMAX = old


@pytest.mark.parametrize("index", ["token", "bigram"])
def test_cuda_paths_equal_cpu_paths_on_the_cpu(tmp_path, index, monkeypatch):
    """The CUDA fast paths (plain mix, argmax selection) forced on the CPU compute the CPU paths' function."""
    cfg = _config(tmp_path, 6, 2, index)
    block = _block(cfg)
    tokens, xn, v = _inputs(cfg)
    cpu, g_cpu, _ = _run(block, "bag", capture=False, tokens=tokens, xn=xn, v=v)
    monkeypatch.setattr(mix_paths, "TOPK_BY_ARGMAX", True)
    block.sparse_shared_grad = False  # as on CUDA
    cuda_like, g_cuda, _ = _run(block, "plain", capture=False, tokens=tokens, xn=xn, v=v)
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


@pytest.mark.parametrize("opts", [{}, {"index": "bigram", "bigram_factor": 2}, {"topk": 1, "router_input": "value"},
                                  {"index": "headmod", "rows": 100, "dedicated_size": 30},
                                  {"router_type": "conv1d"}, {"router_type": "conv1d", "router_input": "value"}])
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


@pytest.mark.parametrize("index", ["token", "grouped", "bigram"])
@pytest.mark.parametrize("M,K", [(6, 1), (6, 2), (9, 3)])
@pytest.mark.parametrize("argmax", [False, True], ids=["topk", "argmax"])
def test_row_mix_equals_plain(tmp_path, index, M, K, argmax, monkeypatch):
    """The row mix (all M slots of n_t, zero weight off the top-K) computes the top-K mix: same output and
    gradients (router, gate, table, inputs) up to float summation order."""
    monkeypatch.setattr(mix_paths, "TOPK_BY_ARGMAX", argmax)
    cfg = _config(tmp_path, M, K, index)
    block = _block(cfg)
    block.sparse_shared_grad = False  # both paths dense (the sparse variant is compared below)
    tokens, xn, v = _inputs(cfg)
    row, g_row, _ = _run(block, "row", capture=False, tokens=tokens, xn=xn, v=v)
    plain, g_plain, _ = _run(block, "plain", capture=True, tokens=tokens, xn=xn, v=v)
    # an output element sums M terms (K of them non-zero) + v; a table-gradient element one term per (token, head)
    assert_same_sums(row, plain, g_row, g_plain, M + 1, tokens.numel() * HEADS * M)


def test_row_mix_sparse_shared_table_gradient_equals_dense(tmp_path, monkeypatch):
    """CPU eager training keeps the shared bigram table's gradient sparse; densified, it is the dense one."""
    monkeypatch.setattr(mix_paths, "MIX", "row")
    cfg = _config(tmp_path, 6, 2, "bigram")
    tokens, xn, v = _inputs(cfg)
    grads = []
    for sparse in (True, False):
        block = _block(cfg)
        block.sparse_shared_grad = sparse
        out = block.value(block.layers[0], xn, v, block.prepare(tokens, None))
        out.square().sum().backward()
        assert block.table.weight.grad.is_sparse == sparse
        grads.append(block.table.weight.grad.to_dense())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-6)


def test_slot_weights_spread_topk_weights_exactly():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 5, 3, 8, generator=g)
    sel = scores.topk(3, dim=-1, sorted=False).indices
    w = torch.rand(4, 5, 3, 3, generator=g)
    dense = mix_paths.slot_weights(sel, w, 8)
    assert dense.shape == (4, 5, 3, 8)
    assert torch.equal(dense.gather(-1, sel), w)  # bit for bit: one weight plus zeros
    assert torch.equal(dense.scatter(-1, sel, 0.0), torch.zeros_like(dense))


@pytest.mark.parametrize("row_sum", mix_paths.ROW_SUMS)
@pytest.mark.parametrize("per_head", [False, True])
def test_row_mix_compiled_form_equals_eager_form(row_sum, per_head, monkeypatch):
    """mome_row_mix's formulas (einsum in eager; unrolled multiply-adds or a broadcast-sum when inductor traces it)
    agree with the naive sum over M, values and gradients, for shared rows (B, T, M, d) and per-head rows
    (B, T, H, M, d)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 5, *((3,) if per_head else ()), 6, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(2, 5, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(2, 5, 3, 16, generator=g, dtype=torch.float64)
    by_head = rows if per_head else rows[:, :, None].expand(2, 5, 3, 6, 16)
    naive = torch.stack([sum(w[:, :, h, m, None] * by_head[:, :, h, m] for m in range(6)) for h in range(3)], dim=2)
    want = torch.autograd.grad((naive * probe).sum(), (rows, w))
    eager = mix_paths.mome_row_mix(rows, w)
    monkeypatch.setattr(mix_paths, "ROW_SUM", row_sum)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = mix_paths.mome_row_mix(rows, w)
    got = torch.autograd.grad((traced * probe).sum(), (rows, w))
    assert eager.shape == traced.shape == (2, 5, 3, 16)
    torch.testing.assert_close(eager, naive, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(traced, naive, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("row_sum", mix_paths.ROW_SUMS)
def test_row_mix_compiled_by_inductor_equals_eager(row_sum, monkeypatch):
    """The real inductor kernels of each compiled row-mix form (~6 s of CPU compilation each), values and
    gradients, against the eager einsum in fp32."""
    torch._dynamo.reset()
    monkeypatch.setattr(mix_paths, "ROW_SUM", row_sum)
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 5, 6, 16, generator=g, requires_grad=True)
    w = torch.rand(2, 5, 3, 6, generator=g, requires_grad=True)
    probe = torch.randn(2, 5, 3, 16, generator=g)
    want = mix_paths.mome_row_mix(rows, w)
    want_grads = torch.autograd.grad((want * probe).sum(), (rows, w))
    got = torch.compile(mix_paths.mome_row_mix, fullgraph=True, dynamic=False)(rows, w)
    got_grads = torch.autograd.grad((got * probe).sum(), (rows, w))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_unknown_row_sum_is_refused(monkeypatch):
    monkeypatch.setattr(mix_paths, "ROW_SUM", "bmm")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ValueError, match="ROW_SUM 'bmm' is unknown; allowed: triton, unrolled, reduce"):
        mix_paths.mome_row_mix(torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 3, 6))


def _table_gathers(model, loss, target=None) -> int:
    """Backward nodes that feed ``target``'s gradient directly (one per gather of it; default: the shared MoME
    table)."""
    seen, stack, count = set(), [loss.grad_fn], 0
    target = model.memory.table.weight if target is None else target
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for nxt, _ in fn.next_functions:
            count += nxt is not None and getattr(nxt, "variable", None) is target
            stack.append(nxt)
    return count


@pytest.mark.parametrize("mix,gathers", [("bag", 2), ("plain", 2), ("row", 1)])
def test_row_mix_gathers_the_shared_table_once_per_forward(mix, gathers, monkeypatch):
    """With the row mix the bigram-indexed table (shared by the memory layers) is read once per forward, so its
    backward builds one table-sized gradient, not one per memory layer (values: the full-model test below)."""
    monkeypatch.setattr(mix_paths, "MIX", mix)
    model = build_model(tiny_config(memory="mome", memory_options={"index": "bigram", "bigram_factor": 2},
                                    n_layer=2, memory_layers=(0, 1)), seed=0)
    model.train()
    data = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(data[:, :-1], data[:, 1:])
    assert len(model.memory.layers) == 2
    assert _table_gathers(model, loss) == gathers


def test_token_only_routing_looks_its_logits_up_once_per_forward():
    """Token-only routing has one logit table for every memory layer: one lookup per forward, so one gradient
    (not one per layer). That the lookup gives the same routing: the next test."""
    model = build_model(tiny_config(memory="mome", memory_options={"routing": "token-only"}, n_layer=3,
                                    memory_layers=(0, 1, 2)), seed=0)
    model.train()
    data = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(data[:, :-1], data[:, 1:])
    assert len(model.memory.layers) == 3
    assert _table_gathers(model, loss, model.memory.route_table.weight) == 1


def test_token_only_logits_from_prepare_equal_a_per_layer_lookup(tmp_path):
    cfg = _config(tmp_path, 6, 2, "token", routing="token-only")
    block = _block(cfg)
    tokens, xn, v = _inputs(cfg)
    idx, row, _, token_logits, _, _ = block.prepare(tokens, None)
    assert token_logits.shape == (*tokens.shape, HEADS * 6)
    for a, b in zip(block.route(0, xn, v, idx, row), block.route(0, xn, v, idx, row, token_logits=token_logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mix,table_sized", [("plain", 3), ("row", 1)])
def test_compiled_backward_builds_one_shared_table_gradient_with_row_mix(mix, table_sized, monkeypatch):
    """The graph torch.compile hands to inductor (AOT autograd's backward, captured without compiling it): with
    2 memory layers reading the shared bigram-indexed table, the plain mix makes 2 table-sized gradients and their
    table-sized sum; the row mix one table-sized gradient. Structure, not timing (bench/train_step.py times it).
    Two layers, not four (4 gradients and 3 sums): the same per-layer count for half the trace (~4 s against ~9 s
    a case on this session's 2-core box)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setattr(mix_paths, "MIX", mix)
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    model = build_model(tiny_config(memory="mome", memory_options={"index": "bigram", "bigram_factor": 2},
                                    n_layer=2, memory_layers=(0, 1)), seed=0)
    model.train()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")),
                             fullgraph=True)
    data = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    compiled(data[:, :-1], data[:, 1:]).backward()
    torch._dynamo.reset()
    n = model.memory.table.weight.numel()
    sized = [node.target for node in graphs["bw"].graph.nodes if node.op == "call_function"
             and getattr(node.meta.get("val"), "shape", None) is not None and node.meta["val"].numel() == n]
    assert len(sized) == table_sized, sized
    assert sum(t == torch.ops.aten.embedding_dense_backward.default for t in sized) == (2 if mix == "plain" else 1)
    assert model.memory.table.weight.grad is not None


def test_shared_table_default_row_mix_equals_plain_in_a_full_model(monkeypatch):
    """Four memory layers reading the shared bigram-indexed table through the rows gathered once in prepare (the
    default, sparse table gradient in CPU training) == the per-layer plain mix: loss and every gradient."""
    cfg = tiny_config(memory="mome", n_layer=4, memory_layers=(0, 1, 2, 3),
                      memory_options={"slots": 4, "topk": 2, "index": "bigram", "bigram_factor": 2})
    data = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    results = []
    for mix in (None, "plain"):
        monkeypatch.setattr(mix_paths, "MIX", mix)
        model = build_model(cfg, seed=0)
        with torch.no_grad():  # non-zero routers and output projections: every parameter gets a gradient
            g = torch.Generator().manual_seed(1)
            for p in list(model.memory.routers.parameters()) + [b.attn.c_proj.weight for b in model.blocks]:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        model.memory.sparse_shared_grad = mix is None
        loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        grads = {n: p.grad.to_dense() if p.grad.is_sparse else p.grad for n, p in model.named_parameters()
                 if p.grad is not None}
        results.append((loss.detach(), grads, model.memory.table.weight.grad.is_sparse))
    (loss_row, g_row, sparse), (loss_plain, g_plain, dense_is_sparse) = results
    assert sparse and not dense_is_sparse
    torch.testing.assert_close(loss_row, loss_plain, rtol=1e-6, atol=0)
    assert set(g_row) == set(g_plain) and "memory.table.weight" in g_row
    assert g_plain["memory.table.weight"].abs().sum() > 0
    for name in g_plain:
        torch.testing.assert_close(g_row[name], g_plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_row_mix_stays_in_the_table_dtype_under_autocast():
    """Like the K-row mixes (elementwise, or embedding_bag in the table's dtype), the row mix's eager einsum must
    not be cast to bf16 by autocast (it is a bmm): the table gradient would be computed in bf16."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 5, 6, 16, generator=g, requires_grad=True)
    w = torch.rand(2, 5, 3, 6, generator=g)
    want = mix_paths.mome_row_mix(rows, w)
    (grad_want,) = torch.autograd.grad(want.sum(), rows)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mix_paths.mome_row_mix(rows, w)
    (grad_got,) = torch.autograd.grad(got.sum(), rows)
    assert got.dtype == torch.float32 and torch.equal(got, want) and torch.equal(grad_got, grad_want)


def test_unknown_mix_switch_is_refused(tmp_path, monkeypatch):
    cfg = _config(tmp_path, 6, 2, "token")
    block = _block(cfg)
    tokens, xn, v = _inputs(cfg)
    monkeypatch.setattr(mix_paths, "MIX", "fused")
    with pytest.raises(ValueError, match="MIX 'fused' is unknown; allowed: None, bag, plain, row"):
        block.value(block.layers[0], xn, v, block.prepare(tokens, None))
