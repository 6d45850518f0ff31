"""End-to-end trainer tests on tiny models, in process (synthetic data unless stated)."""

import json
import math

import pytest
import torch

from nanochat import checkpoint as ckpt
from nanochat import train_end, train_resume
from scripts import base_train

TINY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
        "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core"]


def train(run_dir, *extra, batch=("--device-batch-size", "4", "--total-batch-size", "256")) -> int:
    return base_train.main([*TINY, *batch, "--run-dir", str(run_dir), *extra])


def losses(run_dir) -> dict[int, float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}


def weights(run_dir, step):
    return torch.load(ckpt.step_dir(run_dir, step) / "model.pt")


def test_grad_accum_matches_bigger_batch(tmp_path):
    # 1 process: device batch 2 x accum 4 == device batch 8 x accum 1 (same rows per step, fp32 tolerance)
    assert train(tmp_path / "a", "--num-iterations", "4", batch=("--device-batch-size", "2", "--total-batch-size", "256")) == 0
    assert train(tmp_path / "b", "--num-iterations", "4", batch=("--device-batch-size", "8", "--total-batch-size", "256")) == 0
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert la.keys() == lb.keys() == {1, 2, 3, 4}
    # Not bit for bit: the GEMMs of an 8-row and a 2-row micro-batch, and the accumulation, sum in different
    # orders. Losses are means over 256 tokens: measured within 1.1e-6 here on MKL's AVX-512 and AVX2 paths.
    for s in la:
        assert la[s] == pytest.approx(lb[s], abs=1e-5)
    # Weights only loosely: Adam (eps 1e-10) and NorMuon amplify fp32 summation-order differences of near-zero
    # gradient elements (a ~0 element's Adam step is lr * sign(g)); measured here: x0_lambdas 4.1e-3 (AVX-512)
    # and 4.5e-3 (MKL AVX2), Muon matrices <= 1.1e-3, everything else < 1e-4.
    wa, wb = weights(tmp_path / "a", 4), weights(tmp_path / "b", 4)
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-2, rtol=0), k


def stat_records(run_dir) -> dict[int, dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith(("memory/", "moe/"))}
            for r in recs if r["kind"] == "train"}


def test_resume_is_bit_exact(tmp_path):
    run = tmp_path / "r"
    # MoME top-1 of 4 slots and an MoE FFN: routing stats (memory/*, moe/*) in every record. The counters behind a
    # record cover the steps since the previous one, so the step-3 checkpoint must carry step 3's counts, or the
    # resumed step-4 record would cover step 4 alone.
    flags = ["--num-iterations", "6", "--save-every", "3", "--log-every", "2", "--memory", "mome", "--mome-slots", "4",
             "--mome-topk", "1", "--mlp", "moe", "--moe-experts", "4", "--moe-topk", "2"]
    assert train(run, *flags) == 0
    full, full_stats = losses(run), stat_records(run)
    assert set(full_stats) == {2, 4, 6} and any(k.startswith("memory/maxvio") for k in full_stats[4])
    assert any(k.startswith("moe/load") for k in full_stats[4])
    assert any(k.startswith("memory/gamma_mean") for k in full_stats[4])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["step"] == 6 and math.isfinite(summary["val_bpb"])
    # "kill" after the step-3 checkpoint: drop what came later, then resume
    import shutil
    shutil.rmtree(ckpt.step_dir(run, 6))
    assert ckpt.list_steps(run) == [3]
    assert train(run, *flags, "--resume") == 0
    # identical floats, and metrics.jsonl reads like one uninterrupted run: the same process and thread count
    # replay the same deterministic CPU kernels from the restored state (weights, optimizer, RNG, loader, counters)
    assert losses(run) == full and stat_records(run) == full_stats
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["plan"]["num_iterations"] == 6 and cfg["model_config"]["memory"] == "mome"


def test_resume_keeps_no_mapping_of_the_checkpoint_it_read(tmp_path, monkeypatch):
    """state.pt is memory-mapped on resume; once restored, nothing may still point into it: --keep-last 1 prunes
    that checkpoint two steps later, and a view still held would pin the deleted file's disk space (and read
    from a file the run no longer owns)."""
    from pathlib import Path

    run = tmp_path / "r"
    flags = ["--num-iterations", "4", "--save-every", "2", "--memory", "mome", "--mome-slots", "4", "--mome-topk", "1"]
    assert train(run, *flags) == 0
    import shutil
    shutil.rmtree(ckpt.step_dir(run, 4))
    state_pt = str(ckpt.step_dir(run, 2).resolve() / "state.pt")
    mapped = []
    real_restore = train_resume.restore

    def restore(run_, step):
        real_restore(run_, step)
        import gc
        gc.collect()  # what restore dropped is gone; only what the run still holds stays mapped
        mapped.append([line for line in Path("/proc/self/maps").read_text().splitlines() if state_pt in line])

    monkeypatch.setattr(train_resume, "restore", restore)
    assert train(run, *flags, "--keep-last", "1", "--resume") == 0
    assert mapped == [[]]
    assert ckpt.list_steps(run) == [4]


def test_resume_refuses_changed_trajectory_flags(tmp_path, capsys):
    run = tmp_path / "r"
    assert train(run, "--num-iterations", "2") == 0
    assert train(run, "--num-iterations", "2", "--matrix-lr", "0.03", "--resume") == 2
    assert "--matrix-lr 0.02 (checkpoint) != 0.03" in capsys.readouterr().err
    # the model: field by field (depth is also a trajectory flag, the context length only a model field)
    assert train(run, "--num-iterations", "2", "--max-seq-len", "16", "--resume") == 2
    assert "model config: sequence_len 32 (checkpoint) vs 16 (this run)" in capsys.readouterr().err


def test_a_refused_resume_ends_with_how_to_start_afresh(tmp_path, capsys):
    """The CPU demo run again with another DEMO_STEPS stopped on the flag mismatch with no way forward: the error
    now ends with it, and following it works."""
    run = tmp_path / "r"
    assert train(run, "--num-iterations", "2") == 0
    assert train(run, "--num-iterations", "3", "--resume", "auto") == 2
    err = capsys.readouterr().err.strip()
    assert "num_iterations 2 (checkpoint) != 3" in err
    assert err.endswith(f"to start afresh instead, drop --resume and add --overwrite (it deletes the run in {run}), "
                        "or pass another --run-dir"), err
    assert train(run, "--num-iterations", "3", "--overwrite") == 0
    assert ckpt.list_steps(run) == [3]


def test_a_refused_resume_under_speedrun_names_what_its_user_can_do(tmp_path, capsys, monkeypatch):
    """speedrun.sh passes --resume auto itself (CONTINUE_COMMAND_ENV): "drop --resume and add --overwrite, or pass
    another --run-dir" named flags of a command its user never typed. A run finished by hand with another LR (as a
    non-finite stop's advice says) is then refused by speedrun's --resume auto: the advice now says to delete the run
    dir and run 'bash speedrun.sh' again, or with what the run was trained with, or by hand with the
    base_train command speedrun.sh ran and the checkpoint's flag values; pasting that command continues the run."""
    import shlex
    import sys
    from pathlib import Path

    from nanochat.run_control import CONTINUE_COMMAND_ENV

    monkeypatch.delenv(train_resume.RUNNER_AFRESH_ENV, raising=False)
    monkeypatch.setenv(CONTINUE_COMMAND_ENV, "bash speedrun.sh")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # one process, as the CPU demo runs it
    run = tmp_path / "r un"  # a space: the command is shell-quoted
    assert train(run, "--num-iterations", "3", "--matrix-lr", "0.01", "--max-wall-time-seconds", "0.001") == 0
    assert ckpt.list_steps(run) == [1]
    capsys.readouterr()
    argv = [*TINY, "--device-batch-size", "4", "--total-batch-size", "256", "--run-dir", str(run),
            "--num-iterations", "3", "--resume", "auto"]  # speedrun's flags: the original LR
    monkeypatch.setattr(sys, "argv", [str(base_train.__file__), *argv])  # as `python -m scripts.base_train` sets it
    assert base_train.main(argv) == 2
    err = capsys.readouterr().err
    assert "--matrix-lr 0.01 (checkpoint) != 0.02" in err and "drop --resume" not in err, err
    assert "--resume-override-lr" not in err, err  # another flag 'bash speedrun.sh' does not take
    assert f"to start afresh instead, delete (or move) {run} and run 'bash speedrun.sh' again; to continue it " \
           "instead, run 'bash speedrun.sh' again with what the run was trained with (what differs above: a " \
           "setting it reads, a config file, a default an update changed), or run by hand in " in err, err
    assert "the base_train command 'bash speedrun.sh' ran, with the checkpoint's values of the flags above:" in err
    lines = [line for line in err.splitlines() if "-m scripts.base_train" in line]
    assert len(lines) == 1 and lines[0].startswith("  ") and err.rstrip().endswith(lines[0]), err
    tokens = shlex.split(lines[0])
    assert Path(tokens[0]).name.startswith("python") and tokens[1:3] == ["-m", "scripts.base_train"], tokens
    pasted = tokens[3:]
    assert pasted == [*argv[:-2], "--resume", "latest", "--matrix-lr", "0.01"], pasted
    assert base_train.main(pasted) == 0
    assert "resumed from" in capsys.readouterr().out
    assert ckpt.list_steps(run)[-1] == 3
    # a difference no flag of that command undoes (DEMO_STEPS: the step count): no command, the other ways
    assert base_train.main([*argv[:-4], "--num-iterations", "4", "--matrix-lr", "0.01", "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert "num_iterations 3 (checkpoint) != 4" in err and "scripts.base_train" not in err, err
    assert err.endswith(f"to start afresh instead, delete (or move) {run} and run 'bash speedrun.sh' again; to "
                        "continue it instead, run 'bash speedrun.sh' again with what the run was trained with (what "
                        "differs above: a setting it reads, a config file, a default an update changed)"), err


@pytest.mark.parametrize("vocab, seq_len, seed", [
    (256, 8, 0), (3, 31, 7), (50257, 226, 2**33 + 5), (11, 227, -3),  # one output block (<= 227 words)
    (13, 453, 1), (13, 454, 1), (17, 623, 2), (17, 624, 2), (19, 1300, 3)])  # the twist's blocks and repeats
def test_synthetic_eval_rows_are_the_per_row_generators(vocab, seq_len, seed):
    """The eval rows are drawn for all rows at once (nanochat.cpu_rng) but must be the rows of the per-row
    generators (``SyntheticLoader._row``), bit for bit: the same val set as every earlier run of the seed."""
    from nanochat.train_loop import SyntheticLoader, synthetic_eval_rows

    rows = synthetic_eval_rows(vocab, seq_len, 37 * seq_len - 1, seed)
    each = SyntheticLoader(vocab, 1, seq_len, seed=seed + 7_777_777)
    assert torch.equal(rows, torch.stack([each._row(g) for g in range(37)]))
    if (vocab, seq_len, seed) == (256, 8, 0):  # as drawn before the vectorised draw
        assert rows[:3].tolist() == [[142, 145, 146, 147, 149, 150, 153, 155, 158],
                                     [115, 116, 118, 119, 122, 125, 128, 131, 134],
                                     [29, 30, 31, 32, 35, 38, 41, 44, 46]]


def no_eval_rows(*a, **k):
    raise AssertionError("the eval rows were built before the resume checks")


def test_resume_refusals_come_before_the_eval_rows(tmp_path, capsys, monkeypatch):
    """A requeue with a changed flag, a missing step or another world size is refused before the expensive set-up:
    the synthetic eval rows alone take ~25 s at the default --eval-tokens and a 32-token context."""
    from nanochat import train_setup

    run = tmp_path / "r"
    assert train(run, "--num-iterations", "2") == 0
    monkeypatch.setattr(train_setup, "synthetic_eval_rows", no_eval_rows)
    assert train(run, "--num-iterations", "2", "--matrix-lr", "0.03", "--resume") == 2
    assert "--matrix-lr 0.02 (checkpoint) != 0.03" in capsys.readouterr().err
    assert train(run, "--num-iterations", "2", "--resume", "1") == 2
    assert "no checkpoint step_000001" in capsys.readouterr().err
    # a requeue on another number of processes: recorded in the checkpoint (as if 2 processes had written it)
    meta_path = ckpt.step_dir(run, 2) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["world_size"] = 2
    meta_path.write_text(json.dumps(meta))
    assert train(run, "--num-iterations", "2", "--resume") == 2
    assert "written by 2 processes but this run has 1" in capsys.readouterr().err


def test_missing_and_corrupt_checkpoint_errors(tmp_path, capsys):
    run = tmp_path / "r"
    assert train(run, "--num-iterations", "2", "--resume") == 2
    assert "no checkpoint under" in capsys.readouterr().err
    assert train(run, "--num-iterations", "2", "--resume", "auto") == 0  # auto: fresh start when none exists
    assert train(run, "--num-iterations", "2", "--resume", "1") == 2
    assert "no checkpoint step_000001" in capsys.readouterr().err
    (ckpt.step_dir(run, 2) / "state.pt").write_bytes(b"not a torch file")
    assert train(run, "--num-iterations", "2", "--resume") == 2
    err = capsys.readouterr().err
    assert "corrupt checkpoint file" in err and "state.pt" in err
    (ckpt.step_dir(run, 2) / "model.pt").unlink()
    assert train(run, "--num-iterations", "2", "--resume") == 2


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    real = base_train.train_step
    calls = {"n": 0}

    def poisoned(*a, **k):
        loss, g, stop, aux = real(*a, **k)
        calls["n"] += 1
        return (float("nan") if calls["n"] == 3 else loss), g, stop, aux

    monkeypatch.setattr(base_train, "train_step", poisoned)
    run = tmp_path / "r"
    assert train(run, "--num-iterations", "6", "--save-every", "2") == train_end.EXIT_NONFINITE
    out = capsys.readouterr().out
    assert "train loss is nan at step 3" in out and "Last good checkpoint: step 2" in out
    assert ckpt.list_steps(run) == [2]
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "nonfinite_loss"


def poison_weights_after(monkeypatch, calls_before: int):
    """train_step that sets one wte weight to inf after step ``calls_before`` but still returns that step's finite
    loss: the weights go non-finite one step before the loss does (as with a huge --embedding-lr)."""
    real, calls = base_train.train_step, {"n": 0}

    def poisoned(model, *a, **k):
        out = real(model, *a, **k)
        calls["n"] += 1
        if calls["n"] == calls_before:
            with torch.no_grad():
                model.wte.weight[0, 0] = float("inf")
        return out

    monkeypatch.setattr(base_train, "train_step", poisoned)


def test_nonfinite_weights_are_never_saved(tmp_path, monkeypatch, capsys):
    run = tmp_path / "r"
    poison_weights_after(monkeypatch, 4)
    assert train(run, "--num-iterations", "6", "--save-every", "2") == train_end.EXIT_NONFINITE
    out = capsys.readouterr().out
    assert ckpt.list_steps(run) == [2]  # the step-4 save was refused
    assert "non-finite values after step 4 in wte.weight" in out
    assert "Last good checkpoint: step 2" in out and "checked finite when it was saved" in out
    assert "--resume 2 --resume-override-lr, and lower --embedding-lr" in out
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "nonfinite_params"
    assert json.loads((ckpt.step_dir(run, 2) / "meta.json").read_text())["params_finite"] is True


def test_resume_with_lower_lr_after_nonfinite_is_deliberate_and_recorded(tmp_path, monkeypatch, capsys):
    """The advice printed on a NaN works: --resume STEP --resume-override-lr with a lower LR continues, the new LR
    is really used (lr_matrix in metrics) and the change is in config.json and metrics.jsonl."""
    run = tmp_path / "r"
    poison_weights_after(monkeypatch, 4)
    assert train(run, "--num-iterations", "6", "--save-every", "2") == train_end.EXIT_NONFINITE
    before = {r["step"]: r["lr_matrix"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"}
    monkeypatch.undo()
    assert train(run, "--num-iterations", "6", "--save-every", "2", "--resume", "2", "--matrix-lr", "0.01") == 2
    assert "add --resume-override-lr" in capsys.readouterr().err
    assert train(run, "--num-iterations", "6", "--save-every", "2", "--resume", "2", "--matrix-lr", "0.01",
                 "--seed", "1", "--resume-override-lr") == 2  # only learning rates may change
    assert "--seed 42 (checkpoint) != 1" in capsys.readouterr().err
    assert train(run, "--num-iterations", "6", "--save-every", "2", "--resume", "2", "--matrix-lr", "0.01",
                 "--resume-override-lr") == 0
    out = capsys.readouterr().out
    assert "--resume-override-lr: continuing from step 2 with --matrix-lr 0.01 (checkpoint 0.02)" in out
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    after = {r["step"]: r["lr_matrix"] for r in recs if r["kind"] == "train"}
    assert after[1] == before[1] and after[3] == pytest.approx(before[3] / 2, rel=1e-12)
    assert {"kind": "resume", "step": 2, "lr_override": {"matrix_lr": {"checkpoint": 0.02, "now": 0.01}}} in recs
    override = [{"step": 2, "changes": {"matrix_lr": {"checkpoint": 0.02, "now": 0.01}}}]
    assert json.loads((run / "config.json").read_text())["lr_overrides"] == override
    # the history travels with the checkpoints: a later plain resume keeps it
    assert json.loads((ckpt.step_dir(run, 6) / "meta.json").read_text())["config"]["lr_overrides"] == override
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "completed"


@pytest.mark.parametrize("argv, needle", [
    (["--total-batch-size", "1000"], "--total-batch-size 1000 is not divisible"),
    (["--memory", "nope"], "--memory: invalid choice: 'nope'"),
    (["--target-flops=-3e18"], "--target-flops must be > 0"),
    (["--num-iterations", "0"], "--num-iterations must be >= 1"),
    (["--warmup-ratio", "0.8"], "--warmup-ratio + --warmdown-ratio"),
    (["--mome-slots", "4"], "--mome-slots only applies to --memory mome"),
    # flags that would change nothing: the head size, the width, an optimizer group the model does not have
    (["--model-type", "mobilellm", "--model-dim", "64", "--num-heads", "4"], "--head-dim 32 has no effect with --num-heads"),
    (["--model-dim", "64"], "--aspect-ratio 32 has no effect with --model-dim 64"),
    (["--memory-lr", "0.5"], "--memory-lr 0.5: no optimizer group of this model uses it"),
    (["--model-type", "mobilellm", "--memory", "ve", "--scalar-lr", "9"], "--scalar-lr 9.0: no optimizer group"),
])
def test_bad_flags_fail_before_any_work(tmp_path, capsys, argv, needle):
    run = tmp_path / "r"
    try:
        rc = base_train.main([*TINY, "--run-dir", str(run), "--num-iterations", "3", *argv])
    except SystemExit as e:  # argparse errors
        rc = e.code
    assert rc == 2
    assert needle in capsys.readouterr().err
    assert not run.exists()


def test_real_data_resume_and_vocab_check(tmp_path, capsys, monkeypatch, embedded_data_dir, tiny_tokenizer_dir):
    common = ["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir), "--depth", "1",
              "--aspect-ratio", "64", "--head-dim", "32", "--max-seq-len", "64", "--device-batch-size", "2",
              "--total-batch-size", "256", "--eval-tokens", "512", "--eval-every", "-1", "--no-final-core",
              "--num-iterations", "4", "--save-every", "2"]
    run = tmp_path / "real"
    assert base_train.main([*common, "--run-dir", str(run)]) == 0
    full = losses(run)
    assert json.loads((run / "summary.json").read_text())["val_bpb"] > 0
    # data_passes: the tokens trained over the split's tokens as the dry run estimates them, not the loader's
    # read-ahead (which said 0.14 at step 1 of a mini row that had read 4,096 of ~2.4M tokens); a resume goes on
    from nanochat.dataloader import estimate_split_tokens
    from nanochat.tokenizer import get_tokenizer
    from nanochat.train_setup import PASSES_SAMPLE_DOCS

    split_tokens = estimate_split_tokens(embedded_data_dir, "train", get_tokenizer(tiny_tokenizer_dir),
                                         PASSES_SAMPLE_DOCS)[0]

    def passes() -> list[tuple[int, float, float]]:
        return [(r["step"], r["data_passes"], r["data_read_passes"])
                for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    first = passes()
    assert [(s, p) for s, p, _ in first] == [(s, s * 256 / split_tokens) for s in range(1, 5)], first
    assert all(p < r < 1 for _, p, r in first)  # the reader is ahead of training: its buffer, cropped ends
    import shutil
    shutil.rmtree(ckpt.step_dir(run, 4))
    assert base_train.main([*common, "--run-dir", str(run), "--resume"]) == 0
    assert losses(run) == full  # bit for bit: same process and threads, restored state (see test_resume_is_bit_exact)
    assert passes()[-2:] == first[-2:]  # steps 3 and 4 again, from the checkpoint of step 2: the same values
    assert base_train.main([*common, "--run-dir", str(tmp_path / "v"), "--vocab-size", "999"]) == 2
    assert "but this run needs --vocab-size 999: train one with `python -m scripts.tok_train --vocab-size 999" \
        in capsys.readouterr().err
    from nanochat import dataloader
    monkeypatch.setattr(dataloader, "build_eval_rows", no_eval_rows)  # tokenising --eval-tokens of val text
    assert base_train.main([*common, "--run-dir", str(run), "--resume", "--matrix-lr", "0.03"]) == 2
    assert "--matrix-lr 0.02 (checkpoint) != 0.03" in capsys.readouterr().err


def test_no_final_train_bpb_builds_no_train_rows(tmp_path, monkeypatch, embedded_data_dir, tiny_tokenizer_dir):
    """The train-split rows serve only the final "train bpb": without it they are neither tokenized at startup nor
    required to exist (a train split smaller than --eval-tokens must not fail the run)."""
    import nanochat.dataloader as dataloader

    built = []
    real = dataloader.build_eval_rows
    monkeypatch.setattr(dataloader, "build_eval_rows", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    common = ["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir), "--depth", "1",
              "--aspect-ratio", "64", "--head-dim", "32", "--max-seq-len", "64", "--device-batch-size", "2",
              "--total-batch-size", "256", "--eval-tokens", "512", "--eval-every", "-1", "--no-final-core",
              "--num-iterations", "1"]
    assert base_train.main([*common, "--run-dir", str(tmp_path / "a"), "--no-final-train-bpb"]) == 0
    assert built == ["val"]
    assert "train_bpb" not in json.loads((tmp_path / "a" / "summary.json").read_text())
    assert base_train.main([*common, "--run-dir", str(tmp_path / "b")]) == 0
    assert built == ["val", "val", "train"]
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["train_bpb"] > 0


def test_resuming_from_an_earlier_step_sets_the_later_checkpoints_aside(tmp_path, monkeypatch, capsys):
    """--resume 2 with checkpoints 4 and 6 of the first continuation on disk: those are abandoned. Pruning by step
    number would otherwise delete the new step-4 checkpoint and keep the old step 6, and after a crash
    --resume latest would silently continue the abandoned continuation."""
    run = tmp_path / "r"
    assert train(run, "--num-iterations", "6", "--save-every", "2") == 0
    assert ckpt.list_steps(run) == [2, 4, 6]
    calls = {"n": 0}
    real = base_train.train_step

    def crash_in_step_5(*a, **k):  # a node failure after the new continuation saved step 4
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated crash")
        return real(*a, **k)

    monkeypatch.setattr(base_train, "train_step", crash_in_step_5)
    assert train(run, "--num-iterations", "6", "--save-every", "2", "--keep-last", "1", "--resume", "2",
                 "--matrix-lr", "0.01", "--resume-override-lr") == 1  # the crash: stop_reason error, exit 1
    # the crashed session's own summary (stop_reason error), not the abandoned continuation's "completed"
    assert json.loads((run / "summary.json").read_text())["error"] == "RuntimeError: simulated crash"
    assert "later steps [4, 6] belong to the abandoned continuation" in capsys.readouterr().out
    assert ckpt.list_steps(run) == [4] and ckpt.resolve_resume_step(run, "latest") == 4
    assert ckpt.load_meta(run, 4)["config"]["args"]["matrix_lr"] == 0.01  # the new continuation's
    aside = [p for p in (run / ckpt.CKPT_DIR).iterdir() if p.name.startswith(ckpt.SUPERSEDED_PREFIX)]
    assert len(aside) == 1 and aside[0].name.endswith("-after-step_000002")
    # the completed run's summary and report belong to the abandoned continuation too: a run killed after the
    # rewind must not read as "completed, step 6" (scripts.run would skip it, results would average it)
    assert sorted(p.name for p in aside[0].iterdir()) == ["report.md", "step_000004", "step_000006", "summary.json"]
    assert json.loads((aside[0] / "summary.json").read_text())["stop_reason"] == "completed"
    crashed = json.loads((run / "summary.json").read_text())
    assert (crashed["stop_reason"], crashed["step"], crashed["last_checkpoint"]) == ("error", 4, 4), crashed
    assert json.loads((aside[0] / "step_000006" / "meta.json").read_text())["config"]["args"]["matrix_lr"] == 0.02


def test_wall_time_adds_up_over_resumed_sessions(tmp_path, monkeypatch):
    """summary.json's wall time covered only the last session while its train time covered all of them."""
    run = tmp_path / "r"
    clock = {"t": 1000.0}

    def fake_time():
        clock["t"] += 1.0  # every call to time.time() advances one second
        return clock["t"]

    assert train(run, "--num-iterations", "4", "--save-every", "2") == 0
    one_session = json.loads((run / "summary.json").read_text())["wall_time_s"]
    monkeypatch.setattr(base_train.time, "time", fake_time)
    assert train(run, "--num-iterations", "4", "--save-every", "2", "--resume", "2") == 0
    state = torch.load(ckpt.step_dir(run, 2) / "state.pt", weights_only=False)  # the first session's step 2
    first_part = state["loop"]["wall_time"]
    summary = json.loads((run / "summary.json").read_text())
    assert 0 < first_part < one_session
    assert summary["wall_time_s"] > first_part + 1.0  # this session's fake seconds come on top of it


def test_resume_refuses_other_data_or_tokenizer_but_not_a_moved_copy(tmp_path, capsys, embedded_data_dir,
                                                                      tiny_tokenizer_dir):
    """The checkpoint records content fingerprints of the tokenizer and the prepared data: the same files in
    another directory resume; other shards under the same names, or other merges, are refused naming the flag."""
    import shutil

    from nanochat.dataset import load_manifest, write_manifest, write_text_shard
    from nanochat.tokenizer import Tokenizer

    common = ["--depth", "1", "--aspect-ratio", "64", "--head-dim", "32", "--max-seq-len", "64",
              "--device-batch-size", "2", "--total-batch-size", "256", "--eval-tokens", "512", "--eval-every", "-1",
              "--no-final-core", "--no-final-train-bpb", "--num-iterations", "4", "--save-every", "2"]
    run = tmp_path / "run"
    assert base_train.main([*common, "--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir),
                            "--run-dir", str(run)]) == 0
    meta = ckpt.load_meta(run, 2)
    assert len(meta["tokenizer_sha256"]) == len(meta["data_sha256"]) == 64
    moved_data, moved_tok = tmp_path / "data_copy", tmp_path / "tok_copy"
    shutil.copytree(embedded_data_dir, moved_data)
    shutil.copytree(tiny_tokenizer_dir, moved_tok)

    def resume(data_dir, tok_dir) -> int:
        return base_train.main([*common, "--data-dir", str(data_dir), "--tokenizer-dir", str(tok_dir),
                                "--run-dir", str(run), "--resume", "2"])

    assert resume(moved_data, moved_tok) == 0
    capsys.readouterr()
    # same shard names, other text: drop the last document of the first train shard
    manifest = load_manifest(moved_data)
    first = moved_data / manifest["train"][0]
    import pyarrow.parquet as pq

    texts = pq.read_table(first).column("text").to_pylist()
    write_text_shard(first, texts[:-1])
    write_manifest(moved_data, manifest["dataset"], manifest["train"], manifest["val"], manifest["source"])
    assert resume(moved_data, moved_tok) == 2
    assert f"--data-dir: the prepared data (shards, rows, sizes) of {moved_data}" in capsys.readouterr().err
    # same vocab size, two merges swapped: other token ids
    tok = Tokenizer.load(tiny_tokenizer_dir)
    ranks = dict(tok.mergeable_ranks)
    (a, ra), (b, rb) = sorted(ranks.items(), key=lambda kv: kv[1])[300:302]
    ranks[a], ranks[b] = rb, ra
    Tokenizer(ranks, pattern=tok.pattern, special_tokens=list(tok.special_tokens)).save(moved_tok)
    assert resume(embedded_data_dir, moved_tok) == 2
    assert f"--tokenizer-dir: the tokenizer of {moved_tok.resolve()}" in capsys.readouterr().err


def test_a_missing_core_bundle_is_refused_before_the_eval_rows(tmp_path, capsys, monkeypatch, embedded_data_dir,
                                                               tiny_tokenizer_dir):
    """--bundle is resolved (a download, without --bundle) before the eval rows are tokenized (up to hundreds of
    thousands of rows), so a wrong --bundle fails in seconds."""
    def slow_work(*a, **k):
        raise AssertionError("the eval rows were built before the CORE bundle was resolved")

    monkeypatch.setattr(base_train, "load_eval_rows", slow_work)
    missing = tmp_path / "no-bundle"
    assert base_train.main(["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir),
                            "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "32",
                            "--bundle", str(missing), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"--bundle {missing}" in err, err
    assert not (tmp_path / "r").exists()
