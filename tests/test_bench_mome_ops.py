"""bench/mome_ops.py on the CPU at toy shapes: every variant computes the op's function (forward and gradients,
against the float64 reference and against each other), the smoke run writes every op/variant, and the check can
fail (a wrong variant is reported FAILED and not timed). No timing assertions."""

import dataclasses
import json

import pytest
import torch

from conftest import load_bench
from nanochat.memory import mome_mix

TINY_REPS = ["--reps", "1", "--warmup", "0", "--sets", "2"]


@pytest.fixture
def bench():
    return load_bench("mome_ops")


def _outputs_and_grads(bench, op, fn, inputs, S):
    out = fn(*inputs)
    y = bench.canonical(out, S.M)
    G = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad((y * G).sum(), [inputs[i] for i in op.grad_args])
    return [y.detach(), *grads]


@pytest.mark.parametrize("op_name", ["rowmix", "gate_rowmix", "gate", "shared", "kmix", "inject", "shared_inject"])
def test_variants_agree_with_the_reference_and_each_other_in_fp32(bench, op_name):
    op, S = bench.OPS[op_name], bench.SMALL
    for vname, (fn, _) in op.variants.items():
        errors = bench.check_variant(op, bench.bind(fn, S, torch.float32, False), S,
                                     torch.device("cpu"), torch.float32, seed=3)
        assert set(errors) == {"out", *(f"d_{op.names[i]}" for i in op.grad_args)}
        assert max(errors.values()) < 1e-6, (vname, errors)
    # the same inputs through every variant: outputs and gradients equal to today's (the first variant's)
    inputs = op.make(S, torch.device("cpu"), torch.float32, torch.Generator().manual_seed(5))
    results = {v: _outputs_and_grads(bench, op, bench.bind(fn, S, torch.float32, False),
                                     inputs, S) for v, (fn, _) in op.variants.items()}
    first = next(iter(results.values()))
    for vname, got in results.items():
        for x, ref in zip(got, first):
            torch.testing.assert_close(x.double(), ref.double(), rtol=1e-5, atol=1e-6, msg=f"{op_name}/{vname}")


def test_todays_variants_are_the_library_paths(bench, monkeypatch):
    """argmax passes == mome_mix.topk_indices on its CUDA branch; the plain variant == mome_mix's plain mix; the
    bcast-sum row mix == mome_row_mix (eager: its einsum, the same function)."""
    S, g = bench.SMALL, torch.Generator().manual_seed(2)
    (logits,) = bench.make_gate(S, torch.device("cpu"), torch.float32, g)
    monkeypatch.setattr(mome_mix, "TOPK_BY_ARGMAX", True)
    assert torch.equal(bench.mv._argmax_topk(logits, S.K), mome_mix.topk_indices(logits, S.K))
    table, row, sel, w = bench.make_kmix(S, torch.device("cpu"), torch.float32, g)
    monkeypatch.setattr(mome_mix, "MIX", "plain")
    flat = row[..., None, None] * S.M + sel
    ours = bench.mv.table_plain(table, row, sel, w, m=S.M, k=S.K, out_dtype=torch.float32)
    assert torch.equal(ours, mome_mix.mome_mix(table, flat, w))
    rows = torch.nn.functional.embedding(bench.mv._slots(row, S.M), table)
    torch.testing.assert_close(bench.mv.rowmix_bcast_sum(rows, sel, w, m=S.M, k=S.K, out_dtype=torch.float32),
                               mome_mix.mome_row_mix(rows, mome_mix.slot_weights(sel, w, S.M)))


def test_small_cpu_run_writes_every_op_and_variant(bench, tmp_path, capsys):
    out = tmp_path / "ops.json"
    bench.main(["--device", "cpu", "--small", "--out", str(out), *TINY_REPS])
    result = json.loads(out.read_text())
    assert result["device_name"] == "cpu" and result["torch"] == torch.__version__
    assert result["command"].startswith("python bench/mome_ops.py --device cpu --small")
    assert result["shape"] == dataclasses.asdict(bench.SMALL) and result["dtype"] == "float32"
    assert list(result["ops"]) == list(bench.OPS)
    for name, op in result["ops"].items():
        assert list(op["variants"]) == list(bench.OPS[name].variants)
        assert op["floor"]["fwd_bwd_bytes"] > op["floor"]["fwd_bytes"] > 0
        for vname, r in op["variants"].items():
            assert r["status"] == "ok", (name, vname, r)
            assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_bwd_ratio"] > 0
    printed = capsys.readouterr().out
    assert "FAILED" not in printed and "x floor" in printed


def test_a_wrong_variant_is_reported_failed_and_not_timed(bench, tmp_path, capsys):
    rowmix = bench.OPS["rowmix"]

    def wrong_forward(rows, sel, w, **kw):  # 0.1% too large: far over fp32's tolerance
        return bench.mv.rowmix_bcast_sum(rows, sel, w, **kw) * 1.001

    def wrong_gradient(rows, sel, w, **kw):  # the right forward, a 1% larger gradient for rows and w
        y = bench.mv.rowmix_bcast_sum(rows, sel, w, **kw)
        return y + 0.01 * (y - y.detach())

    variants = dict(rowmix.variants, wrong_forward=(wrong_forward, True), wrong_gradient=(wrong_gradient, True))
    bench.OPS["rowmix"] = dataclasses.replace(rowmix, variants=variants)
    out = tmp_path / "ops.json"
    bench.main(["--device", "cpu", "--small", "--ops", "rowmix", "--out", str(out), *TINY_REPS])
    rows = json.loads(out.read_text())["ops"]["rowmix"]["variants"]
    assert rows["bcast_sum"]["status"] == "ok"
    assert rows["wrong_forward"]["status"].startswith("FAILED (out")
    assert rows["wrong_gradient"]["status"] == "FAILED (d_rows, d_w over 1e-05)"
    assert rows["wrong_gradient"]["errors"]["out"] < 1e-6
    for r in (rows["wrong_forward"], rows["wrong_gradient"]):
        assert "fwd_ms" not in r
    assert "FAILED" in capsys.readouterr().out


def test_rejects_unknown_op(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--ops", "rowmix,speed"])
    assert "--ops: unknown ['speed']" in capsys.readouterr().err


def test_table_prints_cuda_kernel_columns(bench, capsys):
    """The CUDA-only fields (kernel times from torch.profiler) as the table prints them: this runs nowhere else."""
    floor = {"fwd_ms": 0.1, "fwd_bwd_ms": 0.4}
    ok = {"status": "ok", "fwd_ms": 0.3, "fwd_bwd_ms": 1.2, "kernel_fwd_ms": 0.2, "kernel_fwd_bwd_ms": 0.8}
    bench.print_table({"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "dtype": "bfloat16",
                       "compile": True, "bw": 3.35e12,
                       "ops": {"rowmix": {"floor": floor, "variants": {"bcast_sum": ok, "x": {"status": "FAILED"}}}}})
    printed = capsys.readouterr().out
    assert "0.200 (2.0x)" in printed and "0.800 (2.0x)" in printed and "1.200 (3.0x)" in printed
    assert "FAILED" in printed


def test_kernel_profile_sums_device_time_per_call(bench, monkeypatch):
    """kernel_profile's reading of torch.profiler (CUDA only) on a stand-in profiler: device time (us) per call
    in ms, host-side events (no device time) and the profiler's own stalls left out, the longest kernels first."""
    from types import SimpleNamespace

    import torch.profiler

    events = [SimpleNamespace(key="triton_red_fused_mix", self_device_time_total=600.0),
              SimpleNamespace(key="cudaLaunchKernel", self_device_time_total=0.0),
              SimpleNamespace(key="Command Buffer Full", self_device_time_total=900.0),
              SimpleNamespace(key="embedding_dense_backward", self_device_time_total=1500.0)]

    class FakeProfile:
        def __init__(self, activities):
            assert activities == [torch.profiler.ProfilerActivity.CUDA]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return events

    calls = []
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    total, top = bench.kernel_profile(lambda: calls.append(1), calls=3)
    assert len(calls) == 4  # one warm call, then the 3 profiled
    assert total == pytest.approx(0.7) and top == [["embedding_dense_backward", 0.5], ["triton_red_fused_mix", 0.2]]
    events[:] = events[1:3]  # host-side and profiler events only: no kernel time is an error, not 0 ms
    with pytest.raises(RuntimeError, match="no device time"):
        bench.kernel_profile(lambda: None)


def test_bench_ms_falls_back_to_cuda_events_without_triton(bench, monkeypatch):
    """No triton: CUDA events around each call (stand-ins here; this machine has no GPU), median of --reps."""
    import builtins
    from types import SimpleNamespace

    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name.startswith("triton"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    clock = iter(range(100))

    class FakeEvent:
        def __init__(self, enable_timing):
            self.t = None

        def record(self):
            self.t = next(clock)

        def elapsed_time(self, end):
            return float(end.t - self.t)

    calls = []
    monkeypatch.setattr(builtins, "__import__", no_triton)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    a = SimpleNamespace(warmup=2, reps=3, warmup_ms=25.0, rep_ms=100.0)
    ms, timer = bench.bench_ms(lambda: calls.append(1), SimpleNamespace(type="cuda"), a)
    assert (ms, timer, len(calls)) == (1.0, "cuda_events", 5)


@pytest.mark.parametrize("name,bw", [
    ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H100 NVL", 3.9e12),
    ("NVIDIA H200", 4.8e12), ("NVIDIA H200 NVL", 4.8e12), ("NVIDIA A100-SXM4-80GB", 2.0e12),
    ("NVIDIA A100-SXM4-40GB", 1.555e12), ("NVIDIA A100-PCIE-40GB", 1.555e12),
    ("NVIDIA GH200 480GB", None), ("NVIDIA B200", None), ("NVIDIA GeForce RTX 4090", None)])
def test_floor_bandwidth_is_the_named_gpus_or_none(bench, monkeypatch, name, bw):
    """The floor's HBM bandwidth by device name, variants before their family: an H100 NVL (3.9 TB/s) read as the
    SXM's 3.35, a GH200 as an H200 (its HBM is 4.0 or 4.9 TB/s by model), a 40 GB A100 (1.555) as the 80 GB one,
    or any other GPU as 2.0 TB/s would put every "x floor" multiple off by up to 4x (a B200 has 8 TB/s)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert bench.device_info(torch.device("cuda")) == (name, bw)


def test_an_unknown_gpu_needs_bw(bench, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)  # main makes the GPU the current one
    parse = bench.parse_args
    monkeypatch.setattr(bench, "parse_args", lambda argv: setattr(a := parse(argv), "device", "cuda") or a)
    with pytest.raises(SystemExit, match="--bw.*NVIDIA B200"):
        bench.main(["--device", "cpu", "--small", "--ops", "gate"])
