"""bench/kernel_table.py (every kernel of a profile as JSON rows) and bench/profile_diff.py (two such profiles
compared per step): categories, the reading of torch.profiler's device events on stand-ins (this machine has no
GPU), exact deltas and shares on hand-made profiles, and bad input as one error line with exit status 2."""

import json
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from conftest import load_bench


@pytest.fixture
def table():
    return load_bench("kernel_table")


@pytest.fixture
def diff():
    return load_bench("profile_diff")


def test_kernels_fall_in_the_categories_that_matter(table):
    assert set(table.our_triton_kernels()) >= {"_row_mix_fwd_kernel", "_row_mix_bwd_kernel",
                                               "_row_mix_inject_fwd_kernel", "_row_mix_inject_bwd_kernel"}
    want = {
        "nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_32x1_nn_align8>(...)": "gemm",
        "aten::mm": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_4x1x1_kernel0_0": "attention",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*)": "attention",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >(Flash_fwd_params)":
            "attention",
        "triton_poi_fused__to_copy__unsafe_view_pow_relu_14": "triton_inductor",
        "triton_red_fused__log_softmax__to_copy_3": "triton_inductor",
        "triton_per_fused__fused_rms_norm__to_copy__unsafe_view_add_24": "triton_inductor",
        "_row_mix_inject_bwd_kernel": "mome_triton",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>": "optimizer",
        "Memcpy DtoD (Device -> Device)": "copy_memset",
        "Memset (Device)": "copy_memset",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)": "nccl",
        "void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>(...)": "other",
    }
    assert {name: table.categorize(name) for name in want} == want
    assert set(want.values()) == set(table.CATEGORIES)


def _event(name, start, end, device=True, **kw):
    fields = dict(name=name, device_type=DeviceType.CUDA if device else DeviceType.CPU, is_async=False,
                  time_range=SimpleNamespace(start=start, end=end), is_user_annotation=False,
                  activity_type="kernel" if device else "cpu_op", self_cpu_time_total=end - start)
    return SimpleNamespace(**{**fields, **kw})


def test_kernel_rows_read_device_events_of_a_cuda_profile(table):
    """Device kernels summed per name with their device time; host ops (their device time is their kernels'),
    device-side annotations (they span kernels already counted) and the profiler's stalls left out; every kernel
    inside the optimizer step's annotation is 'optimizer', NCCL excepted."""
    ev = [_event("aten::mm", 0, 50, device=False),  # host op launching the GEMMs
          _event("nvjet_gemm_NNN", 10, 30), _event("nvjet_gemm_NNN", 40, 45),
          _event("triton_poi_fused_add_3", 50, 52),
          _event("Command Buffer Full", 52, 60),
          _event("Optimizer.step#MuonAdamW.step", 100, 200, is_user_annotation=True),
          _event("Torch-Compiled Region: 0/0", 0, 60, activity_type="gpu_user_annotation"),
          _event("nvjet_gemm_NNN", 110, 140),  # Muon's Newton-Schulz GEMM
          _event("triton_poi_fused_add_3", 150, 151),
          _event("ncclDevKernel_AllReduce", 160, 170)]
    rows = table.kernel_rows(ev, on_device=True)
    assert rows == [
        {"name": "nvjet_gemm_NNN", "category": "optimizer", "calls": 1, "total_us": 30.0},
        {"name": "nvjet_gemm_NNN", "category": "gemm", "calls": 2, "total_us": 25.0},
        {"name": "ncclDevKernel_AllReduce", "category": "nccl", "calls": 1, "total_us": 10.0},
        {"name": "triton_poi_fused_add_3", "category": "triton_inductor", "calls": 1, "total_us": 2.0},
        {"name": "triton_poi_fused_add_3", "category": "optimizer", "calls": 1, "total_us": 1.0}]
    cpu_rows = table.kernel_rows(ev, on_device=False)  # a CPU run: the host ops' self time
    assert cpu_rows == [{"name": "aten::mm", "category": "gemm", "calls": 1, "total_us": 50.0}]


def test_profile_json_counts_the_optimizer_windows_it_read(table, tmp_path):
    """The number of Optimizer.step annotations on the side read goes into the JSON: 0 on the device means no
    kernel was put under 'optimizer' by its time (profile_diff warns)."""
    kernels = [_event("nvjet_gemm_NNN", 10, 30), _event("nvjet_gemm_NNN", 110, 140)]
    steps = [_event("Optimizer.step#MuonAdamW.step", 100, 200, activity_type="gpu_user_annotation"),
             _event("Optimizer.step#MuonAdamW.step", 90, 210, device=False, is_user_annotation=True)]
    for events, windows, optimizer_us in ((kernels + steps, 1, 30.0), (kernels + steps[1:], 0, 0.0)):
        doc = table.write_profile_json(tmp_path / "p.json", events, True, 1, {"design": "mome"})
        assert json.loads((tmp_path / "p.json").read_text()) == doc
        assert doc["optimizer_windows"] == windows and doc["total_us"] == 50.0
        assert sum(k["total_us"] for k in doc["kernels"] if k["category"] == "optimizer") == optimizer_us


def _write(path, steps, kernels, **meta):
    path.write_text(json.dumps({"steps": steps, "time": "device", "device_name": "GPU X", **meta,
                                "total_us": sum(k[3] for k in kernels),
                                "kernels": [{"name": n, "category": c, "calls": k, "total_us": us}
                                            for n, c, k, us in kernels]}))
    return str(path)


@pytest.fixture
def pair(tmp_path):
    """A: 2 steps, 1300 us per step; B: 1 step, 1600 us: gap +300 us per step."""
    a = _write(tmp_path / "a.json", 2, [("nvjet_gemm_NNN", "gemm", 2, 2000.0),
                                        ("triton_poi_fused_add_3", "triton_inductor", 4, 400.0),
                                        ("Memset (Device)", "copy_memset", 2, 200.0)],
               label="VE", step_ms=10.0, profiled_step_ms=1.5)
    b = _write(tmp_path / "b.json", 1, [("nvjet_gemm_NNN", "gemm", 1, 1000.0),
                                        ("triton_poi_fused_add_7", "triton_inductor", 2, 300.0),
                                        ("triton_poi_fused_add_9", "triton_inductor", 1, 50.0),
                                        ("_row_mix_fwd_kernel", "mome_triton", 1, 250.0)],
               label="MoME", step_ms=10.5, profiled_step_ms=2.0)
    return a, b


def test_profile_diff_gives_per_step_deltas_and_shares_of_the_gap(diff, pair, capsys):
    a, b = pair
    rows = diff.diff_rows(diff.load(a), diff.load(b))
    # inductor's numbering stripped: add_3 in A is add_7 + add_9 in B
    assert [(r["name"], r["category"], r["a"]["us"], r["b"]["us"], r["delta_us"]) for r in rows] == [
        ("_row_mix_fwd_kernel", "mome_triton", 0.0, 250.0, 250.0),
        ("triton_poi_fused_add", "triton_inductor", 200.0, 350.0, 150.0),
        ("Memset (Device)", "copy_memset", 100.0, 0.0, -100.0),
        ("nvjet_gemm_NNN", "gemm", 1000.0, 1000.0, 0.0)]
    assert rows[1]["a"]["calls"] == 2 and rows[1]["b"]["calls"] == 3
    assert diff.main([a, b, "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "| device busy (sum of the kernels) | 1.30 | 1.60 | +0.30 |" in out
    assert "| timed step (median, not profiled) | 10.00 | 10.50 | +0.50 |" in out
    assert "| profiled wall - device busy (idle: host-bound gaps) | 0.20 | 0.40 | +0.20 |" in out
    assert "| kernel launches | 4 | 5 | +1 |" in out
    assert "Gap B - A in the sum of the kernels: +0.300 ms per step" in out and "`_<number>` stripped" in out
    for line in ("| mome_triton | 0.000 | 0.250 | +0.250 | +83.3% |",
                 "| triton_inductor | 0.200 | 0.350 | +0.150 | +50.0% |",
                 "| copy_memset | 0.100 | 0.000 | -0.100 | -33.3% |",
                 "| gemm | 1.000 | 1.000 | +0.000 | +0.0% |",
                 "| _row_mix_fwd_kernel | mome_triton | 0 | 0.0 | 1 | 250.0 | +250.0 | +83.3% |",
                 "| triton_poi_fused_add | triton_inductor | 2 | 200.0 | 3 | 350.0 | +150.0 | +50.0% |",
                 "| (the other 2) | | | | | | -100.0 | -33.3% |"):
        assert line in out, line
    assert "Memset" not in out.split("| kernel (top 2 of 4")[1]  # beyond --top: only in the sum of the rest
    assert "warning" not in out


def test_profile_diff_warns_where_a_device_profile_is_doubtful(diff, pair, tmp_path, capsys):
    """No device-side optimizer annotation (A), kernels adding up to more than the profiled wall (B: 1.6 ms in
    1.0): each one warning line before the tables; the numbers are still printed."""
    a, b = (json.loads(open(path).read()) for path in pair)
    (tmp_path / "a0.json").write_text(json.dumps(a | {"optimizer_windows": 0}))
    (tmp_path / "b1.json").write_text(json.dumps(b | {"profiled_step_ms": 1.0, "optimizer_windows": 1}))
    assert diff.main([str(tmp_path / "a0.json"), str(tmp_path / "b1.json")]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning")]
    assert warnings == [
        "warning: A has no device-side Optimizer.step annotation: its 'optimizer' row holds only the kernels named "
        "so (Muon's GEMMs count as gemm)",
        "warning: B's kernels add up to 1.60 ms per step, more than its profiled wall 1.00 ms: overlapping events "
        "are counted (several streams, or annotations read as kernels)"]
    assert out.index(warnings[-1]) < out.index("| per step, ms |") and "| mome_triton | 0.000 | 0.250 |" in out


@pytest.mark.parametrize("content, why", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"steps": 0, "kernels": [{"name": "k", "category": "gemm", "calls": 1, "total_us": 1.0}]}', "'steps'"),
    ('{"steps": 1, "kernels": []}', "'kernels' must be a non-empty list"),
    ('{"steps": 1, "kernels": [{"name": "k", "category": "gemm", "calls": 1, "total_us": 1.0}]}',
     "'total_us' must be a number (got None)"),
    ('{"steps": 1, "kernels": [{"name": "k", "category": "gemm", "total_us": 1.0}]}', "kernels[0]: missing or wrong calls"),
    ('{"steps": 1, "kernels": [{"name": "k", "category": "gemm", "calls": 1, "total_us": "9"}]}', "wrong total_us"),
])
def test_profile_diff_bad_input_is_one_error_line_and_exit_2(diff, pair, tmp_path, capsys, content, why):
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    assert diff.main([pair[0], str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"profile_diff: error: {bad}: ") and why in captured.err


def test_profile_diff_refuses_a_cpu_profile_against_a_device_profile(diff, pair, tmp_path, capsys):
    cpu = json.loads(open(pair[1]).read()) | {"time": "self_cpu"}
    (tmp_path / "cpu.json").write_text(json.dumps(cpu))
    assert diff.main([pair[0], str(tmp_path / "cpu.json")]) == 2
    assert "a CPU profile cannot be compared with a device profile" in capsys.readouterr().err
