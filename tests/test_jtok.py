"""JTok / JTok-M (spec appendix_adaptations.md §4.4): naive per-token references of the equations, invariances,
the auxiliary balance loss by hand, exact d24 totals, cached decoding, and tiny training runs."""

import argparse
import json
import math

import pytest
import torch

from conftest import tiny_config
from nanochat.checkpoint import load_model
from nanochat.engine import generate, generate_uncached
from nanochat.gpt import GPTConfig, build_model, model_summary
from nanochat.kv_cache import KVCache
from nanochat.memory import add_memory_args, memory_config_from_args
from nanochat.memory.jtok import JTokMMemory, JTokMOptions, JTokOptions
from nanochat.optim import build_optimizer, build_param_groups, OptimConfig

V, C = 512, 128
BASE_D24 = 780_140_592


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _model(memory, n_layer=4, **opts):
    """A tiny model whose zero-initialised parts (residual projections) are made non-trivial and whose scales s
    are random, so every equation is exercised."""
    model = build_model(tiny_config(memory=memory, memory_options=opts, n_layer=n_layer), seed=0)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(std=0.05, generator=_gen(1))
            block.mlp.c_proj.weight.normal_(std=0.05, generator=_gen(2))
        model.memory.scales.normal_(std=1.0, generator=_gen(3))
    return model


def _tokens(B=2, T=12, seed=0):
    return torch.randint(0, V, (B, T), generator=_gen(seed))


# -- naive per-token references (float64, Python loops over tokens) -----------------------------------------
def jtok_reference(block, layer, idx, delta):
    pos, eps = block.layer_pos[layer], block.opts.eps
    E, s = block.tables[pos].weight.double(), block.scales[pos].double()
    out = torch.empty(delta.shape, dtype=torch.float64)
    for b in range(idx.size(0)):
        for t in range(idx.size(1)):
            row = E[int(idx[b, t])]
            out[b, t] = delta[b, t].double() * (1 + s * row / (row.norm() + eps))
    return out


def jtokm_reference(block, layer, idx, h, delta):
    """-> (output, balance term n_e * sum_i f_i P_i) of one layer, token by token."""
    pos, eps, n_e, K = block.layer_pos[layer], block.opts.eps, block.n_experts, block.K
    E = block.tables[pos].weight.double().view(-1, n_e, C)  # (V, n_e, C): table i of the pool = E[:, i]
    R, s = block.routers[pos].weight.double(), block.scales[pos].double()
    N_l = block.n_layer
    out = torch.empty(delta.shape, dtype=torch.float64)
    counts, prob_sum, n_tok = [0] * n_e, [0.0] * n_e, 0
    for b in range(idx.size(0)):
        for t in range(idx.size(1)):
            hn = h[b, t].double() / torch.sqrt(h[b, t].double().square().mean() + torch.finfo(torch.float32).eps)
            logits = [float(R[i].detach() @ hn.detach()) for i in range(n_e)]
            chosen = sorted(range(n_e), key=lambda i: -logits[i])[:K]
            sig = [1 / (1 + math.exp(-g)) for g in logits]
            e = sum(sig[i] / sum(sig[j] for j in chosen) * E[int(idx[b, t]), i] for i in chosen)
            out[b, t] = delta[b, t].double() + s * e / (e.norm() + eps) / math.sqrt(2 * N_l)
            for i in chosen:
                counts[i] += 1
            for i in range(n_e):
                prob_sum[i] += sig[i] / sum(sig)
            n_tok += 1
    balance = n_e * sum(counts[i] / (n_tok * K) * prob_sum[i] / n_tok for i in range(n_e))
    return out, balance


def _random_inputs(B=2, T=12, seed=0):
    g = _gen(seed)
    return _tokens(B, T, seed), torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)


def test_jtok_matches_per_token_reference():
    block = _model("jtok").memory
    idx, _, delta = _random_inputs()
    for layer in block.layers:
        out = block.mlp_out(layer, None, delta, block.prepare(idx, None))
        torch.testing.assert_close(out.double(), jtok_reference(block, layer, idx, delta), rtol=1e-5, atol=1e-6)


def test_jtokm_matches_per_token_reference():
    block = _model("jtokm").memory
    assert block.layers == (1, 2, 3) and (block.n_experts, block.K) == (4, 2)
    idx, h, delta = _random_inputs()
    block.train()
    for layer in block.layers:
        ctx = block.prepare(idx, None)
        out = block.mlp_out(layer, h, delta, ctx)
        ref, balance = jtokm_reference(block, layer, idx, h, delta)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(block.aux_loss(ctx).double(), torch.tensor(1e-4 * balance, dtype=torch.float64))


@pytest.mark.parametrize("memory", ["jtok", "jtokm"])
def test_whole_model_against_reference_non_memory_layers_untouched(memory):
    """Hooks capture each block's input h, attention output a, FFN increment delta and output: a non-memory
    layer gives exactly h + a + delta; a memory layer (h + a) + the reference's delta'. JTok-M's aux loss is
    lambda times the sum of the layers' reference balance terms."""
    model = _model(memory)
    model.train()
    seen = {}
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, args, out, i=i: seen.setdefault(i, {}).update(h=args[0], out=out))
        block.attn.register_forward_hook(lambda m, args, out, i=i: seen.setdefault(i, {}).update(a=out))
        block.mlp.register_forward_hook(lambda m, args, out, i=i: seen.setdefault(i, {}).update(delta=out))
    idx = _tokens()
    _, aux = model(idx, targets=idx, return_aux=True)
    block, balance = model.memory, 0.0
    for i, s in seen.items():
        x = s["h"] + s["a"]
        if i not in block.layers:
            assert torch.equal(s["out"], x + s["delta"]), i
            continue
        if memory == "jtok":
            ref = x.double() + jtok_reference(block, i, idx, s["delta"])
        else:
            d, term = jtokm_reference(block, i, idx, s["h"], s["delta"])
            ref, balance = x.double() + d, balance + term
        torch.testing.assert_close(s["out"].double(), ref, rtol=1e-5, atol=1e-5)
    assert set(seen) == set(range(4)) and len(block.layers) < 4
    if memory == "jtokm":
        torch.testing.assert_close(aux.double(), torch.tensor(1e-4 * balance, dtype=torch.float64))
    else:
        assert aux.item() == 0.0


@pytest.mark.parametrize("memory", ["jtok", "jtokm"])
def test_row_rescaling_invariance(memory):
    block = _model(memory).memory
    idx, h, delta = _random_inputs()
    layer = block.layers[0]
    before = block.mlp_out(layer, h, delta, block.prepare(idx, None))
    table_before = block.tables[0].weight.detach().clone()
    # every token's row(s) scaled by its own c > 0 (JTok-M: one c per token across its pool, and
    # Norm(sum_i w_i c E_i) = Norm(sum_i w_i E_i))
    c = (torch.rand(V, 1, generator=_gen(5)) * 10 + 0.1).repeat_interleave(block.pool_size(), dim=0)
    with torch.no_grad():
        for table in block.tables:
            table.weight.mul_(c)
    after = block.mlp_out(layer, h, delta, block.prepare(idx, None))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    assert (block.tables[0].weight - table_before).abs().max() > 0.01  # the rows really changed


@pytest.mark.parametrize("memory", ["jtok", "jtokm"])
@pytest.mark.parametrize("family", ["nanochat", "mobilellm"])
def test_zero_scales_give_exactly_base(memory, family):
    from nanochat.families import FAMILIES

    cls = FAMILIES[family].config_cls
    extra = {} if family == "nanochat" else {"ffn_hidden": 64}
    base = build_model(cls(**tiny_config(n_layer=4).to_dict() | extra), seed=0)
    mem = build_model(cls(**tiny_config(n_layer=4, memory=memory).to_dict() | extra), seed=0)
    with torch.no_grad():
        for b1, b2 in zip(base.blocks, mem.blocks):  # non-zero FFN outputs, identical in both models
            for p1, p2 in zip(b1.parameters(), b2.parameters()):
                p1.normal_(std=0.05, generator=_gen(7))
                p2.copy_(p1)
        mem.memory.scales.zero_()
    shared = base.state_dict()
    for k, v in mem.state_dict().items():
        if not k.startswith("memory."):
            assert torch.equal(v, shared[k]), k
    idx = _tokens()
    assert torch.equal(mem(idx), base(idx))
    with torch.no_grad():
        mem.memory.scales.fill_(1.0)
    assert not torch.equal(mem(idx), base(idx))


def test_jtokm_balance_loss_by_hand():
    block = _model("jtokm").memory
    block.train()
    layer, n_e = block.layers[0], 4
    W = block.routers[block.layer_pos[layer]].weight

    def aux_for(logit_rows):
        """Tokens t whose normed input is sqrt(C) e_t, so their logits are sqrt(C) W[:, t] = logit_rows[t]."""
        T = len(logit_rows)
        with torch.no_grad():
            W.zero_()
            W[:, :T] = torch.tensor(logit_rows, dtype=torch.float32).T / math.sqrt(C)
        h = torch.eye(C)[:T][None] * 3.0  # (1, T, C): RMSNorm(3 e_t) = sqrt(C) e_t
        ctx = block.prepare(_tokens(1, T), None)
        block.mlp_out(layer, h, torch.zeros(1, T, C), ctx)
        return block.aux_loss(ctx).item()

    # uniform routing: every expert picked equally often (f_i = 1/4) and mean probabilities equal (P_i = 1/4)
    rows = [[2.0, 1.0, -1.0, -3.0][-k:] + [2.0, 1.0, -1.0, -3.0][:-k] for k in range(4)]
    assert aux_for(rows) == pytest.approx(1e-4, rel=1e-5)
    # skewed: token 0 picks {0, 1}, token 1 picks {1, 3} -> f = (1/4, 1/2, 0, 1/4)
    rows = [[3.0, 1.0, 0.0, -2.0], [0.0, 2.0, -1.0, 1.0]]
    sig = [[1 / (1 + math.exp(-g)) for g in r] for r in rows]
    P = [sum(s[i] / sum(s) for s in sig) / 2 for i in range(n_e)]
    f = [1 / 4, 1 / 2, 0, 1 / 4]
    assert aux_for(rows) == pytest.approx(1e-4 * n_e * sum(fi * pi for fi, pi in zip(f, P)), rel=1e-5)
    assert aux_for(rows) > 1e-4  # imbalance costs more than uniform routing
    block.eval()
    ctx = block.prepare(_tokens(1, 2), None)
    block.mlp_out(layer, torch.randn(1, 2, C), torch.zeros(1, 2, C), ctx)
    assert block.aux_loss(ctx) is None  # evaluation forwards build no auxiliary loss


def test_k_equals_n_e_is_the_dense_sigmoid_mixture():
    block = _model("jtokm", topk=4).memory
    idx, h, delta = _random_inputs()
    layer = block.layers[1]
    pos = block.layer_pos[layer]
    out = block.mlp_out(layer, h, delta, block.prepare(idx, None))
    logits = block.routers[pos](torch.nn.functional.rms_norm(h, (C,)))
    w = torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True)  # (B, T, n_e)
    pools = block.tables[pos].weight.view(-1, 4, C)[idx]  # (B, T, n_e, C)
    e = torch.einsum("bti,btic->btc", w, pools)
    dense = delta + block.scales[pos] * e / (e.norm(dim=-1, keepdim=True) + 1e-6) / math.sqrt(2 * 4)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-6)


def test_router_tables_and_scales_get_gradient():
    model = _model("jtokm")
    model.train()
    idx = _tokens()
    loss, aux = model(idx, targets=idx, return_aux=True)
    loss.backward()  # LM loss alone: the router learns through the mixture weights (K = 2)
    mem = model.memory
    for router in mem.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    for table in mem.tables:
        assert table.weight.grad.abs().sum() > 0
    assert (mem.scales.grad.abs().sum(dim=-1) > 0).all()
    model.zero_grad(set_to_none=True)
    _, aux = model(idx, targets=idx, return_aux=True)
    aux.backward()  # the balance loss alone: every router, and earlier layers' tables through the hidden state
    assert all(r.weight.grad.abs().sum() > 0 for r in mem.routers)
    assert mem.tables[0].weight.grad.abs().sum() > 0
    last = mem.tables[-1].weight.grad  # read after the last router: no path to any balance term
    assert last is None or last.abs().sum() == 0


def test_jtok_tables_and_scales_get_gradient():
    model = _model("jtok")
    idx = _tokens()
    model(idx, targets=idx).backward()
    assert all(t.weight.grad.abs().sum() > 0 for t in model.memory.tables)
    assert (model.memory.scales.grad.abs().sum(dim=-1) > 0).all()


# -- options, layers, parameter accounting -----------------------------------------------------------------
def test_options_errors_name_the_flag():
    with pytest.raises(ValueError, match="--jtokm-topk 1.*no gradient"):
        JTokMOptions(topk=1)
    with pytest.raises(ValueError, match="--jtokm-topk 5 exceeds --jtokm-experts 4"):
        JTokMOptions(topk=5)
    with pytest.raises(ValueError, match="--jtokm-aux-weight"):
        JTokMOptions(aux_weight=-1.0)
    with pytest.raises(ValueError, match="--jtok-eps"):
        JTokOptions(eps=0.0)
    parser = argparse.ArgumentParser()
    add_memory_args(parser)
    with pytest.raises(ValueError, match="--jtokm-topk 1"):
        memory_config_from_args(parser.parse_args(["--memory", "jtokm", "--jtokm-topk", "1"]))
    with pytest.raises(ValueError, match="--jtok-eps only applies to --memory jtok"):
        memory_config_from_args(parser.parse_args(["--memory", "jtokm", "--jtok-eps", "1e-5"]))
    cfg = memory_config_from_args(parser.parse_args(["--memory", "jtokm", "--jtokm-experts", "6"]))
    assert cfg["memory_options"] == {"experts": 6, "topk": 2, "aux_weight": 1e-4, "eps": 1e-6}


def test_default_layers():
    assert JTokMMemory.default_layers(24) == (7, 15, 23)
    assert JTokMMemory.default_layers(12) == (3, 7, 11)
    assert JTokMMemory.default_layers(4) == (1, 2, 3)
    assert JTokMMemory.default_layers(2) == (0, 1)
    assert JTokMMemory.default_layers(1) == (0,)
    assert build_model(tiny_config(memory="jtok", n_layer=4), seed=0).memory.layers == (1, 3)


def test_d24_parameter_totals_on_meta():
    V24, C24 = 32768, 1536
    base = model_summary(GPTConfig.from_depth(24))
    jtok = model_summary(GPTConfig.from_depth(24, memory="jtok"))
    jtokm = model_summary(GPTConfig.from_depth(24, memory="jtokm"))
    assert base["params_total"] == BASE_D24
    assert jtok["params_total"] == 1_384_138_800 == BASE_D24 + 12 * (V24 * C24 + C24)
    assert jtokm["params_total"] == 1_384_143_408 == BASE_D24 + 3 * (4 * V24 * C24 + 4 * C24 + C24)
    assert jtok["params_memory"] == jtokm["params_memory"] == 12 * V24 * C24
    # tables and s are excluded from FLOPs; JTok-M's routers (3 x C x 4) are counted
    assert jtok["flops_per_token"] == base["flops_per_token"]
    assert jtokm["flops_per_token"] == base["flops_per_token"] + 6 * 3 * 4 * C24


def test_optimizer_groups():
    for memory in ("jtok", "jtokm"):
        model = build_model(tiny_config(memory=memory, n_layer=4), seed=0)
        groups = {g["name"]: g for g in build_param_groups(model, OptimConfig())}
        ids = lambda g: {id(p) for p in g["params"]}  # noqa: E731
        assert ids(groups["memory_tables"]) == {id(t.weight) for t in model.memory.tables}
        assert groups["memory_tables"]["weight_decay"] == 0.001
        assert id(model.memory.scales) in ids(groups["x0_lambdas"])
        if memory == "jtokm":
            muon = set().union(*(ids(g) for g in groups.values() if g["kind"] == "muon"))
            assert {id(r.weight) for r in model.memory.routers} <= muon


def test_init_values():
    mem = build_model(tiny_config(memory="jtokm", n_layer=4), seed=0).memory
    assert torch.equal(mem.scales, torch.ones_like(mem.scales))
    bound = math.sqrt(3 / C)
    for p in [*(t.weight for t in mem.tables), *(r.weight for r in mem.routers)]:
        assert p.abs().max() <= bound and p.abs().max() > 0.9 * bound and p.std() > 0.5 * bound / math.sqrt(3)


# -- decoding: no state, but the cache path must equal the full forward --------------------------------------
@pytest.mark.parametrize("memory", ["jtok", "jtokm"])
def test_cached_decoding_equals_full_forward(memory):
    model = _model(memory)
    model.eval()
    idx = _tokens(B=2, T=10)
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.for_model(model, batch_size=2, max_len=10)
        steps = [model(idx[:, :6], kv_cache=cache)] + [model(idx[:, t : t + 1], kv_cache=cache) for t in range(6, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.memory_state == {}
    prompt = idx[0, :7].tolist()
    assert generate(model, prompt, max_tokens=8, temperature=0.0)[0] == generate_uncached(model, prompt, 8)


# -- training ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("memory,opts", [("jtok", {}), ("jtokm", {}), ("jtokm", {"experts": 3, "topk": 3})])
def test_tiny_model_trains(memory, opts):
    from nanochat.train_loop import train_step

    model = build_model(tiny_config(memory=memory, memory_options=opts, n_layer=2), seed=0)
    opt = build_optimizer(model)
    data = torch.randint(0, V, (4, 33), generator=_gen(1))
    batches = iter([(data[:, :-1], data[:, 1:])] * 8)
    table, router = model.memory.tables[0].weight, getattr(model.memory, "routers", [None])[0]
    before = [p.detach().clone() for p in (table, model.memory.scales, router and router.weight) if p is not None]
    losses, auxes = [], []
    for _ in range(8):
        loss, _, _, aux = train_step(model, opt, batches, 1, torch.autocast("cpu", enabled=False), "cpu")
        losses.append(loss)
        auxes.append(aux)
    assert losses[-1] < losses[0] - 0.05, losses
    after = [p for p in (table, model.memory.scales, router and router.weight) if p is not None]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))
    assert all(a > 0 for a in auxes) if memory == "jtokm" else all(a == 0 for a in auxes)
    stats = model.memory.stats()
    assert all(math.isfinite(v) for v in stats.values()) and "memory/s_rms/layer1" in stats
    if memory == "jtokm":
        n_e = opts.get("experts", 4)
        for layer in model.memory.layers:
            loads = [stats[f"memory/expert_load/layer{layer}/expert{i}"] for i in range(n_e)]
            assert sum(loads) == pytest.approx(1.0) and stats[f"memory/maxvio/layer{layer}"] >= 0
        assert model.memory.load_counts.sum() == 0  # reset by stats()


def test_base_train_logs_aux_loss(tmp_path):
    from scripts import base_train

    run = tmp_path / "r"
    argv = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
            "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core",
            "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "4", "--run-dir", str(run),
            "--memory", "jtokm", "--jtokm-experts", "3"]
    assert base_train.main(argv) == 0
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert len(train) == 4 and all(r["aux_loss"] > 0 for r in train)
    assert all(r["aux_loss"] < 1e-4 * 3 * 2 for r in train)  # <= lambda n_e per layer, 2 layers at depth 2
    assert {"memory/maxvio/layer0", "memory/expert_load/layer1/expert2", "memory/s_rms/layer0"} <= set(train[-1])
    model, meta = load_model(run)  # the checkpoint rebuilds the block from its meta
    assert meta["model_config"]["memory_options"]["experts"] == 3 and model.memory.n_experts == 3
    assert model.memory.layers == (0, 1) and not torch.equal(model.memory.scales, torch.ones_like(model.memory.scales))


@pytest.mark.slow  # ~90 s of compilation on 2 CPU cores
def test_compiles_fullgraph_in_training_mode():
    for memory in ("jtok", "jtokm"):
        model = build_model(tiny_config(memory=memory, n_layer=2), seed=0)
        model.train()
        compiled = torch.compile(model, fullgraph=True, dynamic=False)  # no graph breaks, no host syncs
        data = _tokens(B=2, T=17)
        loss, aux = compiled(data[:, :-1], data[:, 1:], return_aux=True)
        (loss + aux).backward()
        ref = build_model(tiny_config(memory=memory, n_layer=2), seed=0)
        ref.train()
        ref_loss, ref_aux = ref(data[:, :-1], data[:, 1:], return_aux=True)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(aux, ref_aux, rtol=1e-4, atol=1e-7)
        assert model.memory.tables[0].weight.grad is not None
        if memory == "jtokm":
            assert aux.item() > 0 and model.memory.routers[0].weight.grad.abs().sum() > 0
            assert model.memory.load_counts.sum() == 2 * 2 * 16 * 2  # layers x tokens x K, in-graph, once
