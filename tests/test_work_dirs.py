"""Hidden work folders of runs killed midway (nanochat.work_dirs): the analyses' ``.partial-*`` stage and
make_core_subset's ``.<out>.*`` folder are removed by a later run when their owner is provably gone (a real SIGKILLed
child), never when it lives (a live child; a lock held in another pid namespace) or when the name does not say."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nanochat import work_dirs
from nanochat.analysis import staged_outputs

REPO = Path(__file__).resolve().parents[1]

STAGING_CHILD = """
import sys, time
from pathlib import Path
from nanochat.analysis import staged_outputs
with staged_outputs(Path(sys.argv[1])) as stage:
    (stage / "memory_use.json").write_text("{}")
    print("ready", flush=True)
    time.sleep(600)
"""

# stops make_core_subset between its two renames (--out moved aside, the new subset not yet in): the one moment a
# kill leaves --out's only copy inside the work folder
SUBSET_CHILD = """
import sys, time
from pathlib import Path
from scripts import make_core_subset
real = Path.rename
def rename(self, target):
    if self.name == "new" and Path(target) == Path(sys.argv[2]):
        print("ready", flush=True)
        time.sleep(600)
    return real(self, target)
Path.rename = rename
make_core_subset.main(["--src", sys.argv[1], "--out", sys.argv[2], "--rows", "3"])
"""


def start(code: str, *args) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout.readline() == "ready\n"
    return child


def sigkill(child: subprocess.Popen) -> int:
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    return child.pid


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_later_analysis_removes_the_stage_of_a_killed_one_and_nothing_else(tmp_path, capsys):
    out = tmp_path / "analysis"
    killed = start(STAGING_CHILD, out)
    (left,) = hidden(out)
    dead_pid = sigkill(killed)
    live = start(STAGING_CHILD, out)  # removes the killed one's stage as it starts its own
    try:
        (live_stage,) = hidden(out)
        assert live_stage != left
        host, boot = work_dirs._host(), work_dirs._boot()
        other_boot = "f" * 8 if boot != "f" * 8 else "e" * 8
        kept = [".partial-mine", ".partial-ab12cd34",  # a user's folder; the older form, which names no owner
                f".partial-{dead_pid}-{'0' * 8 if host != '0' * 8 else '1' * 8}-{boot}.abcd1234",  # another host
                f".partial-{os.getpid()}-{host}-{boot}.abcd1234",  # a live pid (its lock free: a reused pid)
                f".partial-{dead_pid}-{host}-{boot}.locked12"]  # a dead pid here, its lock held (a container's)
        gone = [f".partial-{dead_pid}-{host}-{other_boot}.abcd1234"]  # this host before a reboot
        for name in kept + gone:
            (out / name).mkdir()
        (out / ".partial-file").write_text("not a folder")
        held = os.open(out / kept[-1], os.O_RDONLY)
        try:
            work_dirs.try_flock(held)
            capsys.readouterr()
            with staged_outputs(out) as stage:
                (stage / "memory_use.json").write_text("[]")
        finally:
            os.close(held)
        assert hidden(out) == sorted([live_stage, ".partial-file", *kept])
        assert (out / "memory_use.json").read_text() == "[]"
        err = capsys.readouterr().err
        assert err == f"removed 1 work folder(s) left in {out} by runs killed midway: {gone[0]}\n", err
    finally:
        sigkill(live)
    assert live.stderr.read() == f"removed 1 work folder(s) left in {out} by runs killed midway: {left}\n"


def test_a_killed_core_subset_build_is_cleaned_and_its_old_subset_kept(tmp_path, capsys):
    """Killed between moving --out aside and moving the new subset in: the next build puts the old subset back
    before removing the work folder, so its hand-written README.md survives into the rebuild."""
    from nanochat.eval_bundle import SUBSET_DIR
    from scripts import make_core_subset

    src, out = tmp_path / "shared", tmp_path / "subset"
    src.mkdir()
    (src / "eval_bundle").symlink_to(SUBSET_DIR)
    assert make_core_subset.main(["--src", str(src), "--out", str(out), "--rows", "3"]) == 0
    (out / "README.md").write_text("where these rows came from\n")
    sigkill(start(SUBSET_CHILD, src, out))
    assert not out.exists() and len(hidden(tmp_path)) == 1
    (left,) = hidden(tmp_path)
    capsys.readouterr()
    assert make_core_subset.main(["--src", str(src), "--out", str(out), "--rows", "3"]) == 0
    assert hidden(tmp_path) == [] and (out / "README.md").read_text() == "where these rows came from\n"
    assert f"by runs killed midway: {left}\n" in capsys.readouterr().err


@pytest.mark.parametrize("name", [".partial-x", "partial-1-a-b.c"])
def test_remove_stale_leaves_names_without_an_owner(tmp_path, name):
    (tmp_path / name).mkdir()
    assert work_dirs.remove_stale(tmp_path, ".partial-") == [] and (tmp_path / name).is_dir()


def test_remove_stale_keeps_a_folder_whose_pid_no_process_can_have(tmp_path):
    name = f".partial-{2 ** 70}-{work_dirs._host()}-{work_dirs._boot()}.abcd1234"  # os.kill: OverflowError
    (tmp_path / name).mkdir()
    assert work_dirs.remove_stale(tmp_path, ".partial-") == [] and (tmp_path / name).is_dir()


def test_in_use_names_the_folders_a_run_may_still_be_using(tmp_path):
    """A live run's folder (this process's) and another host's (its owner cannot be checked from here) are in use;
    a folder of a pid now gone and folders named otherwise are not; in_use removes nothing."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host, boot = work_dirs._host(), work_dirs._boot()
    live = tmp_path / f".w-{os.getpid()}-{host}-{boot}.abc"
    stale = tmp_path / f".w-{gone.pid}-{host}-{boot}.abc"
    other_host = tmp_path / f".w-{gone.pid}-{'0' * 8 if host != '0' * 8 else '1' * 8}-{boot}.abc"
    others = [tmp_path / ".w-a user's", tmp_path / f".w-z1-{host}-{boot}.abc"]
    for folder in (live, stale, other_host, *others):
        folder.mkdir()
    assert work_dirs.in_use(tmp_path, ".w-") == sorted([live, other_host])
    assert all(p.is_dir() for p in (live, stale, other_host, *others))


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP", "ENOSYS"])
def test_without_file_locks_only_a_dead_pid_of_this_boot_proves_a_folder_stale(tmp_path, monkeypatch, code):
    """A file system without flock (Lustre without -o flock, NFS with nolock for other nodes) cannot show that a
    folder's owner lives. A folder of our host name but another boot id may be a live run on another node whose
    container has the same host name: it is kept (before: removed, its lock counted as free). A folder of this boot
    whose pid is gone is still removed."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host, boot = work_dirs._host(), work_dirs._boot()
    other_boot = "0" * 8 if boot != "0" * 8 else "1" * 8
    elsewhere = tmp_path / f".w-{gone.pid}-{host}-{other_boot}.abc"
    stale = tmp_path / f".w-{gone.pid}-{host}-{boot}.abc"
    for folder in (elsewhere, stale):
        folder.mkdir()
    assert work_dirs.in_use(tmp_path, ".w-") == [elsewhere]
    assert work_dirs.remove_stale(tmp_path, ".w-") == [stale]
    assert elsewhere.is_dir() and not stale.exists()
    with work_dirs.work_dir(tmp_path, ".w-") as own:  # a work folder of its own still works without flock
        assert own.is_dir()
    assert not own.exists()
