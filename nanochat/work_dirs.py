"""Hidden work folders that a later run can prove abandoned: a build that stages its outputs in a folder beside them
(the analyses' ``.partial-*``, make_core_subset's ``.<out>.*``) and is SIGKILLed (an OOM kill, a scheduler's
pre-emption, kill -9) cannot remove it; the next run of that build does, but only what it can prove stale.

A folder is named ``<prefix><pid>-<host>-<boot>.<random>`` (host: a hash of the host name, boot: of the kernel's
boot id) and its owner holds an exclusive ``flock`` on it while it works. A later run removes a folder only if its
whole name has that form with its own prefix and host, its owner is gone (another boot, or no process with that pid
on this one) and the folder's flock is free: a live run (on this host, in another container of this host, or on
another host sharing the file system) is never touched, nor anything named otherwise (a user's folder, a folder of
the older ``<prefix><random>`` form, which says nothing of its owner). On a file system without flock, only a dead
pid of this boot proves a folder stale: a folder of another boot stays (it may be a live run's on another node whose
container has our host name). Left to the user: a file system whose flock is per node (Lustre -o localflock, NFS
-o local_lock) hides another node's lock, so a second node with this host name can lose its live folder.
"""

import hashlib
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from nanochat.jsonfile import entries_named
from nanochat.run_dir import boot_id, pid_alive, try_flock


def _hash8(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _host() -> str:
    return _hash8(socket.gethostname())


def _boot() -> str:
    boot = boot_id()
    return _hash8(boot) if boot else "0" * 8  # no boot id (not Linux): the pid alone tells, on this host


def _parse(folder: Path, prefix: str) -> re.Match | None:
    """pid, host and boot of a work folder's name (see the module doc), or None if it is named otherwise."""
    return re.fullmatch(re.escape(prefix) + r"(\d+)-([0-9a-f]{8})-([0-9a-f]{8})\.[a-z0-9_]+", folder.name)


def _claim_stale(folder: Path, prefix: str) -> int | None:
    """An open fd holding ``folder``'s flock if it is a stale work folder of ``prefix`` (see the module doc), else
    None. Holding it keeps a second cleaner off while this one salvages and removes."""
    m = _parse(folder, prefix)
    if m is None or m[2] != _host() or folder.is_symlink() or not folder.is_dir():
        return None
    if m[3] == _boot() and pid_alive(m[1]):
        return None
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:  # another cleaner removed it meanwhile
        return None
    locked = try_flock(fd)
    # False: its owner lives after all (in another pid namespace), or a cleaner works. None (no flock): only a dead
    # pid of this boot proves it stale; another boot id with our host name may be a live run on another node whose
    # container has the same host name
    if locked or (locked is None and m[3] == _boot()):
        return fd
    os.close(fd)
    return None


def remove_stale(parent: Path, prefix: str, salvage: Callable[[Path], object] | None = None) -> list[Path]:
    """Remove the work folders named ``<prefix>...`` in ``parent`` that runs killed midway left (see the module
    doc); ``salvage(folder)`` first takes out what must survive. Says in one line what it removed."""
    removed = []
    for folder in entries_named(parent, prefix):
        fd = _claim_stale(folder, prefix)
        if fd is None:
            continue
        try:
            if salvage is not None:
                salvage(folder)
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(folder)
    if removed:
        print(f"removed {len(removed)} work folder(s) left in {parent} by runs killed midway: "
              f"{', '.join(p.name for p in removed)}", file=sys.stderr)
    return removed


def in_use(parent: Path, prefix: str) -> list[Path]:
    """The work folders ``<prefix>...`` in ``parent`` (named as the module doc says) that a run may still be using:
    those ``remove_stale`` would keep, another host's included. How a build that must be the only one writing its
    output (an import into one run directory) tells that another is at it."""
    found = []
    for folder in entries_named(parent, prefix):
        if _parse(folder, prefix) is None:
            continue
        fd = _claim_stale(folder, prefix)
        if fd is not None:  # provably stale: not in use (its removal is left to remove_stale)
            os.close(fd)
        elif folder.is_dir() and not folder.is_symlink():
            found.append(folder)
    return found


@contextmanager
def work_dir(parent: Path, prefix: str, salvage: Callable[[Path], object] | None = None) -> Iterator[Path]:
    """A fresh work folder ``<prefix><pid>-<host>-<boot>.<random>`` in ``parent``, locked by this process until the
    block ends, then removed; stale ones of earlier runs (``remove_stale``) are removed first."""
    remove_stale(parent, prefix, salvage)
    folder = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-{_host()}-{_boot()}.", dir=parent))
    fd = None
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try_flock(fd, blocking=True)  # nobody else knows the folder yet: this never waits (no flock: none to take)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if fd is not None:
            os.close(fd)
