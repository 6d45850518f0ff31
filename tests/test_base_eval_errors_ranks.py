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


# "no run" is slow: it fails in the same shared step as "no step" (rank0_decides(existing_step): find_last_step's
# FileNotFoundError there, existing_step's here), raised on every rank and printed once by print_error alike
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c == "no run" else [])
                                  for c in sorted(CASES)])
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


@pytest.mark.parametrize("marked", [True, False])
def test_the_advice_on_a_kernel_every_rank_refused_keeps_its_mark(monkeypatch, marked):
    """--attention run / --mome-kernels run re-raise the set-up's refusal with advice: a new exception, which must
    stay every rank's where the refusal was (train_setup's collectives), or print_error prints it once per rank."""
    from contextlib import ExitStack

    import torch

    from nanochat import train_setup
    from nanochat.common import raised_on_every_rank
    from scripts.base_eval import setup_eval_attention, setup_eval_mome_kernels

    def refuse(*_args, **_kwargs):
        error = ValueError("cannot run here")
        raise raised_on_every_rank(error) if marked else error

    monkeypatch.setattr(train_setup, "setup_attention", refuse)
    monkeypatch.setattr(train_setup, "install_mome_kernels", refuse)
    meta = {"config": {"attention": "fa3", "mome_kernels": "fused"}}
    with pytest.raises(ValueError, match=r"^--attention run: the run trained with fa3") as attention:
        setup_eval_attention("run", meta, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^--mome-kernels run: the run trained with fused") as kernels:
        setup_eval_mome_kernels("run", meta, torch.device("cpu"), ExitStack(), "off")
    for caught in (attention, kernels):
        assert getattr(caught.value, "raised_on_every_rank", False) is marked
