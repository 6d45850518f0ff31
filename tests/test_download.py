"""Downloads against a local HTTP server on 127.0.0.1 with injected failures (never the internet): the plain HTTP
downloader, and the Hugging Face hub path with the real ``huggingface_hub`` talking to the same server as a
fake hub endpoint (HF_ENDPOINT)."""

import hashlib
import io
import os
import signal
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat.dataset import REMOTE_DATASETS, DataError, download_remote_shards, iter_documents, load_manifest, validate_parquet
from nanochat.download import DownloadError, download_file, hub_file


def parquet_bytes(n_rows: int, tag: str, filler: int = 200) -> bytes:
    buf = io.BytesIO()
    # random filler, uncompressed: files are large enough that a half body spans several 64 KiB read chunks
    rows = [f"{tag} document {i} " + os.urandom(filler // 2).hex() for i in range(n_rows)]
    pq.write_table(pa.table({"text": rows}), buf, compression="none")
    return buf.getvalue()


HUB_COMMIT = "c0ffee" * 6 + "abcd"  # 40 hex digits, like a git commit


class FlakyServer:
    """Serves ``files`` (path -> bytes) to GET and HEAD; ``fail[path]`` = list of actions consumed one per GET:
    'error' -> HTTP 503, 'truncate' -> full Content-Length header but only half the body. Honors Range.
    Every response also carries what the hub sends (X-Repo-Commit, ETag = sha256 of the file unless
    ``etags[path]`` says otherwise), so huggingface_hub can use it as an HF_ENDPOINT. ``requests`` records
    (method, path, Range, Authorization) of GETs and HEADs; ``delay`` holds every response back, ``chunk_delay``
    slows every body down."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.fail, self.etags, self.requests = files, {}, {}, []
        self.delay = 0.0  # seconds every response waits before its headers
        self.chunk_delay = 0.0  # seconds between the 64 KiB pieces of a body (a slow link)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.respond(head=True)

            def do_GET(self):
                self.respond(head=False)

            def respond(self, head: bool):
                server.requests.append((self.command, self.path, self.headers.get("Range"),
                                        self.headers.get("Authorization")))
                time.sleep(server.delay)
                body = server.files.get(self.path)
                if body is None:  # as the hub answers for a file a repo lacks
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                action = server.fail.get(self.path, []).pop(0) if server.fail.get(self.path) and not head else None
                if action == "error":
                    self.send_error(503)
                    return
                start, status = 0, 200
                if self.headers.get("Range"):
                    start, status = int(self.headers["Range"].split("=")[1].split("-")[0]), 206
                payload = body[start:]
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.send_header("X-Repo-Commit", HUB_COMMIT)
                self.send_header("ETag", '"%s"' % server.etags.get(self.path, hashlib.sha256(body).hexdigest()))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.end_headers()
                if head:
                    return
                payload = payload[: len(payload) // 2] if action == "truncate" else payload
                try:
                    for i in range(0, len(payload), 1 << 16):
                        self.wfile.write(payload[i:i + (1 << 16)])
                        time.sleep(server.chunk_delay)
                except (BrokenPipeError, ConnectionResetError):  # the client went away (an interrupted download)
                    return
                if action == "truncate":
                    self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # shutdown() waits for serve_forever's next poll: 0.5 s by default, paid at every test's teardown
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def ctrl_c_when(ready):
    """For the block: send this process SIGINT (Ctrl-C) from another thread as soon as ``ready()`` holds (60 s at
    most); the list yielded gets the time it was sent. A condition, not a timer: a loaded machine may take seconds
    to get a download going. Never sent after the block (it would end the whole pytest run)."""
    sent, ended, sending = [], threading.Event(), threading.Lock()

    def wait_then_kill():
        deadline = time.monotonic() + 60
        while not ready() and time.monotonic() < deadline:
            if ended.wait(0.01):
                return
        with sending:
            if not ended.is_set():
                sent.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=wait_then_kill, daemon=True).start()
    try:
        yield sent
    finally:
        with sending:
            ended.set()


def has_bytes(path) -> bool:
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False


def join_download_threads(timeout: float = 10.0) -> None:
    for t in threading.enumerate():
        if t.name.startswith("nanochat-download-"):
            t.join(timeout)
            assert not t.is_alive(), t.name


@pytest.fixture
def server():
    s = FlakyServer({"/shard_00000.parquet": parquet_bytes(30, "a"), "/shard_00001.parquet": parquet_bytes(20, "b", filler=40_000),
                     "/shard_00369.parquet": parquet_bytes(10, "val"), "/junk.parquet": b"not a parquet file" * 50})
    yield s
    s.close()


def test_retries_after_server_errors(server, tmp_path):
    server.fail["/shard_00000.parquet"] = ["error", "error"]
    dest = download_file(f"{server.url}/shard_00000.parquet", tmp_path / "s.parquet", backoff=0.01, progress=True)
    assert dest.read_bytes() == server.files["/shard_00000.parquet"]
    assert len(server.requests) == 3
    assert not (tmp_path / "s.parquet.part").exists()


def test_truncated_body_resumes_with_range(server, tmp_path):
    server.fail["/shard_00001.parquet"] = ["truncate"]
    body = server.files["/shard_00001.parquet"]
    dest = download_file(f"{server.url}/shard_00001.parquet", tmp_path / "s.parquet", backoff=0.01, progress=False)
    assert dest.read_bytes() == body
    assert len(body) > 600_000 and server.requests[0][2] is None
    offset = int(server.requests[1][2].split("=")[1].rstrip("-"))
    assert 0 < offset <= len(body) // 2  # resumed from what was received, not from 0


def test_existing_part_file_is_resumed(server, tmp_path):
    body = server.files["/shard_00000.parquet"]
    (tmp_path / "s.parquet.part").write_bytes(body[:100])
    download_file(f"{server.url}/shard_00000.parquet", tmp_path / "s.parquet", progress=False)
    assert (tmp_path / "s.parquet").read_bytes() == body
    assert server.requests == [("GET", "/shard_00000.parquet", "bytes=100-", None)]


def test_invalid_content_and_404_leave_no_files(server, tmp_path):
    with pytest.raises(DownloadError, match="junk.parquet but the file is invalid"):
        download_file(f"{server.url}/junk.parquet", tmp_path / "j.parquet", validate=validate_parquet,
                      backoff=0.01, progress=False)
    with pytest.raises(DownloadError, match="HTTP 404"):
        download_file(f"{server.url}/missing.parquet", tmp_path / "m.parquet", backoff=0.01, progress=False)
    assert list(tmp_path.iterdir()) == []
    assert len(server.requests) == 2  # a 404 is not retried


def test_gives_up_after_max_attempts_keeping_part_for_resume(server, tmp_path):
    # the large shard: a half body spans several read chunks, so bytes reach the .part (an empty one is removed)
    server.fail["/shard_00001.parquet"] = ["truncate", "truncate", "truncate"]
    with pytest.raises(DownloadError, match="after 3 attempts.*resumes from s.parquet.part"):
        download_file(f"{server.url}/shard_00001.parquet", tmp_path / "s.parquet", max_attempts=3, backoff=0.01,
                      progress=False)
    assert not (tmp_path / "s.parquet").exists() and (tmp_path / "s.parquet.part").stat().st_size > 0
    download_file(f"{server.url}/shard_00001.parquet", tmp_path / "s.parquet", progress=False)
    assert (tmp_path / "s.parquet").read_bytes() == server.files["/shard_00001.parquet"]


def test_remote_dataset_manifest_pins_val_shard(server, tmp_path):
    server.fail["/shard_00369.parquet"] = ["error"]
    m = download_remote_shards("fineweb-edu", tmp_path, 2, base_url=server.url, workers=2, backoff=0.01,
                               progress=False)
    assert m["train"] == ["shard_00000.parquet", "shard_00001.parquet"] and m["val"] == ["shard_00369.parquet"]
    assert m["shards"]["shard_00369.parquet"]["rows"] == 10 and m["val_index"] == 369
    assert load_manifest(tmp_path)["source"] == server.url
    assert len(list(iter_documents(tmp_path, "train"))) == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dataset", "manifest.json", "shard_00000.parquet",
                                                          "shard_00001.parquet", "shard_00369.parquet"]


def test_cli_env_base_url_and_unreachable_network(server, tmp_path, monkeypatch, capsys):
    from scripts.prepare_data import main

    monkeypatch.setenv("NANOCHAT_DATA_BASE_URL", server.url)
    # a failed download is bad input (a dead mirror, no network): exit 2 as in base_eval (it was 1 before session 20)
    assert main(["--dataset", "climbmix", "--num-shards", "1", "--data-dir", str(tmp_path / "c")]) == 2
    assert "shard_06542.parquet: HTTP 404" in capsys.readouterr().err  # val shard of climbmix is 6542
    assert main(["--dataset", "fineweb-edu", "--num-shards", "1", "--data-dir", str(tmp_path / "f")]) == 0
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["--dataset", "fineweb-edu", "--num-shards", "1", "--data-dir", str(tmp_path / "d"),
                 "--base-url", dead, "--max-attempts", "1", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # earlier stderr lines are tqdm bars
    assert err.count("error:") == 1 and last.startswith("error: could not download") and "--base-url" in last
    assert "resumes from" not in last and [p.name for p in (tmp_path / "d").iterdir()] == [".dataset"]


def test_sha256_mismatch_deletes_the_file_and_names_both_hashes(server, tmp_path):
    body = server.files["/shard_00000.parquet"]
    with pytest.raises(DownloadError, match=f"got sha256 {hashlib.sha256(body).hexdigest()}, expected {'0' * 64}"):
        download_file(f"{server.url}/shard_00000.parquet", tmp_path / "s.parquet", sha256="0" * 64, progress=False)
    assert list(tmp_path.iterdir()) == []
    good = hashlib.sha256(body).hexdigest().upper()  # case-insensitive
    assert download_file(f"{server.url}/shard_00000.parquet", tmp_path / "s.parquet", sha256=good,
                         progress=False).read_bytes() == body


# ---- the Hugging Face hub path: real huggingface_hub, the local server as HF_ENDPOINT ------------------------
def hub_path(dataset: str, name: str) -> str:
    return f"/datasets/{REMOTE_DATASETS[dataset][0]}/resolve/main/{name}"


@pytest.fixture
def hub(server, tmp_path, monkeypatch):
    """The server also serves fineweb-edu shards 0, 1 and 369 at hub URLs; the hub cache lives in tmp_path."""
    import huggingface_hub.constants as hf_constants

    for name in ("shard_00000.parquet", "shard_00001.parquet", "shard_00369.parquet"):
        server.files[hub_path("fineweb-edu", name)] = server.files["/" + name]
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.delenv("NANOCHAT_DATA_BASE_URL", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    return server


def test_hub_shards_use_endpoint_token_cache_and_manifest(hub, tmp_path):
    m = download_remote_shards("fineweb-edu", tmp_path / "d", 2, workers=2, progress=False)
    assert m["train"] == ["shard_00000.parquet", "shard_00001.parquet"] and m["val"] == ["shard_00369.parquet"]
    assert m["source"] == "hf://datasets/karpathy/fineweb-edu-100b-shuffle"
    assert m["hub_repo"] == "karpathy/fineweb-edu-100b-shuffle" and m["hub_revision"] == [HUB_COMMIT]
    assert len(list(iter_documents(tmp_path / "d", "train"))) == 50
    # every request went to HF_ENDPOINT with HF_TOKEN; one metadata HEAD + one GET per shard
    assert sorted((r[0], r[1]) for r in hub.requests) == sorted(
        (method, hub_path("fineweb-edu", n)) for n in m["train"] + m["val"] for method in ("GET", "HEAD"))
    assert {r[3] for r in hub.requests} == {"Bearer hf_test_token"}
    # the shard in the data dir is the hub cache's blob (hard link: no second copy), named by its sha256
    shard, body = tmp_path / "d" / "shard_00001.parquet", hub.files["/shard_00001.parquet"]
    blob = tmp_path / "hub" / "datasets--karpathy--fineweb-edu-100b-shuffle" / "blobs" / hashlib.sha256(body).hexdigest()
    assert shard.read_bytes() == body and os.path.samefile(shard, blob)
    # a re-run with one shard more fetches only that one and keeps the rest (the server is not asked again)
    hub.requests.clear()
    hub.files[hub_path("fineweb-edu", "shard_00002.parquet")] = parquet_bytes(5, "c")
    m = download_remote_shards("fineweb-edu", tmp_path / "d", 3, workers=1, progress=False)
    assert m["train"][-1] == "shard_00002.parquet" and m["hub_revision"] == [HUB_COMMIT]
    assert {r[1] for r in hub.requests} == {hub_path("fineweb-edu", "shard_00002.parquet")}


def test_hub_download_resumes_a_dropped_connection(hub, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    # the library streams in 10 MB chunks: smaller ones let a half-sent 1 MB test file resume mid-way
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    path = hub_path("fineweb-edu", "shard_00001.parquet")
    hub.fail[path] = ["truncate"]
    got = hub_file("karpathy/fineweb-edu-100b-shuffle", "shard_00001.parquet", progress=False)
    assert got.read_bytes() == hub.files[path] and got.parent.name == HUB_COMMIT
    gets = [r for r in hub.requests if r[0] == "GET"]
    assert len(gets) == 2 and gets[0][2] is None
    offset = int(gets[1][2].split("=")[1].rstrip("-"))
    assert 0 < offset <= len(hub.files[path]) // 2  # resumed from what was received, not from 0


def test_hub_checksum_mismatch_leaves_no_corrupt_file(hub, tmp_path):
    path = hub_path("fineweb-edu", "shard_00000.parquet")
    hub.etags[path] = "ab" * 32  # the hub's sha256 does not match what the server sends
    with pytest.raises(DownloadError, match=r"shard_00000.parquet: checksum mismatch \(sha256 [0-9a-f]{64}, "
                                            r"the hub says abab.*deleted"):
        download_remote_shards("fineweb-edu", tmp_path / "d", 1, workers=1, progress=False)
    assert not (tmp_path / "d" / "shard_00000.parquet").exists() and not (tmp_path / "d" / "manifest.json").exists()
    cache = tmp_path / "hub" / "datasets--karpathy--fineweb-edu-100b-shuffle"
    assert not (cache / "blobs" / ("ab" * 32)).exists()
    assert not (cache / "snapshots" / HUB_COMMIT / "shard_00000.parquet").exists()


def test_hub_errors_are_clear(hub, tmp_path, monkeypatch, capsys):
    from scripts.prepare_data import main

    with pytest.raises(DownloadError, match="dataset repo karpathy/fineweb-edu-100b-shuffle, file nope.parquet: "
                                            "no such file in the repo"):
        hub_file("karpathy/fineweb-edu-100b-shuffle", "nope.parquet", progress=False)
    import huggingface_hub.constants as hf_constants

    # offline and not cached (the library's answer to an unreachable hub too, after its own retries)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert main(["--dataset", "fineweb-edu", "--num-shards", "1", "--data-dir", str(tmp_path / "d"),
                 "--workers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: dataset repo karpathy/fineweb-edu-100b-shuffle, file shard_00369.parquet: "
                              "not in the hub cache and the hub cannot be reached")
    assert "HF_HUB_OFFLINE" in err[-1] and not list((tmp_path / "d").glob("*.parquet"))


def test_a_directory_of_one_remote_dataset_is_not_reused_for_another(server, tmp_path):
    """Remote shards are reused by name: climbmix into fineweb-edu's directory took fineweb's shard_00000/1."""
    download_remote_shards("fineweb-edu", tmp_path, 2, base_url=server.url, progress=False)
    with pytest.raises(DataError, match=f"--data-dir {tmp_path} holds the 'fineweb-edu' dataset; give --dataset "
                                        "climbmix a directory of its own"):
        download_remote_shards("climbmix", tmp_path, 2, base_url=server.url, progress=False)
    (tmp_path / "manifest.json").unlink()  # an interrupted first download has no manifest, only the mark
    with pytest.raises(DataError, match="holds the 'fineweb-edu' dataset"):
        download_remote_shards("climbmix", tmp_path, 2, base_url=server.url, progress=False)
    assert download_remote_shards("fineweb-edu", tmp_path, 2, base_url=server.url, progress=False)["train"]


def test_the_first_failed_shard_stops_the_download_without_trying_the_queued_ones(server, tmp_path):
    server.fail.update({f"/shard_{i:05d}.parquet": ["error"] * 9 for i in (0, 1, 369)})
    with pytest.raises(DownloadError, match="after 2 attempts"):
        download_remote_shards("fineweb-edu", tmp_path, 2, base_url=server.url, workers=1, max_attempts=2,
                               backoff=0.01, progress=False)
    assert len(server.requests) == 2  # the val shard's 2 attempts; the 2 queued train shards were cancelled


def test_two_processes_downloading_one_file_both_get_it(server, tmp_path):
    """Two ranks (or runs) fetching the same shard shared one .part file: one renamed it under the other."""
    server.delay = 0.3  # every response waits, so both downloads overlap
    url, dest = f"{server.url}/shard_00001.parquet", tmp_path / "s.parquet"
    results = []

    def fetch():
        try:
            results.append(download_file(url, dest, validate=validate_parquet, backoff=0.01, progress=False))
        except Exception as e:  # noqa: BLE001 (recorded for the assertion)
            results.append(e)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [dest, dest] and dest.read_bytes() == server.files["/shard_00001.parquet"]
    assert sum(r[0] == "GET" for r in server.requests) == 1


def test_ctrl_c_stops_the_shard_downloads_at_once_and_the_rerun_resumes_them(server, tmp_path, capsys):
    """Ctrl-C while shards come from a slow mirror: KeyboardInterrupt within a piece of the body, not after every
    download in flight has finished (minutes for real shards); the .part files are kept and the next run resumes
    them with Range requests; one line, exit 130. Before: the interrupt waited for the worker threads, which
    downloaded to the end (~12 s here), then a traceback. ~1 s."""
    from scripts import prepare_data

    server.chunk_delay = 1.0  # shard_00001: ~13 pieces of 64 KiB, ~13 s
    part = tmp_path / "shard_00001.parquet.part"
    with ctrl_c_when(lambda: has_bytes(part)) as sent:  # once its first piece is in
        code = prepare_data.main(["--dataset", "fineweb-edu", "--num-shards", "2", "--base-url", server.url,
                                  "--data-dir", str(tmp_path), "--workers", "3", "--no-progress"])
        # ~1 s (a worker sees the stop at its next piece); far below the ~12 s the rest of the body takes
        elapsed = time.monotonic() - sent[0]
    assert elapsed < 6 and code == 130 and "interrupted" in capsys.readouterr().err, (elapsed, code)
    join_download_threads()  # a worker that missed the stop would go on to the end of the body
    assert part.is_file() and 0 < part.stat().st_size < len(server.files["/shard_00001.parquet"])
    assert not (tmp_path / "shard_00001.parquet").exists()
    server.chunk_delay = 0.0
    download_remote_shards("fineweb-edu", tmp_path, 2, base_url=server.url, progress=False)
    assert (tmp_path / "shard_00001.parquet").read_bytes() == server.files["/shard_00001.parquet"]
    assert any(r[1] == "/shard_00001.parquet" and r[2] for r in server.requests)  # resumed with a Range request
    assert not list(tmp_path.glob("*.part"))


def test_a_missing_shard_is_reported_while_another_download_is_stopped(tmp_path, capsys):
    """A shard the mirror lacks (404) stops the downloads in flight; the error printed is the 404's one line, not the
    stop of the (slow) val shard collected first. ~1 s."""
    from scripts import prepare_data

    slow = FlakyServer({"/shard_00369.parquet": parquet_bytes(20, "val", filler=40_000),
                        "/shard_00000.parquet": parquet_bytes(30, "a")})  # shard_00001 missing: 404 at once
    slow.chunk_delay = 0.1
    try:
        code = prepare_data.main(["--dataset", "fineweb-edu", "--num-shards", "2", "--base-url", slow.url,
                                  "--data-dir", str(tmp_path), "--workers", "3", "--no-progress"])
    finally:
        slow.close()
    err = capsys.readouterr().err
    assert code == 2 and "shard_00001.parquet: HTTP 404" in err and "Traceback" not in err, err
