"""base_eval's errors under torchrun (2 gloo ranks), once the process group exists: one every rank finds alike (a
bad --run-dir, a missing checkpoint step, a flag the checkpoint's model refuses) is printed once, by rank 0, with
exit code 2. Its flag errors, before the group: tests/test_parse_errors_ranks.py."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import base_eval_fixtures  # noqa: E402

tiny_run = base_eval_fixtures.tiny_run  # the fixture (module scope: one tiny trained run for this file)
BASE_EVAL = Path(__file__).parent.parent / "scripts" / "base_eval.py"

CASES = {  # the flags beside --run-dir and --out-dir, and the error's words
    "no run": (["--run-dir", "{tmp}/nosuch"], "nosuch"),
    "no step": (["--step", "99"], "99"),
    "flag the model refuses": (["--mome-shared-table-kernel", "on"], "--mome-shared-table-kernel"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_error_every_rank_raises_is_printed_once(tiny_run, tmp_path, case):
    from conftest import run_torchrun

    root = tiny_run[0]
    flags, needle = CASES[case]
    args = ["--run-dir", str(root / "run"), "--eval", "bpb", "--no-progress", "--device-type", "cpu",
            "--out-dir", str(tmp_path / "o"), *(f.format(tmp=tmp_path) for f in flags)]
    res = run_torchrun(BASE_EVAL, 2, args)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], res.stderr[-4000:]
    assert "exitcode  : 2 " in res.stderr and res.returncode != 0, res.stderr[-4000:]
