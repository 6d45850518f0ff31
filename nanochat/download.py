"""Downloads: files of Hugging Face hub repos through ``huggingface_hub``, anything else through one small HTTP
downloader.

``hub_file`` calls ``huggingface_hub.hf_hub_download``, so hub downloads use the hub cache (``HF_HOME`` /
``HF_HUB_CACHE``), ``HF_TOKEN`` (or a saved ``hf auth login``), ``HF_ENDPOINT`` mirrors, ``HF_HUB_OFFLINE``, Xet
storage when ``hf_xet`` is installed, the library's progress bars and its resume of dropped connections. On top
of that every file is checked against the hub's own checksum: the cache names a blob by its ETag, which is the
sha256 of an LFS file and the git blob sha1 of a small file, so a corrupt blob is detected, deleted and reported.

``download_file`` is for URLs outside the hub (the CORE eval bundle, a plain-HTTP mirror of the shards): retries
with exponential backoff, a ``.part`` file resumed with an HTTP Range request (also by the next run), an optional
sha256 and a content check before the file gets its final name, so a final name always holds a complete file.
"""

import hashlib
import os
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from nanochat.jsonfile import fsync_dir, fsync_file, replace_atomic


class DownloadError(RuntimeError):
    """A download failed or produced a bad file; the message says what to check."""


class DownloadStopped(Exception):
    """``download_file``'s ``stop`` event was set (Ctrl-C in the thread that waits for this download): the ``.part``
    file is kept for the next run."""


class StopFlag(threading.Event):
    """The stop event of downloads in worker threads. Once ``set()`` has returned, no file is given its final name
    under ``placing()`` any more: a worker left running after Ctrl-C (a Xet download, which nothing stops
    mid-file) must not add a file to the data dir behind the back of the "interrupted" message."""

    def __init__(self):
        super().__init__()
        self._placing = threading.Lock()

    def set(self) -> None:
        with self._placing:  # waits for a placement under way (a link and a rename: milliseconds)
            super().set()

    @contextmanager
    def placing(self, what: str):
        """Hold the flag unset for the block (a rename into the destination), or raise ``DownloadStopped``."""
        with self._placing:
            if self.is_set():
                raise DownloadStopped(what)
            yield


def run_in_daemon_threads(fn, items: list, workers: int, stop: StopFlag, done=None, grace: float = 2.0) -> list:
    """``[fn(item) for item in items]``, computed by up to ``workers`` daemon threads; ``done()`` is called in
    this thread as each result (in order) arrives. An exception from ``fn`` (raised here when its item's turn
    comes) or a Ctrl-C here sets ``stop`` (no queued item starts), gives the threads in flight ``grace`` seconds to
    see it and is raised without waiting further. Daemon threads, because a ``ThreadPoolExecutor`` joins its
    workers on exit from its ``with`` and again at interpreter exit: Ctrl-C waited there for whole hub downloads
    (hundreds of MB), which the main thread's KeyboardInterrupt does not reach."""
    import queue
    from concurrent.futures import Future

    futures = [Future() for _ in items]
    todo = queue.SimpleQueue()
    for pair in zip(items, futures):
        todo.put(pair)

    def work() -> None:
        while not stop.is_set():
            try:
                item, future = todo.get_nowait()
            except queue.Empty:
                return
            future.set_running_or_notify_cancel()
            try:
                future.set_result(fn(item))
            except BaseException as e:  # noqa: BLE001 (handed to the waiting thread, which raises it)
                future.set_exception(e)

    threads = [threading.Thread(target=work, name=f"nanochat-download-{i}", daemon=True)
               for i in range(max(1, min(workers, len(items))))]
    results = []
    try:
        for t in threads:  # inside: a Ctrl-C can land here, the started threads already downloading
            t.start()
        for future in futures:
            results.append(future.result())
            if done is not None:
                done()
    except BaseException:
        stop.set()
        deadline = time.monotonic() + grace
        for t in threads:  # downloads stop within a piece (a Xet one never does) and clean up their files
            if t.ident is not None:  # started (a thread the Ctrl-C came before cannot be joined)
                t.join(max(0.0, deadline - time.monotonic()))
        raise
    return results


def stream_sha256(f) -> str:
    """The sha256 of an open binary file from its position to its end, read in 1 MiB pieces (never whole)."""
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


def file_sha256(path) -> str:
    with open(path, "rb") as f:
        return stream_sha256(f)


def git_blob_sha1(path) -> str:
    """The id git (and the hub, as ETag of a non-LFS file) gives a file: sha1 of b"blob <size>\\0" + content."""
    h = hashlib.sha1(f"blob {os.path.getsize(path)}\0".encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- Hugging Face hub ---------------------------------------------------------------------------------------
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHA1 = re.compile(r"^[0-9a-f]{40}$")


def hub_file(repo_id: str, filename: str, *, repo_type: str = "dataset", revision: str | None = None,
             cache_dir=None, progress: bool = True, stop: StopFlag | None = None) -> Path:
    """Download ``filename`` of a hub repo into the hub cache (or find it there), verify it, return its path.

    The returned path is the cache's snapshot entry ``.../snapshots/<commit>/<filename>`` (a link to the blob), so
    ``path.parent.name`` is the commit the file came from. ``HF_ENDPOINT`` and ``HF_TOKEN`` are read at call time.
    ``stop``, once set, ends a plain-HTTP download (not a Xet one) within a piece of 10 MB with ``DownloadStopped``;
    what happens to the partial file is the library's choice (2.4 deletes it: a rerun fetches that file whole).
    """
    import huggingface_hub
    from huggingface_hub.utils import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                       RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{repo_type} repo {repo_id}" + (f"@{revision}" if revision else "") + f", file {filename}"
    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        path = huggingface_hub.hf_hub_download(
            repo_id, filename, repo_type=repo_type, revision=revision, cache_dir=cache_dir, endpoint=endpoint,
            token=os.environ.get("HF_TOKEN") or None, tqdm_class=_hub_bar(progress, stop, where))
    except GatedRepoError as e:
        raise DownloadError(f"{where}: the repo is gated; accept its terms on the hub and set HF_TOKEN ({e})") from e
    except RepositoryNotFoundError as e:
        raise DownloadError(f"{where}: repository not found or private (set HF_TOKEN for private repos; "
                            f"HF_ENDPOINT={endpoint or 'default'})") from e
    except RevisionNotFoundError as e:
        raise DownloadError(f"{where}: revision not found") from e
    except LocalEntryNotFoundError as e:  # offline (HF_HUB_OFFLINE=1 or no network) and not in the cache
        raise DownloadError(f"{where}: not in the hub cache and the hub cannot be reached ({e}); check the "
                            f"network, HF_ENDPOINT or HF_HUB_OFFLINE") from e
    except EntryNotFoundError as e:
        raise DownloadError(f"{where}: no such file in the repo") from e
    except (HfHubHTTPError, OSError) as e:  # HTTP errors after the library's retries, size mismatches, disk full
        raise DownloadError(f"{where}: download failed ({type(e).__name__}: {e}); re-running continues with the "
                            f"files already in the hub cache") from e
    path = Path(path)
    verify_hub_blob(path, where)
    return path


def verify_hub_blob(path: Path, where: str = "") -> bool:
    """Check a cached hub file against the checksum its blob is named by; delete it and raise on a mismatch.

    Returns False when the blob name is not a checksum (nothing to compare with, e.g. a local_dir download).
    """
    blob = Path(path).resolve()
    expected = blob.name
    if _SHA256.match(expected):
        kind, actual = "sha256", file_sha256(blob)
    elif _SHA1.match(expected):
        kind, actual = "git sha1", git_blob_sha1(blob)
    else:
        return False
    if actual != expected:
        blob.unlink(missing_ok=True)
        if Path(path).is_symlink():
            Path(path).unlink()
        raise DownloadError(f"{where or path}: checksum mismatch ({kind} {actual}, the hub says {expected}); the "
                            f"corrupt file was deleted from the hub cache, re-run to download it again")
    return True


def _hub_bar(progress: bool, stop, where: str):
    """hf_hub_download's ``tqdm_class``: the library's own bar (None) unless it must stay hidden (not ``progress``)
    or watch ``stop``. Once ``stop`` is set, the bar's next update in the downloading thread raises
    ``DownloadStopped``: the library updates it after every piece of the body (10 MB), lets the exception through
    and deletes its partial file, the one way to stop it from another thread without an HTTP client of our own."""
    if progress and stop is None:
        return None
    from huggingface_hub.utils import tqdm as hub_tqdm

    class HubBar(hub_tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **(kwargs if progress else {**kwargs, "disable": True}))
            self.owner = threading.get_ident()

        def update(self, n=1):
            # only in the thread that downloads: Xet reports progress from threads of its own
            if stop is not None and stop.is_set() and threading.get_ident() == self.owner:
                raise DownloadStopped(where)
            return super().update(n)

    return HubBar


def place_file(src: Path, dest: Path) -> Path:
    """Give ``dest`` the content of ``src`` (a hub cache file) without copying: a hard link to the blob (which
    survives a cache clean-up), else a symbolic link when the cache is on another file system."""
    blob = Path(src).resolve()

    def link(tmp: Path) -> None:
        try:
            os.link(blob, tmp)
        except FileExistsError:  # another placer's temp name: replace_atomic tries another
            raise
        except OSError:
            tmp.symlink_to(blob)

    replace_atomic(dest, link)  # a temp link of its own: two processes placing one file both succeed
    return Path(dest)


# ---- plain HTTP ---------------------------------------------------------------------------------------------
def download_file(url: str, dest, *, validate=None, sha256: str | None = None, max_attempts: int = 5,
                  backoff: float = 2.0, timeout: float = 60.0, progress: bool = True, hint: str = "",
                  stop=None) -> Path:
    """Download ``url`` to ``dest`` robustly; returns ``dest`` (at once when it already exists).

    Bytes go to ``dest.part`` (resumed with an HTTP Range request after a dropped connection, also by a later
    run); the file gets its final name only after the sha256 (when given) and ``validate(part)`` pass. A ``.part``
    left by a network failure is kept so the next run resumes it; one with bad content is deleted. ``hint`` ends
    every error message (what the user can change: a flag, an environment variable). ``stop`` (a
    ``StopFlag``), once set, ends the download within a piece of the body or a retry's wait with
    ``DownloadStopped``, keeping the ``.part`` file (a download in a worker thread cannot see the main thread's
    Ctrl-C), and no file gets its final name after ``stop.set()`` has returned.
    """
    dest = Path(dest)
    if dest.is_file():
        return dest
    part = dest.with_name(dest.name + ".part")
    with _locked_part(part) as locked:  # another process (a rank, a second run) fetching the same file waits
        try:
            if not dest.is_file():  # else another process finished it while this one waited
                stop = stop or StopFlag()
                _download_locked(url, part, sha256, validate, max_attempts, backoff, timeout, progress, hint, stop)
                fsync_file(part)  # the data before the name: a power cut must not leave ``dest`` over no data
                with stop.placing(url):
                    os.replace(part, dest)
                fsync_dir(dest.parent)
        finally:
            if locked(part) and part.stat().st_size == 0:
                part.unlink()  # nothing received (or only the lock's empty file): no .part to resume from
    return dest


@contextmanager
def _locked_part(part: Path):
    """Hold an exclusive ``flock`` on ``part`` (created empty if missing) for the block, which gets a function
    telling whether a path is still the locked file. A waiter that wakes up to find ``part`` renamed (done) or
    deleted (failed) locks the file now at that path instead."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): no protection against a concurrent download of the same file
        yield Path.exists
        return
    while True:
        f = open(part, "ab")
        fcntl.flock(f, fcntl.LOCK_EX)
        ino = os.fstat(f.fileno()).st_ino

        def locked(path) -> bool:
            try:
                return os.stat(path).st_ino == ino
            except FileNotFoundError:
                return False

        if locked(part):
            break
        f.close()
    try:
        yield locked
    finally:
        f.close()


def _download_locked(url, part, sha256, validate, max_attempts, backoff, timeout, progress, hint, stop) -> None:
    """``download_file``'s retries and checks, into ``part`` (locked by the caller)."""
    hint = f"; {hint}" if hint else ""
    last_error = None
    for attempt in range(max_attempts):
        if (attempt and stop.wait(backoff * 2 ** (attempt - 1))) or stop.is_set():
            raise DownloadStopped(url)
        try:
            _fetch_into(url, part, timeout=timeout, progress=progress, stop=stop)
            break
        except DownloadStopped:
            raise
        except _PermanentHTTPError as e:
            part.unlink(missing_ok=True)
            raise DownloadError(f"{url}: {e}{hint}") from e
        except Exception as e:  # network errors, 5xx, truncated bodies: retry and resume
            last_error = e
    else:
        resume = f"; re-running resumes from {part.name}" if part.exists() and part.stat().st_size else ""
        raise DownloadError(f"could not download {url} after {max_attempts} attempts "
                            f"({type(last_error).__name__}: {last_error}){hint}{resume}")
    if sha256:
        actual = file_sha256(part)
        if actual != sha256.lower():
            part.unlink()
            raise DownloadError(f"checksum mismatch for {url}: got sha256 {actual}, expected {sha256.lower()}; "
                                f"the file was deleted{hint}")
    if validate is not None:
        try:
            validate(part)
        except Exception as e:
            part.unlink(missing_ok=True)
            raise DownloadError(f"downloaded {url} but the file is invalid: {e}") from e


class _PermanentHTTPError(Exception):
    pass


def _fetch_into(url: str, part: Path, timeout: float, progress: bool, stop) -> None:
    """One attempt: append the missing bytes of ``url`` to ``part``; raise if the body ends early."""
    import requests
    from tqdm import tqdm

    offset = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    with requests.get(url, stream=True, timeout=timeout, headers=headers) as r:
        if r.status_code == 416:  # our .part is not a prefix of this file any more: start over
            part.write_bytes(b"")  # emptied in place: the file stays the one locked by download_file
            raise IOError("range not satisfiable; restarting the download from scratch")
        if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
            raise _PermanentHTTPError(f"HTTP {r.status_code}")
        r.raise_for_status()
        if r.status_code != 206:  # server ignored the Range header: rewrite from the start
            offset = 0
        remaining = r.headers.get("Content-Length")
        total = offset + int(remaining) if remaining is not None else None
        written = offset
        with open(part, "ab" if offset else "wb") as f, tqdm(
            total=total, initial=offset, unit="B", unit_scale=True, desc=part.name[:-5],
            disable=not progress, leave=False,
        ) as bar:
            for chunk in r.iter_content(chunk_size=1 << 16):  # small chunks: little is lost when a read fails
                if stop.is_set():
                    raise DownloadStopped(url)
                f.write(chunk)
                written += len(chunk)
                bar.update(len(chunk))
    if total is not None and written < total:
        raise IOError(f"connection closed after {written} of {total} bytes")
