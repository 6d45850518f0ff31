"""scripts.results: which runs count as seeds of a paper row."""

import json
import shutil

from test_results_seeds import table


def test_a_run_started_from_another_runs_weights_is_listed_not_averaged(tmp_path):
    """The paper's rows train from scratch: an --init-from run in a row's directory is named under the table and
    neither averaged nor counted as a seed."""
    from scripts import results

    def write(seed, **summary):
        d = tmp_path / "runs" / "d12" / "base" / f"seed{seed}"
        d.mkdir(parents=True)
        d.joinpath("summary.json").write_text(json.dumps(summary))

    done = dict(stop_reason="completed", params_memory=0, params_total=135_000_000, tok_per_sec=1000.0)
    write(42, **done, val_bpb=0.88, init_from=None)
    write(43, **done, val_bpb=0.70, init_from={"run_dir": "/runs/big", "step": 900, "spec": "/runs/big"})
    results.main(["--table", "d12", "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path / "res")])
    md = (tmp_path / "res" / "d12.md").read_text()
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    base = dict(zip(header, (c.strip() for c in next(l for l in md.splitlines() if l.startswith("| Base |"))
                             .strip("|").split("|"))))
    assert base["seeds"] == "1" and base["val bpb"].startswith("0.8800")
    assert "- Base: seed43 started from the weights of /runs/big step 900 (--init-from), not averaged" in md


def write_seed(root, row, seed, text):
    d = root / "d12" / row / f"seed{seed}"
    d.mkdir(parents=True)
    d.joinpath("summary.json").write_text(text)


DONE = dict(stop_reason="completed", params_memory=0, params_total=135_000_000, tok_per_sec=1000.0)


def test_a_diverged_seed_is_listed_not_dropped_from_the_mean_silently(tmp_path):
    """A completed seed with a NaN val bpb counted as a seed ("2") while the mean was the other seed's alone."""
    from scripts import results

    runs = tmp_path / "runs"
    write_seed(runs, "base", 0, json.dumps({**DONE, "val_bpb": 0.9}))
    write_seed(runs, "base", 1, json.dumps({**DONE, "val_bpb": float("nan")}))
    assert results.main(["--table", "d12", "--runs-root", str(runs), "--out", str(tmp_path / "res")]) == 0
    md = (tmp_path / "res" / "d12.md").read_text()
    assert next(l for l in md.splitlines() if l.startswith("| Base |")).split(" | ")[1] == "1"
    assert "- Base: seed1 has a non-finite val_bpb (nan), not averaged" in md


def test_bad_input_is_one_error_naming_it(tmp_path, capsys):
    """An unknown --table exited 1 without the known tables; a torn or non-object summary.json was a traceback; a
    --runs-root that does not exist (a typo) wrote tables of the paper's numbers only, exit 0."""
    from scripts import results

    runs, out = tmp_path / "runs", ["--out", str(tmp_path / "res")]
    assert results.main(["--table", "nosuch", "--runs-root", str(runs), *out]) == 2
    err = capsys.readouterr().err
    assert "--table nosuch: no such table under" in err and "known: " in err and "d12" in err
    assert results.main(["--table", "d12", "--runs-root", str(runs), *out]) == 2
    assert f"--runs-root {runs}: directory does not exist" in capsys.readouterr().err
    for text, problem in (('{"stop_reason": "compl', "is not valid JSON"), ("[1]", "is not a JSON object")):
        write_seed(runs, "base", 0, text)
        assert results.main(["--table", "d12", "--runs-root", str(runs), *out]) == 2
        assert f"error: {runs / 'd12' / 'base' / 'seed0' / 'summary.json'} {problem}" in capsys.readouterr().err
        shutil.rmtree(runs / "d12" / "base" / "seed0")
    assert not (tmp_path / "res").exists()


def test_an_output_directory_that_cannot_be_written_is_one_error(tmp_path, capsys):
    from scripts import results

    runs = tmp_path / "runs"
    write_seed(runs, "base", 0, json.dumps({**DONE, "val_bpb": 0.9}))
    (tmp_path / "file").write_text("")
    assert results.main(["--table", "d12", "--runs-root", str(runs), "--out", str(tmp_path / "file" / "res")]) == 2
    assert f"error: cannot write the tables under --out {tmp_path / 'file' / 'res'}" in capsys.readouterr().err


def test_a_configs_root_without_row_configs_names_that_flag_not_table(tmp_path, capsys):
    """With no row config under --configs (a wrong path) the error blamed --table, with an empty name, though no
    --table was given ("--table : no such table"); before session 19 it was "no configs found under ..."."""
    from scripts import results

    (tmp_path / "configs").mkdir()
    assert results.main(["--configs", str(tmp_path / "configs"), "--out", str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --configs {tmp_path / 'configs'}: no row configs found\n", err
    assert not (tmp_path / "res").exists()


def test_a_seed_trained_with_other_flags_than_the_row_is_listed_not_averaged(tmp_path):
    """`scripts.run ROW -- --num-iterations 2` (a smoke test) completes the seed; the runner then never trains it
    again and the table averaged the 2-step run as the row. Flags that only change the hardware layout, logging
    or checkpoints (device batch, compile, save/eval cadence) still count as the row."""
    from nanochat.row_config import REPO, load_row_config
    from scripts import results

    train = load_row_config(REPO / "configs" / "d12" / "base.toml")["train"]
    row_args = {key.replace("-", "_"): value for key, value in train.items()}
    row_args.update(num_iterations=None, device_batch_size=16, compile=False, save_every=100)  # runner/hardware
    runs = tmp_path / "runs"
    for seed, args, bpb in ((42, row_args, 0.9),
                            (43, {**row_args, "num_iterations": 2, "eval_tokens": 4096}, 3.3),
                            (44, {**row_args, "target_flops": 1e17}, 1.2)):
        write_seed(runs, "base", seed, json.dumps({**DONE, "val_bpb": bpb}))
        (runs / "d12" / "base" / f"seed{seed}" / "config.json").write_text(json.dumps({"args": args}))
    assert results.main(["--table", "d12", "--runs-root", str(runs), "--out", str(tmp_path / "res")]) == 0
    md = (tmp_path / "res" / "d12.md").read_text()
    base = next(line for line in md.splitlines() if line.startswith("| Base |")).split(" | ")
    assert base[1] == "1" and "0.9000" in md
    assert ("- Base: seed43 trained with other flags than the row's [train]: --eval-tokens 4096 (row: 20971520), "
            "--num-iterations 2 (row: not set), not averaged") in md
    assert "- Base: seed44 trained with other flags than the row's [train]: --target-flops 1e+17 (row: 3e+18)" in md


def test_every_row_config_run_as_written_counts_as_its_row(tmp_path):
    """No false alarm: the args base_train resolves from each row config alone (plus the runner's --seed) match the
    row's [train] for every config shipped."""
    from nanochat.row_config import find_configs, load_row_config
    from nanochat.train_args import parse_args
    from scripts.results import flag_differences

    for path in find_configs():
        args = vars(parse_args(["--config", str(path), "--seed", "42"]))
        tmp_path.joinpath("config.json").write_text(json.dumps({"args": args}))
        assert flag_differences(load_row_config(path), tmp_path) == [], path


def test_a_seed_trained_with_a_flag_its_row_leaves_unset_is_listed(tmp_path):
    """`scripts.run ROW -- --matrix-lr 0.05` on a row whose [train] leaves the flag at base_train's default: the
    seed trained with other hyperparameters than the row's and was averaged as the row (only [train]'s keys and the
    horizons were compared). The args compared are those base_train resolves from the row config alone, as the
    runner starts it; an older version's --core-max-per-task 0 ("all" then) is the row's -1, as --resume reads it."""
    from nanochat.row_config import REPO
    from nanochat.train_args import parse_args
    from scripts import results

    config, runs = REPO / "configs" / "d12" / "base.toml", tmp_path / "runs"
    for seed, extra, bpb in ((42, [], 0.9), (43, ["--matrix-lr", "0.05"], 3.3), (44, [], 0.8),
                             (45, ["--data-seed", "7", "--mome-kernels", "torch"], 1.0)):
        args = vars(parse_args(["--config", str(config), "--seed", str(seed), "--device-batch-size", "16",
                                "--run-dir", str(runs / "d12" / "base" / f"seed{seed}"), "--resume", "auto", *extra]))
        args["data_seed"] = args["data_seed"] if args["data_seed"] is not None else seed  # as base_train resolves
        args["core_max_per_task"] = 0 if seed == 44 else args["core_max_per_task"]
        write_seed(runs, "base", seed, json.dumps({**DONE, "val_bpb": bpb}))
        (runs / "d12" / "base" / f"seed{seed}" / "config.json").write_text(json.dumps({"args": args}, default=str))
    assert results.main(["--table", "d12", "--runs-root", str(runs), "--out", str(tmp_path / "res")]) == 0
    md = (tmp_path / "res" / "d12.md").read_text()
    base = next(line for line in md.splitlines() if line.startswith("| Base |")).split(" | ")
    assert base[1] == "3" and "0.9000 ± 0.1000" in md, md
    default = parse_args(["--config", str(config)]).matrix_lr
    assert (f"- Base: seed43 trained with other flags than the row's [train]: --matrix-lr 0.05 (row: {default}), "
            "not averaged") in md
    assert "seed44" not in md and "seed45" not in md


def test_train_bpbs_on_other_rows_are_not_averaged_together(tmp_path):
    """Since 2026-11-27 a train bpb reads the documents the run read first (summary.json "train_bpb_rows"); older
    summaries have none and measured the split's first documents in manifest order. The two were averaged as one
    number: the first-read seeds are averaged, an older seed is listed; a row of older seeds alone says so."""

    runs = tmp_path / "runs"
    for seed, bpb in ((0, 0.80), (1, 0.82)):
        write_seed(runs, "base", seed, json.dumps({**DONE, "val_bpb": 0.9, "train_bpb": bpb,
                                                   "train_bpb_rows": f"first read with --data-seed {seed}"}))
    write_seed(runs, "base", 2, json.dumps({**DONE, "val_bpb": 0.9, "train_bpb": 0.95}))
    write_seed(runs, "bigram", 0, json.dumps({**DONE, "val_bpb": 0.9, "train_bpb": 0.95}))
    md, cells = table(tmp_path, runs)
    base, bigram = cells("Base"), cells("Bigram (6V)")
    assert base["seeds"] == "3" and base["val bpb"] == "0.9000"
    assert base["train bpb"] == "0.8100 ± 0.0141 (2 of 3 seeds)"  # the seeds column counts seed2 too
    assert "- Base: seed2 train bpb on rows in manifest order (before 2026-11-27), not averaged with the first-read " \
           "ones" in md
    assert bigram["train bpb"] == "0.9500 (rows in manifest order)"
