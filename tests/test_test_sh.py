"""scripts/test.sh: a second run in the same checkout waits for the first (its setup_env.sh may reinstall .venv);
the lock goes with the run, not with a process it left behind. A fake checkout: setup_env.sh and python log what
they do, python until the test releases it."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from test_launcher_watch import wait_until
from test_shell_locks import failing_flock, write_exe

HANG_GUARD_S = 60  # far above what these take: only a hang reaches it

pytestmark = pytest.mark.skipif(shutil.which("flock") is None, reason="no flock command (util-linux)")

FAKE_PYTHON = """#!/usr/bin/env bash
echo "start $RUN" >>"$LOG"
if [ -n "${LEAVE_BEHIND:-}" ]; then sleep 600 & echo $! >"$LEAVE_BEHIND"; fi
while [ ! -e "$LOG.release.$RUN" ]; do sleep 0.05; done
echo "end $RUN" >>"$LOG"
"""



@pytest.fixture
def checkout(tmp_path):
    repo = tmp_path / "repo"
    write_exe(repo / "scripts" / "test.sh", (REPO / "scripts" / "test.sh").read_text())
    (repo / "scripts" / "one_at_a_time.sh").write_text((REPO / "scripts" / "one_at_a_time.sh").read_text())
    write_exe(repo / "scripts" / "setup_env.sh", 'echo "setup $RUN" >>"$LOG"\n')
    write_exe(tmp_path / "bin" / "python", FAKE_PYTHON)
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "activate").write_text(f'export PATH="{tmp_path / "bin"}:$PATH"\n')
    return repo


def start(repo: Path, run: str, **extra: str) -> tuple[subprocess.Popen, Path]:
    out = repo.parent / f"{run}.out"
    env = {**os.environ, "RUN": run, "LOG": str(repo.parent / "log"), **extra}
    with open(out, "w") as f:
        return subprocess.Popen(["bash", str(repo / "scripts" / "test.sh")], env=env, stdout=f,
                                stderr=subprocess.STDOUT), out


def logged(repo: Path) -> list[str]:
    log = repo.parent / "log"
    return log.read_text().splitlines() if log.exists() else []


def release(repo: Path, run: str) -> None:
    (repo.parent / f"log.release.{run}").touch()


def test_a_second_run_waits_for_the_first(checkout):
    first, _ = start(checkout, "a")
    wait_until(lambda: "start a" in logged(checkout), "first pytest", HANG_GUARD_S)
    second, out = start(checkout, "b")
    try:
        wait_until(lambda: "waiting for it to finish" in out.read_text() or "setup b" in logged(checkout),
                   "waiting line", HANG_GUARD_S)
        assert logged(checkout) == ["setup a", "start a"]  # the second neither set up .venv nor ran pytest
        release(checkout, "b")  # released in advance: it must still wait for the first
        release(checkout, "a")
        assert first.wait(HANG_GUARD_S) == 0 and second.wait(HANG_GUARD_S) == 0
        assert logged(checkout) == ["setup a", "start a", "end a", "setup b", "start b", "end b"]
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()


def test_a_process_left_behind_does_not_hold_the_lock(checkout):
    left = checkout.parent / "left.pid"
    release(checkout, "a")
    release(checkout, "b")
    first, _ = start(checkout, "a", LEAVE_BEHIND=str(left))
    try:
        assert first.wait(HANG_GUARD_S) == 0
        second, out = start(checkout, "b")
        assert second.wait(HANG_GUARD_S) == 0
        assert "waiting" not in out.read_text()
        assert logged(checkout) == ["setup a", "start a", "end a", "setup b", "start b", "end b"]
    finally:
        wait_until(lambda: left.exists() and left.read_text().strip(), "left-behind pid", HANG_GUARD_S)
        os.kill(int(left.read_text()), 9)


@pytest.mark.parametrize("old", [False, True])
def test_a_lock_that_cannot_be_taken_runs_unlocked(checkout, old):
    """flock(2) on NFS needs a file open for writing ("Bad file descriptor"); some file systems have no locks; a
    flock before util-linux 2.22 has no -E. That is no other run holding the lock: the suite runs, unlocked, and
    says so, one line a lock; it does not wait or fail."""
    message = "flock: invalid option -- 'E'" if old else "flock: 9: Bad file descriptor"
    path = failing_flock(checkout.parent / "stub", 64 if old else 1, message, old=old)
    release(checkout, "a")
    run, out = start(checkout, "a", PATH=path)
    assert run.wait(HANG_GUARD_S) == 0, out.read_text()
    why = ": this flock has no -E (util-linux before 2.22, busybox)" if old else f" (flock exit 1: {message})"
    assert out.read_text().splitlines() == [f"[test] cannot lock scripts/{script}{why}: not waiting for another run "
                                            "in this checkout" for script in ("test.sh",)]
    assert logged(checkout) == ["setup a", "start a", "end a"]
