"""nanochat.launcher_watch: a worker whose launcher is SIGKILLed stops as on SIGTERM (a fake launcher; torchrun)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import base_eval_fixtures
import torchrun_forked
from conftest import REPO, torchrun_env
from nanochat import checkpoint as ckpt
from nanochat import launcher_watch
from test_speedrun import alive
from test_train_e2e import TINY

WORKER = Path(__file__).parent / "_launcher_watch_worker.py"
EVAL_WORKER = Path(__file__).parent / "_launcher_watch_eval_worker.py"
HANG_GUARD_S = 300  # far above the seconds these take: only a hang reaches it

tiny_run = base_eval_fixtures.tiny_run  # the fixture (module scope)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for process states")


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):  # exited while we looked
            pass
    return out


def wait_until(condition, what: str, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def test_plain_run_is_not_watched():
    assert launcher_watch.watch_launcher(environ={}) is None


def test_watcher_signals_at_once_when_the_parent_is_not_the_launcher(monkeypatch, capfd):
    """The pid watched is not this process's parent (its launcher exited): one SIGTERM to itself, a line on stderr."""
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    launcher_watch._watch(os.getppid() + 1, poll_s=0.01)
    assert sent == [(os.getpid(), signal.SIGTERM)]
    assert f"launcher (pid {os.getppid() + 1}) exited" in capfd.readouterr().err


@pytest.mark.parametrize("watched", [True, False], ids=["torchrun_env", "plain"])
def test_worker_stops_when_its_launcher_is_killed(tmp_path, watched):
    launcher = subprocess.Popen([sys.executable, str(WORKER), "launcher", str(tmp_path), *(["watch"] if watched else [])],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    worker = int(launcher.stdout.readline())
    try:
        wait_until(lambda: (tmp_path / "ready").exists(), "worker start")
        assert int((tmp_path / "ready").read_text()) == launcher.pid
        time.sleep(0.5)  # 10 polls with the launcher alive: no signal
        assert alive(worker) and not (tmp_path / "stopped").exists()
        launcher.kill()
        launcher.wait()
        if watched:
            wait_until(lambda: not alive(worker), "worker exit")
            assert (tmp_path / "stopped").read_text() == "SIGTERM"
            assert f"launcher (pid {launcher.pid}) exited" in (tmp_path / "worker.err").read_text()
        else:  # a plain run outlives its parent (a shell's exit is the terminal's SIGHUP to report, or nohup's)
            time.sleep(1.0)
            assert alive(worker) and not (tmp_path / "stopped").exists()
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)
        launcher.kill()
        launcher.wait()


def drain_until_told(pipe, stop: threading.Event) -> None:
    """Read torchrun's output (shared with its workers) until ``stop``, then close the read end: the workers' next
    lines meet a pipe without a reader, as when the user's `| tee` died with the launcher."""
    for _ in iter(lambda: pipe.read1(4096), b""):
        if stop.is_set():
            break
    pipe.close()


def test_killed_torchrun_workers_save_and_exit(tmp_path):
    run = tmp_path / "run"
    argv = ["--standalone", "--nproc_per_node=2", "-m", "scripts.base_train", *TINY, "--device-batch-size", "2",
            "--total-batch-size", "256", "--num-iterations", "1000000", "--run-dir", str(run)]
    env = torchrun_env()
    read_end, write_end = os.pipe()
    with open(write_end, "wb") as write:  # the launcher holds its own copy
        torchrun = torchrun_forked.Launch(argv, cwd=REPO, env=env, stdout=write)
    stop_reading = threading.Event()
    reader = threading.Thread(target=drain_until_told, args=(open(read_end, "rb"), stop_reading), daemon=True)
    reader.start()
    workers = []
    try:
        metrics = run / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, "training steps")
        workers = children(torchrun.pid)
        assert len(workers) == 2, workers
        torchrun.kill()
        torchrun.wait()
        stop_reading.set()
        wait_until(lambda: not any(map(alive, workers)), "worker exit")
        summary = json.loads((run / "summary.json").read_text())
        assert summary["stop_reason"] == "interrupted" and summary["signal"] == "SIGTERM", summary
        step = summary["step"]
        assert 3 <= step < 1000000
        assert (ckpt.step_dir(run, step) / "model.pt").is_file()
        # the ranks agreed on the stop (a rank that went on would wait in the next step's reduction: no exit), and
        # the save is that of the last step trained
        last = json.loads(metrics.read_text().splitlines()[-1])
        assert last.get("step") == step, last
    finally:
        stop_reading.set()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        torchrun.kill()
        torchrun.wait()


def test_killed_torchrun_eval_ranks_stop_with_what_finished(tiny_run, tmp_path):
    """base_eval's ranks, in their second CORE task when torchrun is SIGKILLed, stop together as on SIGTERM: one
    line, the first task kept for a rerun, no report, the output directory's lock released."""
    from nanochat.run_dir import LOCK_FILE

    root, _, _, bundle = tiny_run
    out, log = tmp_path / "o", tmp_path / "log"
    argv = ["--standalone", "--nproc_per_node=2", str(EVAL_WORKER), str(tmp_path), "--run-dir", str(root / "run"),
            "--bundle", str(bundle), "--eval", "core", "--no-progress", "--device-type", "cpu", "--out-dir", str(out)]
    env = torchrun_env()
    with open(log, "w") as f:
        torchrun = torchrun_forked.Launch(argv, cwd=REPO, env=env, stdout=f)
    workers = []
    try:
        wait_until(lambda: all((tmp_path / f"in_task.{r}").exists() for r in (0, 1)), "second CORE task")
        workers = children(torchrun.pid)
        assert len(workers) == 2, workers
        torchrun.kill()
        torchrun.wait()
        wait_until(lambda: not any(map(alive, workers)), "worker exit")
        text = log.read_text()
        assert text.count("base_eval: interrupted (SIGTERM)") == 1, text[-3000:]
        assert text.count("exited: stopping this worker") == 2, text[-3000:]
        assert list(json.loads((out / "core.partial.json").read_text())["items"]) == ["mc"]
        assert not (out / "core.json").exists() and not (out / LOCK_FILE).exists()
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        torchrun.kill()
        torchrun.wait()
