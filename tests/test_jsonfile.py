"""nanochat.jsonfile's atomic write: a writer that fails leaves the old file and no temp file; writers of one file
at once never share a temp file; the file gets a plain open()'s permissions and reaches the disk before the rename."""

import os
import stat
from pathlib import Path

import pytest

from nanochat import jsonfile
from nanochat.jsonfile import is_temp_for, write_atomic, write_text_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    """A writer stopped midway (a full disk, Ctrl-C) after writing part of the temp file: ``path`` keeps its old
    content and the half-written temp file beside it is removed (it would be taken for an artifact otherwise)."""
    path = tmp_path / "f.bin"
    write_text_atomic(path, "old\n")

    def half_then(error):
        def write(tmp):
            tmp.write_bytes(b"ne")
            raise error
        return write

    # Ctrl-C is no Exception: an ``except Exception`` would leave the temp file
    for error in (OSError(28, "No space left on device"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            write_atomic(path, half_then(error))
        assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]
    write_atomic(path, lambda tmp: tmp.write_bytes(b"new"))
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_two_writers_of_one_file_at_once_each_rename_their_own_whole_file(tmp_path):
    """A second writer starts and finishes while the first is midway (two processes, as one deterministic
    interleaving): each writes a temp file of its own, so both succeed and ``path`` holds the last rename's whole
    content. Before: one fixed temp name, so the second truncated and renamed the first's half-written file and the
    first then failed (FileNotFoundError) on the rename."""
    path, temps = tmp_path / "f.json", []

    def first(tmp):
        temps.append(tmp)
        tmp.write_text('{"writer": ')
        write_atomic(path, second)
        assert tmp.read_text() == '{"writer": '  # untouched by the second writer
        with open(tmp, "a") as f:
            f.write('"first"}')

    def second(tmp):
        temps.append(tmp)
        tmp.write_text('{"writer": "second"}')

    write_atomic(path, first)
    assert path.read_text() == '{"writer": "first"}'
    assert temps[0] != temps[1] and all(is_temp_for(path, t) for t in temps)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_file_has_the_mode_a_plain_open_gives(tmp_path, umask):
    """What open() gives under the umask (0o666 less the umask), also when it replaces a file of another mode: a
    private temp file (mkstemp's 0600) would make every report unreadable to the group."""
    path = tmp_path / "f.json"
    path.write_text("old")
    path.chmod(0o640)
    before = os.umask(umask)
    try:
        write_text_atomic(path, "new")
        (tmp_path / "plain").write_text("x")
    finally:
        os.umask(before)
    want = 0o666 & ~umask
    assert stat.S_IMODE(path.stat().st_mode) == want == stat.S_IMODE((tmp_path / "plain").stat().st_mode)


def test_the_temp_file_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """A power cut after the rename must not leave an empty ``path`` (the rename can reach the disk before the
    data): the temp file's content is fsynced first (then the folder: tests/test_small34a_fsync.py)."""
    path, synced = tmp_path / "f.json", []
    real = os.fsync

    def spy(fd):
        synced.append((os.fstat(fd).st_ino, path.exists()))
        real(fd)

    monkeypatch.setattr(jsonfile.os, "fsync", spy)
    write_text_atomic(path, "data")
    assert synced == [(path.stat().st_ino, False), (tmp_path.stat().st_ino, True)]


def test_is_temp_for_names_only_write_atomics_temp_files(tmp_path):
    path = tmp_path / "m.json"
    seen = []
    write_atomic(path, lambda tmp: seen.append(tmp) or tmp.write_text("{}"))
    assert is_temp_for(path, seen[0]) and is_temp_for(path, str(seen[0]))
    # what an error message names: the file, not its temp name; the default where the OSError names no file
    assert jsonfile.written_path(str(seen[0]), tmp_path) == path == jsonfile.written_path(path, tmp_path)
    assert jsonfile.written_path(None, tmp_path) == tmp_path == jsonfile.written_path("", str(tmp_path))
    for other in (path, tmp_path / "m.json.tmp.bak", tmp_path / "other.json.ab12cd34.tmp",
                  tmp_path / "sub" / seen[0].name, tmp_path / "m.jsonab12cd34.tmp"):
        assert not is_temp_for(path, other), other


# a writer stopped for good midway through its temp file (what SIGKILL leaves), or still writing: it holds the lock
STUCK_WRITER = """
import sys, time
from nanochat.jsonfile import write_atomic
def write(tmp):
    tmp.write_bytes(b"half")
    print(tmp, flush=True)
    time.sleep(600)
write_atomic(sys.argv[1], write)
"""


def stuck_writer(path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    child = subprocess.Popen([sys.executable, "-c", STUCK_WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(repo)})
    return child, Path(child.stdout.readline().strip())


def age(path, seconds):
    then = path.stat().st_mtime - seconds
    os.utime(path, (then, then))


def test_remove_stale_temps_removes_a_killed_writers_temp_file_and_nothing_else(tmp_path, capsys):
    """A SIGKILLed writer's ``<name>.<hex>.tmp`` stayed for good (no later writer uses that name): a build removes
    it once it is old and unlocked. A live writer's (locked, however old), a fresh one, a name no pattern covers
    and files named otherwise stay."""
    import signal

    dead, dead_tmp = stuck_writer(tmp_path / "train_00000.parquet")
    dead.send_signal(signal.SIGKILL)
    dead.wait(timeout=30)
    live, live_tmp = stuck_writer(tmp_path / "train_00001.parquet")
    try:
        fresh = tmp_path / "val_00000.parquet.0123abcd.tmp"
        users = [tmp_path / "notes.txt.0123abcd.tmp", tmp_path / "train_00002.parquet.tmp"]
        for p in (fresh, *users):
            p.write_text("x")
        for p in (dead_tmp, live_tmp, *users):
            age(p, 2 * jsonfile.STALE_TEMP_S)
        assert is_temp_for(tmp_path / "train_00000.parquet", dead_tmp)
        patterns = ("train_[0-9]*.parquet", "val_[0-9]*.parquet")
        assert jsonfile.remove_stale_temps(tmp_path, patterns) == [dead_tmp]
        assert f"removed 1 temp file(s) left in {tmp_path} by writers killed midway: {dead_tmp.name}" in (
            capsys.readouterr().err)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live_tmp, fresh, *users))
        assert jsonfile.remove_stale_temps(tmp_path / "gone", patterns) == []
    finally:
        live.kill()
        live.wait(timeout=30)


def test_a_write_removes_its_targets_temp_files_that_killed_writers_left(tmp_path, capsys, monkeypatch):
    """A small JSON file (an eval report, summary.json) has no build that sweeps its folder: the next write of the
    same file removes the temp file a SIGKILLed writer of it left, once old and unlocked. A live writer's (locked,
    however old), a fresh one, another file's and names of another form stay, and only this file's temp names are
    looked at (a write beside many other files costs one scan); a failed write removes none."""
    import signal

    path = tmp_path / "core.json"
    dead, dead_tmp = stuck_writer(path)
    dead.send_signal(signal.SIGKILL)
    dead.wait(timeout=30)
    live, live_tmp = stuck_writer(path)
    try:
        fresh = tmp_path / "core.json.0123abcd.tmp"
        others = [tmp_path / "core.csv.0123abcd.tmp", tmp_path / "core.json.tmp", tmp_path / "core.json.x.tmp",
                  tmp_path / "core.json.0123abcd.tmp.bak", tmp_path / "core.json.0123ABCD.tmp"]
        for p in (fresh, *others):
            p.write_text("x")
        for p in (dead_tmp, live_tmp, *others):
            age(p, 2 * jsonfile.STALE_TEMP_S)

        def full_disk(tmp):
            raise OSError(28, "No space left on device")

        with pytest.raises(OSError):
            write_atomic(path, full_disk)
        assert dead_tmp.exists() and capsys.readouterr().err == ""
        judged, judge = [], jsonfile._remove_if_stale
        monkeypatch.setattr(jsonfile, "_remove_if_stale", lambda tmp: judged.append(tmp) or judge(tmp))
        write_text_atomic(path, "{}\n")
        assert sorted(judged) == sorted((dead_tmp, live_tmp, fresh))
        assert f"removed 1 temp file(s) left in {tmp_path} by writers killed midway: {dead_tmp.name}" in (
            capsys.readouterr().err)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            p.name for p in (path, live_tmp, fresh, *others))
        write_text_atomic(path, "{}\n")  # none left: nothing said
        assert capsys.readouterr().err == ""
    finally:
        live.kill()
        live.wait(timeout=30)


def test_a_write_that_cannot_look_for_stale_temp_files_still_succeeds(tmp_path, monkeypatch):
    """The search for a killed writer's temp files comes after the rename: a folder that cannot be listed (write
    but no read permission) leaves them, and the finished write is not reported as failed."""
    def unreadable(folder):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(jsonfile.os, "scandir", unreadable)
    write_text_atomic(tmp_path / "summary.json", "{}\n")
    assert (tmp_path / "summary.json").read_text() == "{}\n"


@pytest.mark.parametrize("errno_", ["ENOLCK", "EIO"])
def test_a_file_system_whose_flock_fails_loses_no_write_and_no_live_temp_file(tmp_path, monkeypatch, errno_):
    """flock failing (ENOLCK: no flock there; EIO: an error try_flock does not know) fails no write, and a cleaner
    that cannot tell whether a writer holds a temp file keeps it, however old."""
    import errno
    import fcntl

    def failing(fd, op):
        raise OSError(getattr(errno, errno_), "flock failed")

    monkeypatch.setattr(fcntl, "flock", failing)
    old_tmp = tmp_path / "summary.json.0123abcd.tmp"
    old_tmp.write_text("half")
    age(old_tmp, 2 * jsonfile.STALE_TEMP_S)
    write_text_atomic(tmp_path / "summary.json", "{}\n")
    assert jsonfile.remove_stale_temps(tmp_path, ("*.json",)) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", old_tmp.name]


def test_a_cleaner_never_opens_a_fresh_temp_file(tmp_path, monkeypatch):
    """A live writer's temp file (fresh) is judged by its lstat alone, never opened: closing any fd of a file drops
    the POSIX locks its process holds on it, and on NFS flock is such a lock, so a cleaner in the writer's own
    process (another thread writing the same file) would unlock the writer's temp file. Old ones are opened (to
    flock them) and removed; a fresh one is not even opened."""
    path = tmp_path / "summary.json"
    fresh, old = tmp_path / "summary.json.0123abcd.tmp", tmp_path / "summary.json.4567cdef.tmp"
    for p in (fresh, old):
        p.write_text("half")
    age(old, 2 * jsonfile.STALE_TEMP_S)
    opened, real_open = [], os.open
    monkeypatch.setattr(jsonfile.os, "open", lambda p, *a, **k: opened.append(Path(p)) or real_open(p, *a, **k))
    write_text_atomic(path, "{}\n")
    assert fresh not in opened and old in opened
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", fresh.name]
    opened.clear()
    assert jsonfile.remove_stale_temps(tmp_path, ("*.json",)) == [] and fresh not in opened
