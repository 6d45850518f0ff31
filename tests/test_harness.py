"""The test harness's own launch helpers (tests/conftest.py): what they promise the tests that use them."""

import os

import pytest

import torchrun_forked
from conftest import REPO, once_per_test_run, torchrun_env


def test_a_launch_leaves_no_torchelastic_directory_in_its_tmpdir(tmp_path):
    """torchrun logs into conftest's PET_LOG_DIR (one directory per test session, removed at its end), where a
    launch without --log-dir makes a torchelastic_* directory in TMPDIR and never removes it."""
    tmp, script = tmp_path / "tmp", tmp_path / "worker.py"
    tmp.mkdir()
    script.write_text("import os\nprint(os.environ['TORCHELASTIC_ERROR_FILE'])\n")  # no torch import: ~0.1 s
    r = torchrun_forked.run(["--standalone", "--nproc_per_node=1", str(script)], env=torchrun_env(TMPDIR=str(tmp)),
                            cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in tmp.iterdir()) == []
    # the worker's error file (torchrun's per-rank log directory) is in the session's log directory
    assert r.stdout.strip().startswith(os.environ["PET_LOG_DIR"] + os.sep), r.stdout


class OwnTempDir:
    """A tmp_path_factory whose base temp dir is ``path`` (a test's own)."""

    def __init__(self, path):
        self.path = path

    def getbasetemp(self):
        return self.path


@pytest.mark.parametrize("xdist_worker", [None, "gw1"])
def test_once_per_test_run_makes_once_and_again_after_a_failed_make(tmp_path, monkeypatch, xdist_worker):
    """Under xdist the directory is shared by the workers (beside their temp dirs), else in the process's own; a
    make that raised is made again by the next caller, from an empty directory."""
    if xdist_worker:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", xdist_worker)
    else:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    base = tmp_path / "gw1"
    base.mkdir()
    calls = []

    def failing(out):
        calls.append("failing")
        (out / "half").write_text("")
        raise RuntimeError("launch failed")

    def make(out):
        calls.append(sorted(p.name for p in out.iterdir()))
        (out / "result").write_text("1")

    with pytest.raises(RuntimeError, match="launch failed"):
        once_per_test_run(OwnTempDir(base), "checks", failing)
    first = once_per_test_run(OwnTempDir(base), "checks", make)
    again = once_per_test_run(OwnTempDir(base), "checks", failing)  # made: not called
    assert first == again == (tmp_path if xdist_worker else base) / "checks"
    assert calls == ["failing", []] and (first / "result").read_text() == "1"


def test_once_per_test_run_callers_at_once_wait_for_the_one_make(tmp_path, monkeypatch):
    """Two workers asking at once (here two threads: flock locks each open of the file): one makes, the other
    waits for it and reads what it made."""
    import threading
    import time

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    calls, got = [], []

    def make(out):
        calls.append(1)
        time.sleep(0.3)  # the other caller asks meanwhile
        (out / "result").write_text("1")

    def ask(worker):
        base = tmp_path / worker
        base.mkdir()
        out = once_per_test_run(OwnTempDir(base), "checks", make)
        got.append((out / "result").read_text())

    threads = [threading.Thread(target=ask, args=(w,)) for w in ("gw0", "gw1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and got == ["1", "1"]
