"""A stop signal (Ctrl-C / SIGTERM) saves at the boundary that ends the step it arrives in: docs/training.md's "next step
boundary". base_train's handler only latches the signal; train_step reads the latch at its stop vote (one value per
rank, in the step's single reduction), so every rank stops after the same step even when one rank alone got it."""

import json
import signal

import pytest

from _mid_step_signal_worker import signal_during_step
from nanochat import checkpoint as ckpt
from scripts import base_train
from test_train_e2e import train


def assert_stopped_at(run, step: int, why: str, out: str) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["step"]) == ("interrupted", step), summary
    assert ckpt.list_steps(run) == [step]
    assert f"step_{step:06d} ({why})" in out, out[-3000:]  # rank 0's line: what it knows of the signal


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_during_step_k_saves_step_k(tmp_path, monkeypatch, capsys, sig):
    """Walk of 2026-11-27: a Ctrl-C during step 7 saved step 8 (the flag was read when the step began)."""
    run = tmp_path / "r"
    monkeypatch.setattr(base_train, "train_step", signal_during_step(base_train.train_step, 3, sig))
    assert train(run, "--num-iterations", "8") == 0
    assert_stopped_at(run, 3, f"signal {sig.name}", capsys.readouterr().out)


def test_a_signal_on_one_of_two_ranks_during_step_k_saves_step_k_on_both(two_rank_signal_runs):
    """Rank 1 alone gets SIGTERM mid-step 2; rank 0 learns of it in that step's reduction, so both leave the loop
    after step 2 and take the save's collectives together (a rank that trained on would hang the other). Rank 0,
    which got no signal itself, names rank 1's in summary.json and in its line (what
    test_stop_summary.py::test_a_signal_on_rank_1_alone_is_named_in_rank_0s_summary checks in a launch of its own,
    now slow). Run 0 of conftest.two_rank_signal_runs (TINY, 6 steps of 2 x 2 rows)."""
    run, stdout = two_rank_signal_runs(0)
    assert_stopped_at(run, 2, "signal on another rank", stdout)
    assert json.loads((run / "summary.json").read_text())["signal"] == "SIGTERM"
    assert "interrupted (SIGTERM) at step 2: checkpoint saved" in stdout, stdout[-3000:]
