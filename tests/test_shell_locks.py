"""scripts/one_at_a_time.sh, the one rule of the shell scripts' locks (test.sh, setup_env.sh, speedrun.sh): only
flock's exit 75 (-E) means another process holds the lock; any other failure -- a file system without locks, NFS
with a read-only descriptor, a flock older than -E, no flock at all -- goes on unlocked with one line. Real
processes hold the locks here; a fake `flock` earlier on PATH stands for a file system where it fails."""

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

HELPER = REPO / "scripts" / "one_at_a_time.sh"
NOTE = "not checking for another one"
FLOCK_HELP = "Usage:\n flock [options] <fd>\n -E, --conflict-exit-code <number>  exit code after conflict\n"
# util-linux before 2.22 (and busybox): no -E, a usage error and the whole usage text for it
OLD_FLOCK_HELP = "flock (util-linux 2.17.2)\nUsage: flock [-sxun][-w #] fd#\n"

# the locks' files (one_at_a_time.sh's VENV_LOCK, TEST_LOCK), relative to the checkout: untracked, so that no
# `git pull` replaces one (a new inode) under a run that holds it
VENV_LOCK, TEST_LOCK = ".venv.lock", ".test.lock"

needs_flock = pytest.mark.skipif(shutil.which("flock") is None, reason="no flock command (util-linux)")


def write_exe(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def failing_flock(bin_dir: Path, rc: int = 71, message: str = "flock: 8: No locks available",
                  old: bool = False) -> str:
    """A `flock` that fails as it does where the file system has no locks (ENOLCK: 71), on NFS with a read-only
    descriptor (EBADF: 65), or (old=True) as a flock without -E does (64, usage on stderr). Returns a PATH with it
    first."""
    usage = OLD_FLOCK_HELP if old else FLOCK_HELP
    usage_error = f"printf '%s' '{usage}' >&2" if old else ""
    write_exe(bin_dir / "flock", f"""#!/bin/sh
if [ "$1" = --help ]; then printf '%s' '{usage}'; exit 0; fi
echo '{message}' >&2
{usage_error}
exit {rc}
""")
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def venv_lock(repo: Path, mode: str) -> int:
    """Whether .venv's lock in checkout `repo` can be taken now: 0, or 75 when another process holds one that
    excludes `mode` (-x, -s)."""
    return subprocess.run(["flock", "-n", "-E", "75", mode, str(repo / VENV_LOCK), "true"], timeout=60).returncode


def lock_now(tmp_path: Path, mode: str = "-x", path: str | None = None) -> tuple[int, str]:
    """lock_now on a fresh descriptor of tmp_path/lock in a new bash: (its return, what it printed)."""
    lock = tmp_path / "lock"
    lock.touch()
    script = f'. "{HELPER}"; exec 8<"{lock}"; lock_now 8 {mode} t "{lock}" "{NOTE}"; echo "rc=$?"'
    env = {**os.environ, "PATH": path or os.environ["PATH"]}
    r = subprocess.run([shutil.which("bash"), "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    *lines, rc = r.stdout.splitlines()
    return int(rc.removeprefix("rc=")), "\n".join(lines)


@needs_flock
@pytest.mark.parametrize("held,mode,rc", [("-x", "-x", 75), ("-x", "-s", 75), ("-s", "-x", 75), ("-s", "-s", 0),
                                          (None, "-x", 0)])
def test_only_a_lock_another_process_holds_is_a_conflict(tmp_path, held, mode, rc):
    holder = None
    if held:
        (tmp_path / "lock").touch()
        holder = subprocess.Popen(["flock", "-o", held, str(tmp_path / "lock"), "sh", "-c", "echo held; exec sleep 60"],
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert holder.stdout.readline() == "held\n"
    try:
        assert lock_now(tmp_path, mode) == (rc, "")
    finally:
        if holder:
            os.killpg(holder.pid, signal.SIGKILL)  # flock (-o: it alone holds the lock) and its sleep
            holder.wait()
    assert lock_now(tmp_path, "-x") == (0, "")  # a holder's end frees it


@pytest.mark.parametrize("rc,message", [(71, "flock: 8: No locks available"), (65, "flock: 8: Bad file descriptor"),
                                        (1, "")])
def test_a_lock_flock_cannot_take_is_no_other_run(tmp_path, rc, message):
    got = lock_now(tmp_path, path=failing_flock(tmp_path / "bin", rc, message))
    assert got == (0, f"[t] cannot lock {tmp_path / 'lock'} (flock exit {rc}{': ' + message if message else ''}): "
                      f"{NOTE}")


def test_a_flock_without_conflict_exit_codes_says_so_in_one_line(tmp_path):
    """Its usage error (64) is no lock failure, and its usage text is not printed."""
    path = failing_flock(tmp_path / "bin", 64, "flock: invalid option -- 'E'", old=True)
    assert lock_now(tmp_path, path=path) == (0, f"[t] cannot lock {tmp_path / 'lock'}: this flock has no -E "
                                                f"(util-linux before 2.22, busybox): {NOTE}")


def test_no_flock_command_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    assert lock_now(tmp_path, path=str(tmp_path / "empty")) == (0, f"[t] no flock command: {NOTE}")


def test_a_lock_file_that_cannot_be_opened_is_no_other_run(tmp_path):
    """A checkout this user cannot write has no lock file to open for writing (here a directory stands in the way:
    root writes anywhere): one line, and the caller goes on, unlocked."""
    (tmp_path / "lock").mkdir()
    script = f'set -euo pipefail; . "{HELPER}"; one_at_a_time 8 "{tmp_path / "lock"}" t "waiting"; echo "went on"'
    r = subprocess.run([shutil.which("bash"), "-c", script], capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout == f"[t] cannot open {tmp_path / 'lock'} to lock it (Is a directory): not waiting for another " \
                       "run in this checkout\nwent on\n"
