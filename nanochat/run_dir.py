"""Who owns an output directory: the run-directory lock, "is there a run here already", and writability checks.

A training run directory has one owner at a time. ``RunDirLock`` takes an exclusive ``flock`` on
``<run_dir>/run.lock`` and writes the owner (pid, host, boot id, start time, command) into it; the kernel drops the
lock when the process ends in any way (SIGKILL and crashes included), so a second process is refused only while the
owner lives, and is told who that is (it waits briefly for the record of an owner that has just taken the lock and
not written it yet). An owner that died without releasing leaves its record behind: the next owner reports it (stale
lock: who, when) and takes over. On filesystems without ``flock`` the record alone decides: a live pid on this
host (of this boot: after a reboot the dead owner's pid is soon another process's), or any owner on another host,
is refused, the latter with the file to delete once that run is really gone.

Every writer checks its output directory with ``ensure_writable`` before the expensive work (data preparation,
tokenizer training, model setup, evaluation), so a bad path fails in the first second, not after the work.
"""

import errno
import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

LOCK_FILE = "run.lock"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# what a training run writes into its directory (checkpoints/ only counts when it holds a checkpoint)
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "environment.json", "report.md", "plan.json",
             "wandb_id.txt", "final_eval.partial.json")
RUN_DIRS = ("checkpoints", "eval", "wandb")
TRASH_PREFIX = ".trash-"
RECORD_WAIT_S = 2.0  # how long a refused process waits for the record of an owner that has just taken the lock


class NotWritable(ValueError):
    """An output directory cannot be created or written; the message names the flag and the path."""


class RunDirBusy(ValueError):
    """Another live process owns the run directory."""


def ensure_writable(path, flag: str) -> Path:
    """Create ``path`` (and parents) and write + delete a probe file in it; raise NotWritable naming ``flag``."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise NotWritable(f"{flag} {path} is not a writable directory ({e.strerror or type(e).__name__}"
                          f"{': ' + e.filename if e.filename and str(e.filename) != str(path) else ''}); "
                          f"choose another {flag} or fix its permissions") from e
    return path


def boot_id() -> str | None:
    """This kernel's boot id (Linux; None elsewhere): a pid recorded under another boot is no process of this one,
    whatever process has that pid now."""
    try:
        return BOOT_ID.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def _owner_record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "boot": boot_id(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": shlex.join(getattr(sys, "orig_argv", sys.argv))}


def _owner_may_live(rec: dict) -> bool:
    """Whether the owner ``rec`` names may live: any owner on another host (no pid to check there); on this one, a
    live pid, unless the record is of another boot (the owner died with it: its pid is reused since). A record
    without a boot id (none on this system, or an older version's) is judged by its pid alone."""
    if rec.get("host") != socket.gethostname():
        return True
    boot = boot_id()
    return not (rec.get("boot") and boot and rec["boot"] != boot) and pid_alive(rec.get("pid"))


def describe_owner(rec: dict) -> str:
    return (f"pid {rec.get('pid', '?')} on host {rec.get('host', '?')} (started {rec.get('started', '?')}: "
            f"{rec.get('command', '?')})")


# flock's errors that mean "this file system has no flock" (Lustre without -o flock; NFS, where an exclusive flock
# through a read-only fd is EBADF), not "another process holds it"
NO_FLOCK_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


def try_flock(fd: int, blocking: bool = False) -> bool | None:
    """Take an exclusive flock on ``fd``: True, or False if another holds it (never, when ``blocking``), or None if
    the file system has no flock (``NO_FLOCK_ERRNOS``: the caller decides what stands in for it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in NO_FLOCK_ERRNOS:
            raise
        return None
    return True


def pid_alive(pid) -> bool:
    """Whether a process ``pid`` may live on this host: False only when no process has that pid. Another user's
    process, or a record naming no valid pid (text, none, past a C long, 0 or negative: kill() would read those as
    process groups), counts as alive, so that callers keep what it may own."""
    try:
        pid = int(pid)
        if pid <= 0:
            return True
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


class RunDirLock:
    """Exclusive ownership of a run directory for the life of a run (see the module doc)."""

    def __init__(self, run_dir):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self.stale: dict | None = None  # the record of an owner that died holding the directory
        self.created = False  # this lock created run_dir: release() removes it again if nothing else was written

    def acquire(self, flag: str = "--run-dir") -> "RunDirLock":
        self.created = not self.run_dir.exists()
        for _ in range(10):  # retry when a releasing owner removed the (empty) directory under us
            ensure_writable(self.run_dir, flag)
            fd = self._lock(flag)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return self
            os.close(fd)
        raise RunDirBusy(f"{flag} {self.run_dir}: {self.path} keeps being replaced; is another run starting there?")

    def _lock(self, flag: str) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides, as for the run files
        except OSError as e:
            raise NotWritable(f"{flag} {self.run_dir}: cannot create {self.path} ({e.strerror})") from e
        try:
            locked = try_flock(fd)
            if locked is False:
                self._wait_for_owner_record(fd, flag)  # returns if the owner released meanwhile (we hold it now)
            elif locked is None:  # no flock on this filesystem: the record decides
                self._check_record_only(self._read(fd), flag)
            previous = self._read(fd)  # re-read under the lock: the owner may have released in between
            self.stale = previous or None
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(_owner_record()) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _wait_for_owner_record(self, fd: int, flag: str) -> None:
        """Another open file holds the flock: refuse, naming its owner. The owner writes its record just after its
        flock (and clears it just before unlocking), so the record read now may be empty, half written or the one
        of the dead owner it takes over: wait up to RECORD_WAIT_S for a record naming a live owner (or another
        host's: no pid to check there), retrying the flock meanwhile; return if it is ours after all."""
        deadline = time.monotonic() + RECORD_WAIT_S
        while True:
            rec = self._read(fd)
            live = "pid" in rec and _owner_may_live(rec)
            if live or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
        other = "--run-dir / --run-name" if flag == "--run-dir" else flag
        who = (f"another run: {describe_owner(rec)}" if rec else
               f"another process, which has not written its owner record into {self.path}")
        raise RunDirBusy(f"{flag} {self.run_dir} is in use by {who}. Wait for it to finish or stop it, or choose "
                         f"another {other}")

    def _check_record_only(self, rec: dict, flag: str) -> None:
        if not rec:
            return
        if rec.get("host") != socket.gethostname():
            raise RunDirBusy(f"{flag} {self.run_dir} is recorded as owned by {describe_owner(rec)} and this "
                             f"filesystem has no file locks to check it; if that run is gone, delete {self.path}")
        if _owner_may_live(rec) and rec.get("pid") != os.getpid():
            raise RunDirBusy(f"{flag} {self.run_dir} is in use by another run: {describe_owner(rec)}")

    @staticmethod
    def _read(fd: int) -> dict:
        raw = os.pread(fd, 1 << 16, 0)
        if not raw.strip():
            return {}
        try:
            rec = json.loads(raw)
            return rec if isinstance(rec, dict) else {"command": repr(raw[:200])}
        except ValueError:
            return {"command": f"unreadable lock record {raw[:200]!r}"}

    def release(self, remove_file: bool = False) -> None:
        """Clear the owner record and unlock (an empty record = released cleanly, not stale). A directory this
        lock created and nothing else wrote into (setup failed) is removed again; ``remove_file`` removes the lock
        file in any case (a directory that is not a run's, e.g. an evaluation's output; a process waiting on the
        removed file sees it replaced and retries, see acquire)."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            if remove_file:
                self.path.unlink(missing_ok=True)
            elif self.created and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
                self.path.unlink()
                self.run_dir.rmdir()
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None


def run_contents(run_dir) -> list[str]:
    """The run files in ``run_dir`` that a fresh run would overwrite (empty: nothing to lose there)."""
    run_dir = Path(run_dir)
    found = [name for name in RUN_FILES if name != "plan.json" and (run_dir / name).exists()]
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and any(p.name.startswith("step_") for p in ckpts.iterdir()):
        found.append("checkpoints/")
    return found


def remove_run(run_dir) -> list[str]:
    """--overwrite: move every run file and directory into one trash directory (one rename each), then delete it.
    A kill in between leaves only the trash directory, which ``sweep_trash`` removes on the next start."""
    from nanochat.jsonfile import fsync_dir  # jsonfile imports this module

    run_dir = Path(run_dir)
    names = [n for n in (*RUN_FILES, *RUN_DIRS) if (run_dir / n).exists()]
    if not names:
        return []
    trash = run_dir / f"{TRASH_PREFIX}{uuid.uuid4().hex[:8]}"
    trash.mkdir()
    for name in names:
        os.replace(run_dir / name, trash / name)
    fsync_dir(run_dir)  # else a power cut can bring the old run's files back beside the new run's
    shutil.rmtree(trash, ignore_errors=True)
    return names


def sweep_trash(run_dir) -> list[str]:
    """Delete trash directories an interrupted --overwrite left behind; returns their names."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    gone = [p for p in run_dir.iterdir() if p.name.startswith(TRASH_PREFIX) and p.is_dir()]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in gone]



def claim_run_dir(run_dir: Path, resume: str | None, overwrite: bool, stack) -> None:
    """base_train: rank 0 takes run.lock (released when the ExitStack ``stack`` closes), refuses a fresh run (no
    --resume) over an existing one unless --overwrite, and sweeps what an interrupted save, prune or --overwrite
    left; rank 0's error is raised on every rank."""
    from nanochat import checkpoint as ckpt
    from nanochat.common import print0, rank0_decides

    def claim() -> list[str]:
        lock = RunDirLock(run_dir).acquire()
        stack.callback(lock.release)
        notes = []
        if lock.stale:  # printed at once: a refusal below releases the lock and clears the record
            print0(f"note: {lock.path} was left by {describe_owner(lock.stale)}, which ended without releasing it "
                   "(killed or crashed); this run takes the directory over")
        found = run_contents(run_dir)
        if found and resume is None and not overwrite:
            # a run without a checkpoint (e.g. one whose set-up failed: its summary.json) has nothing to continue
            way = "continue it with --resume (or --resume auto), " if "checkpoints/" in found else \
                "it has no checkpoint to continue (see its summary.json, if any): "
            raise ValueError(f"--run-dir {run_dir} already holds a run ({', '.join(found)}) that a fresh start "
                             f"would overwrite: {way}delete it and start afresh with --overwrite, or choose another "
                             "--run-dir / --run-name")
        if (run_dir / ckpt.CKPT_DIR).exists():
            ensure_writable(run_dir / ckpt.CKPT_DIR, "--run-dir")
        swept = sweep_trash(run_dir) + ckpt.sweep_leftovers(run_dir)
        if swept:
            notes.append(f"removed what an interrupted save, prune or --overwrite left in {run_dir}: "
                         f"{', '.join(swept)}")
        return notes

    for note in rank0_decides(claim):
        print0(note)


def set_aside_stale_results(run_dir: Path, resumed_at: int, folder: Path | None) -> None:
    """summary.json / report.md of a later step describe the abandoned continuation: a run killed after the
    rewind must not read as that run's result ("completed", its val bpb). Moved beside its checkpoints."""
    from nanochat.jsonfile import fsync_dir  # jsonfile imports this module

    summary = run_dir / "summary.json"
    try:
        stale = json.loads(summary.read_text(encoding="utf-8")).get("step", 0) > resumed_at
    except (OSError, ValueError):
        stale = False
    for name in ("summary.json", "report.md") if stale else ():
        path = run_dir / name
        if path.exists():
            if folder is not None:
                os.replace(path, folder / name)
            else:  # its checkpoints are gone already: nothing to keep it with
                path.unlink()
    if stale:  # else a power cut can bring the stale summary back, read as this run's result
        fsync_dir(run_dir)
        if folder is not None:
            fsync_dir(folder)
