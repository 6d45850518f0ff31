"""A signal stop's checkpoint is "pending" (scripts/base_train.py, BOUNDARY_PENDING): its step's evals and samples
have not run, and the --resume runs them first. When that resumed process dies before it saves again (a crash, a
SIGKILL), the next --resume from the same pending checkpoint runs them once more: metrics.jsonl must then hold that
step's eval and sample records once, as an uninterrupted run's does, not once per try. Likewise the "resume"
record of a --resume-override-lr session that died before it saved: the next try logs its own."""

import json
import signal
from collections import Counter

import pytest

from _mid_step_signal_worker import signal_during_call, signal_during_step
from nanochat import checkpoint as ckpt
from nanochat import run_control
from nanochat.metrics import truncate_metrics
from scripts import base_train
from test_run_control import records
from test_signal_boundary import FLAGS, assert_resumed_like
from test_train_e2e import train

LR = {"matrix_lr": {"checkpoint": 0.02, "now": 0.01}}
OVERRIDE = ["--matrix-lr", "0.01", "--resume-override-lr"]


class Crash(RuntimeError):
    """Stands for the death of the resumed process (an exception out of main, as a SIGKILL leaves no summary)."""


def crash(*args, **kwargs):
    raise Crash("killed")


def kinds_and_steps(run) -> Counter:
    """The (kind, step) of every record, counted: a repeated eval shows as a count of 2."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return Counter((r["kind"], r["step"]) for r in map(json.loads, lines))


def stop_pending_at_3(run, monkeypatch) -> None:
    monkeypatch.setattr(base_train, "train_step", signal_during_step(base_train.train_step, 3, signal.SIGTERM))
    assert train(run, *FLAGS) == 0
    assert ckpt.load_meta(run, 3)["loop"].get(base_train.BOUNDARY_PENDING) is True
    monkeypatch.undo()


def crash_after_the_pending_evals(monkeypatch) -> None:
    """The resume runs step 3's eval and samples, then dies in step 4."""
    monkeypatch.setattr(base_train, "train_step", crash)


def crash_in_the_save_after_a_signal_during_them(monkeypatch) -> None:
    """A second signal during step 3's samples in the resume (after its eval; a signal in the eval would cut it,
    and the pending checkpoint would stay as it is): it saves step 3 again, its evals and samples done, but dies
    while saving (a SIGKILL after the grace period), so the pending checkpoint is the one left."""
    monkeypatch.setattr(run_control, "greedy_samples", signal_during_call(run_control.greedy_samples, 1,
                                                                          signal.SIGTERM))
    monkeypatch.setattr(base_train, "save", crash)


@pytest.mark.parametrize("crash", [crash_after_the_pending_evals, crash_in_the_save_after_a_signal_during_them],
                         ids=["after_the_evals", "in_the_signal_save"])
def test_a_crashed_pending_resume_leaves_its_evals_logged_once(tmp_path, monkeypatch, uninterrupted_run, crash):
    run = tmp_path / "run"
    ref = uninterrupted_run(*FLAGS)
    stop_pending_at_3(run, monkeypatch)
    crash(monkeypatch)
    assert train(run, *FLAGS, "--resume") == 1  # the crash: stop_reason error, exit 1 (train_end.stop_by_error)
    monkeypatch.undo()
    assert kinds_and_steps(run)[("eval", 3)] == 1 and kinds_and_steps(run)[("sample", 3)] == 1  # the crashed try's
    assert ckpt.list_steps(run) == [3] and ckpt.load_meta(run, 3)["loop"].get(base_train.BOUNDARY_PENDING) is True
    assert train(run, *FLAGS, "--resume") == 0
    # the crashed session's "stop" record (stop_reason error) stays, as every session boundary's does
    assert kinds_and_steps(run) == kinds_and_steps(ref) + Counter({("stop", 3): 1})
    assert_resumed_like(run, ref)  # values too: this run is deterministic on the CPU


def test_truncate_metrics_drops_a_pending_steps_evals_and_samples_only(tmp_path):
    """The step's train record (logged before the signal stop's save) stays; so do earlier steps' evals, and the
    "resume" and "stop" records of session boundaries at that step."""
    path = tmp_path / "metrics.jsonl"
    recs = [{"kind": "eval", "step": 0}, {"kind": "train", "step": 3}, {"kind": "resume", "step": 3},
            {"kind": "eval", "step": 3}, {"kind": "core", "step": 3}, {"kind": "sample", "step": 3},
            {"kind": "train", "step": 4}, {"kind": "final", "step": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "tr')  # and a torn last line
    truncate_metrics(path, 3, pending=True)
    assert [json.loads(line) for line in path.read_text().splitlines()] == recs[:3]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    truncate_metrics(path, 3)
    assert [json.loads(line) for line in path.read_text().splitlines()] == recs[:6]


def test_truncate_metrics_keeps_the_resume_records_the_checkpoint_holds_once_each(tmp_path):
    """At the checkpoint's step, a "resume" record stays only for a change the checkpoint's history holds (each
    entry accounts for one record); those of earlier steps stay whatever it holds."""
    path, ws = tmp_path / "metrics.jsonl", {"checkpoint": 2, "now": 1}
    recs = [{"kind": "resume", "step": 2, "lr_override": LR}, {"kind": "resume", "step": 3, "lr_override": LR},
            {"kind": "resume", "step": 3, "lr_override": LR, "world_size": ws},
            {"kind": "resume", "step": 3, "lr_override": LR}, {"kind": "resume", "step": 3, "world_size": ws}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    truncate_metrics(path, 3, saved_changes={"lr_override": [LR, LR], "world_size": []})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [recs[0], recs[1], recs[3]]


def test_a_crashed_resumes_lr_override_record_is_not_repeated(tmp_path, monkeypatch):
    """A --resume-override-lr from step 3 that dies before it saves again is abandoned with its record (its
    change is in no checkpoint): the next try from step 3 logs the change once more, and only its record stays."""
    run, flags = tmp_path / "run", ["--num-iterations", "6", "--save-every", "3"]
    assert train(run, *flags) == 0
    monkeypatch.setattr(base_train, "train_step", crash)
    assert train(run, *flags, "--resume", "3", *OVERRIDE) == 1  # the crash: exit 1
    monkeypatch.undo()
    assert train(run, *flags, "--resume", "3", *OVERRIDE) == 0
    assert records(run, "resume") == [{"kind": "resume", "step": 3, "lr_override": LR}]
    assert ckpt.load_meta(run, 6)["config"]["lr_overrides"] == [{"step": 3, "changes": LR}]


def test_a_resume_record_whose_change_its_step_saved_again_stays(tmp_path, monkeypatch):
    """The override's session saves step 3 again (a signal during the samples it owed): checkpoint 3 now holds the
    change, a later resume from it changes nothing and logs no record, and the first one's record stays."""
    run = tmp_path / "run"
    stop_pending_at_3(run, monkeypatch)
    monkeypatch.setattr(run_control, "greedy_samples", signal_during_call(run_control.greedy_samples, 1,
                                                                          signal.SIGTERM))
    assert train(run, *FLAGS, "--resume", *OVERRIDE) == 0
    monkeypatch.undo()
    assert ckpt.load_meta(run, 3)["config"]["lr_overrides"] == [{"step": 3, "changes": LR}]
    assert train(run, *FLAGS, "--resume", "--matrix-lr", "0.01") == 0
    assert records(run, "resume") == [{"kind": "resume", "step": 3, "lr_override": LR}]
