"""speedrun.sh and Slurm's pre-emption notice (SIGUSR1, `sbatch --signal=USR1@90`), on test_speedrun's fake steps;
Ctrl-C in its preflight checks."""

import json
import os
import signal
import time

import pytest

import test_speedrun
from conftest import REPO
from scripts import speedrun_preflight as pre
from test_speedrun import alive, ran, start_speedrun, wait_for_training

fake_speedrun = test_speedrun.fake_speedrun  # the fixture

LATCHED = "for sig in (signal.SIGINT, signal.SIGTERM):"


@pytest.fixture
def usr1_speedrun(fake_speedrun):
    """fake_speedrun whose fake base_train latches SIGUSR1 too (as the real one does) and whose fake torchrun
    records the PET_SIGNALS_TO_HANDLE it was started with."""
    repo, env = fake_speedrun
    python = repo / ".venv" / "bin" / "python"
    text = python.read_text()
    assert text.count(LATCHED) == 1
    python.write_text(text.replace(LATCHED, "for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):"))
    torchrun = repo / ".venv" / "bin" / "torchrun"
    torchrun.write_text('#!/bin/sh\nprintf %s "${PET_SIGNALS_TO_HANDLE-unset}" >"$FAKE_LOG.signals"\nshift 2\n'
                        'exec python "$@"\n')
    return repo, env


def test_sigusr1_to_every_process_stops_the_demo_as_sigterm_does(usr1_speedrun):
    """Slurm signals every process of the step (here: speedrun.sh's process group). speedrun.sh used to die of it
    (exit -10), its step saving unseen; now the step saves and speedrun.sh says where it stopped, exit 1."""
    repo, env = usr1_speedrun
    proc = start_speedrun(repo, env)
    child = wait_for_training(repo, proc)
    try:
        os.killpg(proc.pid, signal.SIGUSR1)
        out, err = proc.communicate(timeout=20)
        assert not alive(child), "the training step was left running after speedrun.sh exited"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
    assert proc.returncode == 1, (proc.returncode, err)
    summary = json.loads((repo / "runs" / "speedrun_cpu" / "base" / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["signals"][0] == "SIGUSR1", summary
    assert "CPU demo interrupted" in err
    assert not any("mome" in line for line in ran(env["FAKE_LOG"], "scripts.base_train"))


@pytest.mark.parametrize("preset", [None, "SIGTERM,SIGUSR2"])
def test_the_gpu_path_tells_torchrun_to_pass_sigusr1_on(usr1_speedrun, tmp_path, preset):
    """torchrun handles SIGTERM,SIGINT,SIGHUP,SIGQUIT by default and dies of a SIGUSR1 (its workers then save on their
    own, tests/test_small34a_signals.py); speedrun.sh adds SIGUSR1, and leaves a list the user set alone."""
    repo, env = usr1_speedrun
    env = {k: v for k, v in env.items() if k != "PET_SIGNALS_TO_HANDLE"}
    env.update({"FAKE_MODE": "gpu 1", "NANOCHAT_DATA_DIR": str(tmp_path / "data"), "FAKE_TRAIN_S": "0"})
    if preset is not None:
        env["PET_SIGNALS_TO_HANDLE"] = preset
    proc = start_speedrun(repo, env)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and len(ran(env["FAKE_LOG"], "scripts.base_train")) == 1, err
    assert open(env["FAKE_LOG"] + ".signals").read() == (preset or "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")


# Ctrl-C in speedrun.sh's checks (scripts.speedrun_preflight in a command substitution): one line, exit 130, no
# Python traceback; speedrun.sh stops there with that status (set -e), or, where the check is an `if` (done), at
# its next step, saying so.
@pytest.mark.parametrize("argv, target", [(["layout", "--gpus", "2", "--", "--depth", "2"], "layout"),
                                          (["mode"], "probe"), (["done", "run", "--", "--depth", "2"], "demo_state")])
def test_ctrl_c_in_a_preflight_check_is_one_line_and_exit_130(monkeypatch, capsys, argv, target):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.delenv("SPEEDRUN_MODE", raising=False)
    monkeypatch.setattr(pre, target, interrupted)
    assert pre.main(argv) == 130
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [f"[speedrun] interrupted (Ctrl-C) during the {argv[0]} check"], err


@pytest.mark.slow  # ~10 s under load: the real check imports torch
def test_ctrl_c_in_speedruns_mode_check_ends_it_quietly(fake_speedrun, tmp_path):
    """The real check, stopped in its nvidia-smi probe (a stand-in that waits) by a terminal's Ctrl-C (the process
    group): speedrun.sh exits 130 with the check's one line; nothing after the check runs."""
    repo, env = fake_speedrun
    marker = tmp_path / "probing"
    smi = repo / ".venv" / "bin" / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ntouch "{marker}"\nexec sleep 30\n')
    smi.chmod(0o755)
    env = {k: v for k, v in env.items() if k not in ("SPEEDRUN_MODE", "CUDA_VISIBLE_DEVICES")}
    proc = start_speedrun(repo, env, FAKE_REAL_PREFLIGHT=str(REPO))
    for _ in range(3000):  # the check imports torch first: seconds under load
        if marker.exists():
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and "[speedrun] interrupted (Ctrl-C) during the mode check" in err, err
    assert ran(env["FAKE_LOG"], "scripts.prepare_data") == ran(env["FAKE_LOG"], "scripts.base_train") == []
