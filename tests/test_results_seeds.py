"""scripts.results: which directories are seeds of a row, and how many seeds each averaged column holds."""

import json


DONE = dict(stop_reason="completed", params_memory=0, params_total=135_000_000, tok_per_sec=1000.0)


def write_seed(root, row, name, summary, config=None):
    d = root / "d12" / row / name
    d.mkdir(parents=True)
    d.joinpath("summary.json").write_text(json.dumps(summary))
    if config is not None:
        d.joinpath("config.json").write_text(json.dumps(config, default=str))


def table(tmp_path, runs):
    from scripts import results

    assert results.main(["--table", "d12", "--runs-root", str(runs), "--out", str(tmp_path / "res")]) == 0
    md = (tmp_path / "res" / "d12.md").read_text()
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]

    def cells(label):
        line = next(l for l in md.splitlines() if l.startswith(f"| {label} |"))
        return dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
    return md, cells


def test_a_copy_of_a_seed_directory_is_not_a_second_seed(tmp_path):
    """The runner writes seed<N>/; a stale run kept aside as seed42.old (or seed42_rerun, seed042) beside the seed42
    that replaced it matched seed*/ and was averaged as one more seed: the row said 2 seeds of one."""
    runs = tmp_path / "runs"
    write_seed(runs, "base", "seed42", {**DONE, "val_bpb": 0.90})
    for name in ("seed42.old", "seed42_rerun", "seed042"):
        write_seed(runs, "base", name, {**DONE, "val_bpb": 0.80})
    md, cells = table(tmp_path, runs)
    assert cells("Base")["seeds"] == "1" and cells("Base")["val bpb"] == "0.9000", md
    for name in ("seed042", "seed42.old", "seed42_rerun"):
        assert (f"- Base: {name} is not a seed directory of scripts.run (seed<N>, N the seed), not averaged"
                in md), md


def test_a_seed_directory_trained_with_another_seed_is_not_that_seed(tmp_path):
    """config.json records the --seed a run trained with; seed43/ holding a copy of seed42's run (cp -r) was a
    second seed 42 averaged as seed 43 (the seed is not among the flags compared with the row's)."""
    from nanochat.row_config import REPO
    from nanochat.train_args import parse_args

    config, runs = REPO / "configs" / "d12" / "base.toml", tmp_path / "runs"
    for name, seed, bpb in (("seed42", 42, 0.90), ("seed43", 42, 0.90), ("seed44", 44, 0.80)):
        args = vars(parse_args(["--config", str(config), "--seed", str(seed)]))
        write_seed(runs, "base", name, {**DONE, "val_bpb": bpb}, {"args": args})
    md, cells = table(tmp_path, runs)
    assert cells("Base")["seeds"] == "2" and cells("Base")["val bpb"] == "0.8500 ± 0.0707", md
    assert "- Base: seed43 trained with --seed 42, not the seed its directory names, not averaged" in md, md


def test_a_column_averaged_over_fewer_seeds_than_the_row_says_so(tmp_path):
    """A finished seed without a CORE (or a train bpb of the other kind of rows) counted in the seeds column while
    the CORE mean was the other seeds' alone, with nothing in the cell or under the table saying so."""
    runs = tmp_path / "runs"
    write_seed(runs, "base", "seed0", {**DONE, "val_bpb": 0.90, "core": 0.15, "train_bpb": 0.80,
                                       "train_bpb_rows": "first read with --data-seed 0"})
    write_seed(runs, "base", "seed1", {**DONE, "val_bpb": 0.92, "core": 0.17, "train_bpb": 0.82,
                                       "train_bpb_rows": "first read with --data-seed 1"})
    write_seed(runs, "base", "seed2", {**DONE, "val_bpb": 0.94, "train_bpb": 0.95})
    md, cells = table(tmp_path, runs)
    base = cells("Base")
    assert base["seeds"] == "3" and base["val bpb"] == "0.9200 ± 0.0200", md
    assert base["CORE"] == "0.1600 ± 0.0141 (2 of 3 seeds)", md
    assert base["train bpb"] == "0.8100 ± 0.0141 (2 of 3 seeds)", md
    assert "- Base: seed2 has no core, not in its mean" in md, md


def test_a_seed_without_summary_json_is_listed(tmp_path):
    """A seed still training, or killed (SIGKILL, OOM killer, a lost node) before it wrote summary.json, has a
    directory but no summary.json: the seed*/summary.json glob skipped it without a word, so the table read as if
    the row had only the other seeds."""
    runs = tmp_path / "runs"
    write_seed(runs, "base", "seed42", {**DONE, "val_bpb": 0.90})
    killed = runs / "d12" / "base" / "seed43"
    killed.mkdir()
    killed.joinpath("metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 9.0}\n')
    md, cells = table(tmp_path, runs)
    assert cells("Base")["seeds"] == "1", md
    assert "- Base: seed43 not finished (no summary.json: still training, or killed before writing it), not averaged" \
        in md, md


def test_a_seed_trained_in_part_with_other_learning_rates_is_listed(tmp_path):
    """A seed started with other LRs (-- --matrix-lr 0.05) and continued with --resume-override-lr and the row's
    LR: config.json's "args" (the last session's flags) equal the row's, so it was averaged as a seed trained with
    the row's LRs throughout; its "lr_overrides" say otherwise."""
    from nanochat.row_config import REPO
    from nanochat.train_args import parse_args

    config, runs = REPO / "configs" / "d12" / "base.toml", tmp_path / "runs"
    row_lr = parse_args(["--config", str(config)]).matrix_lr
    overrides = [{"step": 100, "changes": {"matrix_lr": {"checkpoint": 0.05, "now": row_lr}}}]
    for seed, bpb, lrs in ((42, 0.90, []), (43, 0.80, overrides)):
        args = vars(parse_args(["--config", str(config), "--seed", str(seed)]))
        write_seed(runs, "base", f"seed{seed}", {**DONE, "val_bpb": bpb}, {"args": args, "lr_overrides": lrs})
    md, cells = table(tmp_path, runs)
    assert cells("Base")["seeds"] == "1" and cells("Base")["val bpb"] == "0.9000", md
    assert (f"- Base: seed43 trained in part with other learning rates (overridden by hand (--resume-override-lr): "
            f"--matrix-lr 0.05 -> {row_lr} from step 100), not averaged") in md, md
