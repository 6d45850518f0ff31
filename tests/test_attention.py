"""--attention: the flag, its resolution (fake FlashAttention modules stand in for the CUDA packages, a capability
argument for the GPU), the flash path of causal_attention, the errors, and the record in config.json/summary.json."""

import dataclasses
import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from nanochat import gpt
from nanochat.train_args import parse_args
from scripts import base_train

TINY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
        "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core",
        "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "2"]
HOPPER, AMPERE = (9, 0), (8, 0)


def _qkv(H=4, H_kv=2):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 8, H, 16, generator=g), torch.randn(2, 8, H_kv, 16, generator=g),
            torch.randn(2, 8, H_kv, 16, generator=g))


def _sdpa(q, k, v):
    y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                       enable_gqa=q.size(2) != k.size(2))
    return y.transpose(1, 2)


def _fake_flash(calls: list, returns_tuple: bool):
    """A flash_attn_func stand-in: records its inputs, computes causal attention (fp32), returns out or (out, lse)."""
    def flash_attn_func(q, k, v, causal=False):
        calls.append({"dtypes": {q.dtype, k.dtype, v.dtype}, "causal": causal, "shapes": (q.shape, k.shape)})
        out = _sdpa(q.float(), k.float(), v.float()).to(q.dtype)
        return (out, torch.zeros(q.shape[:3])) if returns_tuple else out
    return flash_attn_func


class _NoCache:
    """A KV cache holding nothing before this call: causal_attention's cached path over the new k/v only."""

    def update(self, layer_idx, k, v):
        return k, v


def _on_cpu(backend):
    """The resolved CUDA backend, applied to CPU tensors: the flash path of causal_attention without a GPU."""
    return dataclasses.replace(backend, device_type="cpu")


def test_flag_default_config_key_and_bad_values(tmp_path, capsys):
    assert parse_args(["--dry-run"]).attention == "sdpa"
    assert parse_args(["--attention", "fa3", "--dry-run"]).attention == "fa3"
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('attention = "auto"\n')
    bad.write_text('attention = "FA3"\n')
    assert parse_args(["--config", str(good), "--dry-run"]).attention == "auto"
    for argv in (["--attention", "flash"], ["--config", str(bad)]):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--attention" in err and all(v in err for v in ("sdpa", "fa2", "fa3", "auto")), err
    with pytest.raises(ValueError, match="--attention must be one of sdpa, fa2, fa3, auto"):
        gpt.resolve_attention("flash", "cpu")


@pytest.mark.parametrize("name", ["fa2", "fa3"])
def test_flash_requested_without_cuda_is_an_error_naming_the_flag(name):
    with pytest.raises(ValueError, match=rf"--attention {name}: FlashAttention runs on CUDA GPUs only, this run is "
                                         r"on cpu; use --attention sdpa or auto"):
        gpt.resolve_attention(name, "cpu")


def test_flash_requested_on_cpu_stops_training_before_any_step(tmp_path, capsys):
    assert base_train.main([*TINY, "--run-dir", str(tmp_path / "r"), "--attention", "fa3"]) == 2
    assert "--attention fa3: FlashAttention runs on CUDA GPUs only" in capsys.readouterr().err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_auto_on_cpu_is_sdpa_and_both_are_recorded(tmp_path, capsys):
    backend = gpt.resolve_attention("auto", "cpu")
    assert (backend.name, backend.func) == ("sdpa", None) and "needs CUDA" in backend.reason
    run = tmp_path / "r"
    assert base_train.main([*TINY, "--run-dir", str(run), "--attention", "auto"]) == 0
    assert "attention: sdpa (--attention auto: FA3 needs CUDA, this run is on cpu)" in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    config = json.loads((run / "config.json").read_text())
    assert summary["attention"] == "sdpa" and config["attention"] == "sdpa" and config["args"]["attention"] == "auto"


def test_fa3_from_flash_attn_interface_returning_out_and_lse(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn_interface",
                        types.SimpleNamespace(flash_attn_func=_fake_flash(calls, returns_tuple=True)))
    backend = gpt.resolve_attention("fa3", "cuda", capability=HOPPER)
    assert backend.name == "fa3" and gpt.resolve_attention("auto", "cuda", capability=HOPPER).name == "fa3"
    monkeypatch.setattr(gpt, "_ATTENTION", _on_cpu(backend))
    q, k, v = _qkv()
    y = gpt.causal_attention(q, k, v)
    # one call, 16-bit inputs, causal, GQA handed over as is; the tuple unpacked into the (B, T, H, d) output
    assert calls == [{"dtypes": {torch.bfloat16}, "causal": True, "shapes": (q.shape, k.shape)}]
    assert isinstance(y, torch.Tensor) and y.shape == q.shape and y.dtype == torch.float32
    assert torch.allclose(y, _sdpa(q, k, v), atol=3e-2)
    gpt.causal_attention(q, k, v, kv_cache=_NoCache())  # decoding with a KV cache stays on SDPA
    assert len(calls) == 1


def test_fa3_from_the_kernels_hub(monkeypatch):
    calls, fetched = [], []

    def get_kernel(name):
        fetched.append(name)
        return types.SimpleNamespace(flash_attn_interface=types.SimpleNamespace(
            flash_attn_func=_fake_flash(calls, returns_tuple=False)))

    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # not installed: import raises ImportError
    monkeypatch.setitem(sys.modules, "kernels", types.SimpleNamespace(get_kernel=get_kernel))
    backend = gpt.resolve_attention("fa3", "cuda", capability=HOPPER)
    assert backend.name == "fa3" and fetched == ["varunneal/flash-attention-3"]
    monkeypatch.setattr(gpt, "_ATTENTION", _on_cpu(backend))
    q, k, v = _qkv(H=2, H_kv=2)
    y = gpt.causal_attention(q, k, v)
    assert len(calls) == 1 and y.shape == q.shape and torch.allclose(y, _sdpa(q, k, v), atol=3e-2)


def test_fa2_is_the_flash_attn_package(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=_fake_flash(calls, False)))
    backend = gpt.resolve_attention("fa2", "cuda", capability=AMPERE)
    assert backend.name == "fa2" and backend.func is sys.modules["flash_attn"].flash_attn_func


def test_missing_or_unsupported_flash_is_an_error_but_auto_falls_back_to_sdpa_saying_why(monkeypatch):
    for module in ("flash_attn", "flash_attn_interface", "kernels"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ValueError, match=r"--attention fa3: cannot load it .*pip install kernels.*or use another "
                                         r"of sdpa, fa2, fa3, auto"):
        gpt.resolve_attention("fa3", "cuda", capability=HOPPER)
    with pytest.raises(ValueError, match=r"--attention fa2: cannot load it .*pip install flash-attn"):
        gpt.resolve_attention("fa2", "cuda", capability=HOPPER)
    with pytest.raises(ValueError, match=r"--attention fa3 needs a Hopper GPU \(compute capability 9.x\), this GPU "
                                         r"is 8.0"):
        gpt.resolve_attention("fa3", "cuda", capability=AMPERE)
    auto = gpt.resolve_attention("auto", "cuda", capability=HOPPER)
    assert auto.name == "sdpa" and "FA3 could not be loaded" in auto.reason
    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.SimpleNamespace(flash_attn_func=print))
    ampere = gpt.resolve_attention("auto", "cuda", capability=AMPERE)  # FA3 installed, but not a Hopper GPU
    assert ampere.name == "sdpa" and "this GPU is 8.0" in ampere.reason


def test_the_old_environment_variable_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_ATTN", "flash")
    with pytest.raises(SystemExit) as e:
        base_train.main([*TINY, "--dry-run"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "NANOCHAT_ATTN is set ('flash') but no longer read" in err and "--attention {sdpa,fa2,fa3,auto}" in err


def test_ranks_that_resolve_differently_stop_the_run(monkeypatch):
    from nanochat import train_setup

    monkeypatch.setattr(train_setup, "gather_objects", lambda name: ["fa3", name])
    monkeypatch.setattr(gpt, "_ATTENTION", gpt._ATTENTION)  # restored after the test
    with pytest.raises(ValueError, match=r"--attention auto resolved to \['fa3', 'sdpa'\] on ranks 0..1"):
        train_setup.setup_attention("auto", torch.device("cpu"))
