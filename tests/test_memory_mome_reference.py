"""MoME fast block == an obviously-correct per-token, per-head loop over the paper's equations (Sec. 3).

The loop below re-derives every step from the paper, in float64 Python over (b, t, head), independently of
the block's vectorised code: the row indexer f, the router logits, TopK, the sigmoid-norm / softmax weights,
the weighted sum of stored memory vectors and the gated injection into v. Outputs AND gradients must match.
"""

import pytest
import torch

from mome_fixtures import HEADS, VOCAB, mome_config, naive_row, random_block


def _config(tmp_path, M, K, index, **extra):
    return mome_config(tmp_path, M, K, index, **extra)


def _block(cfg, seed=0):
    return random_block(cfg, seed).double()


def naive_value(cfg, block, layer, tokens, xn, v):
    """v~_{t,i} = v_{t,i} + gamma_i * (sum_{a in TopK(l_{t,i})} alpha_a E[f(x_t), a] + S[f(x_t)]), loops over b,
    t, head; S, the shared expert (reference notes §3.3/§3.7: weight 1, no gate, the same row for every head), only
    with --mome-shared-expert. Per-head tables (--mome-per-head-table, reference notes §3.3): head i reads
    E[(n*H + i)*M + a] and S[n*H + i]."""
    o, pos = block.opts, block.layer_pos[layer]
    M, K = o.slots, o.topk
    table = block.table.weight if o.index == "bigram" else block.tables[pos].weight
    shared = None
    if o.shared_expert:  # network-shared with the bigram-indexed table, else one per layer
        shared = block.shared_expert.weight if o.index == "bigram" else block.shared_experts[pos].weight
    router = block.routers[pos]
    gate_w = block.gates[pos].proj.weight  # (H, 32)
    B, T, H, d = v.shape
    out = []
    for b in range(B):
        for t in range(T):
            n = naive_row(cfg, block, tokens, b, t)
            gamma = 2 * torch.sigmoid(gate_w @ xn[b, t, :32])  # (H,)
            for i in range(H):
                if o.router_type == "conv1d":
                    logits = naive_conv_logits(block, pos, xn, v, b, t, i)
                elif o.router_input == "hidden":
                    W = router.weight.view(H, M, -1)[i]
                    logits = W @ xn[b, t] + router.bias.view(H, M)[i]
                else:
                    logits = router.weight @ v[b, t, i] + router.bias
                order = sorted(range(M), key=lambda a: -float(logits[a].detach()))
                active = order[:K]
                if K == 1:  # paper: softmax over all M for K = 1
                    probs = torch.softmax(logits, dim=0)
                    alpha = {a: probs[a] for a in active}
                else:  # sigmoid-norm over the selected slots
                    s = torch.sigmoid(logits)
                    denom = sum(s[a] for a in active) + 1e-10
                    alpha = {a: s[a] / denom for a in active}
                head_row = n * H + i if o.per_head_table else n  # the head's own row, or the row all heads share
                m = sum(alpha[a] * table[head_row * M + a] for a in active)
                if shared is not None:
                    m = m + shared[head_row]
                out.append(v[b, t, i] + gamma[i] * m)
    return torch.stack(out).view(B, T, H, d)


def naive_conv_logits(block, pos, xn, v, b, t, i):
    """--mome-router-type conv1d (reference notes §3.5): head i's M logits at (b, t) as the explicit causal sum
    bias + sum over s = t-k+1..t (s >= 0; earlier positions are the zero left-padding) of W[:, :, s - t + k - 1] h_s,
    W (out, in, k) as torch's Conv1d (tap j reads position t - (k - 1) + j). Hidden mode: h_s = norm(x)_s and head
    i's block of M output channels; value mode: h_s = v_s,i, every head the same d -> M kernel."""
    router, k, H, M = block.routers[pos], block.opts.conv_kernel_size, block.H, block.M
    W, bias = router.weight, router.bias
    if block.opts.router_input == "hidden":
        W, bias = W.view(H, M, -1, k)[i], bias.view(H, M)[i]
    logits = bias
    for s in range(max(0, t - k + 1), t + 1):
        h = xn[b, s] if block.opts.router_input == "hidden" else v[b, s, i]
        logits = logits + W[:, :, s - t + k - 1] @ h
    return logits


def _inputs(cfg, seed=1, B=2, T=5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    xn = torch.randn(B, T, cfg.n_embd, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, T, cfg.n_kv_head, cfg.head_dim, generator=g, dtype=torch.float64, requires_grad=True)
    return tokens, xn, v


def _grads(out, tensors, seed=3):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    grads = torch.autograd.grad((out * w).sum(), tensors, allow_unused=True)  # another layer's weights: None
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, tensors)]
    return [g.to_dense() if g.is_sparse else g for g in grads]  # the shared bigram table's grad is sparse


def _assert_block_equals_loop(cfg, block, layer):
    """Outputs and the gradients of every input and parameter of ``block.value`` at ``layer`` equal the loop's."""
    tokens, xn, v = _inputs(cfg)
    fast = block.value(layer, xn, v, block.prepare(tokens, None))
    slow = naive_value(cfg, block, layer, tokens, xn, v)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)
    params = [p for p in block.parameters() if p.requires_grad]
    g_fast = _grads(fast, [xn, v, *params])
    g_slow = _grads(slow, [xn, v, *params])
    for a, b in zip(g_fast, g_slow):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("index", ["token", "grouped", "bigram", "mod", "headmod"])
@pytest.mark.parametrize("M", [3, 6])
@pytest.mark.parametrize("K", [1, 2])
def test_fast_block_equals_paper_loop(tmp_path, index, M, K):
    cfg = _config(tmp_path, M, K, index)
    block = _block(cfg)
    _assert_block_equals_loop(cfg, block, block.layers[0])


@pytest.mark.parametrize("index", ["token", "grouped", "bigram", "mod", "headmod"])
@pytest.mark.parametrize("K", [2, 3])  # top-K and full routing (K == M: the row mix)
def test_shared_expert_equals_paper_loop(tmp_path, index, K):
    """--mome-shared-expert: the routed mix plus S[n_t] (the authors' "1_K_E"), at the SECOND memory layer, so a
    per-layer shared expert read from the wrong layer, or a network-shared one not shared, shows."""
    cfg = _config(tmp_path, 3, K, index, memory_layers=(0, 1), shared_expert=True)
    block = _block(cfg)
    _assert_block_equals_loop(cfg, block, 1)


@pytest.mark.parametrize("mix", ["bag", "plain", "row"])
def test_shared_expert_is_added_on_every_mix_path(tmp_path, monkeypatch, mix):
    from nanochat.memory import mome_mix as mix_paths

    monkeypatch.setattr(mix_paths, "MIX", mix)
    cfg = _config(tmp_path, 6, 2, "token", shared_expert=True)
    block = _block(cfg)
    _assert_block_equals_loop(cfg, block, block.layers[0])


@pytest.mark.parametrize("index", ["token", "grouped", "bigram", "mod", "headmod"])
@pytest.mark.parametrize("K", [2, 3])  # top-K and full routing (K == M: the row mix)
def test_per_head_tables_equal_paper_loop(tmp_path, index, K):
    """--mome-per-head-table with the shared expert: head i reads rows (n*H + i)*M + a and S[n*H + i], at the
    SECOND memory layer (a per-layer table read from the wrong layer, or a network-shared one not shared, shows)."""
    cfg = _config(tmp_path, 3, K, index, memory_layers=(0, 1), per_head_table=True, shared_expert=True)
    block = _block(cfg)
    _assert_block_equals_loop(cfg, block, 1)


@pytest.mark.parametrize("index", ["token", "bigram"])
@pytest.mark.parametrize("mix", ["bag", "plain", "row"])
def test_per_head_tables_on_every_mix_path(tmp_path, monkeypatch, index, mix):
    """Each mix forced (the per-layer token table and the network-shared bigram one), shared expert on."""
    from nanochat.memory import mome_mix as mix_paths

    monkeypatch.setattr(mix_paths, "MIX", mix)
    monkeypatch.setattr(mix_paths, "TOPK_BY_ARGMAX", mix == "plain")  # the CUDA selection too
    cfg = _config(tmp_path, 6, 2, index, per_head_table=True, shared_expert=True)
    block = _block(cfg)
    _assert_block_equals_loop(cfg, block, block.layers[0])


@pytest.mark.parametrize("K", [1, 2])
def test_value_router_equals_paper_loop(tmp_path, K):
    cfg = _config(tmp_path, 6, K, "token", router_input="value")
    block = _block(cfg)
    tokens, xn, v = _inputs(cfg)
    ctx = block.prepare(tokens, None)
    fast = block.value(1, xn, v, ctx)
    slow = naive_value(cfg, block, 1, tokens, xn, v)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)
    g_fast = _grads(fast, [xn, v, block.routers[0].weight])
    g_slow = _grads(slow, [xn, v, block.routers[0].weight])
    for a, b in zip(g_fast, g_slow):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_unselected_rows_get_exactly_zero_gradient(tmp_path):
    cfg = _config(tmp_path, 6, 2, "token")
    block = _block(cfg)
    block.capture = {}
    tokens, xn, v = _inputs(cfg, T=7)
    out = block.value(1, xn, v, block.prepare(tokens, None))
    out.square().sum().backward()
    grad = block.tables[0].weight.grad.view(-1, 6, cfg.head_dim)  # (N, M, d)
    touched = torch.zeros(grad.shape[:2], dtype=torch.bool)
    slots = block.capture[1]["slots"]  # (B, T, H, K)
    touched[tokens[..., None, None].expand_as(slots), slots] = True
    assert touched.sum() < touched.numel() // 4  # the test is meaningful: most rows are unselected
    assert (grad[~touched] == 0).all()
    assert (grad[touched].abs().sum(-1) > 0).all()


def test_full_routing_k_equals_m_mixes_all_slots(tmp_path):
    cfg = _config(tmp_path, 3, 3, "token")
    block = _block(cfg)
    tokens, xn, v = _inputs(cfg)
    fast = block.value(1, xn, v, block.prepare(tokens, None))
    # K == M with sigmoid-norm: weights are sigmoid(l) normalised over all M (the TopK set is everything)
    slow = naive_value(cfg, block, 1, tokens, xn, v)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("gate", ["softmax", "sigmoid", "softmax-norm"])
def test_gate_overrides(tmp_path, gate):
    cfg = _config(tmp_path, 6, 2, "token", gate=gate)
    block = _block(cfg)
    block.capture = {}
    tokens, xn, v = _inputs(cfg)
    block.value(1, xn, v, block.prepare(tokens, None))
    cap = block.capture[1]
    logits = block.routers[0](xn).view(*xn.shape[:2], HEADS, 6)
    p = torch.softmax(logits, -1) if gate.startswith("softmax") else torch.sigmoid(logits)
    expect = p.gather(-1, cap["slots"])
    if gate.endswith("-norm"):
        expect = expect / (expect.sum(-1, keepdim=True) + 1e-10)
    torch.testing.assert_close(cap["weights"], expect)
    assert cap["probs"].shape == (2, 5, HEADS, 6) and cap["gamma"].shape == (2, 5, HEADS)
    if gate == "softmax":  # not renormalised: the top-2 of 6 softmax weights sum to less than 1
        assert (cap["weights"].sum(-1) < 1).all()


def test_fixed_random_routing_equals_its_definition(tmp_path):
    """Appendix control: head i of token x reads the K consecutive slots (mod M) from a fixed pseudo-random
    offset, each with weight 1/K (no router). Loop written from that definition."""
    cfg = _config(tmp_path, 6, 2, "token", routing="fixed-random")
    block = _block(cfg)
    tokens, xn, v = _inputs(cfg)
    fast = block.value(1, xn, v, block.prepare(tokens, None))
    table, gate_w, (B, T, H, _) = block.tables[0].weight, block.gates[0].proj.weight, v.shape
    offsets = block.fixed_offset
    assert len({tuple(offsets[x].tolist()) for x in range(VOCAB)}) > 20  # of 36 (offset per head) pairs: they vary
    out = torch.empty_like(v)
    for b in range(B):
        for t in range(T):
            x = int(tokens[b, t])
            gamma = 2 * torch.sigmoid(gate_w @ xn[b, t, :32])
            for i in range(H):
                slots = [(int(offsets[x, i]) + j) % 6 for j in range(2)]
                out[b, t, i] = v[b, t, i] + gamma[i] * sum(table[x * 6 + a] for a in slots) / 2
    torch.testing.assert_close(fast, out, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("index", ["token", "bigram"])
def test_balance_bias_moves_the_selection_but_not_the_weights(tmp_path, index):
    """Loss-free balancing: TopK over p + b (b: router_bias of the (row, head)), weights from p alone."""
    cfg = _config(tmp_path, 6, 2, index, balance="bias")
    block = _block(cfg)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # large enough to overturn the router's choice for many (token, head) pairs
        block.router_bias.copy_(torch.rand(block.router_bias.shape, generator=g, dtype=torch.float64) * 0.6)
    block.capture = {}
    tokens, xn, v = _inputs(cfg, T=8)
    fast = block.value(1, xn, v, block.prepare(tokens, None))
    router, table = block.routers[0], block._table(0)
    gate_w, (B, T, H, _) = block.gates[0].proj.weight, v.shape
    out, moved = torch.empty_like(v), 0
    for b in range(B):
        for t in range(T):
            n = naive_row(cfg, block, tokens, b, t)
            gamma = 2 * torch.sigmoid(gate_w @ xn[b, t, :32])
            for i in range(H):
                p = torch.sigmoid(router.weight.view(H, 6, -1)[i] @ xn[b, t] + router.bias.view(H, 6)[i])
                scores = p + block.router_bias[0, n, i]
                active = sorted(range(6), key=lambda a: -float(scores[a].detach()))[:2]
                moved += set(active) != set(sorted(range(6), key=lambda a: -float(p[a].detach()))[:2])
                denom = sum(p[a] for a in active) + 1e-10
                out[b, t, i] = v[b, t, i] + gamma[i] * sum(p[a] / denom * table[n * 6 + a] for a in active)
    assert moved >= B * T * H // 4  # the bias really changes which slots are read
    torch.testing.assert_close(fast, out, rtol=1e-10, atol=1e-10)
