"""The MobileLLM (Llama) and Qwen3 backbone families and the STEM block: exact parameter counts of the paper's 14
rows, forward == a naive per-token reference of the equations, init, optimizer groups, KV-cache decoding, training
of every block x family, config round-trips and the --model-type command line."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from nanochat.engine import generate, generate_uncached
from nanochat.families import build_model, config_from_dict, family_of, model_summary, param_groups
from nanochat.kv_cache import KVCache
from nanochat.llama import LlamaConfig, llama_ffn_hidden
from nanochat.optim import MuonAdamW, OptimConfig
from nanochat.qwen3 import Qwen3Config

V = 32768
C125 = LlamaConfig(vocab_size=V)  # the dataclass defaults are MobileLLM-125M
C350 = LlamaConfig(vocab_size=V, n_layer=32, n_embd=960, n_head=15, n_kv_head=5, head_dim=64, ffn_hidden=2560,
                   tie_embeddings=False)
Q06 = Qwen3Config(vocab_size=V)  # Qwen3-0.6B
VALUE = dict(router_input="value")

# (row, config, memory, options, exact memory params, exact total params, reference-estimator FLOPs/token);
# numbers from the reference families spec §9 (its arithmetic agrees with the authors' tests)
ROWS = [
    ("125M Base", C125, "base", {}, 0, 125_077_824, 1_061_894_016),
    ("125M STEM", C125, "stem", {}, 754_974_720, 866_781_504, 982_267_776),
    ("125M VE", C125, "ve", {}, 94_371_840, 219_451_104, 1_061_902_656),
    ("125M A1/3", C125, "mome", dict(slots=3, topk=1, **VALUE), 94_371_840, 219_454_029, 1_061_920_206),
    ("125M A2/6", C125, "mome", dict(slots=6, topk=2, **VALUE), 188_743_680, 313_828_794, 1_061_937_756),
    ("350M Base", C350, "base", {}, 0, 377_549_760, 2_831_529_600),
    ("350M STEM", C350, "stem", {}, 1_342_177_280, 1_680_405_440, 2_595_600_000),
    ("350M VE", C350, "ve", {}, 167_772_160, 545_324_480, 2_831_544_960),
    ("350M A2/5", C350, "mome", dict(slots=5, topk=2, **VALUE), 167_772_160, 545_329_680, 2_831_576_160),
    ("350M A2/10", C350, "mome", dict(slots=10, topk=2, **VALUE), 335_544_320, 713_107_040, 2_831_607_360),
    ("Qwen3 Base", Q06, "base", {}, 0, 474_021_888, 4_052_090_880),
    ("Qwen3 STEM", Q06, "stem", {}, 1_409_286_144, 1_839_267_840, 3_787_849_728),
    ("Qwen3 VE", Q06, "ve", {}, 469_762_048, 943_787_520, 4_052_112_384),
    ("Qwen3 A2/8", Q06, "mome", dict(slots=8, topk=2, router_input="hidden"), 469_762_048, 944_705_920, 4_057_622_784),
]


@pytest.mark.parametrize("row,cfg,memory,opts,mem,total,ref_flops", ROWS, ids=[r[0] for r in ROWS])
def test_paper_rows_exact_parameter_counts(row, cfg, memory, opts, mem, total, ref_flops):
    s = model_summary(dataclasses.replace(cfg, memory=memory, memory_options=opts))
    assert (s["params_memory"], s["params_total"]) == (mem, total)
    # our FLOPs count the output-head matmul also when it is the tied wte (the reference estimator omits it)
    tied_head = 6 * V * cfg.n_embd if cfg.tie_embeddings else 0
    assert s["flops_per_token"] == ref_flops + tied_head


def test_family_geometry_rules():
    assert [llama_ffn_hidden(c) for c in (576, 960, 256, 100)] == [1536, 2560, 768, 512]
    assert (C125.n_head * C125.head_dim, Q06.n_head * Q06.head_dim) == (576, 2048)  # Qwen3's query width != C
    # the memory layers default to the paper's "1/2 setting": the odd layers (15 / 16 / 14 of them)
    for cfg, n in ((C125, 15), (C350, 16), (Q06, 14)):
        with torch.device("meta"):
            model = family_of(cfg).model_cls(dataclasses.replace(cfg, memory="stem"))
        assert model.memory.layers == tuple(range(1, cfg.n_layer, 2)) and len(model.memory.layers) == n
        assert [b.mlp.c_up is None for b in model.blocks] == [i % 2 == 1 for i in range(cfg.n_layer)]


# -- tiny models --------------------------------------------------------------------------------------------
def tiny(family="mobilellm", memory="base", opts=None, tie=True, **kw):
    cls = Qwen3Config if family == "qwen3" else LlamaConfig
    base = dict(sequence_len=32, vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                head_dim=24 if family == "qwen3" else 16, ffn_hidden=96, tie_embeddings=tie, memory=memory,
                memory_options=opts or {})
    base.update(kw)
    return cls(**base)


def randomized(cfg, seed=0):
    """A model whose zero/one-initialised parts (gates, routers, norm gains) are random, so every term counts."""
    model = build_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.split(".")[-2]:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif torch.all(p == 0):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def naive_logits(model, idx):
    """Per-token, per-head loops over the family's equations (families spec §2-§4), for one row of tokens."""
    cfg, P = model.config, dict(model.named_parameters())
    qwen = cfg.family == "qwen3"
    eps, H, Hkv, d, T = (1e-6 if qwen else 1e-5), cfg.n_head, cfg.n_kv_head, cfg.head_dim, len(idx)
    mem = model.memory

    def rms(x, w, e=eps):
        return x / torch.sqrt((x * x).mean() + e) * w

    def rope(vec, t):
        out = vec.clone()
        for j in range(d // 2):
            angle = t * 10000.0 ** (-2 * j / d)
            a, b = (2 * j, 2 * j + 1) if not qwen else (j, j + d // 2)  # interleaved pairs vs half-split
            out[a] = vec[a] * math.cos(angle) - vec[b] * math.sin(angle)
            out[b] = vec[a] * math.sin(angle) + vec[b] * math.cos(angle)
        return out

    h = [P["wte.weight"][int(tok)].clone() for tok in idx]
    for layer in range(cfg.n_layer):
        pre = f"blocks.{layer}."
        ks, vs, qs = [], [], []
        for t in range(T):
            a = rms(h[t], P[pre + "norm_attn.weight"])
            q = (P[pre + "attn.c_q.weight"] @ a).view(H, d)
            k = (P[pre + "attn.c_k.weight"] @ a).view(Hkv, d)
            v = (P[pre + "attn.c_v.weight"] @ a).view(Hkv, d)
            if cfg.memory == "ve" and layer in mem.layers:  # v_j += 2 sigma(W_g a[:32])_j VE[x_t] (per KV head)
                pos = mem.layers.index(layer)
                gamma = 2 * torch.sigmoid(P[f"memory.gates.{pos}.proj.weight"] @ a[:32])
                v = v + gamma[:, None] * P[f"memory.tables.{pos}.weight"][int(idx[t])].view(Hkv, d)
            if qwen:
                q = torch.stack([rms(q[i], P[pre + "attn.q_norm.weight"]) for i in range(H)])
                k = torch.stack([rms(k[j], P[pre + "attn.k_norm.weight"]) for j in range(Hkv)])
            qs.append(torch.stack([rope(q[i], t) for i in range(H)]))
            ks.append(torch.stack([rope(k[j], t) for j in range(Hkv)]))
            vs.append(v)
        for t in range(T):
            heads = []
            for i in range(H):
                j = i // (H // Hkv)  # KV head j serves query heads j*r .. j*r + r - 1
                scores = torch.stack([qs[t][i] @ ks[u][j] for u in range(t + 1)]) / math.sqrt(d)
                p = torch.softmax(scores, dim=0)
                heads.append(sum(p[u] * vs[u][j] for u in range(t + 1)))
            h[t] = h[t] + P[pre + "attn.c_proj.weight"] @ torch.cat(heads)
            m = rms(h[t], P[pre + "norm_mlp.weight"])
            if pre + "mlp.c_up.weight" in P:
                up = P[pre + "mlp.c_up.weight"] @ m
            else:  # STEM: the token's table row replaces the up-projection
                up = P[f"memory.tables.{mem.layers.index(layer)}.weight"][int(idx[t])]
            h[t] = h[t] + P[pre + "mlp.c_proj.weight"] @ (F.silu(P[pre + "mlp.c_gate.weight"] @ m) * up)
    head = P["wte.weight"] if cfg.tie_embeddings else P["lm_head.weight"]
    return torch.stack([head @ rms(x, P["norm_f.weight"]) for x in h])[:, : cfg.vocab_size]


NAIVE_CASES = [("mobilellm", "base", True), ("mobilellm", "ve", False), ("mobilellm", "stem", True),
               ("qwen3", "base", True), ("qwen3", "ve", True), ("qwen3", "stem", False)]


@pytest.mark.parametrize("family,memory,tie", NAIVE_CASES)
def test_forward_equals_naive_reference(family, memory, tie):
    model = randomized(tiny(family, memory, tie=tie, vocab_size=200), seed=3)
    idx = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(idx)
        for row in range(2):
            torch.testing.assert_close(got[row], naive_logits(model, idx[row]), atol=2e-4, rtol=1e-4)
        assert got.shape == (2, 7, 200)


def test_stem_ffn_equals_its_equation():
    model = randomized(tiny("qwen3", "stem"), seed=1)
    xn = torch.randn(2, 5, 64)
    idx = torch.randint(0, 256, (2, 5))
    mlp, table = model.blocks[1].mlp, model.memory.tables[0].weight
    want = (F.silu(xn @ mlp.c_gate.weight.T) * table[idx]) @ mlp.c_proj.weight.T
    torch.testing.assert_close(mlp(xn, model.memory, model.memory.prepare(idx, None)), want)
    assert model.blocks[0].mlp.c_up is not None and mlp.c_up is None


def test_stem_refuses_the_nanochat_backbone():
    from conftest import tiny_config
    from nanochat.gpt import build_model as build_gpt

    with pytest.raises(ValueError, match="SwiGLU"):
        build_gpt(tiny_config(memory="stem"))


# -- init ---------------------------------------------------------------------------------------------------
def test_mobilellm_init_truncated_fan_in():
    cfg = tiny("mobilellm", "mome", dict(slots=4), n_embd=256, ffn_hidden=768, head_dim=64, n_layer=2)
    model = build_model(cfg, seed=0)
    std = 256**-0.5
    for name, p in [("wte", model.wte.weight), ("c_q", model.blocks[0].attn.c_q.weight),
                    ("c_gate", model.blocks[0].mlp.c_gate.weight)]:
        assert p.abs().max() <= 3 * std + 1e-7, name
        assert abs(p.std().item() - 0.986 * std) < 0.03 * std, name  # a +-3 sigma truncated normal's std
    down = model.blocks[0].mlp.c_proj.weight
    assert down.abs().max() <= 3 * 768**-0.5 + 1e-7 and abs(down.std().item() - 0.986 * 768**-0.5) < 1e-3
    assert torch.all(model.blocks[0].norm_attn.weight == 1) and torch.all(model.norm_f.weight == 1)
    table = model.memory.tables[0].weight
    assert table.abs().max() <= std and table.abs().max() > 0.99 * std  # U(+-C^-0.5), not sqrt(3/C)
    assert torch.all(model.memory.routers[0].weight == 0) and torch.all(model.memory.gates[0].proj.weight == 0)


def test_qwen3_init_normal_002():
    model = build_model(tiny("qwen3", "ve", n_embd=256, head_dim=64, ffn_hidden=768), seed=0)
    for p in (model.wte.weight, model.blocks[0].attn.c_proj.weight, model.blocks[1].mlp.c_proj.weight):
        assert abs(p.std().item() - 0.02) < 1e-3 and p.abs().max() > 3 * 0.02  # untruncated
    assert torch.all(model.blocks[0].attn.q_norm.weight == 1) and torch.all(model.blocks[0].attn.k_norm.weight == 1)
    table = model.memory.tables[0].weight
    assert table.abs().max() <= 0.02 and table.abs().max() > 0.0199
    assert torch.all(model.memory.gates[0].proj.weight == 0)
    stem = build_model(tiny("qwen3", "stem", n_embd=256, head_dim=64, ffn_hidden=768), seed=0)
    assert abs(stem.memory.tables[0].weight.std().item() - 0.02) < 1e-3


# -- optimizer groups (families spec §5-§6 tables) ----------------------------------------------------------
def _groups(cfg, memory="base", opts=None, **oc):
    with torch.device("meta"):
        model = family_of(cfg).model_cls(dataclasses.replace(cfg, memory=memory, memory_options=opts or {}))
    return {g["name"]: g for g in param_groups(model, OptimConfig(**oc))}, model


@pytest.mark.parametrize("cfg,wte_lr,head_lr,extra_lr,muon_wd", [
    (C125, 0.34641, None, 0.023094, 0.032), (C350, 0.26833, 0.0035777, 0.017889, 0.028125),
    (Q06, 0.0034641, None, 0.017321, 0.036735),
])
def test_family_optimizer_groups(cfg, wte_lr, head_lr, extra_lr, muon_wd):
    g, model = _groups(cfg, "mome", dict(slots=4, topk=2, **VALUE), memory_lr=0.1, memory_beta2=0.95)
    assert g["wte"]["lr"] == pytest.approx(wte_lr, rel=1e-4)
    assert ("lm_head" in g) == (head_lr is not None) and (head_lr is None or g["lm_head"]["lr"] == pytest.approx(head_lr, rel=1e-4))
    assert g["adam_extra"]["lr"] == pytest.approx(extra_lr, rel=1e-4)
    assert g["memory_tables"]["lr"] == pytest.approx(0.1 * (cfg.n_embd / 768) ** -0.5)
    assert g["memory_tables"]["betas"] == (0.8, 0.95) and g["memory_tables"]["weight_decay"] == 0.001
    muon = [x for x in g.values() if x["kind"] == "muon"]
    assert all(x["lr"] == 0.02 and x["weight_decay"] == pytest.approx(muon_wd, rel=1e-4) for x in muon)
    # every norm gain and router bias is AdamW; every router/gate/block matrix is Muon
    extra = {id(p) for p in g["adam_extra"]["params"]}
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith("bias"):
            assert id(p) in extra, name
        elif p.ndim == 2 and "wte" not in name and "lm_head" not in name and "tables" not in name:
            assert any(id(p) in {id(q) for q in x["params"]} for x in muon), name


def test_stem_tables_group():
    g, _ = _groups(C125, "stem", memory_lr=0.3, memory_beta2=0.95)
    assert g["memory_tables"]["lr"] == pytest.approx(0.34641, rel=1e-4)  # STEM rows: trained like the embedding
    assert g["memory_tables"]["weight_decay"] == 0.0 and len(g["memory_tables"]["params"]) == 15


# -- behaviour ----------------------------------------------------------------------------------------------
BLOCKS = [("base", {}), ("ve", {}), ("bigram", {}), ("mome", dict(slots=4, topk=2)),
          ("mome", dict(slots=3, topk=1, **VALUE)), ("stem", {})]


@pytest.mark.parametrize("family", ["mobilellm", "qwen3"])
@pytest.mark.parametrize("memory,opts", BLOCKS, ids=lambda x: str(x))
def test_every_block_trains_on_every_family(family, memory, opts):
    model = build_model(tiny(family, memory, opts), seed=0)
    opt = MuonAdamW(param_groups(model, OptimConfig(embedding_lr=0.05, memory_lr=0.05)))
    data = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    tables = [t.detach().clone() for t in model.memory.memory_tables()]
    losses = []
    for _ in range(6):
        loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0 and all(math.isfinite(x) for x in losses), losses
    assert all(not torch.equal(a, b) for a, b in zip(tables, model.memory.memory_tables()))  # memory learns


@pytest.mark.parametrize("family", ["mobilellm", "qwen3"])
@pytest.mark.parametrize("memory,opts", BLOCKS, ids=lambda x: str(x))
def test_cached_decoding_equals_full_forward(family, memory, opts):
    model = randomized(tiny(family, memory, opts, tie=family == "qwen3"), seed=2).eval()
    idx = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.for_model(model, batch_size=2, max_len=11)
        inc = torch.cat([model(idx[:, :6], kv_cache=cache)] + [model(idx[:, t:t + 1], kv_cache=cache)
                                                                 for t in range(6, 11)], dim=1)
    torch.testing.assert_close(inc, full, atol=1e-4, rtol=1e-4)
    prompt = idx[0, :5].tolist()
    assert generate(model, prompt, max_tokens=6, temperature=0.0)[0] == generate_uncached(model, prompt, 6)


@pytest.mark.parametrize("family", ["mobilellm", "qwen3"])
def test_causality_and_gqa_shapes(family):
    model = randomized(tiny(family, "mome", dict(slots=4)), seed=0)
    idx = torch.randint(0, 256, (1, 12))
    idx2 = idx.clone()
    idx2[0, 8:] = (idx2[0, 8:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(idx2)
    assert torch.allclose(a[0, :8], b[0, :8], atol=1e-5) and not torch.allclose(a[0, 8:], b[0, 8:])
    attn = model.blocks[0].attn
    assert attn.c_q.weight.shape == (4 * model.config.head_dim, 64) and attn.c_k.weight.shape[0] == 2 * model.config.head_dim


def test_bf16_autocast_forward_backward():
    for family in ("mobilellm", "qwen3"):
        model = build_model(tiny(family, "mome", dict(slots=4)), seed=0)
        idx = torch.randint(0, 256, (2, 16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, idx)
        assert loss.dtype == torch.float32 and abs(loss.item() - math.log(256)) < 1.0
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_config_round_trip_and_checkpoint(tmp_path):
    from nanochat import checkpoint as ckpt

    for cfg in (tiny("qwen3", "stem", tie=False), tiny("mobilellm", "mome", dict(slots=3, topk=1, **VALUE))):
        d = cfg.to_dict()
        assert d["family"] == cfg.family and config_from_dict(d) == cfg
        model = build_model(cfg, seed=5)
        ckpt.save_checkpoint(tmp_path / cfg.family, 1, model, {})
        loaded, meta = ckpt.load_model(tmp_path / cfg.family, 1)
        assert type(loaded) is type(model) and loaded.config == cfg
        idx = torch.randint(0, 256, (1, 9))
        with torch.no_grad():
            assert torch.equal(loaded(idx), model(idx))
    from conftest import tiny_config
    assert "family" not in tiny_config().to_dict() and config_from_dict(tiny_config().to_dict()) == tiny_config()
    with pytest.raises(ValueError, match="unknown family"):
        config_from_dict({**cfg.to_dict(), "family": "gpt5"})
