"""Fresh-eyes review of the numbers a run reports (session 33): MFU, tok/s and the readers of metrics.jsonl."""

import json
import math
import shutil
import time
from types import SimpleNamespace

import pytest
import torch

from nanochat import checkpoint as ckpt
from nanochat import train_end
from nanochat.metrics import mfu
from scripts import base_train
from test_train_e2e import train


def train_records(run_dir) -> dict[int, dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if r["kind"] == "train"}


@pytest.mark.slow
def test_mfu_of_a_run_resumed_on_other_gpus_weighs_each_step_by_its_own_hardware(tmp_path, monkeypatch):
    """A run resumed on other hardware (another GPU kind, or --resume-new-world-size): summary.json's MFU is the
    model FLOPs of the steady steps over the peak FLOPs the devices of each step could have done, not the mean step
    time over the LAST session's peak x world (which read 4x too high here: 4 of its 5 steady steps ran at a peak 4x
    lower than the last session's)."""
    run, flags = tmp_path / "r", ["--num-iterations", "10", "--save-every", "5"]
    peaks = {"first": 1e12, "second": 4e12}

    def on(session):
        monkeypatch.setattr(base_train, "peak_flops", lambda device: peaks[session])
        monkeypatch.setattr(train_end, "peak_flops", lambda device: peaks[session])

    on("first")
    assert train(run, *flags) == 0
    shutil.rmtree(ckpt.step_dir(run, 10))  # "killed" after the step-5 checkpoint
    on("second")
    assert train(run, *flags, "--resume") == 0
    recs, summary = train_records(run), json.loads((run / "summary.json").read_text())
    # steady steps: after the first 3 of each process: steps 4, 5 of the first session, 9, 10 of the second
    steady = {4: "first", 5: "first", 9: "second", 10: "second"}
    assert summary["tok_per_sec_steps"] == len(steady)
    flops = summary["flops_per_token"] * 256 * len(steady)
    capacity = sum(recs[s]["dt"] * peaks[session] for s, session in steady.items())  # world 1
    assert math.isclose(summary["mfu"], 100 * flops / capacity, rel_tol=1e-9)
    assert math.isclose(summary["tok_per_sec"], 256 * len(steady) / sum(recs[s]["dt"] for s in steady), rel_tol=1e-9)


FLOPS_PER_TOKEN, BATCH = 1_000_000, 1024


def run_of(loop: dict, world: int, device: str = "cpu") -> SimpleNamespace:
    return SimpleNamespace(args=SimpleNamespace(total_batch_size=BATCH), loop=loop, world=world,
                           plan={"flops_per_token": FLOPS_PER_TOKEN}, device=torch.device(device))


def session(loop: dict, dts: list[float], world: int, peak: float | None) -> None:
    """One process's steps as base_train counts them: the first WARMUP_STEPS are not steady."""
    for i, dt in enumerate(dts):
        loop["step"] = loop.get("step", 0) + 1
        train_end.count_step_time(loop, dt, i >= train_end.WARMUP_STEPS, world, peak)


def test_mfu_after_a_world_size_change_counts_each_steps_gpus(monkeypatch):
    """8 GPUs, then --resume-new-world-size 4 at the same per-GPU speed (steps twice as long): the MFU is the same
    in both sessions, so the run's is that one; the mean step time over the last session's 4 GPUs read 4/3 of it."""
    peak = 1e15
    monkeypatch.setattr(train_end, "peak_flops", lambda device: peak)  # the last session's GPUs, as before the fix
    loop = {}
    session(loop, [5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 8, peak)
    session(loop, [5.0, 2.0, 2.0, 2.0, 2.0, 2.0], 4, peak)
    out = train_end.throughput(run_of(loop, 4))
    assert out["tok_per_sec_steps"] == 6 and loop["train_time"] == 10.0 + 9.0 + 6.0
    one_session = mfu(FLOPS_PER_TOKEN * BATCH, 1.0, peak, 8)
    assert one_session == mfu(FLOPS_PER_TOKEN * BATCH, 2.0, peak, 4)
    assert out["mfu"] == pytest.approx(one_session, rel=1e-12)
    assert out["tok_per_sec"] == pytest.approx(6 * BATCH / 9.0, rel=1e-12)  # all steady tokens over their seconds


def test_mfu_is_unknown_once_a_steady_step_ran_on_a_gpu_of_unknown_peak(monkeypatch):
    monkeypatch.setattr(train_end, "peak_flops", lambda device: 1e15)
    loop = {}
    session(loop, [1.0] * 5, 1, None)  # an unlisted GPU
    session(loop, [1.0] * 5, 1, 1e15)
    assert loop["steady_peak_flop"] is None and train_end.throughput(run_of(loop, 1))["mfu"] is None
    assert train_end.throughput(run_of(loop, 1))["tok_per_sec"] == pytest.approx(BATCH)


def test_a_checkpoint_from_before_the_peak_flop_count_keeps_its_mfu(monkeypatch):
    """A loop without steady_peak_flop (older checkpoints): its steady steps count on the resuming session's GPUs,
    which is what summary.json's MFU took before; the steps after the resume add their own."""
    peak = 1e15
    monkeypatch.setattr(train_end, "peak_flops", lambda device: peak)
    old = {"step": 10, "train_time": 14.0, "steady_steps": 7, "steady_time": 7.0}
    assert train_end.throughput(run_of(dict(old), 2))["mfu"] == pytest.approx(
        mfu(FLOPS_PER_TOKEN * BATCH, 1.0, peak, 2), rel=1e-12)
    loop = dict(old)
    session(loop, [3.0, 3.0, 3.0, 1.0], 2, peak)
    assert loop["steady_peak_flop"] == pytest.approx(8.0 * 2 * peak) and loop["steady_steps"] == 8
    assert train_end.throughput(run_of(loop, 2))["mfu"] == pytest.approx(
        mfu(FLOPS_PER_TOKEN * BATCH, 1.0, peak, 2), rel=1e-12)


def test_plot_curves_takes_a_null_metric_for_no_value(tmp_path, capsys):
    """A CPU run logs "mfu": null in every train record (no known peak): `plot curves --metric mfu` wrote an empty
    figure (exit 0, "[plot] wrote ..."); a null is no value: the run is left out, and with no run left it is the
    error of a metric no run has."""
    from scripts import plot

    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    for run, value in ((cpu, None), (gpu, 40.5)):
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "mfu": value}) + "\n"
                                                   for s in range(1, 4)))
    assert plot.main(["curves", str(cpu), "--metric", "mfu", "--out", str(tmp_path / "c")]) == 2
    assert "error: no run has 'mfu' values in its metrics.jsonl" in capsys.readouterr().err
    assert not list(tmp_path.glob("c.*"))
    assert plot.main(["curves", str(cpu), str(gpu), "--metric", "mfu", "--out", str(tmp_path / "c")]) == 0
    assert "cpu: no 'mfu' values, left out of the plot" in capsys.readouterr().err


def test_a_run_that_trained_no_step_has_no_all_steps_throughput():
    """Stopped before its first step (a signal during the set-up, a wall-time budget spent by it): summary.json said
    "tok_per_sec_all_steps": 0.0 (0 tokens over the 1e-9 s floor), which report.md printed as a measured 0 tok/s."""
    from nanochat.report import fmt_throughput

    out = train_end.throughput(run_of({"step": 0, "train_time": 0.0}, 1))
    assert out["tok_per_sec"] is None and out["mfu"] is None and out["tok_per_sec_all_steps"] is None
    assert "all steps" not in fmt_throughput(out) and fmt_throughput(out).startswith("n/a")


def test_wall_time_counts_the_sessions_set_up(tmp_path, monkeypatch):
    """summary.json's wall_time_s is documented (scripts.results WALL_NOTE) as start-up to the end of the final
    evaluation, as --max-wall-time-seconds counts; it began after the set-up (data, model build, checkpoint load),
    which a 1 s sleep in the set-up shows: the wall time fell 1 s short of the time to the summary's write."""
    real_prepare = base_train.prepare_resume

    def slow_prepare(run):
        time.sleep(1.0)
        return real_prepare(run)

    monkeypatch.setattr(base_train, "prepare_resume", slow_prepare)
    run = tmp_path / "r"
    before = time.time()
    assert train(run, "--num-iterations", "1") == 0
    written = (run / "summary.json").stat().st_mtime
    wall = json.loads((run / "summary.json").read_text())["wall_time_s"]
    assert written - before - 0.5 < wall <= written - before


def test_per_gpu_throughput_after_a_world_size_change_counts_each_sessions_gpus(tmp_path):
    """scripts.results shows tok/s per GPU: summary.json's tok/s (all the run's GPUs) over its world_size, which is
    the LAST session's. 8 GPUs, then --resume-new-world-size 4 at the same per-GPU speed: it read 1/3 more per GPU
    than either session ran at. summary.json now has tok_per_sec_per_gpu (steady tokens over steady GPU-seconds)."""
    from test_results_seeds import DONE, table, write_seed

    loop = {}
    session(loop, [5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 8, None)  # 3 steady steps of 8 GPUs x 1 s
    session(loop, [5.0, 2.0, 2.0, 2.0, 2.0, 2.0], 4, None)  # 3 of 4 GPUs x 2 s: the same GPU-seconds per step
    out = train_end.throughput(run_of(loop, 4))
    per_gpu = 6 * BATCH / (3 * 8 * 1.0 + 3 * 4 * 2.0)
    assert out["tok_per_sec_per_gpu"] == pytest.approx(per_gpu, rel=1e-12)
    runs = tmp_path / "runs"
    write_seed(runs, "base", "seed42", {**DONE, "val_bpb": 0.9, "world_size": 4, **out})
    md, cells = table(tmp_path, runs)
    assert cells("Base")["tok/s per GPU"] == f"{per_gpu:,.0f}", md


def test_report_shows_tok_per_sec_per_gpu_where_the_run_had_several():
    from nanochat.report import fmt_throughput

    assert fmt_throughput({"tok_per_sec": 4000.0, "tok_per_sec_per_gpu": 1000.0}) == "4,000 (per GPU: 1,000)"
    assert fmt_throughput({"tok_per_sec": 1000.0, "tok_per_sec_per_gpu": 1000.0}) == "1,000"


def test_eta_uses_this_sessions_steady_steps():
    """The step line's ETA was the run's mean steady step over every session: resumed on 4 of its 8 GPUs (steps
    twice as long), 10 steps left read (10 x 1 s + 3 x 2 s) / 13 x 10 = 12.3 s instead of 20 s."""
    loop = {}
    session(loop, [5.0, 1.0, 1.0, 1.0] + [1.0] * 9, 8, None)  # 10 steady steps of 1 s
    assert train_end.eta_seconds(loop, 0, 0.0, 10) == pytest.approx(10.0)  # the run's until this session has one
    assert train_end.eta_seconds(loop, 3, 6.0, 10) == pytest.approx(20.0)
    assert train_end.eta_seconds(loop, 3, 6.0, 0) == 0.0
    assert math.isnan(train_end.eta_seconds({"step": 2, "train_time": 9.0}, 0, 0.0, 10))


def test_mfu_n_a_names_the_session_device_without_a_known_peak():
    """A run resumed from an unlisted GPU onto an H100 has no MFU (a steady step ran at an unknown peak); report.md
    said "no peak FLOP/s known for NVIDIA H100 80GB HBM3", the last session's GPU, whose peak is known."""
    from nanochat.report import NA, fmt_mfu

    odd = {"device_type": "cuda", "device_name": "NVIDIA H800"}
    h100 = {"device_type": "cuda", "device_name": "NVIDIA H100 80GB HBM3"}
    summary = {"mfu": None, "tok_per_sec": 1e5}
    assert fmt_mfu(summary, h100, [odd, h100]) == f"{NA} (no peak FLOP/s known for NVIDIA H800)"
    assert fmt_mfu(summary, odd, [odd]) == f"{NA} (no peak FLOP/s known for NVIDIA H800)"
    assert fmt_mfu(summary, h100) == f"{NA} (no peak FLOP/s known for NVIDIA H100 80GB HBM3)"  # no sessions given
