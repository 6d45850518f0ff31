import pytest
import torch

from conftest import tiny_config
from nanochat.gpt import GPT, GPTConfig, apply_rotary_emb, build_model, model_summary
from nanochat.kv_cache import KVCache


def test_geometry_from_depth():
    d12, d24 = GPTConfig.from_depth(12), GPTConfig.from_depth(24)
    assert (d12.n_embd, d12.n_head, d12.head_dim, d12.n_layer) == (768, 6, 128, 12)
    assert (d24.n_embd, d24.n_head, d24.head_dim, d24.n_layer) == (1536, 12, 128, 24)
    assert GPTConfig.from_depth(20).n_embd == 1280  # 20*64 rounded up to 128
    assert GPTConfig.from_depth(3).n_embd == 256  # 192 rounded up


@pytest.mark.parametrize("fields, needle", [
    (dict(n_layer=0), "n_layer must be >= 1"), (dict(n_head=0), "n_head must be >= 1"),
    (dict(n_kv_head=0), "n_kv_head must be >= 1"), (dict(n_embd=96, n_head=2, n_kv_head=2, sequence_len=0),
                                                     "sequence_len must be >= 1"),
    (dict(n_embd=96, n_head=32, n_kv_head=32), "head size n_embd / n_head = 3 must be even"),
])
def test_config_built_in_python_is_checked(fields, needle):
    """The CLI validates its flags; a GPTConfig built in Python gets the same geometry checks (not a division
    by zero, a 0-layer model that silently runs, or a RoPE shape error at the first forward)."""
    with pytest.raises(ValueError, match=needle):
        tiny_config(**fields)


def test_d12_exact_param_count_and_flops():
    s = model_summary(GPTConfig.from_depth(12))
    assert s["params_total"] == 2 * 25_165_824 + 12 * 7_077_888 + 24 == 135_266_328
    assert s["params_memory"] == 0 and s["params_backbone"] == s["params_total"]
    assert s["flops_per_token"] == 887_095_296


def test_d24_param_count_and_flops_follow_the_same_rules():
    s = model_summary(GPTConfig.from_depth(24))
    C, V, L = 1536, 32768, 24
    assert s["params_total"] == 2 * V * C + L * 12 * C * C + 2 * L == 780_140_592
    assert s["flops_per_token"] == 6 * (s["params_total"] - V * C - 2 * L) + L * 12 * C * 2048 == 5_284_823_040


def test_vocab_padding_and_logit_crop():
    cfg = tiny_config(vocab_size=500)
    assert cfg.padded_vocab_size == 512
    model = build_model(cfg, seed=0)
    assert model.wte.weight.shape == (512, 128)
    logits = model(torch.randint(0, 500, (2, 8)))
    assert logits.shape == (2, 8, 500)
    assert logits.abs().max() <= 15.0  # softcap


def test_init_values():
    model = build_model(tiny_config(), seed=0)
    assert torch.all(model.resid_lambdas == 1.0) and torch.all(model.x0_lambdas == 0.1)
    for b in model.blocks:
        assert torch.all(b.attn.c_proj.weight == 0) and torch.all(b.mlp.c_proj.weight == 0)
        bound = 3**0.5 / 128**0.5
        assert b.attn.c_q.weight.abs().max() <= bound
    assert abs(model.wte.weight.std().item() - 1.0) < 0.05
    assert abs(model.lm_head.weight.std().item() - 0.001) < 1e-4


def test_rope_is_a_rotation_and_relative():
    torch.manual_seed(0)
    model = build_model(tiny_config(), seed=0)
    x = torch.randn(1, 4, 2, 64)
    cos, sin = model.rope_cos[:, :4], model.rope_sin[:, :4]
    y = apply_rotary_emb(x, cos, sin)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    # dot products depend only on the position difference
    q = torch.randn(1, 1, 1, 64).expand(1, 4, 1, 64)
    k = torch.randn(1, 1, 1, 64).expand(1, 4, 1, 64)
    qr, kr = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
    d01 = (qr[0, 1, 0] * kr[0, 0, 0]).sum()
    d23 = (qr[0, 3, 0] * kr[0, 2, 0]).sum()
    assert torch.allclose(d01, d23, atol=1e-5)


def test_causality():
    model = build_model(tiny_config(), seed=0)
    for b in model.blocks:  # make the blocks non-trivial (c_proj starts at zero)
        torch.nn.init.normal_(b.attn.c_proj.weight, std=0.02)
        torch.nn.init.normal_(b.mlp.c_proj.weight, std=0.02)
    idx = torch.randint(0, 512, (1, 16))
    a = model(idx)
    idx2 = idx.clone()
    idx2[0, 10:] = (idx2[0, 10:] + 1) % 512
    b = model(idx2)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-5)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_backward_tiny(dtype):
    model = build_model(tiny_config(), seed=0)
    idx = torch.randint(0, 512, (2, 32))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = model(idx, idx)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 0.5  # near-uniform at init
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        assert torch.isfinite(p.grad).all(), n


def test_overfit_one_batch():
    from nanochat.optim import OptimConfig, build_optimizer

    torch.manual_seed(0)
    model = build_model(tiny_config(), seed=0)
    opt = build_optimizer(model, OptimConfig())
    idx = torch.randint(0, 512, (4, 33))
    x, y = idx[:, :-1], idx[:, 1:]
    losses = []
    for _ in range(50):
        loss = model(x, y)
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_kv_cache_decoding_matches_full_forward():
    model = build_model(tiny_config(), seed=0)
    for b in model.blocks:
        torch.nn.init.normal_(b.attn.c_proj.weight, std=0.02)
        torch.nn.init.normal_(b.mlp.c_proj.weight, std=0.02)
    idx = torch.randint(0, 512, (2, 12))
    full = model(idx)
    cache = KVCache.for_model(model, batch_size=2, max_len=12)
    prefill = model(idx[:, :7], kv_cache=cache)
    steps = [model(idx[:, t : t + 1], kv_cache=cache) for t in range(7, 12)]
    inc = torch.cat([prefill, *steps], dim=1)
    assert torch.allclose(full, inc, atol=1e-4)


def test_meta_build_has_no_storage():
    with torch.device("meta"):
        model = GPT(GPTConfig.from_depth(24))
    assert model.wte.weight.is_meta


def test_softcap_is_computed_in_fp32_under_bf16_autocast():
    """Logits = 15 tanh(z / 15) with z = the bf16 lm_head output upcast BEFORE the softcap (model spec §9: softcap in
    fp32): the tanh of bf16 z in bf16 would round each logit to bf16's 8 bits."""
    model = build_model(tiny_config(), seed=0)
    torch.nn.init.normal_(model.lm_head.weight, std=0.5)  # logits ~ N(0, 5^2): well inside the softcap's curve
    idx = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(0))
    head_out = {}
    model.lm_head.register_forward_hook(lambda m, i, out: head_out.update(z=out))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx)
    z = head_out["z"]
    assert z.dtype == torch.bfloat16 and logits.dtype == torch.float32
    expect = 15.0 * torch.tanh(z[..., :512].float() / 15.0)
    assert torch.equal(logits, expect)
    assert not torch.equal(logits, (15.0 * torch.tanh(z[..., :512] / 15.0)).float())  # the bf16 softcap differs
