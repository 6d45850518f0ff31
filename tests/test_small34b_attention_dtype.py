"""--dtype float32 with a FlashAttention kernel (--attention fa2/fa3/auto on CUDA): FlashAttention takes 16-bit
inputs only, so attention computes in bf16 while the rest stays fp32. The start-up says so once, naming
--attention sdpa for fp32 attention, and summary.json/report.md record the attention's dtype. CUDA is faked on the
CPU as in tests/test_cuda_branches.py (the capability call, a stand-in flash module)."""

import dataclasses
import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from nanochat import gpt, train_setup
from nanochat.report import fmt_throughput
from scripts import base_train

TINY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
        "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core",
        "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "2"]
NOTE = "pass --attention sdpa for float32 attention"


def _flash(calls: list):
    def flash_attn_func(q, k, v, causal=False):
        calls.append({q.dtype, k.dtype, v.dtype})
        y = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=causal,
                                           enable_gqa=q.size(2) != k.size(2))
        return y.transpose(1, 2).to(q.dtype)
    return flash_attn_func


@pytest.fixture
def hopper(monkeypatch):
    """A Hopper GPU with FA3 installed, as resolve_attention sees it; the installed backend restored after."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.SimpleNamespace(flash_attn_func=_flash(calls)))
    monkeypatch.setattr(gpt, "_ATTENTION", gpt._ATTENTION)
    return calls


@pytest.mark.parametrize("requested,dtype,told", [("fa3", "float32", True), ("auto", "float32", True),
                                                  ("fa3", "bfloat16", False), ("fa3", "auto", False),
                                                  ("sdpa", "float32", False)])
def test_start_up_says_once_that_flash_attention_is_bf16_under_float32(hopper, capsys, requested, dtype, told):
    name = train_setup.setup_attention(requested, torch.device("cuda"), dtype)
    out = capsys.readouterr().out
    assert out.count(NOTE) == (1 if told else 0), out
    if told:
        assert (f"attention: {name} computes in bfloat16 under --dtype float32 (FlashAttention takes 16-bit inputs "
                f"only); {NOTE}") in out


def test_attention_dtype_of_each_kernel():
    assert [gpt.attention_dtype(name, "float32") for name in ("sdpa", "fa2", "fa3")] == ["float32", "bfloat16",
                                                                                          "bfloat16"]
    assert [gpt.attention_dtype(name, "bfloat16") for name in ("sdpa", "fa3")] == ["bfloat16", "bfloat16"]


def test_summary_and_report_record_the_attention_dtype(tmp_path, monkeypatch, hopper):
    """A float32 run whose resolved kernel is FA3 (its stand-in run on the CPU tensors): bf16 attention recorded."""
    fa3 = gpt.resolve_attention("fa3", "cuda")
    monkeypatch.setattr(train_setup, "resolve_attention", lambda requested, device: dataclasses.replace(
        fa3, device_type="cpu"))
    run = tmp_path / "r"
    assert base_train.main([*TINY, "--run-dir", str(run), "--attention", "fa3", "--dtype", "float32"]) == 0
    assert hopper and all(dtypes == {torch.bfloat16} for dtypes in hopper)  # the kernel ran, in bf16
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["dtype"], summary["attention"], summary["attention_dtype"]) == ("float32", "fa3", "bfloat16")
    assert "(attention fa3 in bfloat16; steady state" in (run / "report.md").read_text()


def test_report_names_the_attention_dtype_where_it_is_not_the_run_dtype():
    base = {"tok_per_sec": 1000.0, "dtype": "float32", "tok_per_sec_steps": 5}
    assert "(attention sdpa; " in fmt_throughput({**base, "attention": "sdpa", "attention_dtype": "float32"})
    assert "(attention sdpa; " in fmt_throughput({**base, "attention": "sdpa"})  # summaries from before
    assert "(attention fa3+sdpa in bfloat16+float32; " in fmt_throughput(
        {**base, "attention": "fa3+sdpa", "attention_dtype": "bfloat16+float32"})  # a resume on another kernel
