"""Session 33's fresh-eyes review of the backbone families (MobileLLM, Qwen3): the edges it found uncovered."""

import dataclasses
import itertools

import pytest
import torch

from nanochat.families import build_model, config_from_dict
from nanochat.llama import LlamaConfig
from nanochat.qwen3 import Qwen3Config

SMALL = dict(sequence_len=16, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, head_dim=16, ffn_hidden=96)


@pytest.mark.parametrize("cls,other", [(LlamaConfig, "qwen3"), (Qwen3Config, "mobilellm"), (LlamaConfig, "nanochat")])
def test_a_config_whose_family_field_names_another_family_is_refused(cls, other):
    """``family`` is a dataclass field of the SwiGLU configs (meta.json records it) and ``build_model`` dispatches on
    it, while the init rules (``memory_table_bound``, ``init_token_table``) come from the class: LlamaConfig(
    family="qwen3") built a Qwen3 model with MobileLLM's U(+-C^-0.5) memory tables and truncated token tables, and
    Qwen3Config(family="mobilellm") a MobileLLM model with Qwen3's 0.02 inits, which saved and reloaded as a
    LlamaConfig. The class and the field must agree."""
    with pytest.raises(ValueError, match=f"family={other!r}"):
        cls(**SMALL, family=other)
    with pytest.raises(ValueError, match=f"family={other!r}"):
        dataclasses.replace(cls(**SMALL), family=other)
    own = cls(**SMALL)
    assert config_from_dict(own.to_dict()) == own and type(build_model(own).config) is cls


@pytest.mark.parametrize("family,opts", [("mobilellm", dict(slots=3, topk=1, router_input="value")),
                                         ("qwen3", dict(slots=4, topk=2, router_input="hidden"))],
                         ids=["mobilellm-A1/3-value", "qwen3-A2/4-hidden"])
def test_mome_value_hook_per_kv_head_equals_its_equation(family, opts):
    """MoME on a GQA family (families spec §5), per token and KV head j, from the model's parameters: value router
    l_j = W v_j + b, ONE (M, d) weight shared by the KV heads (MobileLLM), or the hidden router's (H_kv*M, C) output
    on the attention-norm output a read head-major, (H_kv, M) (Qwen3); A1/M: softmax, top-1, weight p_max (not
    renormalised); A2/M: sigmoid, top-2, weights p / sum_top2 p; v_j += 2 sigmoid(W_g a[:32])_j * sum_k w_k
    E[x_t * M + slot_k]. Existing tests pin this hook's inputs (the VE naive forward) and MoME's equation on MHA
    nanochat models, not MoME's per-KV-head layout (H_kv < H, d != C / H)."""
    from test_families import randomized, tiny

    model = randomized(tiny(family, "mome", opts, vocab_size=100), seed=3).eval()
    mem, cfg = model.memory, model.config
    H, d, M, K = cfg.n_kv_head, cfg.head_dim, opts["slots"], opts["topk"]
    assert H < cfg.n_head and (family == "mobilellm" or cfg.n_head * d != cfg.n_embd)  # GQA; Qwen3: d != C / H
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 100, (2, 5), generator=g)
    xn, v = torch.randn(2, 5, cfg.n_embd, generator=g), torch.randn(2, 5, H, d, generator=g)
    layer, pos = mem.layers[-1], len(mem.layers) - 1
    with torch.no_grad():
        got = mem.value(layer, xn, v, mem.prepare(idx, None))
    router, gate, table = mem.routers[pos], mem.gates[pos].proj.weight, mem.tables[pos].weight
    for b, t in itertools.product(range(2), range(5)):
        a, tok = xn[b, t], int(idx[b, t])
        if opts["router_input"] == "hidden":
            logits = (router.weight @ a + router.bias).view(H, M)
        else:
            logits = torch.stack([router.weight @ v[b, t, j] + router.bias for j in range(H)])
        gamma = 2 * torch.sigmoid(gate @ a[:32])
        for j in range(H):
            p = torch.softmax(logits[j], 0) if K == 1 else torch.sigmoid(logits[j])
            top = p.topk(K).indices
            w = p[top] if K == 1 else p[top] / p[top].sum()
            mix = sum(w[k] * table[tok * M + int(top[k])] for k in range(K))
            torch.testing.assert_close(got[b, t, j], v[b, t, j] + gamma[j] * mix, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", [LlamaConfig, Qwen3Config])
def test_an_empty_vocabulary_is_refused_at_the_config(cls):
    """As GPTConfig does for configs built in Python: vocab_size 0 built a model whose first forward failed in
    index_select ("self indexing axis dim should be positive"), far from the cause."""
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        cls(**{**SMALL, "vocab_size": 0})
