"""The KV cache of incremental decoding (nanochat/kv_cache.py, the cache branch of gpt.causal_attention).

* dtype: each layer's K/V are stored in the dtype they are written in (bf16 under autocast, fp32 in fp32), and
  ``update`` returns views of that storage, so a decode step reads the prefix in place instead of converting all
  of it; a write in another dtype is an error, never a silent rounding.
* sliding windows: an S layer's new queries attend only to the keys within their window (the cached views are
  sliced), not to the whole prefix under a mask.
* cached greedy decoding equals the uncached forward for window patterns whose window is shorter than the prompt,
  with a decode long enough for the window to slide, for Base and MoME (and the cache dtype for every family).
"""

import pytest
import torch
import torch.nn.functional as F

from bf16_bound import assert_greedy_within_bf16_bound, bf16_logits_and_bound
from conftest import tiny_config
from cuda_autocast import CudaAutocastPolicy, cuda_autocast_dtype
from nanochat.engine import generate, generate_uncached
from nanochat.families import FAMILIES, build_model
from nanochat.gpt import attention_mask, causal_attention
from nanochat.kv_cache import KVCache


def _nontrivial(model):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # c_proj, routers and gates start at zero: attention and memory would not reach the logits
        for p in model.parameters():
            if p.ndim >= 1 and p.is_floating_point() and torch.all(p == 0):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def _windowed(memory="base", pattern="SL", n_layer=4, sequence_len=8):
    """Window sequence_len // 2 = 4 on the S layers: shorter than the prompts below."""
    opts = {"memory_options": {"slots": 6, "topk": 2}} if memory == "mome" else {}
    return _nontrivial(build_model(tiny_config(n_layer=n_layer, window_pattern=pattern, sequence_len=sequence_len,
                                               memory=memory, **opts), seed=0))


def _family(family):
    if family == "nanochat":
        return _nontrivial(build_model(tiny_config(n_embd=64), seed=0))
    cfg = FAMILIES[family].config_cls(sequence_len=32, vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                                      head_dim=24 if family == "qwen3" else 16, ffn_hidden=128)
    return _nontrivial(build_model(cfg, seed=0))


class SdpaSpy:
    """Records (q, k, v, attn_mask) of every SDPA call."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = F.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, **kw):
            self.calls.append((q, k, v, attn_mask))
            return real(q, k, v, attn_mask=attn_mask, **kw)

        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)


# -- dtype and views -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["nanochat", "mobilellm", "qwen3"])
def test_the_cache_holds_the_autocast_dtype_and_attention_reads_views_of_it(family, monkeypatch):
    """Under CPU bf16 autocast every layer's K and V storage is bf16, and the k/v each decode step hands SDPA are
    the cache's storage itself (same data_ptr: no copy or conversion of the prefix per step)."""
    model = _family(family)
    spy = SdpaSpy(monkeypatch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = KVCache.for_model(model, batch_size=2, max_len=9)
        model(torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(0)), kv_cache=cache)
        spy.calls.clear()
        model(torch.tensor([[3], [4]]), kv_cache=cache)
    n_layer = model.config.n_layer
    assert [t.dtype for t in cache.k + cache.v] == [torch.bfloat16] * (2 * n_layer)
    assert len(spy.calls) == n_layer
    for layer, (q, k, v, mask) in enumerate(spy.calls):
        assert k.dtype == v.dtype == torch.bfloat16 and k.size(2) == v.size(2) == 7
        assert k.data_ptr() == cache.k[layer].data_ptr() and v.data_ptr() == cache.v[layer].data_ptr()


def test_under_cuda_autocasts_policy_the_cache_is_bf16_too():
    """CUDA autocast returns fp32 from QK-norm's rms_norm: k reaches the attention in fp32 beside a bf16 v. SDPA
    casts both to bf16 itself (checked against the real AutocastCUDA kernel), so the cache stores bf16 k as well
    (the same SDPA inputs, half the storage, no fp32 prefix re-cast per step)."""
    q = torch.randn(1, 2, 3, 4)
    assert cuda_autocast_dtype(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), q, q, q.bfloat16()) \
        == torch.bfloat16
    model = _family("nanochat")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastPolicy():
        cache = KVCache.for_model(model, batch_size=1, max_len=8)
        model(torch.tensor([[1, 2, 3, 4, 5]]), kv_cache=cache)
    assert [t.dtype for t in cache.k + cache.v] == [torch.bfloat16] * 4


def test_the_cache_is_fp32_in_fp32_and_update_returns_views():
    model = _family("nanochat")
    with torch.no_grad():
        cache = KVCache.for_model(model, batch_size=1, max_len=8)
        model(torch.tensor([[1, 2, 3]]), kv_cache=cache)
    assert [t.dtype for t in cache.k + cache.v] == [torch.float32] * 4
    direct = KVCache(2, 1, 3, 4, max_len=6)
    k, v = torch.randn(2, 3, 4, 4).bfloat16(), torch.randn(2, 3, 4, 4).bfloat16()
    k_all, v_all = direct.update(0, k, v)
    assert direct.k[0].shape == (2, 3, 6, 4) and direct.k[0].dtype == torch.bfloat16
    assert k_all.data_ptr() == direct.k[0].data_ptr() and v_all.data_ptr() == direct.v[0].data_ptr()
    assert k_all.shape == (2, 3, 4, 4) and torch.equal(k_all, k) and torch.equal(v_all, v)


def test_a_write_in_another_dtype_is_an_error():
    """Prefill in fp32, then a decode step under bf16 autocast: the bf16 k cannot join the fp32 prefix silently
    (nor could fp32 go into bf16 storage without rounding)."""
    model = _family("nanochat")
    with torch.no_grad():
        cache = KVCache.for_model(model, batch_size=1, max_len=8)
        model(torch.tensor([[1, 2, 3]]), kv_cache=cache)
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="holds torch.float32"):
            model(torch.tensor([[4]]), kv_cache=cache)
    fixed = KVCache(1, 1, 2, 4, max_len=4, dtype=torch.float64)
    with pytest.raises(TypeError, match="k arrives as torch.float32 but the cache holds torch.float64"):
        fixed.update(0, torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4).double())


# -- sliding windows -------------------------------------------------------------------------------------------
def test_windowed_layers_attend_to_the_window_only(monkeypatch):
    """An S layer (window w = 4) at decode position pos reads keys max(0, pos - w) .. pos: min(pos, w) + 1 keys,
    with no mask (all of them are visible); a chunk of T queries at pos reads pos + T - max(0, pos - w) keys
    under a mask. L layers read the whole prefix."""
    model = _windowed(pattern="SL", n_layer=2)
    assert model.config.attention_windows == (4, None)
    spy = SdpaSpy(monkeypatch)
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    chunks = [(0, 3), (3, 9), *((t, t + 1) for t in range(9, 16))]
    with torch.no_grad():
        cache = KVCache.for_model(model, batch_size=2, max_len=16)
        for a, b in chunks:
            model(idx[:, a:b], kv_cache=cache)
    s_calls, l_calls = spy.calls[0::2], spy.calls[1::2]
    assert [c[1].size(2) for c in s_calls] == [b - max(0, a - 4) for a, b in chunks] == [3, 9] + [5] * 7
    assert [c[1].size(2) for c in l_calls] == [b for a, b in chunks]
    assert all(c[3] is None for c in s_calls[2:])  # one query seeing all of its w + 1 keys: no mask
    mask = s_calls[1][3]  # queries 3..8 over keys 0..8
    assert torch.equal(mask, attention_mask(3, 6, 9, 4, mask.device))


@pytest.mark.parametrize("window", [0, 1, 3, 5])
def test_the_windowed_slice_equals_the_masked_full_prefix(window):
    """The cache branch against attention over the whole prefix with the window mask (the computation before
    slicing), for a chunked prefill and a decode past the window. Not bit-equal in general: SDPA reduces over a
    different number of keys (the dropped ones contribute exp(-inf) = 0), so fp64 within 1e-12."""
    g = torch.Generator().manual_seed(window)
    B, T, H, H_kv, d = 2, 14, 4, 2, 8
    q, k, v = (torch.randn(B, T, h, d, generator=g, dtype=torch.float64) for h in (H, H_kv, H_kv))
    cache = KVCache(B, 1, H_kv, d, max_len=T)
    for a, b in [(0, 4), (4, 9), *((t, t + 1) for t in range(9, T))]:
        got = causal_attention(q[:, a:b], k[:, a:b], v[:, a:b], cache, 0, window)
        cache.advance(b - a)
        qt, kt, vt = q[:, a:b].transpose(1, 2), k[:, :b].transpose(1, 2), v[:, :b].transpose(1, 2)
        want = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attention_mask(a, b - a, b, window, q.device),
                                              enable_gqa=True).transpose(1, 2)
        assert torch.allclose(got, want, atol=1e-12, rtol=0), (a, b)


# -- decoding equals the uncached forward ----------------------------------------------------------------------
@pytest.mark.parametrize("memory", ["base", "mome"])
@pytest.mark.parametrize("pattern", ["SL", "SSL", "SSSL"])
def test_cached_greedy_with_a_sliding_window_equals_uncached(memory, pattern):
    """Window 4 < the 6-token prompt, 14 decoded tokens: the window slides past the prompt. fp32, so the logits of
    the cached path (other GEMM shapes, a sliced key range) agree with the full forward to rounding (1e-5), and
    greedy tokens are equal."""
    model = _windowed(memory, pattern)
    idx = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.for_model(model, batch_size=2, max_len=20)
        steps = [model(idx[:, :6], kv_cache=cache)] + [model(idx[:, t:t + 1], kv_cache=cache) for t in range(6, 20)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    prompt = idx[0, :6].tolist()
    assert generate(model, prompt, max_tokens=14, temperature=0.0)[0] == generate_uncached(model, prompt, 14)


@pytest.mark.parametrize("memory", ["base", "mome"])
def test_cached_decoding_under_bf16_autocast_with_a_sliding_window(memory):
    """bf16 autocast: the cached logits stay within the bf16 bound of the uncached forward under the same autocast,
    and every cached greedy token is the uncached argmax up to that bound (bf16_bound.py): top-1/top-2 gaps here
    are 0 to 2e-4, below the 3e-4 the two paths differ by; ATen's AVX2 path picked another third token."""
    model = _windowed(memory, "SL")
    idx = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full, bound = bf16_logits_and_bound(model, idx)
        cache = KVCache.for_model(model, batch_size=1, max_len=16)
        steps = [model(idx[:, :6], kv_cache=cache)] + [model(idx[:, t:t + 1], kv_cache=cache) for t in range(6, 16)]
        prompt = idx[0, :6].tolist()
        cached = generate(model, prompt, 10, temperature=0.0)[0]
        assert_greedy_within_bf16_bound(model, prompt, cached)
    assert ((torch.cat(steps, 1) - full).abs() <= bound).all()


def test_decode_bench_runs_tiny(capsys):
    from conftest import load_bench

    out = load_bench("decode").main(["--depth", "2", "--width", "64", "--head-dim", "32", "--seq-len", "8",
                                     "--prompt", "3", "--tokens", "9", "--reps", "2", "--threads", "0"])
    assert out["windows"] == (4, None) and out["min_seconds"] <= out["seconds"]
    assert out["min_tok_per_s"] == pytest.approx(9 / out["min_seconds"])
    assert "tokens 9" in capsys.readouterr().out
