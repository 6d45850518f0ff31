"""VE / Bigram / MoME: parameter accounting, init equivalence, hashing, KV-cache decoding, flag errors."""

import argparse

import pytest
import torch

from conftest import tiny_config
from nanochat.gpt import GPT, GPTConfig, build_model, model_summary
from nanochat.kv_cache import KVCache
from nanochat.memory import add_memory_args, memory_config_from_args
from nanochat.memory.hashing import bigram_hash
from nanochat.memory.mome import MoMEOptions

D12_BASE = 135_266_328


def d12(memory, **opts):
    return model_summary(GPTConfig.from_depth(12, memory=memory, memory_options=opts))


# -- parameter accounting (paper Table 1 / compound-scaling table, reference notes §1.8) -------------------
def test_d12_table1_numbers():
    assert d12("base")["params_total"] == D12_BASE
    ve, bg, mome = d12("ve"), d12("bigram"), d12("mome")
    assert (ve["params_memory"], ve["params_total"]) == (150_994_944, 286_262_424)
    # 1,152 gate params + 12 lambdas (one per layer, as in the reference)
    assert (bg["params_memory"], bg["params_total"]) == (150_994_944, 286_262_436)
    assert (mome["params_memory"], mome["params_total"]) == (150_994_944, 286_428_528)
    assert mome["flops_per_token"] == 888_098_832
    assert ve["flops_per_token"] == bg["flops_per_token"] == 887_102_208  # gates counted, tables/lambdas not


def test_d12_302m_rows_and_compound_rows():
    assert d12("mome", slots=12)["params_memory"] == 301_989_888  # c1 A2/12
    assert d12("mome", slots=12)["flops_per_token"] == 889_095_456
    # compound scaling: one shared table of n*V*M*128 params
    for n, M, mem_m in [(6, 6, 151), (12, 6, 302), (6, 12, 302), (12, 12, 604), (24, 6, 604), (6, 24, 604)]:
        s = d12("mome", index="bigram", bigram_factor=n, slots=M)
        assert s["params_memory"] == n * 32768 * M * 128
        assert round(s["params_memory"] / 1e6) == mem_m
    assert round(d12("mome", index="bigram", bigram_factor=6, slots=12)["params_total"] / 1e5) / 10 == 437.6


def test_d12_grouped_rows(tmp_path):
    from nanochat.memory.slot_map import write_slot_map

    for c, M, mem, total in [(2, 12, 150_994_944, 286_594_632), (2, 24, 301_989_888, None), (4, 48, 301_989_888, None)]:
        path = tmp_path / f"c{c}.json"
        write_slot_map(path, [list(range(i, i + c)) for i in range(0, 32768, c)], 32768, c)
        s = d12("mome", index="grouped", group_size=c, slots=M, slot_map=str(path))
        assert s["params_memory"] == mem
        if total:
            assert s["params_total"] == total


def test_routing_controls_declared_counts():
    hidden, tok, rnd = d12("mome"), d12("mome", routing="token-only"), d12("mome", routing="fixed-random")
    ve = d12("ve")
    assert rnd["params_total"] == ve["params_total"]  # no router at all
    assert tok["params_total"] == ve["params_total"] + 32768 * 6 * 6  # one V x H*M logit table
    assert hidden["params_total"] == ve["params_total"] + 6 * (768 * 36 + 36)
    d24 = lambda **o: model_summary(GPTConfig.from_depth(24, memory="mome", memory_options=dict(slots=12, **o)))
    # paper appendix "Context-Conditioned Routing" (d24, A2/12): 1,386.8M / 1,388.8M / 1,384.1M
    assert [round(d24(routing=r)["params_total"] / 1e5) for r in ("context", "token-only", "fixed-random")] == \
        [13868, 13888, 13841]


def test_ve_table_footprint_equals_mome_m_equals_h():
    cfg = dict(vocab_size=512, n_layer=4, n_head=4, n_kv_head=4, n_embd=128)
    ve = model_summary(tiny_config(memory="ve", **cfg))["params_memory"]
    mome = model_summary(tiny_config(memory="mome", memory_options=dict(slots=4), **cfg))["params_memory"]
    assert ve == mome == 2 * 512 * 128


def test_shared_bigram_tables_are_one_tensor():
    m = build_model(tiny_config(memory="bigram", n_layer=4), seed=0)
    assert len(m.memory.memory_tables()) == 1 and m.memory.layers == (1, 3)
    m = build_model(tiny_config(memory="mome", n_layer=4, memory_options=dict(index="bigram", bigram_factor=2)))
    tables = m.memory.memory_tables()
    assert len(tables) == 1 and tables[0].shape == (2 * 512 * 6, 64)
    assert len(m.memory.routers) == len(m.memory.gates) == 2  # per-layer routers and gates


def test_optimizer_groups():
    from nanochat.optim import OptimConfig, build_param_groups

    m = build_model(tiny_config(memory="mome"), seed=0)
    groups = {g["name"]: g for g in build_param_groups(m, OptimConfig())}
    assert groups["memory_tables"]["params"][0] is m.memory.tables[0].weight
    assert groups["memory_tables"]["weight_decay"] == 0.001
    assert any(p is m.memory.routers[0].bias for p in groups["adam_extra"]["params"])
    b = build_model(tiny_config(memory="bigram"), seed=0)
    groups = {g["name"]: g for g in build_param_groups(b, OptimConfig())}
    assert groups["memory_tables"]["weight_decay"] == 0.0
    assert any(p is b.memory.lambdas for p in groups["x0_lambdas"]["params"])


# -- behaviour ------------------------------------------------------------------------------------------
def test_bigram_at_init_equals_base_exactly():
    idx = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    base = build_model(tiny_config(), seed=7)
    bigram = build_model(tiny_config(memory="bigram"), seed=7)
    assert torch.equal(base(idx), bigram(idx))


def test_bigram_hash_definition():
    idx = torch.tensor([[5, 7, 9], [1, 2, 3]])
    h = bigram_hash(idx, 100)
    assert h[:, 0].tolist() == [99, 99]
    assert int(h[0, 1]) == ((36313 * 7) ^ (27191 * 5)) % 99
    h2 = bigram_hash(idx, 100, prev=torch.tensor([4, 0]))
    assert int(h2[0, 0]) == ((36313 * 5) ^ (27191 * 4)) % 99
    assert torch.equal(h2[:, 1:], h[:, 1:])
    big = torch.full((1, 2), 2**31 - 1)  # int64 arithmetic: no overflow for large ids
    assert int(bigram_hash(big, 7)[0, 1]) == ((36313 * (2**31 - 1)) ^ (27191 * (2**31 - 1))) % 6


def _perturb(model):
    with torch.no_grad():  # non-trivial tables, routers and gates, so every path matters
        g = torch.Generator().manual_seed(1)
        for p in model.memory.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("memory,opts", [("bigram", {}), ("mome", {}), ("mome", {"index": "bigram", "bigram_factor": 2}),
                                         ("mome", {"index": "headmod", "rows": 100, "dedicated_size": 30}),
                                         ("ve", {}), ("mome", {"routing": "fixed-random"}),
                                         ("mome", {"routing": "token-only"}), ("mome", {"topk": 1, "router_input": "value"}),
                                         ("mome", {"topk": 6}), ("mome", {"shared_expert": True}),
                                         ("mome", {"index": "bigram", "bigram_factor": 2, "shared_expert": True}),
                                         ("mome", {"per_head_table": True, "shared_expert": True, "balance": "bias"}),
                                         ("mome", {"index": "bigram", "bigram_factor": 2, "per_head_table": True})])
def test_kv_decoding_equals_full_forward(memory, opts):
    model = build_model(tiny_config(memory=memory, memory_options=opts), seed=0).eval()
    _perturb(model)
    idx = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    full = model(idx)
    cache = KVCache.for_model(model, batch_size=2, max_len=12)
    parts = [model(idx[:, :5], kv_cache=cache), model(idx[:, 5:8], kv_cache=cache)]  # chunked prefill
    parts += [model(idx[:, t : t + 1], kv_cache=cache) for t in range(8, 12)]  # token-by-token decode
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_capture_records_routing_tensors():
    model = build_model(tiny_config(memory="mome", n_layer=4), seed=0)
    model.memory.capture = {}
    model(torch.randint(0, 512, (2, 8)))
    assert sorted(model.memory.capture) == [1, 3]
    cap = model.memory.capture[3]
    assert cap["slots"].shape == cap["weights"].shape == (2, 8, 2, 2)
    assert cap["probs"].shape == (2, 8, 2, 6) and cap["gamma"].shape == cap["inject_norm"].shape == (2, 8, 2)
    assert not cap["weights"].requires_grad


def test_mome_stats_and_balance_update():
    model = build_model(tiny_config(memory="mome", memory_options=dict(balance="bias", balance_lr=0.01)), seed=0)
    _perturb(model)
    model(torch.randint(0, 512, (2, 16)))
    mem = model.memory
    counts = mem.balance_counts.clone()
    assert counts.sum() == 2 * 16 * 2 * 2  # B*T*H*K assignments
    mem.update_balance()
    visited = counts.sum(-1) > 0
    expect = 0.01 * torch.sign(counts.sum(-1, keepdim=True) / 6 - counts) * visited[..., None]
    assert torch.equal(mem.router_bias, expect) and mem.balance_counts.sum() == 0
    assert "memory.router_bias" in model.state_dict()  # persistent: saved in checkpoints
    s = mem.stats()
    assert 0 < s["memory/load_entropy/layer1"] <= 1 and s["memory/maxvio/layer1"] >= 0
    assert s["memory/gamma_mean/layer1"] > 0


def test_mome_load_counts_equal_a_naive_count_of_the_selected_slots():
    model = build_model(tiny_config(memory="mome", memory_options=dict(slots=6, topk=2)), seed=0)
    _perturb(model)
    mem = model.memory
    mem.capture = {}
    model(torch.randint(0, 512, (3, 16), generator=torch.Generator().manual_seed(0)))
    for layer, pos in mem.layer_pos.items():
        sel = mem.capture[layer]["slots"]  # (B, T, H, K)
        naive = torch.zeros(mem.H, mem.M)
        for b, t, h, k in torch.cartesian_prod(*(torch.arange(n) for n in sel.shape)).tolist():
            naive[h, sel[b, t, h, k]] += 1
        assert torch.equal(mem.load_counts[pos], naive), layer
    # the logged statistics from those counts: per layer, the load of each slot summed over heads
    s = mem.stats()
    for layer, pos in mem.layer_pos.items():
        load = mem.capture[layer]["slots"].flatten().bincount(minlength=mem.M).double()  # (M,)
        mean = load.sum() / mem.M
        frac = load / load.sum()
        entropy = -(frac * frac.clamp_min(1e-30).log()).sum() / torch.log(torch.tensor(6.0, dtype=torch.float64))
        assert s[f"memory/maxvio/layer{layer}"] == pytest.approx(float((load.max() - mean) / mean), rel=1e-6)
        assert s[f"memory/load_entropy/layer{layer}"] == pytest.approx(float(entropy), rel=1e-6)


# -- bad input --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag,option", [("--mome-shared-expert", "shared_expert"),
                                         ("--mome-per-head-table", "per_head_table")])
def test_mome_switches_on_the_cli(flag, option):
    """The authors' optional MoME parts are store_true switches, off by default, refused where they do not apply."""
    p = argparse.ArgumentParser()
    add_memory_args(p)
    assert memory_config_from_args(p.parse_args(["--memory", "mome", flag]))["memory_options"][option] is True
    assert memory_config_from_args(p.parse_args(["--memory", "mome"]))["memory_options"][option] is False
    with pytest.raises(ValueError, match=f"{flag} only applies to --memory mome"):
        memory_config_from_args(p.parse_args(["--memory", "ve", flag]))
    with pytest.raises(ValueError, match=f"{flag} only applies to --mome-routing context"):
        memory_config_from_args(p.parse_args(["--memory", "mome", "--mome-routing", "fixed-random", flag]))


@pytest.mark.parametrize("opts,flag", [
    (dict(slots=3, topk=4), "--mome-topk"),
    (dict(index="grouped", group_size=4, slots=6, slot_map="x.json"), "--mome-slots"),
    (dict(index="hash"), "--mome-index"),
    (dict(index="bigram", bigram_factor=0), "--mome-bigram-factor"),
    (dict(gate="relu"), "--mome-gate"),
    (dict(routing="random"), "--mome-routing"),
    (dict(index="grouped", group_size=2, slots=6), "--mome-slot-map"),
    (dict(group_size=2), "--mome-group-size"),
    (dict(bigram_factor=12), "--mome-bigram-factor"),
    (dict(shared_expert=True, routing="token-only"), "--mome-shared-expert"),
    (dict(shared_expert=True, routing="fixed-random"), "--mome-shared-expert"),
    (dict(shared_expert=1), "--mome-shared-expert"),
    (dict(per_head_table=True, routing="token-only"), "--mome-per-head-table"),
    (dict(per_head_table=True, routing="fixed-random"), "--mome-per-head-table"),
    (dict(per_head_table="yes"), "--mome-per-head-table"),
])
def test_mome_option_errors_name_the_flag(opts, flag):
    with pytest.raises(ValueError, match=flag):
        MoMEOptions(**opts)


def test_errors_through_the_model_config(tmp_path):
    with pytest.raises(ValueError, match="--bigram-factor"):
        model_summary(tiny_config(memory="bigram", memory_options=dict(factor=0)))
    with pytest.raises(ValueError, match="--memory-layers"):
        model_summary(tiny_config(memory="ve", memory_layers=(1, 2)))
    with pytest.raises(ValueError, match="--memory 'nope' is unknown"):
        model_summary(tiny_config(memory="nope"))
    with pytest.raises(ValueError, match="unknown option"):
        model_summary(tiny_config(memory="ve", memory_options=dict(slots=3)))


def _args(*argv):
    p = argparse.ArgumentParser()
    add_memory_args(p)
    return p.parse_args(list(argv))


def test_cli_helpers():
    cfg = memory_config_from_args(_args("--memory", "mome", "--mome-slots", "12", "--memory-layers", "1,3"))
    assert cfg["memory"] == "mome" and cfg["memory_layers"] == [1, 3] and cfg["memory_options"]["slots"] == 12
    assert model_summary(tiny_config(n_layer=4, **cfg))["params_memory"] == 2 * 512 * 12 * 64
    assert memory_config_from_args(_args()) == {"memory": "base", "memory_layers": [], "memory_options": {}}
    assert memory_config_from_args(_args("--memory", "bigram", "--bigram-factor", "3"))["memory_options"] == {"factor": 3}
    with pytest.raises(ValueError, match="--mome-topk only applies to --memory mome"):
        memory_config_from_args(_args("--memory", "ve", "--mome-topk", "1"))
    with pytest.raises(ValueError, match="--bigram-factor only applies"):
        memory_config_from_args(_args("--memory", "mome", "--bigram-factor", "2"))
    with pytest.raises(ValueError, match="--mome-topk"):
        memory_config_from_args(_args("--memory", "mome", "--mome-topk", "7"))
    with pytest.raises(ValueError, match="--memory-layers"):
        memory_config_from_args(_args("--memory", "mome", "--memory-layers", "1,x"))
    with pytest.raises(ValueError, match="--mome-slot-map"):
        memory_config_from_args(_args("--memory", "mome", "--mome-index", "grouped", "--mome-slot-map", "/no/such"))
    with pytest.raises(SystemExit):
        _args("--mome-index", "hash")


def test_mome_balance_lr_without_bias_balancing_is_refused():
    """--mome-balance-lr steers only the bias of --mome-balance bias; with the default --mome-balance none it would
    change nothing, so it is an error naming both flags (the reference's 125M configs carry such an inert
    balance LR; families spec §11.12: a clean config rejects keys that have no effect)."""
    with pytest.raises(ValueError, match="--mome-balance-lr 0.01 only applies with --mome-balance bias"):
        memory_config_from_args(_args("--memory", "mome", "--mome-balance-lr", "0.01"))
    opts = memory_config_from_args(_args("--memory", "mome", "--mome-balance", "bias", "--mome-balance-lr", "0.01"))
    assert opts["memory_options"]["balance_lr"] == 0.01
    assert memory_config_from_args(_args("--memory", "mome"))["memory_options"]["balance_lr"] == 0.001  # default


# -- init and optimizer groups of the nanochat memory blocks (reference model spec §9) -----------------------
def test_nanochat_memory_init_values():
    """VE and MoME tables U(+-sqrt(3/C)) (the backbone's matrix init), every gate and router zero (gamma = 1, tied
    router logits), the Bigram table zero and its lambda 0.1 on the memory layers (0, unused, elsewhere)."""
    C = 128
    bound = (3 / C) ** 0.5
    for memory in ("ve", "mome"):
        mem = build_model(tiny_config(memory=memory, n_layer=4, n_embd=C), seed=0).memory
        for table in mem.tables:
            w = table.weight
            assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound, memory  # uniform to the bound, not N(0, s)
            assert abs(w.std().item() - bound / 3**0.5) < 0.02 * bound, memory
        assert all(torch.all(g.proj.weight == 0) for g in mem.gates), memory
    mome = build_model(tiny_config(memory="mome", n_layer=4, n_embd=C), seed=0).memory
    assert all(torch.all(r.weight == 0) and torch.all(r.bias == 0) for r in mome.routers)
    bigram = build_model(tiny_config(memory="bigram", n_layer=4, n_embd=C), seed=0).memory
    assert torch.all(bigram.table.weight == 0) and all(torch.all(g.proj.weight == 0) for g in bigram.gates)
    assert bigram.lambdas.tolist() == pytest.approx([0.0, 0.1, 0.0, 0.1])


@pytest.mark.parametrize("memory,table_wd", [("ve", 0.001), ("mome", 0.001), ("bigram", 0.0)])
def test_nanochat_memory_optimizer_groups(memory, table_wd):
    """Memory tables: AdamW lr 0.2 x (C/768)^-0.5, betas (0.8, 0.995), eps 1e-10, decay 0.001 (Bigram 0); gates
    and routers: Muon; router biases: AdamW at 0.02 x (C/768)^-0.5; Bigram lambdas with x0_lambdas (0.5, betas
    (0.96, 0.95)). d24, so the width scale 0.5^0.5 is not 1."""
    from nanochat.optim import OptimConfig, build_param_groups

    with torch.device("meta"):
        model = GPT(GPTConfig.from_depth(24, memory=memory))
    groups = {g["name"]: g for g in build_param_groups(model, OptimConfig())}
    s = 0.5**0.5
    tables = groups["memory_tables"]
    assert {id(p) for p in tables["params"]} == {id(p) for p in model.memory.memory_tables()}
    assert tables["lr"] == pytest.approx(0.2 * s) and tables["betas"] == (0.8, 0.995)
    assert tables["eps"] == 1e-10 and tables["weight_decay"] == table_wd
    muon = {id(p) for g in groups.values() if g["kind"] == "muon" for p in g["params"]}
    extra = {id(p) for p in groups.get("adam_extra", {"params": []})["params"]}
    for gate in model.memory.gates:
        assert id(gate.proj.weight) in muon
    for router in getattr(model.memory, "routers", []):
        assert id(router.weight) in muon and id(router.bias) in extra
    if memory == "mome":
        assert groups["adam_extra"]["lr"] == pytest.approx(0.02 * s) and groups["adam_extra"]["weight_decay"] == 0
    if memory == "bigram":
        x0 = groups["x0_lambdas"]
        assert any(p is model.memory.lambdas for p in x0["params"])
        assert x0["lr"] == 0.5 and x0["betas"] == (0.96, 0.95)


ROUND_TRIP = [("ve", {}, {}), ("bigram", {}, {}), ("mome", {}, {}), ("mome", {"index": "bigram", "bigram_factor": 2}, {}),
              ("mome", {"routing": "token-only"}, {}), ("mome", {"routing": "fixed-random"}, {}),
              ("mome", {"balance": "bias"}, {}), ("mome", {"topk": 1, "router_input": "value"}, {}),
              ("mome", {"index": "headmod", "rows": 100, "dedicated_size": 30, "balance": "bias"}, {}),
              ("engram", {"compression": "identity", "dim": 64, "heads": 2, "first_prime": 101}, {}),
              ("jtok", {}, {}), ("jtokm", {}, {}), ("move_input", {"experts": 5, "rank": 8}, {}),
              ("mome", {}, {"mlp": "moe", "moe_hidden": 64}), ("mome", {"shared_expert": True}, {}),
              ("mome", {"index": "bigram", "bigram_factor": 2, "shared_expert": True}, {}),
              ("mome", {"per_head_table": True, "shared_expert": True, "balance": "bias"}, {}),
              ("mome", {"index": "bigram", "bigram_factor": 2, "per_head_table": True, "shared_expert": True}, {})]


@pytest.mark.parametrize("memory,opts,backbone", ROUND_TRIP, ids=lambda x: str(x) if x else "")
def test_checkpoint_round_trip_is_exact_for_every_block(tmp_path, memory, opts, backbone):
    """save_checkpoint -> load_model rebuilds the same config and gives bit-identical logits for every memory design
    (and the MoE FFN), with every parameter and float buffer (but the RoPE tables) moved off its init, so a buffer
    the forward reads but the checkpoint lacks shows (reference training spec §6: a round-trip per block type)."""
    from nanochat import checkpoint as ckpt

    model = build_model(tiny_config(memory=memory, memory_options=opts, n_layer=4, **backbone), seed=0).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():  # e.g. the balancing bias; not the RoPE tables, rebuilt on load
            if b.is_floating_point() and not name.startswith("rope_"):
                b.add_(0.3 * torch.randn(b.shape, generator=g))
    ckpt.save_checkpoint(tmp_path, 5, model, {})
    loaded, meta = ckpt.load_model(tmp_path, 5)
    loaded.eval()
    assert meta["step"] == 5 and loaded.config == model.config
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    idx = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))
