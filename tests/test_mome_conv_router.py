"""--mome-router-type conv1d (the reference's --moe-ve-gate-type conv1d, reference notes §3.5): the block equals the
paper loop with an explicit causal sum over the last k positions (outputs and gradients, both router inputs), is
causal, starts at zero logits, has exact parameter counts and FLOPs, puts its kernel in the AdamW "adam_extra"
group, refuses meaningless flag combinations by name, and decodes with a KV cache exactly like the full forward."""

import argparse

import pytest
import torch

from conftest import tiny_config
from mome_fixtures import mome_config, random_block
from nanochat.gpt import GPTConfig, build_model, model_summary
from nanochat.kv_cache import KVCache
from nanochat.memory import add_memory_args, memory_config_from_args
from nanochat.memory.mome import MoMEOptions
from nanochat.memory.mome_router import CausalConvRouter
from test_memory_mome_reference import _assert_block_equals_loop, naive_conv_logits


def _conv_block(tmp_path, router_input, k=4, index="token", M=6, K=2, **extra):
    cfg = mome_config(tmp_path, M, K, index, router_type="conv1d", conv_kernel_size=k, router_input=router_input,
                      **extra)
    return cfg, random_block(cfg).double()


def _logits(block, xn, v, state=None):
    return block._conv_logits(0, xn, v, state)  # (B, T, H, M)


def _random_inputs(cfg, B=2, T=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    xn = torch.randn(B, T, cfg.n_embd, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, cfg.n_kv_head, cfg.head_dim, generator=g, dtype=torch.float64)
    return xn, v


# -- the router against the explicit causal sum ------------------------------------------------------------
@pytest.mark.parametrize("router_input", ["hidden", "value"])
@pytest.mark.parametrize("k", [1, 2, 4, 9])  # 9 > T: every position sees the zero padding
def test_conv_logits_equal_the_explicit_causal_sum(tmp_path, router_input, k):
    cfg, block = _conv_block(tmp_path, router_input, k)
    xn, v = _random_inputs(cfg)
    got = _logits(block, xn, v)
    B, T, H, _ = v.shape
    want = torch.stack([torch.stack([torch.stack([naive_conv_logits(block, 0, xn, v, b, t, i) for i in range(H)])
                                     for t in range(T)]) for b in range(B)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("router_input", ["hidden", "value"])
@pytest.mark.parametrize("index,K", [("token", 1), ("token", 2), ("bigram", 2), ("grouped", 6)])
def test_block_with_conv_router_equals_paper_loop(tmp_path, router_input, index, K):
    """value() and the gradients of xn, v and every parameter (the conv kernel and bias included) equal the
    float64 loop of test_memory_mome_reference with the conv logits; K == M (the row mix) too."""
    cfg, block = _conv_block(tmp_path, router_input, 3, index, K=K)
    _assert_block_equals_loop(cfg, block, block.layers[0])


def test_conv_router_gradcheck():
    router = CausalConvRouter(3, 4, 3).double()
    with torch.no_grad():
        for p in router.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: torch.nn.functional.conv1d(
        torch.nn.functional.pad(x.transpose(1, 2), (2, 0)), w, b).transpose(1, 2), (x, router.weight, router.bias))
    assert torch.autograd.gradcheck(router, (x,))


@pytest.mark.parametrize("router_input", ["hidden", "value"])
def test_conv_router_is_causal(tmp_path, router_input):
    """Changing the router inputs at t+1.. leaves every logit at <= t unchanged; the logit at t+1 changes."""
    cfg, block = _conv_block(tmp_path, router_input, 3)
    xn, v = _random_inputs(cfg)
    base = _logits(block, xn, v)
    for t in range(xn.size(1) - 1):
        xn2, v2 = xn.clone(), v.clone()
        xn2[:, t + 1:] += 1.0
        v2[:, t + 1:] += 1.0
        moved = _logits(block, xn2, v2)
        assert torch.equal(moved[:, : t + 1], base[:, : t + 1])
        assert not torch.allclose(moved[:, t + 1], base[:, t + 1])


def test_model_routing_is_causal_in_the_tokens():
    """In a whole model, changing token t+1 leaves the routing scores (capture "probs") and logits at <= t alone."""
    model = build_model(tiny_config(memory="mome", memory_options=dict(router_type="conv1d")), seed=0).eval()
    with torch.no_grad():
        for r in model.memory.routers:
            r.weight.normal_(generator=torch.Generator().manual_seed(3))
    idx = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(2))
    idx2 = idx.clone()
    idx2[:, 6] = (idx2[:, 6] + 1) % 512
    outs = []
    for tokens in (idx, idx2):
        model.memory.capture = {}
        outs.append((model(tokens), model.memory.capture[model.memory.layers[0]]["probs"]))
    (a, pa), (b, pb) = outs
    assert torch.equal(a[:, :6], b[:, :6]) and torch.equal(pa[:, :6], pb[:, :6])
    assert not torch.equal(pa[:, 6], pb[:, 6])


@pytest.mark.parametrize("router_input", ["hidden", "value"])
def test_conv_router_starts_at_zero_logits(router_input):
    model = build_model(tiny_config(memory="mome", memory_options=dict(router_type="conv1d",
                                                                       router_input=router_input)), seed=0)
    for r in model.memory.routers:
        assert not r.weight.any() and not r.bias.any()
    xn = torch.randn(2, 5, 128)
    v = torch.randn(2, 5, 2, 64)
    assert not model.memory._conv_logits(0, xn, v, None).any()


# -- parameter counts, FLOPs, optimizer groups -------------------------------------------------------------
def test_d12_parameter_counts_and_flops_are_exact():
    """d12 A2/6 (6 memory layers, H = 6, C = 768, d = 128): the linear router is C x H*M + H*M per layer; the conv
    router k times the weight, same bias; value mode d x M x k + M. FLOPs count the kernel: 6 x its parameters."""
    d12 = lambda **o: model_summary(GPTConfig.from_depth(12, memory="mome", memory_options=o))
    linear = d12()
    assert linear["params_total"] == 286_428_528 and linear["flops_per_token"] == 888_098_832
    for opts, router in ((dict(router_type="conv1d"), 768 * 36 * 4 + 36),
                         (dict(router_type="conv1d", conv_kernel_size=2), 768 * 36 * 2 + 36),
                         (dict(router_type="conv1d", router_input="value"), 128 * 6 * 4 + 6)):
        s = d12(**opts)
        extra = 6 * (router - (768 * 36 + 36))
        assert s["params_total"] == linear["params_total"] + extra, opts
        assert s["params_memory"] == linear["params_memory"] == 150_994_944
        assert s["params_active"] == linear["params_active"] + extra
        assert s["flops_per_token"] == linear["flops_per_token"] + 6 * extra
    assert d12(router_type="conv1d")["params_total"] == 286_926_192
    assert d12(router_type="conv1d")["flops_per_token"] == 891_084_816


def test_conv_kernel_and_bias_go_to_adam_extra():
    from nanochat.optim import OptimConfig, build_param_groups

    m = build_model(tiny_config(memory="mome", memory_options=dict(router_type="conv1d")), seed=0)
    oc = OptimConfig()
    groups = {g["name"]: g for g in build_param_groups(m, oc)}
    extra = groups["adam_extra"]
    for r in m.memory.routers:
        assert r.weight.ndim == 3
        assert any(p is r.weight for p in extra["params"]) and any(p is r.bias for p in extra["params"])
    muon = [p for g in groups.values() if g["kind"] == "muon" for p in g["params"]]
    assert not any(p is r.weight for r in m.memory.routers for p in muon)
    assert extra["lr"] == oc.matrix_lr * (128 / 768) ** -0.5 * oc.lr_scale  # the reference: 0.02 x s_d
    assert extra["weight_decay"] == 0.0


def test_conv_router_learns():
    """Training from zero init moves the conv kernel and bias (from the second step: the attention output
    projections start at zero, so the first step's gradient reaches no value vector)."""
    from nanochat.optim import build_optimizer

    model = build_model(tiny_config(memory="mome", memory_options=dict(router_type="conv1d")), seed=0)
    opt = build_optimizer(model)
    data = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(data[:, :-1], data[:, 1:]).backward()
        opt.step()
        model.zero_grad(set_to_none=True)
    assert all(r.weight[..., -1].any() and r.weight[..., 0].any() and r.bias.any() for r in model.memory.routers)


# -- flags ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts, needle", [
    (dict(router_type="conv2d"), "--mome-router-type 'conv2d' is unknown; allowed: linear, conv1d"),
    (dict(router_type="conv1d", conv_kernel_size=0), "--mome-conv-kernel-size must be an integer >= 1 (got 0)"),
    (dict(router_type="conv1d", conv_kernel_size=2.5), "--mome-conv-kernel-size must be an integer >= 1"),
    (dict(conv_kernel_size=3), "--mome-conv-kernel-size only applies to --mome-router-type conv1d (got "
                               "--mome-router-type linear)"),
    (dict(router_type="conv1d", routing="token-only"), "--mome-router-type conv1d only applies to --mome-routing "
                                                      "context (got token-only"),
    (dict(router_type="conv1d", routing="fixed-random"), "--mome-router-type conv1d only applies to --mome-routing "
                                                        "context (got fixed-random"),
])
def test_bad_conv_options_name_the_flag(opts, needle):
    with pytest.raises(ValueError) as e:
        MoMEOptions(**opts)
    assert needle in str(e.value)


def _args(argv):
    p = argparse.ArgumentParser()
    add_memory_args(p)
    return p.parse_args(argv)


def test_conv_flags_on_the_command_line(capsys):
    cfg = memory_config_from_args(_args(["--memory", "mome", "--mome-router-type", "conv1d",
                                         "--mome-conv-kernel-size", "3"]))
    assert cfg["memory_options"]["router_type"] == "conv1d" and cfg["memory_options"]["conv_kernel_size"] == 3
    with pytest.raises(ValueError, match="--mome-conv-kernel-size only applies to --memory mome"):
        memory_config_from_args(_args(["--memory", "ve", "--mome-conv-kernel-size", "3"]))
    with pytest.raises(ValueError, match="--mome-router-type only applies to --memory mome"):
        memory_config_from_args(_args(["--memory", "ve", "--mome-router-type", "conv1d"]))
    with pytest.raises(SystemExit):
        _args(["--memory", "mome", "--mome-router-type", "conv3"])
    assert "--mome-router-type: invalid choice: 'conv3'" in capsys.readouterr().err


def test_old_configs_without_the_fields_build_a_linear_router():
    """A checkpoint recorded before these options existed (no router_type / conv_kernel_size) keeps its router."""
    model = build_model(tiny_config(memory="mome", memory_options=dict(slots=6, topk=2)), seed=0)
    assert isinstance(model.memory.routers[0], torch.nn.Linear)


# -- KV-cache decoding ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts", [dict(), dict(router_input="value", conv_kernel_size=3),
                                  dict(conv_kernel_size=1), dict(conv_kernel_size=7),
                                  dict(index="bigram", bigram_factor=2, per_head_table=True, shared_expert=True)])
def test_kv_decoding_equals_full_forward(opts):
    """Chunked prefill then token-by-token decode == one full forward: the cache carries the k-1 router inputs
    before each call (k = 7 > the first chunk: the zero padding reaches into the second chunk's window)."""
    model = build_model(tiny_config(memory="mome", memory_options=dict(router_type="conv1d", **opts)), seed=0).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.memory.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    idx = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    full = model(idx)
    cache = KVCache.for_model(model, batch_size=2, max_len=12)
    parts = [model(idx[:, :5], kv_cache=cache), model(idx[:, 5:8], kv_cache=cache)]
    parts += [model(idx[:, t : t + 1], kv_cache=cache) for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    k = model.memory.opts.conv_kernel_size
    H = 2 if model.memory.opts.router_input == "value" else 1  # value mode: one sequence per (batch, head)
    state = cache.memory_state["mome_router0"]
    assert state.shape[:2] == (2 * H, k - 1)
    cache.reset()
    assert "mome_router0" not in cache.memory_state


@pytest.mark.parametrize("router_input", ["hidden", "value"])
def test_cached_generation_equals_uncached(router_input):
    """nanochat.engine: greedy decoding with the KV cache (prompt prefill, then one token per forward, two samples
    in a batch) == re-running the whole sequence every step."""
    from nanochat.engine import generate, generate_uncached

    cfg = tiny_config(memory="mome", memory_options=dict(router_type="conv1d", router_input=router_input))
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every zero-initialised part non-trivial, as tests/test_engine.py; routers and memory
        for p in model.parameters():  # strong enough that a wrong look-back changes the greedy tokens
            if p.ndim >= 1 and not p.any():
                p.normal_(std=0.05, generator=g)
        for p in model.memory.parameters():
            p.normal_(std=1.0, generator=g)
    prompt = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    cached = generate(model, prompt, max_tokens=10, temperature=0.0, num_samples=2)
    assert cached[0] == cached[1] == generate_uncached(model, prompt, max_tokens=10)


# -- torch.compile -------------------------------------------------------------------------------------------
@pytest.mark.slow  # an inductor compile on the CPU
@pytest.mark.parametrize("router_input", ["hidden", "value"])
def test_compiled_training_forward_equals_eager(router_input):
    """Inductor-compiled (fullgraph) training forward and backward == eager, conv kernel gradient included."""
    cfg = tiny_config(memory="mome", memory_options=dict(router_type="conv1d", router_input=router_input))
    models = [build_model(cfg, seed=0), build_model(cfg, seed=0)]
    for model in models:
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for p in [*model.memory.parameters(), *(b.attn.c_proj.weight for b in model.blocks)]:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        model.train()
    data = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(models[0], fullgraph=True, dynamic=False)
    losses = [m(data[:, :-1], data[:, 1:]) for m in (compiled, models[1])]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(models[0].memory.routers, models[1].memory.routers):
        torch.testing.assert_close(a.weight.grad, b.weight.grad, rtol=1e-4, atol=1e-6)
        assert a.weight.grad.any()
