"""summary.json says how a base_train run ended, whichever way it ended: the stop reason, the signal that stopped it
(during training as during the final evaluation), and the error and last checkpoint of a stop by an error."""

import json
import shlex
import signal
import sys
from pathlib import Path

import pytest

from _mid_step_signal_worker import signal_during_step
from conftest import REPO, run_torchrun
from nanochat import checkpoint as ckpt
from nanochat import train_end
from nanochat.dataset import DataError
from scripts import base_train
from test_train_dist import BATCH
from test_train_e2e import TINY, train
from test_train_final_eval_resume import FLAGS, PARTIAL, fake_core

SIGNAL_WORKER = REPO / "tests" / "_mid_step_signal_worker.py"


def summary_of(run) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_during_training_is_named_in_the_summary(tmp_path, monkeypatch, capsys, sig):
    """Only a signal during the final evaluation was named ("signal"); one during training said "interrupted"."""
    run = tmp_path / "r"
    monkeypatch.setattr(base_train, "train_step", signal_during_step(base_train.train_step, 2, sig))
    assert train(run, "--num-iterations", "5") == 0
    summary = summary_of(run)
    assert (summary["stop_reason"], summary["step"], summary["signal"]) == ("interrupted", 2, sig.name), summary
    assert f"interrupted ({sig.name}) at step 2: checkpoint saved" in capsys.readouterr().out


# slow: the same launch as test_signal_step.py::test_a_signal_on_one_of_two_ranks_during_step_k_saves_step_k_on_both
# (rank 1 alone signalled mid-step 2), which checks the signal in rank 0's summary and line too; the name (SIGINT
# here, SIGTERM there) reaches rank 0 by final_eval.signal_of_any_rank, a gather of names alike for any signal
@pytest.mark.slow
def test_a_signal_on_rank_1_alone_is_named_in_rank_0s_summary(tmp_path):
    """Rank 0 writes summary.json and got no signal itself: it must still name rank 1's (a Ctrl-C here)."""
    run = tmp_path / "r"
    kill = ["--kill-step", "2", "--kill-ranks", "1", "--kill-with", "SIGINT"]
    r = run_torchrun(SIGNAL_WORKER, 2, [*kill, *TINY, *BATCH, "--num-iterations", "6", "--run-dir", str(run)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = summary_of(run)
    assert (summary["stop_reason"], summary["step"], summary["signal"]) == ("interrupted", 2, "SIGINT"), summary
    assert "interrupted (SIGINT) at step 2: checkpoint saved" in r.stdout, r.stdout[-3000:]


def test_a_final_eval_error_writes_the_summary_and_exits_1(tmp_path, monkeypatch, capsys):
    """An error no signal explains in the final evaluation (here CORE task b) was raised: exit 1 and no summary.json,
    although training finished and its checkpoint is saved. Now: summary.json says final_eval_error with the error,
    what finished (the val bpb), the step and its checkpoint; the message says how to go on; exit 1."""
    run = tmp_path / "run"
    fake_core(monkeypatch, [], fails_in="b")
    assert train(run, *FLAGS) == 1
    summary = summary_of(run)
    assert (summary["stop_reason"], summary["step"], summary["last_checkpoint"]) == ("final_eval_error", 3, 3)
    assert summary["error"] == "RuntimeError: CORE task b failed" and summary["training_stop_reason"] == "completed"
    assert "val_bpb" in summary and "core" not in summary and "signal" not in summary, summary
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: CORE task b failed" in err  # the error, debuggable
    assert "the final evaluation of step 3 failed (training completed)" in err, err
    assert f"the checkpoint of step 3 is saved; --resume reruns the final evaluation, reusing the parts kept in " \
           f"{run / PARTIAL}" in err, err
    assert sorted(json.loads((run / PARTIAL).read_text())["items"]) == ["a", "split val"]


def error_stop(run, monkeypatch, error: Exception, at_call: int, *extra) -> int:
    real, calls = base_train.train_step, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == at_call:
            raise error
        return real(*a, **k)

    monkeypatch.setattr(base_train, "train_step", failing)
    return train(run, "--num-iterations", "6", "--save-every", "2", *extra)


@pytest.mark.parametrize("error, reason, code", [
    (DataError("/data/train_00001.parquet: row group 3 cannot be read"), "data_error", 2),
    (base_train.NonFiniteLoss("train loss is nan at step 4"), "nonfinite_loss", train_end.EXIT_NONFINITE)],
    ids=["data_error", "nonfinite_loss"])
def test_an_error_stop_records_the_error_and_the_last_checkpoint(tmp_path, monkeypatch, error, reason, code):
    """summary.json said only the stop reason and the last finished step (3 here), which is not the last checkpoint
    (2): the error and the checkpoint to go on from were in the console alone."""
    run = tmp_path / "r"
    assert error_stop(run, monkeypatch, error, 4) == code
    summary = summary_of(run)
    assert (summary["stop_reason"], summary["step"], summary["last_checkpoint"]) == (reason, 3, 2), summary
    assert str(error) in summary["error"], summary


def test_a_failed_checkpoint_write_records_the_error(tmp_path, monkeypatch):
    run = tmp_path / "r"
    real = ckpt.save_checkpoint

    def full_at_4(run_dir, step, *a, **k):
        if step == 4:
            raise ckpt.CheckpointWriteError("writing step_000004 failed: [Errno 28] No space left on device")
        return real(run_dir, step, *a, **k)

    monkeypatch.setattr(ckpt, "save_checkpoint", full_at_4)
    assert train(run, "--num-iterations", "6", "--save-every", "2") == 2
    summary = summary_of(run)
    assert (summary["stop_reason"], summary["step"], summary["last_checkpoint"]) == ("checkpoint_error", 4, 2)
    assert "No space left on device" in summary["error"], summary


@pytest.mark.parametrize("flags, reason", [([], "completed"), (["--max-wall-time-seconds", "0.001"],
                                                                  "wall_time_limit")])
def test_a_run_that_ends_well_says_so_without_error_fields(tmp_path, flags, reason):
    run = tmp_path / "r"
    assert train(run, "--num-iterations", "3", *flags) == 0
    summary = summary_of(run)
    assert summary["stop_reason"] == reason and "val_bpb" in summary, summary
    assert not {"error", "signal", "last_checkpoint"} & set(summary), summary


RUNNER_WAY = "running the same scripts.run command again"


@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=lambda s: s.name)
def test_under_the_runner_a_signal_stop_names_the_runners_way_on(tmp_path, monkeypatch, capsys, sig):
    """Under scripts.run (which sets RUNNER_AFRESH_ENV and adds --resume auto itself) "continue with --resume" named a
    flag the runner does not take, beside the runner's own advice to run its command again."""
    from nanochat.train_resume import RUNNER_AFRESH_ENV

    monkeypatch.setenv(RUNNER_AFRESH_ENV, "python -m scripts.run configs/mini/base.toml -- --overwrite")
    monkeypatch.setattr(base_train, "train_step", signal_during_step(base_train.train_step, 2, sig))
    assert train(tmp_path / "r", "--num-iterations", "5") == 0
    out = capsys.readouterr().out
    assert f"interrupted ({sig.name}) at step 2: checkpoint saved; continue by {RUNNER_WAY}" in out, out
    assert "--resume" not in out.split(f"interrupted ({sig.name})")[1].splitlines()[0]


def test_under_the_runner_an_error_stop_names_the_runners_way_on(tmp_path, monkeypatch, capsys):
    from nanochat.train_resume import RUNNER_AFRESH_ENV

    monkeypatch.setenv(RUNNER_AFRESH_ENV, "python -m scripts.run configs/mini/base.toml -- --overwrite")
    assert error_stop(tmp_path / "r", monkeypatch, DataError("/data/x.parquet: unreadable"), 4) == 2
    err = capsys.readouterr().err
    assert f"then continue by {RUNNER_WAY}" in err and "--resume" not in err, err


def test_under_the_runner_a_final_eval_error_names_the_runners_way_on(tmp_path, monkeypatch, capsys):
    from nanochat.train_resume import RUNNER_AFRESH_ENV

    monkeypatch.setenv(RUNNER_AFRESH_ENV, "python -m scripts.run configs/mini/base.toml -- --overwrite")
    run = tmp_path / "run"
    fake_core(monkeypatch, [], fails_in="b")
    assert train(run, *FLAGS) == 1
    err = capsys.readouterr().err
    assert f"the checkpoint of step 3 is saved; {RUNNER_WAY} reruns the final evaluation, reusing the parts kept " \
           f"in {run / PARTIAL}" in err, err


def test_an_unplanned_error_in_training_writes_the_summary_and_exits_1(tmp_path, monkeypatch, capsys):
    """An error no stop plans for (an OOM in a step, a bug) ended with a traceback, exit 1 and no summary.json: the
    run dir had no account of how the run ended. Now summary.json says "error" with the error, the step and the
    checkpoint to go on from; metrics.jsonl has the stop; stderr keeps the traceback and says how to continue."""
    run = tmp_path / "r"
    assert error_stop(run, monkeypatch, RuntimeError("CUDA out of memory (simulated)"), 4) == 1
    summary = summary_of(run)
    assert (summary["stop_reason"], summary["step"], summary["last_checkpoint"]) == ("error", 3, 2), summary
    assert summary["error"] == "RuntimeError: CUDA out of memory (simulated)" and "signal" not in summary, summary
    stops = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"stop"' in line]
    assert [(s["reason"], s["step"], s["error"]) for s in stops] == [("error", 3, summary["error"])], stops
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: CUDA out of memory (simulated)" in err, err
    assert f"training stopped by an error after step 3\nlast checkpoint: step 2 in {run / ckpt.CKPT_DIR}" in err, err
    assert "fix the cause, then continue with --resume" in err, err


def test_an_unplanned_error_before_any_checkpoint_says_none(tmp_path, monkeypatch, capsys):
    run = tmp_path / "r"
    assert error_stop(run, monkeypatch, AssertionError("a bug"), 2, "--save-every", "-1") == 1
    summary = summary_of(run)
    assert (summary["stop_reason"], summary["step"], summary["last_checkpoint"]) == ("error", 1, None), summary
    assert summary["error"] == "AssertionError: a bug", summary
    assert "no checkpoint was saved: once the cause is fixed, start again with --overwrite" in capsys.readouterr().err


def test_a_failed_summary_write_does_not_hide_the_error(tmp_path, monkeypatch, capsys):
    """The disk that fills during a step may refuse summary.json too: the step's error must still be the one
    reported (traceback and message), with the write's failure beside it, and the exit code 1."""
    run = tmp_path / "r"

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(train_end, "write_summary", full)
    assert error_stop(run, monkeypatch, RuntimeError("the step's own error"), 4) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: the step's own error" in err and "Traceback" in err, err
    assert "summary.json not written either: [Errno 28] No space left on device" in err, err
    assert not (run / "summary.json").exists()


def test_a_second_ctrl_c_still_aborts_without_a_summary(tmp_path, monkeypatch):
    """KeyboardInterrupt (a second Ctrl-C) is by design no error to account for: it propagates at once."""
    with pytest.raises(KeyboardInterrupt):
        error_stop(tmp_path / "r", monkeypatch, KeyboardInterrupt(), 2)
    assert not (tmp_path / "r" / "summary.json").exists()


def test_under_the_runner_a_nonfinite_stop_names_the_runners_way_on(tmp_path, monkeypatch, capsys):
    """"the same command with --resume 2 --resume-override-lr" is not a scripts.run command: those flags go after --."""
    from nanochat.train_resume import RUNNER_AFRESH_ENV

    monkeypatch.setenv(RUNNER_AFRESH_ENV, "python -m scripts.run configs/mini/base.toml -- --overwrite")
    error = base_train.NonFiniteLoss("train loss is nan at step 4")
    assert error_stop(tmp_path / "r", monkeypatch, error, 4) == train_end.EXIT_NONFINITE
    out = capsys.readouterr().out
    assert "To continue from it: the same scripts.run command with --resume 2 --resume-override-lr and the lower " \
           "learning rates after --" in out, out


def advised_command(out: str) -> list[str]:
    """The tokens of the command a non-finite stop under speedrun.sh says to run by hand (its own line)."""
    lines = [line for line in out.splitlines() if "-m scripts.base_train" in line]
    assert len(lines) == 1 and lines[0].startswith("  "), out
    return shlex.split(lines[0])


def base_train_flags(tokens: list[str]) -> list[str]:
    return tokens[tokens.index("scripts.base_train") + 1:]


def changed_flags(before: list[str], after: list[str]) -> dict:
    """{dest: (before, after)} of every flag whose parsed value differs: base_train's parser reads both."""
    from nanochat.train_args import parse_args

    old, new = vars(parse_args(before)), vars(parse_args(after))
    return {k: (old[k], new[k]) for k in old if old[k] != new[k]}


def test_under_speedrun_a_stop_names_speedrun_and_a_nonfinite_stop_the_command_to_run_by_hand(tmp_path, monkeypatch,
                                                                                              capsys):
    """speedrun.sh passes --resume auto itself and names its command in CONTINUE_COMMAND_ENV: a completed run's
    unwritten summary (as a stopped final evaluation) said "--resume reruns the final evaluation" beside speedrun's
    own "run 'bash speedrun.sh' again". A non-finite stop said "the same command with --resume 2
    --resume-override-lr, and lower the learning rates": the command the user typed is `bash speedrun.sh`, which
    takes neither. It now names the base_train command speedrun.sh ran (sys.argv, under `python -m`), with --resume 2
    --resume-override-lr in place of --resume auto and half the LRs of this run's optimizer groups, shell-quoted, and
    says what speedrun.sh then does with that run: continues it with those LRs if it stops again (its --resume auto
    with the original ones was refused, exit 2, until session 30), takes it as done once completed."""
    from types import SimpleNamespace

    from nanochat.run_control import CONTINUE_COMMAND_ENV
    from nanochat.train_resume import RUNNER_AFRESH_ENV

    monkeypatch.delenv(RUNNER_AFRESH_ENV, raising=False)
    monkeypatch.setenv(CONTINUE_COMMAND_ENV, "bash speedrun.sh")
    run = SimpleNamespace(run_dir=tmp_path, loop={"step": 4})
    message = train_end.summary_not_written(run, "completed", {}, OSError(28, "No space left on device",
                                                                          str(tmp_path / "summary.json")))
    assert "running 'bash speedrun.sh' again reruns the final evaluation and writes summary.json" in message, message
    assert "--resume" not in message, message
    assert train_end.way_on_after_error(tmp_path, None).endswith("continue by running 'bash speedrun.sh' again")
    run_dir = tmp_path / "r weird"  # a space: the command is shell-quoted
    argv = [*TINY, "--device-batch-size", "4", "--total-batch-size", "256", "--run-dir", str(run_dir),
            "--num-iterations", "6", "--save-every", "2", "--resume", "auto"]  # what error_stop passes main
    monkeypatch.setattr(sys, "argv", [str(REPO / "scripts" / "base_train.py"), *argv])  # as `python -m` sets it
    error = base_train.NonFiniteLoss("train loss is nan at step 4")
    assert error_stop(run_dir, monkeypatch, error, 4, "--resume", "auto") == train_end.EXIT_NONFINITE
    out = capsys.readouterr().out
    assert "the same command" not in out, out
    assert "'bash speedrun.sh' cannot lower learning rates: to continue from it, run by hand in " in out, out
    # speedrun.sh continues the run resumed that way (the overrides from its LRs, in the checkpoint: session 30), and
    # once finished its done check takes it (in config.json)
    assert "refuses" not in out, out
    assert "If it stops again once it has saved a checkpoint, 'bash speedrun.sh' continues it with these learning " \
           "rates; once it has completed, 'bash speedrun.sh' takes it as done and goes on to its report (which names " \
           "the changed learning rates); or check the data" in out, out
    tokens = advised_command(out)
    assert tokens[1:3] == ["-m", "scripts.base_train"] and Path(tokens[0]).name.startswith("python"), tokens
    flags = base_train_flags(tokens)
    assert "auto" not in flags, flags
    # a base model's groups: every LR flag but --memory-lr, halved; the resume from step 2 with the override
    lrs = {"embedding_lr": 0.3, "unembedding_lr": 0.004, "matrix_lr": 0.02, "scalar_lr": 0.5}
    assert changed_flags(argv, flags) == {"resume": ("auto", "2"), "resume_override_lr": (False, True),
                                          **{k: (v, v / 2) for k, v in lrs.items()}}, flags


def test_under_speedrun_a_nonfinite_stop_before_any_checkpoint_and_under_torchrun(tmp_path, monkeypatch):
    """The advice's other cases under speedrun.sh: no checkpoint ("start again with --overwrite" named a flag
    speedrun.sh does not take either), parameters found non-finite (only their groups' LRs), torchrun on one node (its
    command, as speedrun.sh launches it), and where no command can be told (base_train.main called in the process of
    another program; several nodes): the wording without one."""
    from types import SimpleNamespace

    import torch

    from nanochat.run_control import CONTINUE_COMMAND_ENV
    from nanochat.train_args import parse_args
    from nanochat.train_resume import RUNNER_AFRESH_ENV

    monkeypatch.delenv(RUNNER_AFRESH_ENV, raising=False)
    monkeypatch.setenv(CONTINUE_COMMAND_ENV, "bash speedrun.sh")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = [*TINY, "--run-dir", str(tmp_path), "--matrix-lr", "0.04", "--resume", "auto"]
    monkeypatch.setattr(sys, "argv", [str(REPO / "scripts" / "base_train.py"), *argv])
    model = torch.nn.Linear(2, 2)
    groups = [{"name": "wte", "params": [model.weight]}, {"name": "matrix", "params": [model.bias]}]
    run = SimpleNamespace(run_dir=tmp_path, args=parse_args(argv), model=model, world=2,
                          optimizer=SimpleNamespace(param_groups=groups))
    error = train_end.NonFiniteParams("parameters are not finite at step 4: bias", ["bias"])
    advice = train_end.nonfinite_advice(run, error)
    assert "No checkpoint was saved before it. 'bash speedrun.sh' cannot lower learning rates: to start again, " \
           "run by hand in " in advice, advice
    # a run started again with other LRs is not speedrun.sh's, finished or not: no promise of its done check
    assert "so finish it by hand; or check the data" in advice and "takes it as done" not in advice, advice
    tokens = advised_command(advice)
    assert Path(tokens[0]).name == "torchrun" and \
        tokens[1:5] == ["--standalone", "--nproc_per_node=2", "-m", "scripts.base_train"], tokens
    flags = base_train_flags(tokens)
    assert flags.count("--matrix-lr") == 1, flags  # the run's own value is replaced, not followed by another
    assert changed_flags(argv, flags) == {"resume": ("auto", None), "overwrite": (False, True),
                                          "matrix_lr": (0.04, 0.02)}, flags
    optimizer_state = train_end.NonFiniteParams("non-finite: optimizer state x", ["optimizer state x"])
    assert changed_flags(argv, base_train_flags(advised_command(train_end.nonfinite_advice(run, optimizer_state)))) \
        == {"resume": ("auto", None), "overwrite": (False, True), "matrix_lr": (0.04, 0.02),
            "embedding_lr": (0.3, 0.15)}  # no parameter named: every group's LR
    for cannot_tell in ({"world": 4}, {"argv": ["-m pytest", *argv]}):  # two nodes of 2; main(argv) in pytest
        monkeypatch.setattr(run, "world", cannot_tell.get("world", 2))
        monkeypatch.setattr(sys, "argv", cannot_tell.get("argv", sys.argv))
        advice = train_end.nonfinite_advice(run, error)
        assert "run the base_train command 'bash speedrun.sh' ran by hand, with --overwrite and lower --matrix-lr " \
               "(the LR of the non-finite tensors)" in advice, advice
        assert "scripts.base_train" not in advice, advice


def full_disk_for(name: str):
    """A write_json that fails like a full disk for the file ``name`` alone (the error names it, as open() would)."""
    from nanochat.train_setup import write_json as real

    def write_json(path, obj):
        if path.name == name:
            raise OSError(28, "No space left on device", str(path))
        return real(path, obj)
    return write_json


def test_a_failed_write_before_the_first_step_writes_the_summary(tmp_path, monkeypatch, capsys):
    """An error in the set-up of the run dir (config.json on a full disk) ended with a traceback and no summary.json.
    Now it ends as an unplanned error does (stop_reason error, exit 1), with one clean line for an OSError."""
    run = tmp_path / "r"
    monkeypatch.setattr(base_train, "write_json", full_disk_for("config.json"))
    assert train(run, "--num-iterations", "3") == 1
    summary = summary_of(run)
    assert (summary["stop_reason"], summary["step"], summary["last_checkpoint"]) == ("error", 0, None), summary
    assert summary["error"] == f"OSError: [Errno 28] No space left on device: '{run / 'config.json'}'", summary
    err = capsys.readouterr().err
    assert "Traceback" not in err, err  # a full disk is no bug: its line says it all
    assert f"error: {summary['error']}\ntraining stopped before step 1: the set-up of the run dir failed" in err, err
    assert "no checkpoint was saved: once the cause is fixed, start again with --overwrite" in err, err


def test_a_failed_resume_set_up_names_the_checkpoint_to_go_on_from(tmp_path, monkeypatch, capsys):
    """On a resume the set-up also rewrites metrics.jsonl (truncate_metrics): a bug there keeps its traceback, and
    summary.json names the step resumed from as the checkpoint to go on from."""
    run = tmp_path / "r"
    assert train(run, "--num-iterations", "6", "--save-every", "2", "--max-wall-time-seconds", "0.001") == 0
    step = summary_of(run)["step"]

    def broken(*a, **k):
        raise RuntimeError("a bug in truncate_metrics")

    monkeypatch.setattr(base_train, "truncate_metrics", broken)
    assert train(run, "--num-iterations", "6", "--save-every", "2", "--resume") == 1
    summary = summary_of(run)
    assert (summary["stop_reason"], summary["step"], summary["last_checkpoint"]) == ("error", step, step), summary
    assert summary["error"] == "RuntimeError: a bug in truncate_metrics", summary
    err = capsys.readouterr().err
    assert "Traceback" in err and f"last checkpoint: step {step} in {run / ckpt.CKPT_DIR}" in err, err


def test_a_metrics_file_that_cannot_be_opened_is_an_error_stop(tmp_path, monkeypatch, capsys):
    run = tmp_path / "r"

    def unopenable(*a, **k):
        raise PermissionError(13, "Permission denied", str(run / "metrics.jsonl"))

    monkeypatch.setattr(base_train, "MetricsLogger", unopenable)
    assert train(run, "--num-iterations", "3") == 1
    summary = summary_of(run)
    assert summary["stop_reason"] == "error" and summary["error"].startswith("PermissionError: [Errno 13]"), summary
    assert "Traceback" not in capsys.readouterr().err


def test_a_failed_summary_write_keeps_the_set_up_error(tmp_path, monkeypatch, capsys):
    run = tmp_path / "r"
    monkeypatch.setattr(base_train, "write_json", full_disk_for("plan.json"))
    monkeypatch.setattr(train_end, "write_json", full_disk_for("summary.json"))
    assert train(run, "--num-iterations", "3") == 1
    err = capsys.readouterr().err
    assert f"error: OSError: [Errno 28] No space left on device: '{run / 'plan.json'}'" in err, err
    assert "summary.json not written either: [Errno 28] No space left on device" in err, err
    assert not (run / "summary.json").exists() and "Traceback" not in err, err


def test_a_failed_summary_write_at_the_end_says_what_finished(tmp_path, monkeypatch, capsys):
    """A completed run whose own summary.json could not be written (a full disk) ended with a traceback. Now: one
    line naming the file, that training and the final evaluation finished, and that a --resume writes the summary
    (it does: the resume below, on a disk with space again, reruns the final evaluation and writes it); exit 2."""
    run = tmp_path / "r"
    with monkeypatch.context() as m:
        m.setattr(train_end, "write_json", full_disk_for("summary.json"))
        assert train(run, "--num-iterations", "3") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert f"error: summary.json not written: [Errno 28] No space left on device: '{run / 'summary.json'}'" in err, err
    assert "training completed and its final evaluation finished (the checkpoint of step 3 is saved); free space " \
           "(or fix the run dir), then --resume reruns the final evaluation and writes summary.json" in err, err
    assert not (run / "summary.json").exists()
    assert train(run, "--num-iterations", "3", "--resume") == 0
    summary = summary_of(run)
    assert (summary["stop_reason"], summary["step"]) == ("completed", 3) and "val_bpb" in summary, summary


def test_a_failed_report_write_at_the_end_is_a_warning_naming_report_md(tmp_path, monkeypatch, capsys):
    """summary.json was written, then report.md failed: that was said as "summary.json not written ... --resume
    reruns the final evaluation", exit 2, although the run had finished (and scripts.run then counts the seed as
    done, so the advised resume never came). Now one warning line names report.md and the command that writes it,
    exit 0; that command, run, writes it."""
    from nanochat import report
    from scripts import report as report_cli

    run = tmp_path / "r"
    real = report.write_text_atomic

    def full_disk(path, text):
        if path.name == report.REPORT:
            raise OSError(28, "No space left on device", str(path))
        return real(path, text)

    with monkeypatch.context() as m:
        m.setattr(report, "write_text_atomic", full_disk)
        assert train(run, "--num-iterations", "3") == 0
    err = capsys.readouterr().err
    assert summary_of(run)["stop_reason"] == "completed" and not (run / "report.md").exists()
    warning = [line for line in err.splitlines() if "report.md" in line]
    assert warning == [f"warning: report.md not written: [Errno 28] No space left on device: '{run / 'report.md'}'; "
                       f"the run is finished (summary.json is written): python -m scripts.report {run} --run-report "
                       "writes it"], err
    assert "summary.json not written" not in err and "Traceback" not in err, err
    assert report_cli.main([str(run), "--run-report"]) == 0
    assert (run / "report.md").read_text().startswith("# Run report: ")


def test_a_run_file_the_report_cannot_read_is_a_warning_too(tmp_path, capsys):
    """report.md reads the run's files back: a torn environment.json (ValueError naming it) leaves summary.json
    standing and is the same one warning, not an error of the run."""
    (tmp_path / "summary.json").write_text(json.dumps({"run_name": "r", "stop_reason": "completed"}))
    (tmp_path / "environment.json").write_text('{"sessions": [')
    train_end.write_report_or_warn(tmp_path)
    err = capsys.readouterr().err.strip()
    assert err.startswith("warning: report.md not written: ") and "environment.json" in err, err
    assert err.endswith(f"python -m scripts.report {tmp_path} --run-report writes it") and "\n" not in err, err
    assert not (tmp_path / "report.md").exists()


@pytest.mark.parametrize("reason, evals, said", [
    ("wall_time_limit", {}, "training stopped at its wall-time limit and its final evaluation finished (the "
                            "checkpoint of step 4 is saved); free space (or fix the run dir), then continue with "
                            "--resume: summary.json is written when it stops"),
    ("interrupted", {"signal": "SIGTERM"}, "training was interrupted (SIGTERM) (the checkpoint of step 4 is saved)"),
    ("interrupted", {"signal": "SIGINT", "interrupted_during": "final_eval"},
     "the final evaluation was interrupted (SIGINT) (the checkpoint of step 4 is saved)")],
    ids=["wall_time_limit", "interrupted", "interrupted_final_eval"])
def test_a_failed_summary_write_of_an_unfinished_run_says_to_continue(tmp_path, reason, evals, said):
    """Only a completed run's --resume reruns the final evaluation; the others continue training (or the final
    evaluation) and write the summary when they stop."""
    from types import SimpleNamespace

    run = SimpleNamespace(run_dir=tmp_path, loop={"step": 4})
    tmp = tmp_path / "summary.json.0123abcd.tmp"  # write_atomic's temp file: the message names the file itself
    message = train_end.summary_not_written(run, reason, evals, OSError(28, "No space left on device", str(tmp)))
    assert message.startswith("error: summary.json not written: [Errno 28] No space left on device"), message
    assert said in message, message


def test_a_failed_summary_write_keeps_the_nonfinite_stop(tmp_path, monkeypatch, capsys):
    """A non-finite loss whose summary.json cannot be written ended in the write's traceback with exit 1: the advice
    stands, with the write's failure beside it, and the exit code is still the non-finite one."""
    monkeypatch.setattr(train_end, "write_json", full_disk_for("summary.json"))
    error = base_train.NonFiniteLoss("train loss is nan at step 4")
    assert error_stop(tmp_path / "r", monkeypatch, error, 4) == train_end.EXIT_NONFINITE
    captured = capsys.readouterr()
    assert "error: train loss is nan at step 4; stopping without saving" in captured.out, captured.out
    assert "summary.json not written either: [Errno 28] No space left on device" in captured.err, captured.err
    assert "Traceback" not in captured.err, captured.err
