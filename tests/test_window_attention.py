"""--window-pattern: sliding-window attention (reference spec §1.1, §Attention, §1.8).

The pattern of L/S letters is tiled over the layers with the last layer forced to L; an L layer attends to the full
causal context, an S layer lets the query at row i see the keys at col i - window_left .. i (window_left =
sequence_len // 2). Checked against a naive per-row softmax of that rule, on every path (SDPA with and without a
KV cache, the FlashAttention call), plus the FLOP term, the flag and the families (the authors' checkpoint format:
test_reference_import.py)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from nanochat import gpt
from nanochat.families import config_from_dict
from nanochat.gpt import GPTConfig, build_model, causal_attention, model_summary
from nanochat.kv_cache import KVCache
from nanochat.train_args import parse_args
from scripts import base_train

TINY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
        "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core",
        "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "2"]


def naive_window_attention(q, k, v, window, pos=0):
    """Row by row: query row pos+i (B, T, H, d) softmaxes over keys col with 0 <= row - col <= window (no upper
    bound for None) of k, v (B, T_k, H_kv, d); GQA query head h reads KV head h // (H / H_kv)."""
    B, T, H, d = q.shape
    group = H // k.size(2)
    out = torch.zeros_like(q)
    for i in range(T):
        row = pos + i
        cols = [c for c in range(k.size(1)) if 0 <= row - c and (window is None or row - c <= window)]
        for h in range(H):
            keys, values = k[:, cols, h // group], v[:, cols, h // group]  # (B, n, d)
            scores = torch.einsum("bd,bnd->bn", q[:, i, h], keys) / math.sqrt(d)
            out[:, i, h] = torch.einsum("bn,bnd->bd", scores.softmax(-1), values)
    return out


def _qkv(T=10, H=4, H_kv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, T, h, d, generator=g, dtype=torch.float64) for h in (H, H_kv, H_kv))


def _nontrivial(model):
    with torch.no_grad():  # c_proj starts at zero: attention would not reach the logits
        for p in model.parameters():
            if p.ndim >= 1 and torch.all(p == 0):
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(p.numel()))
    return model.eval()


@pytest.mark.parametrize("window", [0, 1, 3, 8, 9, 10, None])
def test_sdpa_window_equals_the_naive_rule(window):
    q, k, v = _qkv()
    want = naive_window_attention(q, k, v, window)
    assert torch.allclose(causal_attention(q, k, v, window=window), want, atol=1e-12)


@pytest.mark.parametrize("window", [0, 2, 5, None])
def test_kv_cache_prefill_and_decode_respect_the_window(window):
    """Prefill 6 rows, then one row at a time: row pos+i sees the cached keys within its window only."""
    q, k, v = _qkv(T=12)
    cache = KVCache(2, 1, k.size(2), k.size(3), max_len=12, dtype=torch.float64)
    outs = []
    for start, end in [(0, 6), *((t, t + 1) for t in range(6, 12))]:
        outs.append(causal_attention(q[:, start:end], k[:, start:end], v[:, start:end], cache, 0, window))
        cache.advance(end - start)
    assert torch.allclose(torch.cat(outs, 1), naive_window_attention(q, k, v, window), atol=1e-12)


def test_pattern_tiles_over_the_layers_and_the_last_layer_is_L():
    assert GPTConfig(n_layer=6, sequence_len=32, window_pattern="SSL").attention_windows == (16, 16, None, 16, 16, None)
    assert GPTConfig(n_layer=5, sequence_len=32, window_pattern="SSSL").attention_windows == (16, 16, 16, None, None)
    assert GPTConfig(n_layer=3, sequence_len=33, window_pattern="S").attention_windows == (16, 16, None)
    assert GPTConfig(n_layer=1, window_pattern="S").attention_windows == (None,)
    assert GPTConfig(n_layer=4).attention_windows == (None,) * 4  # the default "L"
    model = build_model(tiny_config(n_layer=4, window_pattern="LS"), seed=0)
    assert [b.attn.window for b in model.blocks] == [None, 16, None, None]


def test_an_all_L_pattern_is_the_default_config():
    """"LL" is the same model as "L": it must compare equal (resume and --init-from checks) and keep the old meta."""
    assert GPTConfig(window_pattern="LLL") == GPTConfig()
    assert "window_pattern" not in GPTConfig(window_pattern="LL").to_dict()
    assert GPTConfig(window_pattern="SL").to_dict()["window_pattern"] == "SL"


def test_a_repeated_pattern_is_stored_as_its_shortest_period():
    """"SLSL" tiles exactly as "SL" at every depth: the same model, so the configs compare equal (resume,
    --init-from, eval reuse) and save alike; a pattern that is not a repetition is kept as given."""
    for given, stored in (("SLSL", "SL"), ("SSLSSLSSL", "SSL"), ("SSSL", "SSSL"), ("SLS", "SLS"), ("SS", "S"),
                          ("LSLS", "LS")):
        assert GPTConfig(window_pattern=given).window_pattern == stored
        for depth in range(1, 14):  # the given pattern tiled by hand, last layer L
            letters = [given[i % len(given)] for i in range(depth - 1)] + ["L"]
            want = tuple(None if c == "L" else 1024 for c in letters)
            assert GPTConfig(n_layer=depth, window_pattern=given).attention_windows == want
    assert GPTConfig(window_pattern="SLSL") == GPTConfig(window_pattern="SL")
    assert GPTConfig(window_pattern="SLSL").to_dict()["window_pattern"] == "SL"


def test_all_L_takes_todays_causal_path_bit_for_bit(monkeypatch):
    """Every layer of an all-L model calls SDPA with is_causal and no mask, as before windows existed; an S layer
    whose window reaches every key takes that path too, so its logits are bit-equal to the all-L model's."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask")))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    full = _nontrivial(build_model(tiny_config(n_layer=3), seed=0))
    with torch.no_grad():
        want = full(idx)
        assert calls == [(True, None)] * 3
        windowed = build_model(tiny_config(n_layer=3, window_pattern="S"), seed=0)  # windows of 16 >= T = 16
        windowed.load_state_dict(full.state_dict())
        assert torch.equal(windowed.eval()(idx), want)
        assert calls == [(True, None)] * 6
        longer = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
        assert not torch.allclose(windowed(longer), full(longer))  # T = 32 > 16: the window now cuts keys off
    assert [c for c, m in calls[6:9]] == [False, False, True] and calls[6][1] is not None


def test_windowed_model_equals_a_naive_attention_forward(monkeypatch):
    """The whole model: swapping in the naive per-row rule for every layer's attention changes no logit."""
    cfg = tiny_config(n_layer=4, window_pattern="SSSL", sequence_len=16)  # window 8
    model = _nontrivial(build_model(cfg, seed=0)).double()
    idx = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(idx)
        monkeypatch.setattr(gpt, "causal_attention", lambda q, k, v, cache, layer, window:
                            naive_window_attention(q, k, v, window))
        assert torch.allclose(got, model(idx), atol=1e-10)


def test_flash_gets_the_window_size_of_S_layers_only(monkeypatch):
    """FA2/FA3: flash_attn_func(q, k, v, causal=True, window_size=(window_left, 0)) on S layers; L layers call it
    exactly as before (no window_size)."""
    calls = []

    def flash_attn_func(q, k, v, causal=False, **kw):
        calls.append(kw)
        window = kw.get("window_size", (None, 0))[0]
        return naive_window_attention(q.float(), k.float(), v.float(), window).to(q.dtype)

    monkeypatch.setattr(gpt, "_ATTENTION", gpt.AttentionBackend("fa3", flash_attn_func, device_type="cpu"))
    q, k, v = (t.float() for t in _qkv())
    y = causal_attention(q, k, v, window=3)
    assert calls == [{"window_size": (3, 0)}]
    assert torch.allclose(y, naive_window_attention(q, k, v, 3), atol=3e-2)
    causal_attention(q, k, v)
    causal_attention(q, k, v, window=10)  # reaches every key: the plain causal call
    assert calls[1:] == [{}, {}]


def test_flops_attention_term_uses_each_layers_window():
    """Σ_layers 12·H·d·min(window_left, T): an S layer counts T//2, an L layer T (reference §1.8)."""
    full, sssl = (model_summary(GPTConfig.from_depth(12, **kw))["flops_per_token"]
                  for kw in ({}, {"window_pattern": "SSSL"}))
    H, d, T = 6, 128, 2048
    assert full == 887_095_296  # unchanged by the window machinery (test_gpt's d12 number)
    assert sssl == full - 9 * 12 * H * d * (T - T // 2) == 802_160_640  # 9 S layers of 12 (the last is L)
    small = tiny_config(n_layer=3, window_pattern="S", sequence_len=33)  # S: 16 = 33 // 2
    base = model_summary(tiny_config(n_layer=3, sequence_len=33))["flops_per_token"]
    assert model_summary(small)["flops_per_token"] == base - 2 * 12 * 2 * 64 * (33 - 16)


@pytest.mark.parametrize("pattern", ["", "SXL", "ssl", "L S"])
def test_a_bad_pattern_is_an_error_naming_the_flag(pattern, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--window-pattern", pattern, "--dry-run"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--window-pattern {pattern!r}: expected a non-empty string of the letters L and S" in err
    with pytest.raises(ValueError, match="--window-pattern"):
        tiny_config(window_pattern=pattern)


@pytest.mark.parametrize("model_type", ["mobilellm", "qwen3"])
def test_the_other_families_refuse_sliding_windows(model_type, capsys):
    argv = ["--model-type", model_type, "--depth", "2", "--model-dim", "64", "--num-heads", "4", "--head-dim", "16",
            "--max-seq-len", "32", "--dry-run", "--vocab-size", "256"]
    assert base_train.main([*argv, "--window-pattern", "SL"]) == 2
    assert (f"--window-pattern SL: --model-type {model_type} attends to the full causal context in every layer"
            in capsys.readouterr().err)
    for pattern in ("L", "LL"):
        args = parse_args([*argv, "--window-pattern", pattern])
        assert base_train.model_config(args, 256).attention_windows == (None, None)


def test_recorded_in_config_json_and_trains(tmp_path):
    run = tmp_path / "r"
    assert base_train.main([*TINY, "--run-dir", str(run), "--window-pattern", "SL", "--depth", "3"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["model_config"]["window_pattern"] == "SL" and config["args"]["window_pattern"] == "SL"
    assert config_from_dict(config["model_config"]).attention_windows == (16, None, None)
    # an all-L model's meta.json is the one written before the field existed, which reads as all-L
    all_l = tiny_config().to_dict()
    assert "window_pattern" not in all_l and config_from_dict(all_l) == tiny_config()
    assert config_from_dict(tiny_config(window_pattern="SSL").to_dict()).window_pattern == "SSL"


def test_compiled_windowed_forward_backward_equals_eager():
    model = _nontrivial(build_model(tiny_config(n_layer=2, window_pattern="S", sequence_len=16), seed=0)).train()
    idx = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(4))
    eager = model(idx[:, :-1], idx[:, 1:])
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(idx[:, :-1], idx[:, 1:])
    assert torch.allclose(compiled, eager, atol=1e-6)
    compiled.backward()

