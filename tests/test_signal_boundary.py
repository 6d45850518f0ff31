"""A stop signal that lands during a periodic sample or checkpoint save (the work at a step boundary) stops the run
right after that work, at that step: not after the next step, which would cost one more step and one more save inside
a scheduler's grace period. Every rank votes on it once after such work (a small all-reduce), so they stop together;
the checkpoint of that step then holds the finished work, and --resume continues as from a periodic save. A signal
during a periodic eval cuts the eval short instead, and the step's checkpoint is a pending one (its --resume runs the
step's evals and samples): tests/test_periodic_eval_cut.py."""

import json
import signal

import pytest

from _mid_step_signal_worker import signal_during_call, signal_during_step
from nanochat import checkpoint as ckpt
from nanochat import run_control
from scripts import base_train
from test_run_control import records
from test_signal_step import assert_stopped_at
from test_train_e2e import losses, train

FLAGS = ["--num-iterations", "6", "--eval-every", "3", "--sample-every", "3"]


def assert_resumed_like(run, ref) -> None:
    """The resumed run reads like the uninterrupted one: the same losses, evals and samples, none repeated."""
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "completed"
    assert losses(run) == losses(ref)
    for kind, key in (("eval", "val_bpb"), ("sample", "samples")):
        assert [(r["step"], r[key]) for r in records(run, kind)] == [(r["step"], r[key]) for r in records(ref, kind)]


def count_steps(monkeypatch) -> list:
    calls, real = [], base_train.train_step
    monkeypatch.setattr(base_train, "train_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("during, saved_by", [("eval", "signal SIGTERM"), ("sample", "signal SIGTERM"),
                                              ("save", "periodic")])
def test_a_signal_during_a_boundarys_work_stops_at_that_step(tmp_path, monkeypatch, capsys, uninterrupted_run, during,
                                                            saved_by):
    """Step 3's eval (call 2: step 0 has one), samples or periodic save gets a SIGTERM: the run stops at step 3
    without training step 4. A save that was due is the stop's checkpoint; else the stop saves step 3 now: after
    the samples, with them done; in the eval, which the signal cuts short, pending (its resume runs it)."""
    run = tmp_path / "run"
    flags = [*FLAGS, *(["--save-every", "3"] if during == "save" else [])]
    ref = uninterrupted_run(*flags)
    target, name, call = {"eval": (base_train, "run_split_bpb", 2), "sample": (run_control, "greedy_samples", 1),
                          "save": (base_train, "save", 1)}[during]
    monkeypatch.setattr(target, name, signal_during_call(getattr(target, name), call, signal.SIGTERM))
    steps = count_steps(monkeypatch)
    capsys.readouterr()
    assert train(run, *flags) == 0
    assert_stopped_at(run, 3, saved_by, capsys.readouterr().out)
    assert len(steps) == 3
    # the samples and the save ran whole, after the step's eval; the cut eval and the samples after it are owed
    assert ckpt.load_meta(run, 3)["loop"].get(base_train.BOUNDARY_PENDING) is (True if during == "eval" else None)
    assert [r["step"] for r in records(run, "eval")] == ([0] if during == "eval" else [0, 3])
    monkeypatch.undo()
    assert train(run, *flags, "--resume") == 0
    assert_resumed_like(run, ref)


def test_a_signal_during_the_evals_a_resume_owed_cuts_them_and_keeps_the_pending_checkpoint(tmp_path, monkeypatch,
                                                                                          capsys, uninterrupted_run):
    """A signal during step 3 saves step 3 before its eval (the resume owes it); a second signal during that eval,
    in the resume, cuts it short: nothing is logged of it and step 3's pending checkpoint, the state the resume
    loaded, is not written again (a save within the scheduler's grace period for nothing). The next resume runs
    the eval once."""
    run = tmp_path / "run"
    ref = uninterrupted_run(*FLAGS)
    monkeypatch.setattr(base_train, "train_step", signal_during_step(base_train.train_step, 3, signal.SIGTERM))
    assert train(run, *FLAGS) == 0
    assert ckpt.load_meta(run, 3)["loop"].get(base_train.BOUNDARY_PENDING) is True
    saved = (ckpt.step_dir(run, 3) / "model.pt").stat().st_mtime_ns
    monkeypatch.undo()
    monkeypatch.setattr(base_train, "run_split_bpb", signal_during_call(base_train.run_split_bpb, 1, signal.SIGTERM))
    steps = count_steps(monkeypatch)
    capsys.readouterr()
    assert train(run, *FLAGS, "--resume") == 0
    out = capsys.readouterr().out
    assert "SIGTERM during the periodic evals" in out and "saved checkpoint" not in out
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["step"], summary["signal"]) == ("interrupted", 3, "SIGTERM")
    assert len(steps) == 0 and [r["step"] for r in records(run, "eval")] == [0]
    assert ckpt.list_steps(run) == [3] and (ckpt.step_dir(run, 3) / "model.pt").stat().st_mtime_ns == saved
    assert ckpt.load_meta(run, 3)["loop"].get(base_train.BOUNDARY_PENDING) is True
    monkeypatch.undo()
    assert train(run, *FLAGS, "--resume") == 0
    assert_resumed_like(run, ref)


def test_a_signal_on_one_of_two_ranks_during_an_eval_stops_both_at_that_step(two_rank_signal_runs):
    """Rank 1 alone gets SIGTERM as step 2's val-bpb eval starts; both ranks cut it at its first stop vote and
    stop at step 2 (rank 0 saves it pending, naming the other rank), not after the eval and step 3. Run 1 of
    conftest.two_rank_signal_runs (TINY, --eval-every 2, 6 steps of 2 x 2 rows), checked on the copy of the run dir
    it left; run 2 is its --resume (the worker with no rank signalled: base_train itself), in the same launch."""
    stopped, stdout = two_rank_signal_runs(1)
    assert_stopped_at(stopped, 2, "signal on another rank", stdout)
    assert [rec["step"] for rec in records(stopped, "eval")] == [0]
    assert ckpt.load_meta(stopped, 2)["loop"].get(base_train.BOUNDARY_PENDING) is True
    run, _ = two_rank_signal_runs(2)
    assert [rec["step"] for rec in records(run, "eval")] == [0, 2, 4] and sorted(losses(run)) == [1, 2, 3, 4, 5, 6]
