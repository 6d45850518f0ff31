"""Ctrl-C during hub shard downloads (``hf_hub_download`` in worker threads, which nothing can stop mid-file):
prepare_data stops within a second or two, says what it kept, exits 130, and no download still running afterwards
places a shard or writes a manifest. In-process with a blocking fake of the library."""

import hashlib
import os
import signal
import threading
import time
from pathlib import Path

from test_download import HUB_COMMIT, parquet_bytes

BLOCKED = ("shard_00000.parquet", "shard_00001.parquet")  # the train shards; the val shard (369) comes at once


class BlockingHub:
    """A stand-in for ``huggingface_hub.hf_hub_download`` that lays files out as the hub cache does (blob named by
    its sha256, snapshot link) and holds back the ``BLOCKED`` ones until ``release`` is set (10 s at most)."""

    def __init__(self, cache: Path):
        self.cache, self.release, self.returned, self.blocked = cache, threading.Event(), [], []

    def __call__(self, repo_id, filename, **kwargs):
        if filename in BLOCKED:
            self.blocked.append(filename)
            self.release.wait(10)
        body = parquet_bytes(5, filename)
        blob = self.cache / "blobs" / hashlib.sha256(body).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(body)
        snapshot = self.cache / "snapshots" / HUB_COMMIT / filename
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        snapshot.unlink(missing_ok=True)
        snapshot.symlink_to(blob)
        self.returned.append(filename)
        return str(snapshot)


def ctrl_c_when(ready) -> list:
    """Send this process SIGINT (Ctrl-C) from another thread as soon as ``ready()`` holds (10 s at most); the
    list returned gets the time it was sent."""
    sent = []

    def wait_then_kill():
        deadline = time.monotonic() + 10
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=wait_then_kill, daemon=True).start()
    return sent


def join_download_threads(timeout: float = 10.0) -> None:
    for t in threading.enumerate():
        if t.name.startswith("nanochat-download-"):
            t.join(timeout)
            assert not t.is_alive(), t.name


def test_ctrl_c_does_not_wait_for_hub_downloads_and_they_place_nothing_later(tmp_path, monkeypatch, capsys):
    """Before: the interrupt waited for the pool's threads (here 10 s; whole shards for real), then they placed
    their shards into the data dir after the "interrupted" line. ~1.5 s."""
    import huggingface_hub

    from scripts import prepare_data

    hub = BlockingHub(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub)
    monkeypatch.delenv("NANOCHAT_DATA_BASE_URL", raising=False)
    data = tmp_path / "data"
    flags = ["--dataset", "fineweb-edu", "--num-shards", "2", "--data-dir", str(data), "--workers", "3",
             "--no-progress"]
    # Ctrl-C once the val shard is placed and both train shards hang in the hub library
    sent = ctrl_c_when(lambda: (data / "shard_00369.parquet").exists() and len(hub.blocked) == 2)
    try:
        code = prepare_data.main(flags)
        elapsed = time.monotonic() - sent[0]
    finally:
        hub.release.set()
    join_download_threads()  # the fakes return now: their shards must not be placed
    assert elapsed < 5 and code == 130, (elapsed, code)
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and "prepare_data: interrupted" in err, err
    assert sorted(hub.returned) == ["shard_00000.parquet", "shard_00001.parquet", "shard_00369.parquet"]
    assert sorted(p.name for p in data.glob("*.parquet")) == ["shard_00369.parquet"]  # finished before: kept
    assert not (data / "manifest.json").exists()
    # the next run finds what the cache holds and finishes
    assert prepare_data.main(flags) == 0
    assert sorted(p.name for p in data.glob("*.parquet")) == ["shard_00000.parquet", "shard_00001.parquet",
                                                              "shard_00369.parquet"]
    assert (data / "manifest.json").is_file()


def test_a_hub_error_is_still_one_line_while_other_hub_downloads_hang(tmp_path, monkeypatch, capsys):
    """The first failure is reported at once (exit 2), not after the downloads in flight. ~1 s."""
    import huggingface_hub
    from huggingface_hub.utils import EntryNotFoundError

    from scripts import prepare_data

    hub = BlockingHub(tmp_path / "hub")

    def missing_val(repo_id, filename, **kwargs):
        if filename == "shard_00369.parquet":
            time.sleep(0.3)  # the train shards are in flight by then
            raise EntryNotFoundError("404 Client Error: entry not found")
        return hub(repo_id, filename, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing_val)
    monkeypatch.delenv("NANOCHAT_DATA_BASE_URL", raising=False)
    started = time.monotonic()
    try:
        code = prepare_data.main(["--dataset", "fineweb-edu", "--num-shards", "2", "--data-dir",
                                  str(tmp_path / "d"), "--workers", "3", "--no-progress"])
    finally:
        hub.release.set()
    elapsed = time.monotonic() - started
    join_download_threads()
    err = capsys.readouterr().err
    assert code == 2 and elapsed < 5, (code, elapsed)
    assert err.strip().splitlines()[-1] == ("error: dataset repo karpathy/fineweb-edu-100b-shuffle, file "
                                            "shard_00369.parquet: no such file in the repo"), err
    assert not list((tmp_path / "d").glob("*.parquet")) and not (tmp_path / "d" / "manifest.json").exists()
