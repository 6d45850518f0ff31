"""base_train's final evaluation keeps its finished parts (nanochat.eval_resume) across a signal: a --resume reuses
those whose fingerprint matches and computes the rest, with the numbers of an uninterrupted run."""

import errno
import json
import os
import signal

import pytest

from conftest import REPO
from nanochat import eval_resume, final_eval
from scripts import base_train
from test_train_e2e import train

FLAGS = ["--num-iterations", "3", "--final-core"]
PARTIAL = "final_eval.partial.json"


def fake_core(monkeypatch, scored: list, sigterm_in: str | None = None, fails_in: str | None = None) -> None:
    """A stand-in CORE of tasks "a" and "b" that keeps each through the final evaluation's ``finished`` (as
    evaluate_core does): ``scored`` lists the tasks computed; a SIGTERM arrives in task ``sigterm_in`` once it is
    scored, and task ``fails_in`` raises an error."""
    monkeypatch.setattr(base_train, "resolve_bundle", lambda args: REPO)

    def run_core(model, data, args, device, autocast, finished=None):
        tasks = {}
        for name, accuracy in (("a", 0.25), ("b", 0.75)):
            def score():
                scored.append(name)
                if name == sigterm_in:
                    os.kill(os.getpid(), signal.SIGTERM)  # one process: raises here, before the task is kept
                if name == fails_in:
                    raise RuntimeError(f"CORE task {name} failed")
                return {"accuracy": accuracy}
            tasks[name] = finished.get_or_run(name, lambda: {"task": name}, score)
        return {"core": sum(t["accuracy"] for t in tasks.values()) / 2, "label": "CORE", "tasks": tasks}

    monkeypatch.setattr(final_eval, "run_core", run_core)


def count_bpb(monkeypatch) -> list:
    calls, real = [], final_eval.run_split_bpb
    monkeypatch.setattr(final_eval, "run_split_bpb", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    return calls


def interrupted_in_core(run, monkeypatch) -> dict:
    """A run whose final evaluation is stopped by SIGTERM in CORE task b: val bpb and task a are kept."""
    scored = []
    with monkeypatch.context() as m:
        fake_core(m, scored, sigterm_in="b")
        assert train(run, *FLAGS) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["interrupted_during"]) == ("interrupted", "final_eval")
    assert scored == ["a", "b"] and "core" not in summary
    kept = json.loads((run / PARTIAL).read_text())["items"]
    assert sorted(kept) == ["a", "split val"] and kept["a"]["result"] == {"accuracy": 0.25}
    return summary


def test_a_resume_reuses_the_finished_parts_and_matches_an_uninterrupted_run(tmp_path, monkeypatch, capsys):
    ref, run = tmp_path / "ref", tmp_path / "run"
    fake_core(monkeypatch, [])
    assert train(ref, *FLAGS) == 0
    expected = json.loads((ref / "summary.json").read_text())
    assert not (ref / PARTIAL).exists()  # deleted once the final evaluation completed
    interrupted = interrupted_in_core(run, monkeypatch)
    assert f"the finished ones are kept in {run / PARTIAL}" in capsys.readouterr().out
    assert interrupted["val_bpb"] == expected["val_bpb"]
    scored = []
    fake_core(monkeypatch, scored)
    bpb_calls = count_bpb(monkeypatch)
    assert train(run, *FLAGS, "--resume") == 0
    assert (bpb_calls, scored) == ([], ["b"])  # val bpb and task a were reused
    out = capsys.readouterr().out
    assert f"final evaluation parts: 2 of 3 reused from {run / PARTIAL} (finished by an earlier run): split val, a" \
        in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and "interrupted_during" not in summary
    keys = ("val_bpb", "core", "core_label", "core_tasks")
    assert {k: summary[k] for k in keys} == {k: expected[k] for k in keys}  # one process: exactly
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "final"]
    ref_final = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "final"]
    assert final == ref_final and len(final) == 1
    assert not (run / PARTIAL).exists()


@pytest.mark.parametrize("change", [["--eval-batch-size", "2"], ["--eval-tokens", "128"]],
                         ids=["setting", "item inputs"])
def test_a_changed_setting_recomputes_every_part(tmp_path, monkeypatch, capsys, change):
    """Another eval batch size (a setting of the whole evaluation) or another --eval-tokens (the val split's own
    inputs): the kept val bpb is not reused."""
    run = tmp_path / "run"
    interrupted_in_core(run, monkeypatch)
    scored = []
    fake_core(monkeypatch, scored)
    bpb_calls = count_bpb(monkeypatch)
    assert train(run, *FLAGS, *change, "--resume") == 0
    assert bpb_calls == ["val"]
    out = capsys.readouterr().out
    if change[0] == "--eval-batch-size":
        assert scored == ["a", "b"] and "reused from" not in out
        assert "were computed with other settings (eval_batch_size 4 -> 2); recomputing them" in out
    else:
        assert scored == ["b"]  # the CORE task's inputs are unchanged
        assert "the inputs of split val changed (eval_tokens 256 -> 128); recomputing it" in out
        assert "final evaluation parts: 1 of 3 reused" in out
    assert not (run / PARTIAL).exists()


def test_a_crash_in_the_final_evaluation_keeps_the_finished_parts(tmp_path, monkeypatch):
    """An error (here in CORE task b) ends the run with it; what finished before it is kept, and reused."""
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        fake_core(m, [], fails_in="b")
        assert train(run, *FLAGS) == 1  # summary.json says final_eval_error (tests/test_stop_summary.py)
    assert sorted(json.loads((run / PARTIAL).read_text())["items"]) == ["a", "split val"]
    scored = []
    fake_core(monkeypatch, scored)
    bpb_calls = count_bpb(monkeypatch)
    assert train(run, *FLAGS, "--resume") == 0
    assert (bpb_calls, scored) == ([], ["b"])
    assert json.loads((run / "summary.json").read_text())["core"] == 0.5
    assert not (run / PARTIAL).exists()


def test_a_full_disk_while_a_part_is_kept_stops_with_advice_and_a_resume_goes_on(tmp_path, monkeypatch, capsys):
    """Keeping CORE task a fails (a full disk: the val bpb was kept): exit 2 with an error line that says to free
    space and continue with --resume (not base_eval's "run the same command again", which a run dir refuses), no
    traceback; summary.json says final_eval_write_error with the val bpb that finished; the --resume reuses it."""
    run = tmp_path / "run"
    real, writes = eval_resume.write_text_atomic, []

    def full_after_one(path, text):
        writes.append(path)
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    with monkeypatch.context() as m:
        fake_core(m, [])
        m.setattr(eval_resume, "write_text_atomic", full_after_one)
        assert train(run, *FLAGS) == 2
    err = capsys.readouterr().err
    assert f"writing {run / PARTIAL} failed (OSError: [Errno 28] No space left on device)" in err
    assert "continue with --resume" in err and "run the same command again" not in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "final_eval_write_error" and "val_bpb" in summary and "core" not in summary
    scored = []
    fake_core(monkeypatch, scored)
    bpb_calls = count_bpb(monkeypatch)
    assert train(run, *FLAGS, "--resume") == 0
    assert (bpb_calls, scored) == ([], ["a", "b"])
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "completed"


def test_a_signal_once_every_part_is_computed_changes_nothing(tmp_path, monkeypatch):
    """SIGTERM as the kept parts are deleted (every number computed, the final record logged): the run completed,
    as base_eval after its last report; not "interrupted" beside a complete evaluation whose parts are gone, which a
    --resume would compute all over again."""
    run = tmp_path / "run"
    fake_core(monkeypatch, [])
    real = final_eval.FinishedResults.discard

    def discard_then_signal(self):
        real(self)
        os.kill(os.getpid(), signal.SIGTERM)  # one process: the handler runs here

    monkeypatch.setattr(final_eval.FinishedResults, "discard", discard_then_signal)
    assert train(run, *FLAGS) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["core"]) == ("completed", 0.5) and "interrupted_during" not in summary
