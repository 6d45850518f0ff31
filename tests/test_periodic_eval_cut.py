"""A stop signal during a periodic eval (val bpb, CORE) cuts the eval short, on every rank at the same stop vote, and
saves the step's checkpoint as a signal stop's: pending (scripts/base_train.py, BOUNDARY_PENDING), so its --resume
runs the step's evals and samples. A long CORE no longer outlasts a scheduler's grace period between SIGTERM and
SIGKILL. The cut eval logs no record; the --resume logs it once."""

import json
import signal

import pytest
import torch

from _eval_helpers import CharTok, tiny_gpt
from _periodic_eval_cut_worker import signal_in_core_batch, with_tiny_core, write_tiny_bundle
from conftest import REPO, run_torchrun
from nanochat import checkpoint as ckpt
from nanochat import core_eval
from nanochat.eval_resume import Interrupted
from scripts import base_train
from test_run_control import records
from test_signal_boundary import assert_resumed_like, count_steps
from test_signal_step import assert_stopped_at
from test_train_e2e import TINY, train

FLAGS = ["--num-iterations", "4", "--eval-every", "2", "--core-every", "2", "--sample-every", "2"]
WORKER = REPO / "tests" / "_periodic_eval_cut_worker.py"


def steps_of(run, kind: str) -> list[int]:
    return [r["step"] for r in records(run, kind)]


def test_a_signal_inside_a_periodic_core_cuts_it_and_saves_the_step_pending(tmp_path, monkeypatch, capsys):
    """SIGTERM as CORE scores its 2nd of 3 batches at step 2 (after that step's val bpb; at 4 rows a batch, task mc
    takes 2, task lm 1): task lm is not scored, no CORE record, step 3 never trained; step 2 is saved pending and its
    --resume runs its val bpb, CORE and samples once, with the numbers of an uninterrupted run."""
    bundle = write_tiny_bundle(tmp_path / "bundle")
    with_tiny_core(bundle, monkeypatch.setattr)
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train(ref, *FLAGS) == 0
    assert steps_of(ref, "core") == [2] and steps_of(ref, "eval") == [0, 2]
    scored = signal_in_core_batch(2, signal.SIGTERM, monkeypatch.setattr)
    steps = count_steps(monkeypatch)
    capsys.readouterr()
    assert train(run, *FLAGS) == 0
    assert_stopped_at(run, 2, "signal SIGTERM", capsys.readouterr().out)
    assert len(scored) == 2 and len(steps) == 2
    assert ckpt.load_meta(run, 2)["loop"].get(base_train.BOUNDARY_PENDING) is True
    assert steps_of(run, "core") == [] and steps_of(run, "sample") == [] and steps_of(run, "eval") == [0, 2]
    monkeypatch.undo()
    with_tiny_core(bundle, monkeypatch.setattr)
    assert train(run, *FLAGS, "--resume") == 0
    assert_resumed_like(run, ref)  # the eval at step 2, logged before the cut, is not there twice
    assert [(r["step"], r["core"]) for r in records(run, "core")] == [(r["step"], r["core"]) for r in records(ref, "core")]


def test_a_signal_on_one_of_two_ranks_inside_a_periodic_core_cuts_it_on_both(tmp_path):
    """Rank 1 alone gets SIGTERM as it scores its only batch of task mc (rank 0 has two: unequal shares). Both ranks
    stop CORE at the next stop vote (rank 1 counting on without work until then), save step 2 pending (rank 0 names
    the other rank's signal) and exit 0; the --resume logs step 2's CORE once. Both runs in one launch (--runs-out:
    a launch costs ~4 s of the CI's 2 cores), the first one's checks on the copy of the run dir it left."""
    bundle = write_tiny_bundle(tmp_path / "bundle")
    run, out = tmp_path / "r", tmp_path / "out"
    out.mkdir()
    flags = [*TINY, "--eval-every", "2", "--core-every", "2", "--device-batch-size", "2", "--total-batch-size", "256",
             "--num-iterations", "4", "--run-dir", str(run)]
    r = run_torchrun(WORKER, 2, ["--runs-out", str(out),
                                 "--bundle-dir", str(bundle), "--signal-ranks", "1", "--signal-at-batch", "1", *flags,
                                 "--next-run", "--bundle-dir", str(bundle), "--signal-ranks", "", "--signal-at-batch",
                                 "0", *flags, "--resume"])
    stopped, stdout = out / "run0", (out / "run0.rank0.out").read_text()
    assert r.returncode == 0, stdout[-3000:] + r.stderr[-3000:]
    assert_stopped_at(stopped, 2, "signal on another rank", stdout)
    assert json.loads((stopped / "summary.json").read_text())["signal"] == "SIGTERM"
    assert "SIGTERM during the periodic evals" in stdout
    assert ckpt.load_meta(stopped, 2)["loop"].get(base_train.BOUNDARY_PENDING) is True
    assert steps_of(stopped, "core") == [] and steps_of(stopped, "eval") == [0, 2]
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "completed"
    assert steps_of(run, "core") == [2] and steps_of(run, "eval") == [0, 2]


def test_an_interrupted_core_leaves_the_model_in_its_mode(tmp_path, monkeypatch):
    """A trainer's model goes into CORE in training mode; a stop signal (or an error) inside it used to leave it in
    eval mode (dropout off, MoME's routing statistics not counted) for whatever came next."""
    model = tiny_gpt(seq_len=64).train()

    def interrupted(*args, **kwargs):
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(core_eval, "_score_batch", interrupted)
    with pytest.raises(Interrupted), torch.no_grad():
        core_eval.evaluate_core(model, CharTok(), write_tiny_bundle(tmp_path / "bundle"), progress=False)
    assert model.training


def test_an_error_reading_old_caps_leaves_the_model_in_its_mode(tmp_path, monkeypatch):
    """The set-up before CORE's first task (read_old_caps: an unreadable results file) may raise too: the model,
    already put in eval mode, went back to the caller that way."""
    model = tiny_gpt(seq_len=64).train()

    def unreadable(finished):
        raise OSError("simulated unreadable results file")

    monkeypatch.setattr(core_eval, "read_old_caps", unreadable)
    with pytest.raises(OSError), torch.no_grad():
        core_eval.evaluate_core(model, CharTok(), write_tiny_bundle(tmp_path / "bundle"), progress=False,
                                finished=object())
    assert model.training


def test_a_resume_that_changed_the_config_and_is_cut_in_its_owed_evals_saves_the_change(tmp_path, monkeypatch,
                                                                                         capsys):
    """A session resumed from a pending checkpoint with --resume-override-lr and SIGTERM in the step's owed val bpb:
    the checkpoint on disk lacks the override, so it is saved again with it (the next --resume takes the new LR
    without --resume-override-lr) and "checkpoint saved" is true. (--resume-new-world-size takes the same path: a
    change this session made at the step.)"""
    from _mid_step_signal_worker import signal_during_call, signal_during_step
    from test_signal_boundary import FLAGS as BOUNDARY_FLAGS

    run = tmp_path / "r"
    real_step, real_bpb = base_train.train_step, base_train.run_split_bpb
    monkeypatch.setattr(base_train, "train_step", signal_during_step(real_step, 3, signal.SIGTERM))
    assert train(run, *BOUNDARY_FLAGS) == 0  # step 3: saved pending, its evals owed
    monkeypatch.setattr(base_train, "train_step", real_step)
    monkeypatch.setattr(base_train, "run_split_bpb", signal_during_call(real_bpb, 1, signal.SIGTERM))
    capsys.readouterr()
    change = ["--matrix-lr", "0.01", "--resume-override-lr"]
    assert train(run, *BOUNDARY_FLAGS, "--resume", *change) == 0
    out = capsys.readouterr().out
    assert "SIGTERM during the periodic evals: cut short (the cut one logs nothing); saving the step" in out, out
    config = ckpt.load_meta(run, 3)["config"]
    assert ckpt.load_meta(run, 3)["loop"].get(base_train.BOUNDARY_PENDING) is True
    assert [e["step"] for e in config["lr_overrides"]] == [3], config
    monkeypatch.setattr(base_train, "run_split_bpb", real_bpb)
    assert train(run, *BOUNDARY_FLAGS, "--resume", *change[:-1]) == 0  # the change is the checkpoint's now
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "completed"
