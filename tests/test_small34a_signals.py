"""SIGUSR1, Slurm's pre-emption notice (`sbatch --signal=USR1@90`), stops a run as SIGTERM does: base_train saves at
the step boundary, base_eval's evaluation ends with what finished kept. Its default action would kill the process
without a checkpoint. Slurm signals every process of the job step, torchrun's workers included (they run in sessions
of their own); torchrun itself does not handle SIGUSR1 unless told (--signals-to-handle), and dies of it."""

import json
import os
import signal
import sys
import time
from contextlib import contextmanager

import pytest

import torchrun_forked
from _mid_step_signal_worker import signal_during_step
from conftest import REPO, torchrun_env
from nanochat import checkpoint as ckpt
from nanochat.eval_resume import Interrupted, interrupts_raise
from scripts import base_train
from test_launcher_watch import HANG_GUARD_S, children, wait_until
from test_signal_step import assert_stopped_at
from test_speedrun import alive
from test_train_e2e import TINY, train


SPEEDRUN_TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"  # torchrun's defaults plus SIGUSR1


class Unhandled(Exception):
    """SIGUSR1 reached the handler the test installed: the code under test did not install its own."""


@contextmanager
def sigusr1_not_fatal():
    """Before the fix SIGUSR1's default action would kill pytest itself: a handler that raises stands in for it."""
    def unhandled(signum, frame):
        raise Unhandled("SIGUSR1 was not caught by the code under test")

    previous = signal.signal(signal.SIGUSR1, unhandled)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_sigusr1_during_step_k_saves_step_k(tmp_path, monkeypatch, capsys):
    run = tmp_path / "r"
    monkeypatch.setattr(base_train, "train_step", signal_during_step(base_train.train_step, 3, signal.SIGUSR1))
    with sigusr1_not_fatal():
        assert train(run, "--num-iterations", "8") == 0
        assert signal.getsignal(signal.SIGUSR1).__name__ == "unhandled"  # the run gave the previous handler back
    assert_stopped_at(run, 3, "signal SIGUSR1", capsys.readouterr().out)
    assert json.loads((run / "summary.json").read_text())["signal"] == "SIGUSR1"


def test_sigusr1_interrupts_an_evaluation():
    with sigusr1_not_fatal(), pytest.raises(Interrupted) as stopped:
        with interrupts_raise():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(5)  # the handler runs at the next bytecode; never reached
    assert stopped.value.signum == signal.SIGUSR1


# The Slurm-like case that needs no flag and the forwarding that speedrun.sh sets up: a launch each (~10 s at rest)
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the workers")
@pytest.mark.parametrize("how", ["slurm", "forwarded"])
def test_sigusr1_under_torchrun_saves(tmp_path, how):
    """slurm: as Slurm's --signal=USR1 does, SIGUSR1 to each worker and to torchrun (default flags: it dies of it,
    rc -10; the launcher watch's later SIGTERM changes nothing). forwarded: to torchrun alone, told to handle it
    (PET_SIGNALS_TO_HANDLE, which speedrun.sh exports; the env form of --signals-to-handle): it passes it on, waits
    for the workers and exits 1 (its SignalException), as on SIGTERM. Either way both ranks latch SIGUSR1, agree at
    the step's stop vote, save the step and write summary.json naming SIGUSR1."""
    run = tmp_path / "run"
    argv = ["--standalone", "--nproc_per_node=2", "-m", "scripts.base_train", *TINY, "--device-batch-size", "2",
            "--total-batch-size", "256", "--num-iterations", "1000000", "--run-dir", str(run)]
    env = torchrun_env(PET_SIGNALS_TO_HANDLE=SPEEDRUN_TORCHRUN_SIGNALS) if how == "forwarded" else torchrun_env()
    env = {k: v for k, v in env.items() if how == "forwarded" or k != "PET_SIGNALS_TO_HANDLE"}
    workers = []
    with open(tmp_path / "out.txt", "w") as out:
        torchrun = torchrun_forked.Launch(argv, cwd=REPO, env=env, stdout=out)
    try:
        metrics = run / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, "training steps")
        workers = children(torchrun.pid)
        assert len(workers) == 2, workers
        for pid in [*(workers if how == "slurm" else []), torchrun.pid]:
            os.kill(pid, signal.SIGUSR1)
        assert torchrun.wait(HANG_GUARD_S) == (-signal.SIGUSR1 if how == "slurm" else 1)
        wait_until(lambda: not any(map(alive, workers)), "worker exit")
        summary = json.loads((run / "summary.json").read_text())
        assert summary["stop_reason"] == "interrupted" and summary["signal"] == "SIGUSR1", summary
        step = summary["step"]
        assert (ckpt.step_dir(run, step) / "model.pt").is_file()
        assert json.loads(metrics.read_text().splitlines()[-1]).get("step") == step
    finally:
        for pid in filter(alive, workers):
            os.kill(pid, signal.SIGKILL)
        torchrun.kill()
        torchrun.wait()
