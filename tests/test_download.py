"""The downloader against a local HTTP server on 127.0.0.1 with injected failures (never the internet)."""

import io
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat.dataset import DownloadError, download_file, download_remote_shards, iter_documents, load_manifest


def parquet_bytes(n_rows: int, tag: str, filler: int = 200) -> bytes:
    buf = io.BytesIO()
    # random filler, uncompressed: files are large enough that a half body spans several 64 KiB read chunks
    rows = [f"{tag} document {i} " + os.urandom(filler // 2).hex() for i in range(n_rows)]
    pq.write_table(pa.table({"text": rows}), buf, compression="none")
    return buf.getvalue()


class FlakyServer:
    """Serves ``files`` (path -> bytes); ``fail[path]`` = list of actions consumed one per request:
    'error' -> HTTP 503, 'truncate' -> full Content-Length header but only half the body. Honors Range."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.fail, self.requests = files, {}, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests.append((self.path, self.headers.get("Range")))
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                action = server.fail.get(self.path, []).pop(0) if server.fail.get(self.path) else None
                if action == "error":
                    self.send_error(503)
                    return
                start, status = 0, 200
                if self.headers.get("Range"):
                    start, status = int(self.headers["Range"].split("=")[1].split("-")[0]), 206
                payload = body[start:]
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.end_headers()
                self.wfile.write(payload[: len(payload) // 2] if action == "truncate" else payload)
                if action == "truncate":
                    self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


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
    assert len(body) > 600_000 and server.requests[0][1] is None
    offset = int(server.requests[1][1].split("=")[1].rstrip("-"))
    assert 0 < offset <= len(body) // 2  # resumed from what was received, not from 0


def test_existing_part_file_is_resumed(server, tmp_path):
    body = server.files["/shard_00000.parquet"]
    (tmp_path / "s.parquet.part").write_bytes(body[:100])
    download_file(f"{server.url}/shard_00000.parquet", tmp_path / "s.parquet", progress=False)
    assert (tmp_path / "s.parquet").read_bytes() == body
    assert server.requests == [("/shard_00000.parquet", "bytes=100-")]


def test_invalid_content_and_404_leave_no_files(server, tmp_path):
    with pytest.raises(DownloadError, match="junk.parquet but the file is invalid"):
        download_file(f"{server.url}/junk.parquet", tmp_path / "j.parquet", backoff=0.01, progress=False)
    with pytest.raises(DownloadError, match="HTTP 404"):
        download_file(f"{server.url}/missing.parquet", tmp_path / "m.parquet", backoff=0.01, progress=False)
    assert list(tmp_path.iterdir()) == []
    assert len(server.requests) == 2  # a 404 is not retried


def test_gives_up_after_max_attempts_keeping_part_for_resume(server, tmp_path):
    server.fail["/shard_00000.parquet"] = ["truncate", "truncate", "truncate"]
    with pytest.raises(DownloadError, match="after 3 attempts.*resumes from s.parquet.part"):
        download_file(f"{server.url}/shard_00000.parquet", tmp_path / "s.parquet", max_attempts=3, backoff=0.01,
                      progress=False)
    assert not (tmp_path / "s.parquet").exists() and (tmp_path / "s.parquet.part").exists()
    download_file(f"{server.url}/shard_00000.parquet", tmp_path / "s.parquet", progress=False)
    assert (tmp_path / "s.parquet").read_bytes() == server.files["/shard_00000.parquet"]


def test_remote_dataset_manifest_pins_val_shard(server, tmp_path):
    server.fail["/shard_00369.parquet"] = ["error"]
    m = download_remote_shards("fineweb-edu", tmp_path, 2, base_url=server.url, workers=2, backoff=0.01,
                               progress=False)
    assert m["train"] == ["shard_00000.parquet", "shard_00001.parquet"] and m["val"] == ["shard_00369.parquet"]
    assert m["shards"]["shard_00369.parquet"]["rows"] == 10 and m["val_index"] == 369
    assert load_manifest(tmp_path)["source"] == server.url
    assert len(list(iter_documents(tmp_path, "train"))) == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shard_00000.parquet",
                                                          "shard_00001.parquet", "shard_00369.parquet"]


def test_cli_env_base_url_and_unreachable_network(server, tmp_path, monkeypatch, capsys):
    from scripts.prepare_data import main

    monkeypatch.setenv("NANOCHAT_DATA_BASE_URL", server.url)
    assert main(["--dataset", "climbmix", "--num-shards", "1", "--data-dir", str(tmp_path / "c")]) == 1
    assert "shard_06542.parquet: HTTP 404" in capsys.readouterr().err  # val shard of climbmix is 6542
    assert main(["--dataset", "fineweb-edu", "--num-shards", "1", "--data-dir", str(tmp_path / "f")]) == 0
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["--dataset", "fineweb-edu", "--num-shards", "1", "--data-dir", str(tmp_path / "d"),
                 "--base-url", dead, "--max-attempts", "1", "--workers", "1"]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # earlier stderr lines are tqdm bars
    assert err.count("error:") == 1 and last.startswith("error: could not download") and "--base-url" in last
    assert "resumes from" not in last and not list((tmp_path / "d").iterdir())
