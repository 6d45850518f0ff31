"""Ctrl-C during hub shard downloads (``hf_hub_download`` in worker threads, which the main thread's
KeyboardInterrupt never reaches): prepare_data stops within a second or two, says what it kept, exits 130, and no
download still running afterwards places a shard or writes a manifest. In-process with a blocking fake of the
library (a download that never stops, like a Xet one), and with the real library against a slow local server as
HF_ENDPOINT (never the internet), whose plain-HTTP downloads stop within a piece and delete their partial files."""

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_download import (HUB_COMMIT, FlakyServer, ctrl_c_when, has_bytes, hub_path, join_download_threads,
                           parquet_bytes)

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("shard_00000.parquet", "shard_00001.parquet")  # the train shards; the val shard (369) comes at once


class BlockingHub:
    """A stand-in for ``huggingface_hub.hf_hub_download`` that lays files out as the hub cache does (blob named by
    its sha256, snapshot link) and holds back the ``BLOCKED`` ones until ``release`` is set (60 s at most: far
    above the 15 s bounds below, so a caller that waits for them fails those)."""

    def __init__(self, cache: Path):
        self.cache, self.release, self.returned, self.blocked = cache, threading.Event(), [], []

    def __call__(self, repo_id, filename, **kwargs):
        if filename in BLOCKED:
            self.blocked.append(filename)
            self.release.wait(60)
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


def test_ctrl_c_does_not_wait_for_hub_downloads_and_they_place_nothing_later(tmp_path, monkeypatch, capsys):
    """Before: the interrupt waited for the pool's threads (here 60 s; whole shards for real), then they placed
    their shards into the data dir after the "interrupted" line. ~2.5 s (the 2 s grace)."""
    import huggingface_hub

    from scripts import prepare_data

    hub = BlockingHub(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub)
    monkeypatch.delenv("NANOCHAT_DATA_BASE_URL", raising=False)
    data = tmp_path / "data"
    flags = ["--dataset", "fineweb-edu", "--num-shards", "2", "--data-dir", str(data), "--workers", "3",
             "--no-progress"]
    # Ctrl-C once the val shard is placed and both train shards hang in the hub library
    try:
        with ctrl_c_when(lambda: (data / "shard_00369.parquet").exists() and len(hub.blocked) == 2) as sent:
            code = prepare_data.main(flags)
            elapsed = time.monotonic() - sent[0]
    finally:
        hub.release.set()
    join_download_threads()  # the fakes return now: their shards must not be placed
    assert elapsed < 15 and code == 130, (elapsed, code)
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
    """The first failure is reported at once (exit 2), not after the downloads in flight (60 s). ~2.5 s (the 2 s
    grace)."""
    import huggingface_hub
    from huggingface_hub.utils import EntryNotFoundError

    from scripts import prepare_data

    hub = BlockingHub(tmp_path / "hub")

    def missing_val(repo_id, filename, **kwargs):
        if filename == "shard_00369.parquet":
            deadline = time.monotonic() + 60
            while len(hub.blocked) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # until the train shards hang in flight (a sleep was a guess on a loaded machine)
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
    assert code == 2 and elapsed < 15, (code, elapsed)
    assert err.strip().splitlines()[-1] == ("error: dataset repo karpathy/fineweb-edu-100b-shuffle, file "
                                            "shard_00369.parquet: no such file in the repo"), err
    assert not list((tmp_path / "d").glob("*.parquet")) and not (tmp_path / "d" / "manifest.json").exists()


@pytest.fixture
def slow_hub(tmp_path):
    """Three ~800 kB shards at hub URLs, sent at 64 KiB a second (~13 s each)."""
    files = {hub_path("fineweb-edu", f"shard_{i:05d}.parquet"): parquet_bytes(20, str(i), filler=40_000)
             for i in (0, 1, 369)}
    server = FlakyServer(files)
    server.chunk_delay = 1.0
    yield server
    server.close()


def test_ctrl_c_stops_real_hub_downloads_at_once_and_leaves_no_partial_files(slow_hub, tmp_path):
    """End to end, a process with the real huggingface_hub in its worker threads: SIGINT mid-body exits 130 within
    seconds (nothing at exit waits for the threads either), with no shard and no manifest; the downloads in flight
    stop within a piece and the library deletes its partial files (abandoned threads would leave one per shard, a
    random name no rerun reuses); the rerun completes. Before: exit after every body had arrived (~12 s here, minutes
    for real shards). ~8 s (two interpreter starts)."""
    data, cache = tmp_path / "data", tmp_path / "hub"
    env = {**os.environ, "HF_ENDPOINT": slow_hub.url, "HF_TOKEN": "hf_test_token", "HF_HUB_CACHE": str(cache),
           "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(ROOT)}
    env.pop("NANOCHAT_DATA_BASE_URL", None)
    # the library reads bodies in 10 MB pieces, a small part of a real shard: 64 KiB ones are as small a part here
    launch = ("import sys, huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 1 << 16; "
              "from scripts.prepare_data import main; sys.exit(main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", launch, "--dataset", "fineweb-edu", "--num-shards", "2", "--data-dir", str(data),
           "--workers", "3", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while (sum(r[0] == "GET" and r[1] in slow_hub.files for r in slow_hub.requests) < 3
               and time.monotonic() < deadline):
            time.sleep(0.05)
        while len([p for p in cache.rglob("*.incomplete") if has_bytes(p)]) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # until a piece of every body has arrived
        assert len(list(cache.rglob("*.incomplete"))) == 3, "not every download in flight"
        proc.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - interrupted
    finally:
        proc.kill()
    # ~1 s (the next piece of each body); the bodies' ends are ~12 s away
    assert proc.returncode == 130 and elapsed < 7, (proc.returncode, elapsed, err)
    assert "Traceback" not in err and "prepare_data: interrupted" in err, err
    assert not list(data.glob("*.parquet")) and not (data / "manifest.json").exists()
    assert not list(cache.rglob("*.incomplete"))
    slow_hub.chunk_delay = 0.0
    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    for path, body in slow_hub.files.items():
        assert (data / path.rsplit("/", 1)[1]).read_bytes() == body


@pytest.fixture
def slow_hub_env(slow_hub, tmp_path, monkeypatch):
    """This process's huggingface_hub pointed at ``slow_hub``, its cache in tmp_path, bodies read in 64 KiB
    pieces (10 MB for real: a small part of a real shard, as 64 KiB is of these)."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.setenv("HF_ENDPOINT", slow_hub.url)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.delenv("NANOCHAT_DATA_BASE_URL", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    return slow_hub


def test_a_failed_shard_stops_the_real_hub_downloads_in_flight(slow_hub_env, tmp_path, capsys):
    """The val shard is missing (404) while both train shards are being fetched: exit 2 with the 404's line within
    seconds, and the two downloads stop at their first piece, the library deleting their partial files (before,
    with daemon threads alone, they ran on to the end of their ~13 s bodies). ~2 s."""
    from scripts import prepare_data

    del slow_hub_env.files[hub_path("fineweb-edu", "shard_00369.parquet")]
    slow_hub_env.delay = 1.0  # every answer: the train shards' GETs are sent after the 404 has come
    started = time.monotonic()
    code = prepare_data.main(["--dataset", "fineweb-edu", "--num-shards", "2", "--data-dir", str(tmp_path / "d"),
                              "--workers", "3", "--no-progress"])
    elapsed = time.monotonic() - started
    join_download_threads()
    err = capsys.readouterr().err
    assert code == 2 and elapsed < 9, (code, elapsed, err)  # ~2 s; the bodies' ends ~15 s
    assert err.strip().splitlines()[-1].endswith("file shard_00369.parquet: no such file in the repo"), err
    assert not list((tmp_path / "d").glob("*.parquet")) and not list((tmp_path / "hub").rglob("*.incomplete"))
    gets = [r for r in slow_hub_env.requests if r[0] == "GET" and r[1] in slow_hub_env.files]
    assert len(gets) == 2, slow_hub_env.requests  # both train shards had started


def test_a_hub_download_in_the_main_thread_stops_at_once_on_ctrl_c(slow_hub_env, tmp_path):
    """A single hub_file in the main thread (import_reference's weights) needs nothing of ours: the KeyboardInterrupt
    comes out of the library's socket read at once and the library deletes its partial file. < 1 s."""
    from nanochat.download import hub_file

    in_flight = lambda: any(has_bytes(p) for p in (tmp_path / "hub").rglob("*.incomplete"))  # noqa: E731
    with ctrl_c_when(in_flight) as sent, pytest.raises(KeyboardInterrupt):
        hub_file("karpathy/fineweb-edu-100b-shuffle", "shard_00001.parquet", progress=False)
    assert time.monotonic() - sent[0] < 6  # ~0 s; the rest of the body takes ~12 s
    assert not list((tmp_path / "hub").rglob("*.incomplete"))


def test_run_in_daemon_threads_keeps_order_and_waits_one_grace_in_all():
    """Results in the items' order and ``done`` called in the calling thread once per result, whatever order the
    threads finish in; on a failure, ``grace`` is one deadline for all the threads in flight (joined in turn, each
    for what is left of it), not ``grace`` per thread: 15 hung threads at 0.5 s each would be 7.5 s."""
    from nanochat.download import StopFlag, run_in_daemon_threads

    caller, done_in = threading.get_ident(), []
    results = run_in_daemon_threads(lambda i: time.sleep(0.01 * (5 - i)) or i * i, list(range(6)), 4, StopFlag(),
                                    done=lambda: done_in.append(threading.get_ident()))
    assert results == [0, 1, 4, 9, 16, 25] and done_in == [caller] * 6

    n = 16
    release, stop, all_in_flight = threading.Event(), StopFlag(), threading.Barrier(n)

    def hang_or_fail(i):
        all_in_flight.wait(30)  # a queued item would not start once the failure has set the stop
        if i == 0:
            raise ValueError("shard 0 is bad")
        release.wait(30)  # a download that does not see the stop (a Xet one)

    started = time.monotonic()
    try:
        with pytest.raises(ValueError, match="shard 0 is bad"):
            run_in_daemon_threads(hang_or_fail, list(range(n)), n, stop, grace=0.5)
        elapsed = time.monotonic() - started
    finally:
        release.set()
    assert stop.is_set() and 0.5 <= elapsed < 4, elapsed  # ~0.5 s
    join_download_threads()


def test_a_ctrl_c_while_the_threads_start_sets_the_stop(monkeypatch):
    """The Ctrl-C of the hub test above can land while the calling thread is still starting the workers (a started
    thread runs first on a loaded machine: CI, session 29): it was raised outside the part that sets ``stop``, so
    the downloads in flight went on and placed their shards after the "interrupted" line. Now it sets the stop,
    and only the threads that were started are joined."""
    from nanochat import download
    from nanochat.download import StopFlag, run_in_daemon_threads

    release, stop, placed = threading.Event(), StopFlag(), []
    starts = []

    class CtrlCOnSecondStart(threading.Thread):
        def start(self):
            super().start()
            starts.append(self.name)
            if len(starts) == 2:
                raise KeyboardInterrupt  # as the SIGINT's handler raises it in the calling thread

    def download_then_place(i):
        release.wait(30)
        if not stop.is_set():
            placed.append(i)

    monkeypatch.setattr(download.threading, "Thread", CtrlCOnSecondStart)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_in_daemon_threads(download_then_place, list(range(4)), 4, stop, grace=0.2)
        assert stop.is_set() and len(starts) == 2  # the other two were never started (nor joined)
    finally:
        release.set()
    join_download_threads()
    assert placed == []
