"""bf16 on a CPU without native bf16 matmuls (an AVX2-only EPYC: ~60x a float32 matmul): the check that tells, and
the one note a run that computes so prints at start-up (nanochat.common)."""

import warnings

import pytest
import torch

from nanochat import common


def cpu_like(monkeypatch, machine="x86_64", **checks):
    """This process's CPU as ``machine`` whose torch.cpu checks answer ``checks`` (a name left out: no such check
    in this torch; an exception: a check that raises)."""
    monkeypatch.setattr(common.platform, "machine", lambda: machine)
    for name in common.NATIVE_BF16_CHECKS:
        if name not in checks:
            monkeypatch.delattr(torch.cpu, name, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, name, lambda answer=checks[name]: answer() if callable(answer) else answer)


def raises():
    raise RuntimeError("no cpuinfo")


AVX512_BF16, AMX = common.NATIVE_BF16_CHECKS


@pytest.mark.parametrize("machine,checks,native", [
    ("x86_64", {AVX512_BF16: False, AMX: False}, False),  # the AVX2-only EPYC
    ("x86_64", {AVX512_BF16: True, AMX: False}, True),  # a Zen 4 / Cooper Lake
    ("x86_64", {AVX512_BF16: False, AMX: True}, True),  # a Sapphire Rapids (it has both)
    ("AMD64", {AVX512_BF16: True, AMX: True}, True),
    ("x86_64", {AVX512_BF16: False}, None),  # a torch without the AMX check: cannot tell
    ("x86_64", {AMX: True}, True),  # ... unless the other one says yes
    ("x86_64", {}, None),
    ("x86_64", {AVX512_BF16: raises, AMX: False}, None),
    ("aarch64", {AVX512_BF16: False, AMX: False}, None),  # torch's x86 checks answer False on an ARM CPU
    ("arm64", {AVX512_BF16: True, AMX: True}, None),
])
def test_native_bf16_is_told_on_x86_only_and_unknown_without_the_checks(monkeypatch, machine, checks, native):
    cpu_like(monkeypatch, machine, **checks)
    assert common.cpu_has_native_bf16() is native


def test_this_torch_has_the_checks_the_function_reads():
    """torch 2.13 (CI) has both private checks (so does 2.11, the GPU image's: read in its torch/cpu/__init__.py);
    a torch that drops them makes the check "unknown" (above), which this test would flag."""
    assert all(callable(getattr(torch.cpu, name, None)) for name in common.NATIVE_BF16_CHECKS)


def autocast_output(capsys, device_type, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.autocast("cuda") on a CPU-only torch warns and disables itself
        ctx = common.autocast_context(device_type, dtype)
    return ctx, capsys.readouterr().out


def test_bf16_on_a_cpu_without_native_bf16_notes_it_once_on_rank_0(monkeypatch, capsys):
    monkeypatch.setattr(common, "_slow_bf16_decided", False)
    monkeypatch.delenv("RANK", raising=False)
    cpu_like(monkeypatch, **{AVX512_BF16: False, AMX: False})
    assert autocast_output(capsys, "cpu", "float32")[1] == ""
    assert autocast_output(capsys, "cuda", "bfloat16")[1] == ""  # a GPU's bf16 is native, whatever the host CPU
    assert autocast_output(capsys, "cpu", "auto")[1] == ""  # float32 on the CPU
    ctx, out = autocast_output(capsys, "cpu", "bfloat16")
    assert out.count("note:") == 1 and out.startswith("note: this run computes in bfloat16 on a CPU without native "
                                                       "bf16 matmuls (no AVX512-BF16, no AMX)")
    assert f"about {common.SLOW_BF16_RATIO}x a float32 matmul on a CPU like this one" in out
    assert "--dtype float32 is fast here but changes the numerics" in out and "not averaged" in out
    with ctx:  # a note, never a silent change: the run still computes in bf16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert autocast_output(capsys, "cpu", "bfloat16")[1] == ""  # once per process


@pytest.mark.parametrize("case", ["native", "unknown", "rank 1"])
def test_no_note_where_bf16_is_native_unknown_or_on_another_rank(monkeypatch, capsys, case):
    monkeypatch.setattr(common, "_slow_bf16_decided", False)
    monkeypatch.setenv("RANK", "1" if case == "rank 1" else "0")
    answers = {"native": {AVX512_BF16: True, AMX: False}, "unknown": {}}.get(case, {AVX512_BF16: False, AMX: False})
    cpu_like(monkeypatch, **answers)
    assert autocast_output(capsys, "cpu", "bfloat16")[1] == ""


def test_the_cpu_is_probed_once_per_process_whether_or_not_it_notes(monkeypatch, capsys):
    """bench/mome_ops enters its autocast inside each timed call: on a CPU with native bf16 (no note printed) every
    entry probed torch.cpu again, where the answer cannot change within a process."""
    monkeypatch.setattr(common, "_slow_bf16_decided", False)
    probes = []
    monkeypatch.setattr(common, "cpu_has_native_bf16", lambda: probes.append(1) or True)
    for _ in range(3):
        assert autocast_output(capsys, "cpu", "bfloat16")[1] == ""
    assert len(probes) == 1


BENCH_RUNS = {  # tiny bf16 runs of the benches that build their own autocast (or bf16 weights): their main's argv
    "moe": ["--device", "cpu", "--dtype", "bfloat16", "--tokens", "16", "--width", "64", "--experts", "2",
            "--reps", "1", "--warmup", "0"],
    "decode": ["--depth", "1", "--width", "64", "--head-dim", "32", "--seq-len", "8", "--prompt", "2", "--tokens",
               "3", "--reps", "2", "--autocast", "bf16"],
    "latency": ["--dtype", "bfloat16", "--widths", "64", "--head-dim", "32", "--mem-layers", "1", "--vocab-size",
                "512", "--reps", "1", "--warmup", "0", "--context", "4", "--seq-len", "8", "--mode", "decode"],
}


@pytest.mark.parametrize("name", [*BENCH_RUNS, "mome_ops"])
def test_the_benches_in_bf16_on_a_cpu_without_native_bf16_give_the_note_once(monkeypatch, capsys, tmp_path, name):
    """bench/moe, mome_ops, latency and decode built their own torch.autocast (latency: bf16 weights), so a bf16
    run on such a CPU never said why it was slow; they now go through nanochat.common's note, printed once."""
    from conftest import load_bench

    monkeypatch.setattr(common, "_slow_bf16_decided", False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(common, "cpu_has_native_bf16", lambda: False)
    bench = load_bench(name)
    if name == "mome_ops":  # its timed calls each enter this context
        for _ in range(2):
            with bench._autocast(torch.device("cpu"), torch.bfloat16):
                assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    else:
        # latency writes its JSON under the checkout's runs/bench unless told otherwise
        bench.main(BENCH_RUNS[name] + (["--out", str(tmp_path / "latency.json")] if name == "latency" else []))
    out = capsys.readouterr().out
    assert out.count("note: this run computes in bfloat16 on a CPU without native bf16 matmuls") == 1, out
