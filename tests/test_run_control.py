"""Run control beside the step counts: --max-wall-time-seconds, --save-at-flops, --eval-every-flops, --sample-every
(nanochat/run_control.py, wired into scripts/base_train.py)."""

import json
import math
from fractions import Fraction

import pytest
import torch

from conftest import REPO, run_torchrun, sigterm_after, tiny_config
from nanochat import checkpoint as ckpt
from nanochat import final_eval, run_control
from nanochat.run_control import FlopCadence, first_step_reaching, parse_flop_count, parse_flop_list
from scripts import base_train
from test_train_e2e import TINY, losses, train


BATCH = ["--device-batch-size", "4", "--total-batch-size", "256"]  # train()'s: 3 steps of TINY are ~5.7e8 FLOPs


def records(run_dir, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def flops_per_step(tmp_path, *flags) -> int:
    """The training FLOPs of one step of ``train(...)`` with these flags, from --dry-run's plan.json."""
    assert train(tmp_path / "plan", *flags, "--dry-run") == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    return plan["flops_per_token"] * plan["total_batch_size"]


def test_flop_counts_parse_exactly():
    assert parse_flop_count("2_000_000_000_000_000_001", "--x") == 2_000_000_000_000_000_001  # no float rounding
    assert parse_flop_count(" 1e18 ", "--x") == 10**18 and parse_flop_count("1.5e3", "--x") == 1500
    assert parse_flop_list("3e6,1e6,1_000_000", "--x") == [10**6, 3 * 10**6]
    for bad in ("", "abc", "1e18x", "_1", "1__0", "1_", "nan", "inf"):
        with pytest.raises(ValueError, match="--x: .* is not a FLOP count"):
            parse_flop_count(bad, "--x")
    for bad in ("0", "-1e18"):
        with pytest.raises(ValueError, match="--x: FLOP counts must be > 0"):
            parse_flop_count(bad, "--x")
    # a target equal to a step's count is reached at that step; one FLOP more, at the next
    assert first_step_reaching(Fraction(5 * 123), 123) == 5 and first_step_reaching(Fraction(5 * 123 + 1), 123) == 6


def test_flop_cadence_triggers_once_per_step():
    # interval 2.5 steps: targets 2.5, 5, 7.5, 10 steps -> steps 3, 5, 8, 10
    every = FlopCadence(100, interval=Fraction(250))
    assert [s for s in range(0, 11) if every.due(s)] == [3, 5, 8, 10]
    # an interval below one step's FLOPs: several targets per step, each step due once
    assert [s for s in range(0, 5) if FlopCadence(100, interval=Fraction(30)).due(s)] == [1, 2, 3, 4]
    targets = FlopCadence(100, steps=frozenset(first_step_reaching(t, 100) for t in parse_flop_list("50,70,200", "-")))
    assert [s for s in range(0, 5) if targets.due(s)] == [1, 2]


def fake_step_clock(monkeypatch, seconds_per_step: float):
    """run_control.clock reads a fake time that each train step advances by ``seconds_per_step`` (before the
    step's wall-time vote): the stop step is then exact arithmetic, not a timing."""
    now = {"t": 1000.0}
    real = base_train.train_step

    def step(*a, **k):
        now["t"] += seconds_per_step
        return real(*a, **k)

    monkeypatch.setattr(run_control, "clock", lambda: now["t"])
    monkeypatch.setattr(base_train, "train_step", step)


def test_wall_time_stop_saves_evaluates_and_resumes(tmp_path, monkeypatch, capsys):
    """10 fake seconds per step, a 25 s budget: each process stops after ceil(25 / 10) = 3 of its own steps, saves,
    runs the final evaluation and samples; --resume gets a fresh budget (its own clock) and continues, and the
    three sessions train exactly like one uninterrupted run. The stops fall on --eval-every steps: those evals are
    kept (the stop's final record goes with the resume, which does not evaluate its own step again)."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    flags = ["--num-iterations", "8", "--sample-every", "2", "--eval-every", "3"]
    assert train(ref, *flags) == 0
    fake_step_clock(monkeypatch, 10.0)
    limit = ["--max-wall-time-seconds", "25"]
    for session, stop_at in enumerate((3, 6)):
        assert train(run, *flags, *limit, *(["--resume"] if session else [])) == 0
        summary = json.loads((run / "summary.json").read_text())
        assert summary["stop_reason"] == "wall_time_limit" and summary["step"] == stop_at
        assert math.isfinite(summary["val_bpb"])  # the final evaluation ran
        assert ckpt.list_steps(run)[-1] == stop_at and ckpt.load_meta(run, stop_at)["reason"] == "wall_time_limit"
        assert records(run, "final")[-1]["step"] == stop_at
        assert "continue with --resume" in capsys.readouterr().out
    assert [r["step"] for r in records(run, "stop")] == [3, 6]
    assert records(run, "stop")[0]["elapsed_s"] == 30.0 and records(run, "stop")[0]["limit_s"] == 25.0
    assert train(run, *flags, *limit, "--resume") == 0
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "completed"
    assert losses(run) == losses(ref)
    assert [r["step"] for r in records(run, "final")] == [8]  # each session's final record went with its resume
    assert [r["step"] for r in records(ref, "eval")] == [0, 3, 6]
    assert [(r["step"], r["val_bpb"]) for r in records(run, "eval")] == \
        [(r["step"], r["val_bpb"]) for r in records(ref, "eval")]
    assert ckpt.load_meta(run, 8)["loop"]["min_val_bpb"] == ckpt.load_meta(ref, 8)["loop"]["min_val_bpb"]
    # samples every 2 steps and at the end of each session, none repeated by a resume
    assert [r["step"] for r in records(run, "sample")] == [2, 3, 4, 6, 8]
    assert [r["step"] for r in records(ref, "sample")] == [2, 4, 6, 8]
    assert all(len(r["samples"]) == 7 for r in records(run, "sample"))
    # a signal is not a wall-time stop: no final evaluation (test_train_dist covers its exit path)
    assert base_train.stop_reason(4, 8, base_train.StopVotes(signal=True, wall_time=True)) == "interrupted"


def test_save_at_flops_keeps_each_target_checkpoint_once(tmp_path, monkeypatch):
    per_step = flops_per_step(tmp_path, "--num-iterations", "8")
    # 2.5 steps, exactly 5 steps (underscores), and one FLOP past 5 steps (also a --save-every step)
    targets = [per_step * 5 // 2, per_step * 5, per_step * 5 + 1]
    expected = sorted({math.ceil(Fraction(t, per_step)) for t in targets})
    assert expected == [3, 5, 6]
    run = tmp_path / "r"
    flags = ["--num-iterations", "8", "--save-every", "2", "--keep-last", "1",
             "--save-at-flops", ",".join(f"{t:_}" for t in targets)]
    assert train(run, *flags) == 0
    # the --save-at-flops checkpoints are kept; --keep-last 1 pruned the periodic ones (2, 4)
    assert ckpt.list_steps(run) == [*expected, 8]
    assert [ckpt.load_meta(run, s)["reason"] for s in expected] == ["save_at_flops", "save_at_flops",
                                                                     "periodic, save_at_flops"]
    # resuming from the step-5 target: 6 and 8 are written again, 3 and 5 are not
    saved, real_save = [], base_train.save
    monkeypatch.setattr(base_train, "save", lambda run_, reason, keep=False: (saved.append((run_.loop["step"], keep)),
                                                                             real_save(run_, reason, keep)))
    assert train(run, *flags, "--resume", "5") == 0
    assert saved == [(6, True), (8, False)]
    assert ckpt.list_steps(run) == [*expected, 8]


def test_eval_every_flops_replaces_the_step_cadences(tmp_path, monkeypatch, capsys):
    per_step = flops_per_step(tmp_path, "--num-iterations", "8")
    interval = per_step * 3 // 2  # targets at 1.5, 3, 4.5, 6, 7.5 steps -> steps 2, 3, 5, 6, 8
    expected = sorted({math.ceil(Fraction(k * interval, per_step)) for k in range(1, 6)})
    assert expected == [2, 3, 5, 6, 8]
    assert train(tmp_path / "plan", "--num-iterations", "8", "--eval-every-flops", str(interval), "--dry-run") == 0
    assert f"eval at flops: steps {', '.join(map(str, expected))}" in capsys.readouterr().out
    core_steps = []
    monkeypatch.setattr(base_train, "resolve_bundle", lambda args: REPO)  # stands in for a CORE bundle
    monkeypatch.setattr(base_train, "run_core", lambda *a, **k: core_steps.append(1) or {"core": 0.5, "label": "CORE"})
    run = tmp_path / "r"
    # --eval-every -1 (in TINY) is consistent with it; the default --core-every -1 too
    assert train(run, "--num-iterations", "8", "--eval-every-flops", str(interval), "--no-final-core") == 0
    evals = records(run, "eval")
    assert [r["step"] for r in evals] == expected[:-1]  # step 8 is the final evaluation's
    assert [r["step"] for r in records(run, "core")] == expected[:-1] and len(core_steps) == len(expected) - 1
    assert all(r["flops"] == r["step"] * per_step for r in evals)
    # a list of targets: two reached by step 1 evaluate once
    run = tmp_path / "list"
    assert train(run, "--num-iterations", "4", "--eval-every-flops", f"{per_step // 3},{per_step // 2},{per_step * 3}",
                 "--no-final-core") == 0
    assert [r["step"] for r in records(run, "eval")] == [1, 3]


@pytest.mark.parametrize("argv, needle", [
    (["--save-at-flops", "1e6,abc"], "--save-at-flops: 'abc' is not a FLOP count"),
    (["--save-at-flops=-1e6"], "--save-at-flops: FLOP counts must be > 0"),
    (["--eval-every-flops", "1e6,,2e6"], "--eval-every-flops: '' is not a FLOP count"),
    (["--eval-every-flops", "1e6", "--eval-every", "5"], "--eval-every-flops 1e6 replaces --eval-every"),
    (["--eval-every-flops", "1e6", "--core-every", "5"], "--eval-every-flops 1e6 replaces --core-every"),
    (["--max-wall-time-seconds", "0"], "--max-wall-time-seconds must be a positive number of seconds or -1"),
    (["--max-wall-time-seconds", "inf"], "--max-wall-time-seconds must be a positive number of seconds or -1"),
    (["--sample-every", "0"], "--sample-every must be a positive step count or -1"),
    (["--save-at-flops", "1e6,1e12"], "--save-at-flops 1e+12: beyond this run's 5.66231e+08 training FLOPs"),
    (["--eval-every-flops", "1e12"], "--eval-every-flops 1e12: beyond this run's"),
    (["--eval-every-flops", "1e6,1e12"], "--eval-every-flops 1e+12: beyond this run's"),
])
def test_bad_run_control_flags_fail_before_any_work(tmp_path, capsys, argv, needle):
    run = tmp_path / "r"
    try:
        rc = base_train.main([*TINY, *BATCH, "--run-dir", str(run), "--num-iterations", "3", *argv])
    except SystemExit as e:  # argparse errors
        rc = e.code
    assert rc == 2
    assert needle in capsys.readouterr().err
    assert not run.exists()
    # --dry-run refuses a target out of reach too (its plan is the one the run would have)
    if "beyond" in needle:
        assert base_train.main([*TINY, *BATCH, "--run-dir", str(run), "--num-iterations", "3", *argv, "--dry-run"]) == 2


def test_greedy_samples_complete_the_text_prompts_without_touching_training_state(tiny_tokenizer_dir):
    from nanochat.gpt import build_model
    from nanochat.tokenizer import get_tokenizer
    from nanochat.train_loop import stats_buffers

    tok = get_tokenizer(tiny_tokenizer_dir)
    model = build_model(tiny_config(vocab_size=tok.vocab_size, memory="mome",
                                    memory_options={"slots": 4, "topk": 2, "balance": "bias"}), seed=0)
    model.train()
    before = {k: v.clone() for k, v in stats_buffers(model).items()} | {"bias": model.memory.balance_counts.clone()}
    prompts = run_control.sample_prompts(tok, None)
    assert [text for text, _ in prompts] == list(run_control.SAMPLE_PROMPTS)
    assert all(ids[0] == tok.bos_token_id for _, ids in prompts)
    samples = run_control.greedy_samples(model, prompts, tok, torch.autocast("cpu", enabled=False))
    assert model.training  # restored
    after = {k: v for k, v in stats_buffers(model).items()} | {"bias": model.memory.balance_counts}
    assert all(torch.equal(before[k], after[k]) for k in before)  # eval mode: no routing counts recorded
    assert [s["prompt"] for s in samples] == list(run_control.SAMPLE_PROMPTS)
    again = run_control.greedy_samples(model, prompts, tok, torch.autocast("cpu", enabled=False))
    assert samples == again and all(isinstance(s["completion"], str) for s in samples)  # greedy: deterministic
    from nanochat.engine import generate

    model.eval()
    first = generate(model, prompts[0][1], run_control.SAMPLE_TOKENS, temperature=0.0)[0]  # 16 tokens, greedy
    cut = first.index(tok.bos_token_id) if tok.bos_token_id in first else len(first)  # BOS ends a sample
    assert samples[0]["completion"] == tok.decode(first[:cut])


def test_two_ranks_stop_at_the_same_step_when_one_clock_runs_out(tmp_path):
    """Rank 1's (fake) clock runs 10x faster: its budget is spent after step 3, rank 0's never. Both stop at step 3
    (agreed in the step's loss reduction), save, evaluate; only rank 0 samples."""
    run = tmp_path / "r"
    r = run_torchrun(REPO / "tests" / "_wall_time_worker.py", 2,
                     [*TINY, "--device-batch-size", "2", "--total-batch-size", "256", "--num-iterations", "8",
                      "--max-wall-time-seconds", "25", "--sample-every", "2", "--run-dir", str(run)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "wall_time_limit" and summary["step"] == 3
    assert ckpt.list_steps(run) == [3] and math.isfinite(summary["val_bpb"])
    assert json.loads((run / "samples.rank0.json").read_text()) == [2, 3]
    assert not (run / "samples.rank1.json").exists()



def test_a_signal_on_an_eval_step_saves_before_evaluating_and_the_resume_evaluates(tmp_path, monkeypatch):
    """A scheduler's SIGKILL follows its SIGTERM after a grace period: the checkpoint of a signal stop must not wait
    for a periodic eval (bpb, and CORE with --eval-every-flops: minutes at scale). The eval of that step is not
    lost: the resume runs it (and the samples), and the evals equal an uninterrupted run's."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    flags = ["--num-iterations", "6", "--eval-every", "3"]
    assert train(ref, *flags) == 0
    events, real_step, real_eval = [], base_train.train_step, base_train.run_split_bpb
    real_save = base_train.save

    def step(*a, **k):  # a signal during step 3 (on any rank): the boundary after it is an eval step
        loss, gnorm, votes, aux = real_step(*a, **k)
        events.append("step")
        return loss, gnorm, base_train.StopVotes(signal=events.count("step") == 3), aux

    monkeypatch.setattr(base_train, "train_step", step)
    monkeypatch.setattr(base_train, "run_split_bpb", lambda *a, **k: events.append("eval") or real_eval(*a, **k))
    monkeypatch.setattr(base_train, "save", lambda *a, **k: events.append("save") or real_save(*a, **k))
    assert train(run, *flags) == 0
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "interrupted"
    assert events == ["eval", "step", "step", "step", "save"]  # step 0's eval, then the save at once
    events.clear()
    monkeypatch.setattr(base_train, "train_step", real_step)
    assert train(run, *flags, "--resume") == 0
    assert events[0] == "eval"  # step 3's, by the resume
    assert [(r["step"], r["val_bpb"]) for r in records(run, "eval")] == \
        [(r["step"], r["val_bpb"]) for r in records(ref, "eval")] and len(records(ref, "eval")) == 2
    assert losses(run) == losses(ref)


def fake_core(monkeypatch) -> None:
    """A stand-in CORE for the final evaluation (nanochat.final_eval; periodic CORE is base_train's own)."""
    monkeypatch.setattr(base_train, "resolve_bundle", lambda args: REPO)  # stands in for a CORE bundle
    monkeypatch.setattr(final_eval, "run_core", lambda *a, **k: {"core": 0.5, "label": "CORE"})


@pytest.mark.parametrize("stop", ["completed", "wall_time_limit"])
def test_a_signal_during_the_final_evaluation_still_writes_the_summary(tmp_path, monkeypatch, capsys, stop):
    """The checkpoint is saved before the final evaluation; a SIGTERM during it (a scheduler's cancel, whose
    SIGKILL follows after a grace period the evaluation could outlast) ends the evaluation at once, and the run's
    record is still written: summary.json says interrupted, during the final evaluation, after what, and keeps
    the evaluation's finished part (val bpb; CORE was cut). Exit 0, as for any signal stop. A --resume of the
    completed run runs the final evaluation (its numbers equal an uninterrupted run's); a resume of the wall-time
    stop trains on and evaluates at the end."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    fake_core(monkeypatch)
    flags = ["--num-iterations", "8", "--final-core"]
    assert train(ref, *flags) == 0
    expected = json.loads((ref / "summary.json").read_text())
    assert expected["core"] == 0.5
    limit = []
    if stop == "wall_time_limit":
        fake_step_clock(monkeypatch, 10.0)
        limit = ["--max-wall-time-seconds", "25"]
    with monkeypatch.context() as m:
        calls = sigterm_after(m, final_eval, "run_core", 0)
        assert train(run, *flags, *limit) == 0
    assert len(calls) == 1
    step = 8 if stop == "completed" else 3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["step"] == step
    assert summary["interrupted_during"] == "final_eval" and summary["training_stop_reason"] == stop
    assert summary["signal"] == "SIGTERM"
    assert math.isfinite(summary["val_bpb"]) and "core" not in summary
    assert ckpt.list_steps(run)[-1] == step
    assert records(run, "final") == []
    assert records(run, "stop")[-1] == {"kind": "stop", "step": step, "reason": "interrupted",
                                        "during": "final_eval", "signal": "SIGTERM"}
    out = capsys.readouterr().out
    # worded as the final evaluation's error path words it; "(stopped by completed)" before session 25
    after = "training completed" if stop == "completed" else "training stopped at its wall-time limit"
    assert f"interrupted (SIGTERM) during the final evaluation of step {step} ({after}): checkpoint saved" in out
    assert (run / "report.md").is_file()
    assert train(run, *flags, *limit, "--resume") == 0  # the fake clock stops the wall-time run again at step 6
    summary = json.loads((run / "summary.json").read_text())
    if stop == "completed":
        assert summary["stop_reason"] == "completed" and "interrupted_during" not in summary
        assert (summary["val_bpb"], summary["core"]) == (expected["val_bpb"], 0.5)
        assert [r["step"] for r in records(run, "final")] == [8]
    else:
        assert (summary["stop_reason"], summary["step"]) == ("wall_time_limit", 6) and summary["core"] == 0.5
    assert losses(run) == {s: v for s, v in losses(ref).items() if s <= (8 if stop == "completed" else 6)}


def test_a_signal_during_the_last_step_skips_the_final_evaluation(tmp_path, monkeypatch):
    """A SIGTERM during the last step: the final checkpoint is written at once and the final evaluation is not
    started (the scheduler's SIGKILL is coming); summary.json records the interruption, and --resume evaluates."""
    import os
    import signal

    run = tmp_path / "run"
    real_step, events = base_train.train_step, []

    def step(*a, **k):
        out = real_step(*a, **k)
        if events.count("step") == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        events.append("step")
        return out

    monkeypatch.setattr(base_train, "train_step", step)
    real_eval = final_eval.run_split_bpb  # TINY has no periodic evals: the final evaluation's
    monkeypatch.setattr(final_eval, "run_split_bpb", lambda *a, **k: events.append("eval") or real_eval(*a, **k))
    assert train(run, "--num-iterations", "4") == 0
    assert events == ["step"] * 4
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["interrupted_during"], summary["training_stop_reason"]) == \
        ("interrupted", "final_eval", "completed")
    assert "val_bpb" not in summary and ckpt.list_steps(run) == [4]
    monkeypatch.setattr(base_train, "train_step", real_step)
    assert train(run, "--num-iterations", "4", "--resume") == 0
    assert events.count("eval") == 1  # val bpb, by the resume
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "completed"


REAL_DATA = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "32", "--eval-tokens", "256",
             "--eval-every", "-1", "--no-final-core", *BATCH, "--num-iterations", "6"]


def test_dry_run_plans_with_the_tokenizer_the_run_would_load(tmp_path, capsys, embedded_data_dir, tiny_tokenizer_dir):
    """Without --vocab-size, --dry-run reads the vocab of the tokenizer the run would load (FLOPs/token depend on
    it: the embedding and the head), so the steps it names for --save-at-flops are the run's."""
    from nanochat.tokenizer import get_tokenizer

    vocab = get_tokenizer(tiny_tokenizer_dir).vocab_size
    flags = [*REAL_DATA, "--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir)]
    per_step = flops_per_step(tmp_path, "--vocab-size", str(vocab), "--tokenizer-dir", str(tiny_tokenizer_dir))
    target = ["--save-at-flops", str(per_step * 5 // 2)]  # 2.5 steps of the real vocab: step 3
    capsys.readouterr()
    assert base_train.main([*flags, *target, "--run-dir", str(tmp_path / "dry"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "save at flops: steps 3\n" in out
    assert f"vocab size: {vocab:,} (the tokenizer in {tiny_tokenizer_dir})" in out
    dry = json.loads((tmp_path / "dry" / "plan.json").read_text())
    assert dry["model_config"]["vocab_size"] == vocab
    run = tmp_path / "run"
    assert base_train.main([*flags, *target, "--run-dir", str(run)]) == 0
    assert ckpt.list_steps(run) == [3, 6]
    assert json.loads((run / "plan.json").read_text()) == dry


def test_dry_run_without_a_tokenizer_says_which_vocab_it_assumed(tmp_path, capsys):
    """No tokenizer where the run would load one (yet) and no --vocab-size: the plan is the paper's vocab, and the
    output says so and how to give the real one; --synthetic-data and --vocab-size name their own."""
    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    flags = [*REAL_DATA, "--tokenizer-dir", str(empty), "--run-dir", str(tmp_path / "dry"), "--dry-run"]
    assert base_train.main(flags) == 0
    out = capsys.readouterr().out
    assert (f"vocab size: 32,768 ASSUMED (no tokenizer in {empty} yet): the run uses its tokenizer's; pass "
            "--vocab-size N or --tokenizer-dir DIR for the plan and FLOP-target steps of the real one") in out
    assert json.loads((tmp_path / "dry" / "plan.json").read_text())["model_config"]["vocab_size"] == 32768
    assert base_train.main([*flags, "--save-at-flops", "1e12"]) == 2  # a refusal names the assumption too
    err = capsys.readouterr().err
    assert "--save-at-flops 1e+12: beyond this run's" in err and "(vocab size 32,768 ASSUMED (no tokenizer" in err
    assert train(tmp_path / "synthetic", "--dry-run") == 0  # TINY pins --vocab-size 256
    assert "vocab size: 256 (--vocab-size)" in capsys.readouterr().out
    assert base_train.main([*REAL_DATA, "--synthetic-data", "--run-dir", str(tmp_path / "s"), "--dry-run"]) == 0
    assert "vocab size: 32,768 (the --synthetic-data default)" in capsys.readouterr().out


def test_a_flop_target_at_the_target_flops_budget_is_the_final_step(tmp_path, capsys):
    """--target-flops F rounds to steps: F = 5.25 steps of FLOPs gives 5 steps, whose count is below F. A
    --save-at-flops (or --eval-every-flops) target of F itself is the run's end, not beyond it: it falls on the
    final step, and that checkpoint is kept (never pruned by --keep-last). A target above F is still refused."""
    per_step = flops_per_step(tmp_path, "--num-iterations", "8")
    budget = per_step * 21 // 4  # 5.25 steps
    assert float(budget) == budget  # --target-flops is read as a float
    flags = ["--target-flops", str(budget), "--save-every", "2", "--keep-last", "1"]
    capsys.readouterr()
    assert train(tmp_path / "plan", *flags, "--save-at-flops", f"{per_step * 2},{budget}", "--eval-every-flops",
                 str(budget), "--dry-run") == 0
    out = capsys.readouterr().out
    assert "num_iterations: 5\n" in out and "save at flops: steps 2, 5\n" in out and "eval at flops: steps 5\n" in out
    run = tmp_path / "r"
    assert train(run, *flags, "--save-at-flops", f"{per_step * 2},{budget}") == 0
    assert ckpt.list_steps(run) == [2, 5]  # --keep-last 1 pruned step 4
    assert ckpt.load_meta(run, 5)["reason"] == "final, save_at_flops" and ckpt.load_meta(run, 5)["keep"]
    assert train(tmp_path / "e", *flags, "--eval-every-flops", f"{per_step},{budget}") == 0
    assert [r["step"] for r in records(tmp_path / "e", "eval")] == [1]  # step 5's is the final evaluation
    capsys.readouterr()
    for flag in ("--save-at-flops", "--eval-every-flops"):
        assert train(tmp_path / "x", *flags, flag, str(budget + 1)) == 2
        err = capsys.readouterr().err
        assert f"{flag} " in err and "beyond this run's" in err, err
        assert f"its last step stands for --target-flops {float(budget):.6g}" in err


# -- signals at the edges of the final evaluation (single process; the review of 2026-11-26) ------------------------
def test_a_signal_after_the_evaluation_stopped_changes_nothing(monkeypatch):
    """base_eval stops on the first signal and then cleans up (destroying the process group, so a later signal takes
    the one-process path): a second signal, e.g. torchrun forwarding Slurm's, must not raise out of that clean-up."""
    import signal

    from nanochat.eval_resume import Interrupted, interrupts_raise

    with interrupts_raise():
        with pytest.raises(Interrupted):
            signal.raise_signal(signal.SIGTERM)
        try:  # during the clean-up: ignored
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)
        except Interrupted as e:
            pytest.fail(f"a signal after the evaluation stopped raised {e!r}")


def test_a_signal_on_entry_to_the_final_evaluation_is_not_lost(monkeypatch):
    """A signal that lands between interrupts()'s check of ``received`` and arming the handler used to be recorded
    and never acted on: the evaluation ran to the end. Delivered at exactly that point by patching the check."""
    import signal

    from nanochat.eval_resume import Interrupted
    from nanochat.train_loop import StopSignal

    class Racy(StopSignal):
        _received = None

        @property
        def received(self):  # the entry check reads None, and the signal lands right after it
            value = self._received
            if value is None and not getattr(self, "_fired", False):
                self._fired = True
                self._handle(signal.SIGTERM, None)
            return value

        @received.setter
        def received(self, value):
            self._received = value

    stop = Racy()
    evaluated = []
    with pytest.raises(Interrupted):
        with stop.interrupts():
            evaluated.append("ran")
    assert evaluated == [] and stop.received == "SIGTERM"
