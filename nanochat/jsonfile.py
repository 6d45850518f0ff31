"""The small JSON files every tool depends on (manifest, tokenizer header, checkpoint meta, eval reports): reading
them with one clear error that names the file, whatever is wrong with it (not UTF-8, not JSON, not a JSON object),
and writing files (text, bytes, a torch.save, a link) so that a reader never sees half a file and two writers of
one file never share a temp file."""

import errno
import fnmatch
import json
import os
import secrets
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from nanochat.run_dir import try_flock

T = TypeVar("T")

# A temp file of write_atomic untouched this long, and not flocked, was left by a writer killed midway (SIGKILL,
# an OOM kill): a live writer holds its flock, and writes into it from the moment it is created
STALE_TEMP_S = 3600.0


def read_json_object(path, error: type[Exception], advice: str = "") -> dict:
    """The JSON object in ``path``; raises ``error`` naming the file (and ending with ``advice``, if any) otherwise."""
    path = Path(path)
    advice = f"; {advice}" if advice else ""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise error(f"{path} is not valid JSON ({e}){advice}") from e
    if not isinstance(obj, dict):
        raise error(f"{path} is not a JSON object{advice}")
    return obj


def write_atomic(path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` to write the file at a temp name of its own beside ``path``, fsync it, then rename it over
    ``path`` and fsync the folder (``fsync_dir``): a kill mid-write leaves the old file (or none), never a torn one,
    and two processes writing ``path`` at once each rename a whole file (the last rename wins) instead of one
    renaming or removing the other's. Once renamed, the temp files of ``path`` that writers killed midway left are
    removed (``remove_stale_temps``' rules).
    """
    path = Path(path)
    fd, tmp = _create_temp(path)
    try:
        try:
            _hold_lock(fd)  # while it writes: remove_stale_temps keeps this temp file
            write(tmp)
            os.fsync(fd)  # the data before the rename: else a power cut can leave ``path`` empty
        finally:
            os.close(fd)
        tmp.replace(path)
    except BaseException:  # e.g. a full disk, Ctrl-C: no torn temp file left beside ``path``
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    _remove_stale_temps_of(path)


def fsync_dir(directory) -> None:
    """fsync folder ``directory`` after a rename into it: until then a power cut can bring back the old entry (or
    none) even though the file's data is on the disk. A file system that cannot fsync a folder (some FUSE and
    network ones) says EINVAL or ENOTSUP: the rename is then as durable as it makes it, which is no error. A folder
    this process may write but not read (EACCES on the open) cannot be synced from here either: also none. Any
    other error (EIO) raises: the rename may not have reached the disk."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_file(path) -> None:
    """fsync the data of the file at ``path`` (before a rename gives it a name that later runs trust)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new empty ``<name>.<8 hex digits>.tmp`` beside ``path`` (same file system: the rename is atomic), opened.
    O_EXCL never takes another writer's file; mode 0o666 lets the umask decide, as a plain open() does (mkstemp's
    0o600 would make every report private)."""
    return _at_free_temp_name(path, lambda tmp: os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                                        0o666))


def _at_free_temp_name(path: Path, create: Callable[[Path], T]) -> tuple[T, Path]:
    """``create(tmp)`` at a fresh ``<name>.<8 hex digits>.tmp`` beside ``path``, tried again at another name while
    it raises FileExistsError (the name is another writer's)."""
    for _ in range(100):
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return create(tmp), tmp
        except FileExistsError:  # 1 in 4e9 per existing temp file
            continue
    raise FileExistsError(f"no free temp name beside {path} after 100 tries")


def replace_atomic(path, create: Callable[[Path], object]) -> None:
    """``create(tmp)`` makes a new entry that is not a file written in place (a hard link, a symbolic link) at a
    free temp name beside ``path``, raising FileExistsError if that name is taken (another is tried); then it is
    renamed over ``path``, or removed if anything fails. Two processes placing ``path`` at once each rename their
    own entry (the last rename wins)."""
    path = Path(path)
    _, tmp = _at_free_temp_name(path, create)
    try:
        tmp.replace(path)
    finally:  # also after a rename: one of a hard link over another link of its file does nothing (POSIX)
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_text_atomic(path, text: str) -> None:
    """``write_atomic`` of ``text`` (UTF-8)."""
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_bytes_atomic(path, data: bytes) -> None:
    """``write_atomic`` of ``data``."""
    write_atomic(path, lambda tmp: tmp.write_bytes(data))


def is_temp_for(path, candidate) -> bool:
    """Whether ``candidate`` is named like one of ``write_atomic``'s temp files for ``path`` (beside it,
    ``<name>.<8 hex digits>.tmp``): how an OSError's filename is told to be about writing ``path``."""
    return Path(candidate) != written_path(candidate) == Path(path)


def written_path(filename, default=None) -> Path:
    """The file that ``write_atomic`` (or ``replace_atomic``) was writing through the temp file ``filename``:
    ``filename`` less its ``.<8 hex digits>.tmp``, or ``filename`` itself if it is named otherwise. An error
    message names the file the user asked for, not a temp name they never see. ``default`` (e.g. the output
    folder) stands in where ``filename`` is None or empty: an OSError that names no file."""
    if not filename and default is not None:
        return Path(default)
    filename = Path(filename)
    stem, dot, suffix = filename.name.rpartition(".")
    name, dot2, token = stem.rpartition(".")
    if (name and dot2 == dot == "." and suffix == "tmp" and len(token) == 8
            and all(c in "0123456789abcdef" for c in token)):
        return filename.with_name(name)
    return filename


def _hold_lock(fd: int) -> None:
    """Flock the writer's own fresh temp file (never held by another), so that no cleaner takes it for a killed
    writer's. Any OSError is ignored, not only try_flock's "no flock here": the lock only keeps cleaners off a temp
    file, and where flock fails a cleaner's fails too (``_unlocked``: it keeps the file), so a report or a shard is
    never lost to a lock."""
    try:
        try_flock(fd)
    except OSError:  # an errno that try_flock does not know as "no flock here"
        pass


def _unlocked(fd: int) -> bool:
    """Whether no process holds a flock on ``fd``'s file. False also where flock is unsupported or fails in a way
    try_flock does not know: a cleaner that cannot tell keeps the file, rather than fail a finished write."""
    try:
        return try_flock(fd) is True
    except OSError:
        return False


def entries_named(parent, prefix: str) -> list[Path]:
    """The entries of folder ``parent`` whose name starts with ``prefix``, sorted (none if it is missing): one scan,
    nothing opened or stat'ed."""
    try:
        return sorted(Path(parent) / e.name for e in os.scandir(parent) if e.name.startswith(prefix))
    except FileNotFoundError:
        return []


def _remove_if_stale(tmp: Path) -> bool:
    """Remove ``tmp``, a file named like a temp file of ``write_atomic``, if its writer was killed midway: a plain
    file of one link (not a link another made), untouched for ``STALE_TEMP_S`` and not flocked. True if removed."""
    try:
        st = tmp.lstat()
    except OSError:  # gone meanwhile (its writer renamed it): not ours to judge
        return False
    # a fresh file (a live writer's) is not even opened: closing any fd of a file drops the POSIX locks this
    # process holds on it, which is what flock is on NFS
    if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime <= STALE_TEMP_S:
        return False
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)  # RDWR: NFS locks need a writable fd
    except OSError:  # gone meanwhile (its writer renamed it), or a link: not ours to judge
        return False
    try:
        st = os.fstat(fd)  # again, on what is open: the name may have been replaced since the lstat
        if (st.st_nlink == 1 and time.time() - st.st_mtime > STALE_TEMP_S and _unlocked(fd)
                and os.path.samestat(st, os.stat(tmp, follow_symlinks=False))):
            tmp.unlink()
            return True
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)
    return False


def _say_removed(directory, removed: list[Path]) -> None:
    if removed:
        print(f"removed {len(removed)} temp file(s) left in {directory} by writers killed midway: "
              f"{', '.join(p.name for p in removed)}", file=sys.stderr)


def _remove_stale_temps_of(path: Path) -> None:
    """After a write of ``path``: its temp files that writers killed midway left (``_remove_if_stale``). Small files
    (an eval report, summary.json, plan.json) have no build that sweeps their folder with ``remove_stale_temps``, so
    the next write of the same file does it. One scan of the folder, for names starting ``<name>.``."""
    try:
        _say_removed(path.parent, [tmp for tmp in entries_named(path.parent, f"{path.name}.")
                                   if is_temp_for(path, tmp) and _remove_if_stale(tmp)])
    except OSError:  # e.g. a folder it may write but not list: the write is done, and must not fail for this
        pass


def remove_stale_temps(directory, patterns: tuple[str, ...]) -> list[Path]:
    """Remove the temp files that ``write_atomic`` writers of files matching ``patterns`` (fnmatch) in
    ``directory`` left when killed midway (a rename never came; the name is this writer's own, so no later writer
    reuses or replaces it): those named ``<file>.<8 hex digits>.tmp``, untouched for ``STALE_TEMP_S`` and not
    flocked. A build calls it once it is done; returns what it removed (one stderr line says so)."""
    removed = [tmp for tmp in entries_named(directory, "")
               if (target := written_path(tmp)) != tmp and any(fnmatch.fnmatchcase(target.name, p) for p in patterns)
               and _remove_if_stale(tmp)]
    _say_removed(directory, removed)
    return removed
