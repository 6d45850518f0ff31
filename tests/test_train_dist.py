"""Trainer under torchrun (gloo) and under signals; subprocess tests."""

import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO, run_torchrun
from test_train_e2e import TINY, losses

BATCH = ["--device-batch-size", "2", "--total-batch-size", "256"]


def test_two_process_torchrun_matches_one_process(tmp_path):
    script = REPO / "scripts" / "base_train.py"
    args = [*TINY, *BATCH, "--num-iterations", "3", "--memory", "ve"]
    r1 = run_torchrun(script, 1, [*args, "--run-dir", str(tmp_path / "one")])
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = run_torchrun(script, 2, [*args, "--run-dir", str(tmp_path / "two")])
    assert r2.returncode == 0, r2.stderr[-3000:]
    l1, l2 = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert l1.keys() == l2.keys() == {1, 2, 3}
    for s in l1:
        assert abs(l1[s] - l2[s]) < 1e-5, (s, l1[s], l2[s])
    plan = json.loads((tmp_path / "two" / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["grad_accum_steps"] == 2


def test_sigterm_saves_and_resume_continues_exactly(tmp_path):
    run, ref = tmp_path / "sig", tmp_path / "ref"
    flags = [*TINY, *BATCH, "--num-iterations", "40"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "scripts.base_train", *flags, "--run-dir", str(run)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and 3 <= summary["step"] < 40, summary
    assert f"step_{summary['step']:06d}" in out and "continue with --resume" in out
    r = subprocess.run([*cmd, "--resume"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "scripts.base_train", *flags, "--run-dir", str(ref)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(run) == losses(ref)  # interrupted + resumed == uninterrupted, bit for bit
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "completed"
