"""Ctrl-C during the CORE eval bundle download (base_eval's first run): our own HTTP downloader in the main thread,
so the KeyboardInterrupt comes out of the socket read at once; the ``.part`` file is kept and the next run resumes
it. Against a slow local server (never the internet)."""

import hashlib
import io
import os
import time
import zipfile

import pytest

from nanochat.eval_bundle import download_bundle
from test_download import FlakyServer, ctrl_c_when, has_bytes


def bundle_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:  # stored: the size stays ~800 kB
        zf.writestr("eval_bundle/core.yaml", "icl_tasks: []\n")
        zf.writestr("eval_bundle/eval_data/filler.bin", os.urandom(800_000))
    return buf.getvalue()


def test_ctrl_c_stops_the_bundle_download_at_once_and_the_rerun_resumes_it(tmp_path, monkeypatch):
    """~13 pieces of 64 KiB at 1 s each; Ctrl-C once the first piece is in ends the download at once (not after
    the ~12 s the rest of the body takes). < 1 s."""
    body = bundle_zip()
    server = FlakyServer({"/eval_bundle.zip": body})
    server.chunk_delay = 1.0
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", f"{server.url}/eval_bundle.zip")
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_SHA256", hashlib.sha256(body).hexdigest())
    part = tmp_path / "eval_bundle.zip.part"
    try:
        with ctrl_c_when(lambda: has_bytes(part)) as sent, pytest.raises(KeyboardInterrupt):
            download_bundle(tmp_path, timeout=30)
        elapsed = time.monotonic() - sent[0]  # ~0 s: the socket read is interrupted
        kept = part.stat().st_size
        assert elapsed < 6 and 0 < kept < len(body), (elapsed, kept)
        assert not (tmp_path / "eval_bundle").exists() and not (tmp_path / "eval_bundle.zip").exists()
        server.chunk_delay = 0.0
        assert (download_bundle(tmp_path) / "core.yaml").read_text() == "icl_tasks: []\n"
        gets = [r for r in server.requests if r[0] == "GET"]
        assert len(gets) == 2 and gets[1][2] == f"bytes={kept}-", gets  # resumed where it stopped
        assert not part.exists()
    finally:
        server.close()
