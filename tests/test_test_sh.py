"""scripts/test.sh: a second run in the same checkout waits for the first (its setup_env.sh may reinstall .venv);
while pytest runs it holds .venv's lock shared, so that an install waits for the tests; the
locks go with the run, not with a process it left behind. A fake checkout: setup_env.sh and python log what they
do, python until the test releases it."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from test_launcher_watch import wait_until
from test_shell_locks import TEST_LOCK, VENV_LOCK, failing_flock, venv_lock, write_exe

HANG_GUARD_S = 60  # far above what these take: only a hang reaches it

pytestmark = pytest.mark.skipif(shutil.which("flock") is None, reason="no flock command (util-linux)")

FAKE_PYTHON = """#!/usr/bin/env bash
echo "start $RUN" >>"$LOG"
if [ -n "${LEAVE_BEHIND:-}" ]; then sleep 600 & echo $! >"$LEAVE_BEHIND"; fi
while [ ! -e "$LOG.release.$RUN" ]; do sleep 0.05; done
echo "end $RUN" >>"$LOG"
"""
# The real one installs holding .venv's lock exclusively: test.sh must not hold it (shared) across this call,
# or the install would wait for test.sh, which waits for it. OTHER_INSTALL: another run's install (speedrun.sh's,
# a user's) takes the lock as this one returns, until the test releases it, and then finishes (ok) or not (fail).
FAKE_SETUP = """#!/usr/bin/env bash
cd "$(dirname "$0")/.."
flock -n -E 75 .venv.lock true 2>/dev/null || [ $? != 75 ] || {
    echo ".venv's lock held during setup" >&2; exit 9; }
echo "setup $RUN" >>"$LOG"
touch .venv/.setup_env.stamp
[ -n "${OTHER_INSTALL:-}" ] || exit 0
flock .venv.lock sh -c 'rm .venv/.setup_env.stamp; touch "$LOG.installing"
    while [ ! -e "$LOG.release.install" ]; do sleep 0.05; done
    [ "$OTHER_INSTALL" = fail ] || touch .venv/.setup_env.stamp' &
while [ ! -e "$LOG.installing" ]; do sleep 0.05; done
"""


@pytest.fixture
def checkout(tmp_path):
    repo = tmp_path / "repo"
    write_exe(repo / "scripts" / "test.sh", (REPO / "scripts" / "test.sh").read_text())
    (repo / "scripts" / "one_at_a_time.sh").write_text((REPO / "scripts" / "one_at_a_time.sh").read_text())
    write_exe(repo / "scripts" / "setup_env.sh", FAKE_SETUP)
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


@pytest.mark.parametrize("pull", [False, True])
def test_a_second_run_waits_for_the_first(checkout, pull):
    """pull: a `git pull` between the two writes a changed test.sh anew (a new inode): the lock is no tracked file,
    so the second still waits."""
    first, _ = start(checkout, "a")
    wait_until(lambda: "start a" in logged(checkout), "first pytest", HANG_GUARD_S)
    if pull:
        script = checkout / "scripts" / "test.sh"
        ino = script.stat().st_ino
        write_exe(checkout / "scripts" / "test.sh.pulled", script.read_text() + "# pulled\n")
        (checkout / "scripts" / "test.sh.pulled").replace(script)
        assert script.stat().st_ino != ino
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


def test_a_process_left_behind_does_not_hold_the_locks(checkout):
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
        assert venv_lock(checkout, "-x") == 0  # an install need not wait for it either
    finally:
        wait_until(lambda: left.exists() and left.read_text().strip(), "left-behind pid", HANG_GUARD_S)
        os.kill(int(left.read_text()), 9)


def test_pytest_runs_under_venvs_lock_shared(checkout):
    """An install (setup_env.sh holds its lock exclusively for one) waits until the tests end; another run's check
    of .venv (shared) does not."""
    run, out = start(checkout, "a")
    try:
        wait_until(lambda: "start a" in logged(checkout), "pytest", HANG_GUARD_S)
        assert (venv_lock(checkout, "-x"), venv_lock(checkout, "-s")) == (75, 0)
        release(checkout, "a")
        assert run.wait(HANG_GUARD_S) == 0, out.read_text()
    finally:
        run.kill()
        run.wait()
    assert venv_lock(checkout, "-x") == 0


@pytest.mark.parametrize("install", ["ok", "fail"])
def test_an_install_after_setup_is_waited_for_and_must_finish(checkout, install):
    """Another run's install (speedrun.sh, a user) that takes .venv between test.sh's setup_env.sh and its pytest:
    the tests wait for it, and run only on a .venv it finished (its stamp)."""
    release(checkout, "a")
    run, out = start(checkout, "a", OTHER_INSTALL=install)
    try:
        wait_until(lambda: "waiting" in out.read_text(), "waiting line", HANG_GUARD_S)
        assert out.read_text() == f"[test] scripts/setup_env.sh is installing .venv in {checkout}: waiting for it " \
                                  "to finish\n"
        assert logged(checkout) == ["setup a"]
        release(checkout, "install")
        assert run.wait(HANG_GUARD_S) == (0 if install == "ok" else 1), out.read_text()
    finally:
        release(checkout, "install")
        run.kill()
        run.wait()
    if install == "ok":
        assert logged(checkout) == ["setup a", "start a", "end a"]
    else:
        assert logged(checkout) == ["setup a"]
        assert "[test] .venv has no stamp of a finished install: another scripts/setup_env.sh changed it and did " \
               "not finish; run this again" in out.read_text()


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
    assert out.read_text().splitlines() == [f"[test] cannot lock {lock}{why}: not waiting for another run in this "
                                            "checkout" for lock in (TEST_LOCK, VENV_LOCK)]
    assert logged(checkout) == ["setup a", "start a", "end a"]


ARGV_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$@" >"$LOG.argv"
"""


@pytest.mark.parametrize("workers, expected", [(None, "2"), ("", "2"), ("0", "0"), ("3", "3")])
def test_pytest_runs_in_test_workers_processes_a_file_each(checkout, monkeypatch, workers, expected):
    """Two pytest-xdist processes by default, each taking whole files (a file's module fixtures and shared launches
    run once) in collection order (conftest's LONGEST_FILES first); TEST_WORKERS=0 is one process. The user's
    arguments come after, so their -n or --dist wins."""
    monkeypatch.delenv("TEST_WORKERS", raising=False)
    write_exe(checkout.parent / "bin" / "python", ARGV_PYTHON)
    run, out = start(checkout, "a", **({} if workers is None else {"TEST_WORKERS": workers}))
    assert run.wait(HANG_GUARD_S) == 0, out.read_text()
    argv = (checkout.parent / "log.argv").read_text().splitlines()
    assert argv == ["-m", "pytest", "-q", "-n", expected, "--dist", "loadfile", "--no-loadscope-reorder"]


@pytest.mark.parametrize("workers", ["two", "-1", "2.5"])
def test_a_test_workers_that_is_no_count_is_refused(checkout, workers):
    write_exe(checkout.parent / "bin" / "python", ARGV_PYTHON)
    run, out = start(checkout, "a", TEST_WORKERS=workers)
    assert run.wait(HANG_GUARD_S) == 2
    assert f"[test] TEST_WORKERS must be a whole number of pytest processes, 0 for one process (got '{workers}')" \
        in out.read_text()
    assert not (checkout.parent / "log.argv").exists()  # pytest never started
