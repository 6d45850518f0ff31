"""A run whose output reader goes away (its scripts.run runner killed, a `| tee` stopped, a closed ssh terminal)
keeps running and still saves on SIGTERM: scripts.run's children get SIGTERM when the runner dies (PR_SET_PDEATHSIG),
and a SIGTERM is of no use if the next progress line then kills the run on the dead pipe before it can save."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nanochat.lost_output import survive_lost_output

REPO = Path(__file__).resolve().parents[1]
TINY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
        "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core",
        "--device-batch-size", "4", "--total-batch-size", "256"]


def test_a_write_to_a_pipe_with_no_reader_is_dropped_and_later_writes_go_nowhere():
    read_end, write_end = os.pipe()
    raw = os.fdopen(write_end, "w", buffering=1)
    stream = survive_lost_output(raw)
    stream.write("seen\n")
    assert os.read(read_end, 100) == b"seen\n"
    os.close(read_end)  # the reader goes away
    assert stream.write("lost\n") == len("lost\n")  # BrokenPipeError without the wrapper
    stream.write("x" * 100_000)  # more than a pipe buffer: would block or fail on the pipe itself
    stream.flush()
    assert stream.fileno() == write_end  # everything else is the wrapped stream's
    os.fstat(write_end)  # still open: now /dev/null
    raw.close()


def test_other_write_errors_still_raise(tmp_path):
    full = Path("/dev/full")
    if not full.exists():
        pytest.skip("no /dev/full")
    stream = survive_lost_output(open(full, "w"))
    with pytest.raises(OSError):  # ENOSPC is no lost reader: it must not be hidden
        stream.write("x")
        stream.flush()


def test_the_runners_say_points_a_stdout_with_no_reader_at_devnull(monkeypatch):
    """scripts.run's own lines (and its child's, echoed) once nobody reads them: the line is dropped, the same file
    descriptor now writes to /dev/null, and neither that line nor a later one raises."""
    from scripts.run import say

    read_end, write_end = os.pipe()
    raw = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", raw)
    say("seen\n")
    assert os.read(read_end, 100) == b"seen\n"
    os.close(read_end)  # the reader goes away
    say("lost\n")  # BrokenPipeError without the redirect
    devnull = os.stat(os.devnull)
    assert (os.fstat(write_end).st_dev, os.fstat(write_end).st_ino) == (devnull.st_dev, devnull.st_ino)
    say("x" * 100_000)  # more than a pipe buffer: would block or fail on the pipe itself
    raw.close()


def test_base_train_saves_on_sigterm_after_its_output_reader_died(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "scripts.base_train", *TINY, "--num-iterations", "100000",
                             "--log-every", "1", "--run-dir", str(run)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    watchdog = threading.Timer(300, proc.kill)  # a hung run fails the test instead of holding the suite
    watchdog.start()
    try:
        seen = b""
        while b"step 00003/" not in seen:  # training, printing a line per step
            chunk = proc.stdout.read1(4096)
            assert chunk, f"base_train ended early: {seen.decode(errors='replace')[-2000:]}"
            seen += chunk
        proc.stdout.close()  # the reader dies: every later line of base_train hits a pipe with no reader
        time.sleep(0.5)
        assert proc.poll() is None, "base_train died on its dead stdout"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted"
    assert list((run / "checkpoints").glob("step_*"))
