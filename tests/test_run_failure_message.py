"""scripts.run's last line when base_train exits non-zero: it said only the exit code; now it says what this launch's
summary.json says (the stop reason, the error) and the runner's way on, and never repeats an earlier launch's."""

import json
import sys

import pytest

from scripts.run import run_one

HOW = "by re-running the same command"


def child_that_writes(summary: dict | None, code: int) -> list[str]:
    """A stand-in for base_train: writes ``summary`` (None: nothing) as summary.json into argv[1], exits ``code``."""
    write = f"open(sys.argv[1] + '/summary.json', 'w').write({json.dumps(json.dumps(summary))}); " if summary else ""
    return [sys.executable, "-c", f"import sys; {write}sys.exit({code})"]


def failure(tmp_path, summary: dict | None, code: int) -> str:
    run_dir = tmp_path / "seed1"
    run_dir.mkdir(exist_ok=True)
    with pytest.raises(SystemExit) as ended:
        run_one(1, run_dir, [*child_that_writes(summary, code), str(run_dir)], how=HOW)
    return str(ended.value.code)


def test_an_error_stop_names_the_error_and_the_way_on(tmp_path):
    summary = {"stop_reason": "error", "step": 3, "error": "RuntimeError: CUDA out of memory", "last_checkpoint": 2}
    line = failure(tmp_path, summary, 1)
    assert line.startswith("[run] seed 1 failed with exit code 1: error at step 3 (RuntimeError: CUDA out of memory); "
                           f"once the cause is fixed, it continues from its checkpoint of step 2 {HOW}. Log: "), line


def test_an_error_before_any_checkpoint_starts_again(tmp_path):
    summary = {"stop_reason": "data_error", "step": 1, "error": "DataError: x.parquet", "last_checkpoint": None}
    line = failure(tmp_path, summary, 2)
    assert "exit code 2: data_error at step 1 (DataError: x.parquet); once the cause is fixed, it continues from " \
           f"the start (no checkpoint was saved) {HOW}." in line, line


def test_a_nonfinite_stop_points_at_base_trains_advice(tmp_path):
    summary = {"stop_reason": "nonfinite_loss", "step": 4, "error": "NonFiniteLoss: loss is nan", "last_checkpoint": 2}
    line = failure(tmp_path, summary, 3)
    assert "exit code 3: nonfinite_loss at step 4 (NonFiniteLoss: loss is nan); base_train's message in the log " \
           "names the last good checkpoint and the lower learning rates" in line, line
    assert HOW not in line  # the same command would meet the same NaN


def test_an_earlier_launchs_summary_is_not_this_ones_account(tmp_path):
    """A resume that fails before its first step (bad flags: exit 2) writes no summary.json: the one there is the
    earlier launch's (interrupted), which must not be reported as this failure's."""
    (tmp_path / "seed1").mkdir()
    (tmp_path / "seed1" / "summary.json").write_text(json.dumps({"stop_reason": "interrupted", "step": 2}))
    line = failure(tmp_path, None, 2)
    assert line.startswith("[run] seed 1 failed with exit code 2; see ") and "interrupted" not in line, line


def test_a_signal_stop_under_torchrun_continues_from_its_step(tmp_path):
    """torchrun exits non-zero after a SIGTERM that every worker answered by saving (summary: interrupted, exit 0
    each): the seed continues from the checkpoint of its step, no cause to fix."""
    line = failure(tmp_path, {"stop_reason": "interrupted", "step": 5, "signal": "SIGTERM"}, 1)
    assert f"exit code 1: interrupted at step 5; it continues from its checkpoint of step 5 {HOW}. Log: " in line, line


def test_a_failed_rewind_continues_from_its_own_step_with_the_same_command(tmp_path):
    """A --resume K below the latest checkpoint whose set-up failed: base_train's summary has step K and
    last_checkpoint the latest, which it left untouched. --resume auto would take the latest and drop the rewind the
    user asked for: the way on is the same command, --resume K kept."""
    from scripts.run import how_to_continue

    summary = {"stop_reason": "error", "step": 1, "error": "UnpicklingError: bad", "last_checkpoint": 2}
    run_dir = tmp_path / "seed1"
    run_dir.mkdir()
    with pytest.raises(SystemExit) as ended:
        run_one(1, run_dir, [*child_that_writes(summary, 1), str(run_dir)], how=how_to_continue(["--resume", "1"]))
    line = str(ended.value.code)
    assert "error at step 1 (UnpicklingError: bad); once the cause is fixed, it continues from its checkpoint of " \
           f"step 1 {HOW} (its --resume 1 kept; the later checkpoints, up to step 2, are untouched). Log: " in line, line
    assert "--resume auto" not in line
