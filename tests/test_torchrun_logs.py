"""A test's torchrun launch leaves nothing under TMPDIR: torchrun logs into conftest's PET_LOG_DIR (one directory per
test session, removed at its end), where a launch without --log-dir makes a torchelastic_* directory in TMPDIR and
never removes it."""

import os

import torchrun_forked
from conftest import REPO, torchrun_env


def test_a_launch_leaves_no_torchelastic_directory_in_its_tmpdir(tmp_path):
    tmp, script = tmp_path / "tmp", tmp_path / "worker.py"
    tmp.mkdir()
    script.write_text("import os\nprint(os.environ['TORCHELASTIC_ERROR_FILE'])\n")  # no torch import: ~0.1 s
    r = torchrun_forked.run(["--standalone", "--nproc_per_node=1", str(script)], env=torchrun_env(TMPDIR=str(tmp)),
                            cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in tmp.iterdir()) == []
    # the worker's error file (torchrun's per-rank log directory) is in the session's log directory
    assert r.stdout.strip().startswith(os.environ["PET_LOG_DIR"] + os.sep), r.stdout
