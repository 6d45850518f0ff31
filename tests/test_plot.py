"""scripts.plot under bad input: one error naming what is wrong, exit 2, nothing written or created."""

import builtins
import errno
import json

import pytest

from scripts import plot


def fake_curve_run(root, name):
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 5.0 - s / 10}) + "\n"
                                               for s in range(1, 6)))
    return run


def test_a_run_directory_that_does_not_exist_is_an_error_and_is_not_created(tmp_path, capsys):
    """A mistyped run directory was left out of the plot with a note (exit 0); as the first run it was created, to
    hold the default output."""
    a, typo = fake_curve_run(tmp_path, "a"), tmp_path / "typo"
    for argv in (["curves", str(a), str(typo), "--out", str(tmp_path / "c")], ["curves", str(typo), str(a)]):
        assert plot.main(argv) == 2
        assert f"error: {typo}: no such run directory" in capsys.readouterr().err
    assert not typo.exists() and not list(tmp_path.glob("c.*"))


def test_unknown_table_and_missing_runs_root_name_the_flag(tmp_path, capsys):
    """An unknown --table exited 1 without the known tables; a missing --runs-root drew the families plot from
    the paper's bars alone, exit 0."""
    out = ["--out", str(tmp_path / "p")]
    for cmd in ("scaling", "families"):
        assert plot.main([cmd, "--table", "nosuch", "--runs-root", str(tmp_path), *out]) == 2
        err = capsys.readouterr().err
        assert "--table nosuch: no such table" in err and "d12_scaling" in err
        assert plot.main([cmd, "--runs-root", str(tmp_path / "none"), *out]) == 2
        assert f"--runs-root {tmp_path / 'none'}: directory does not exist" in capsys.readouterr().err
    assert not list(tmp_path.glob("p.*"))


def test_a_full_disk_is_one_error_and_leaves_no_torn_figure(tmp_path, capsys, monkeypatch):
    a = fake_curve_run(tmp_path, "a")
    out = tmp_path / "figs" / "c"
    real_open = builtins.open

    def full_open(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".pdf"):
            real_open(path, mode).close()
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_open)
    assert plot.main(["curves", str(a), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot write {out}.pdf: [Errno 28] No space left on device")
    assert not [p for p in (tmp_path / "figs").iterdir()]


def test_curves_with_no_run_holding_the_metric_is_an_error(tmp_path, capsys):
    a = fake_curve_run(tmp_path, "a")
    assert plot.main(["curves", str(a), "--metric", "nosuch", "--out", str(tmp_path / "c")]) == 2
    assert "error: no run has 'nosuch' values in its metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(plot.PlotError):
        plot.plot_curves([a], "nosuch", tmp_path / "c")


def test_families_with_no_finished_run_is_an_error_like_scaling(tmp_path, capsys):
    """With a runs/ that holds no finished run of the table, `plot families` wrote a figure of the paper's bars
    with an empty "ours" legend entry (exit 0) while `plot scaling` refused; now both refuse."""
    runs, out = tmp_path / "runs", tmp_path / "p"
    runs.mkdir()
    for cmd, table in (("scaling", "d12_scaling"), ("families", "families")):
        assert plot.main([cmd, "--runs-root", str(runs), "--out", str(out)]) == 2
        assert f"error: no finished runs for table '{table}' under {runs}" in capsys.readouterr().err
    assert not list(tmp_path.glob("p.*"))


def test_no_finished_runs_says_why_each_completed_seed_was_not_counted(tmp_path, capsys):
    """`plot scaling --table mini` with a completed seed trained with other flags (a `-- --num-iterations 2` smoke)
    said only "no finished runs"; it now gives the reasons scripts.results prints under its table."""
    from nanochat.row_config import REPO, load_row_config

    train = load_row_config(REPO / "configs" / "mini" / "mome_c1_m4.toml")["train"]
    seed = tmp_path / "runs" / "mini" / "mome_c1_m4" / "seed42"
    seed.mkdir(parents=True)
    seed.joinpath("summary.json").write_text(json.dumps({"stop_reason": "completed", "val_bpb": 3.3,
                                                         "params_memory": 1000, "params_total": 9000}))
    args = {key.replace("-", "_"): value for key, value in train.items()}
    seed.joinpath("config.json").write_text(json.dumps({"args": {**args, "num_iterations": 2}}))
    out = tmp_path / "p"
    assert plot.main(["scaling", "--table", "mini", "--runs-root", str(tmp_path / "runs"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no finished runs for table 'mini' under {tmp_path / 'runs'}"), err
    label = load_row_config(REPO / "configs" / "mini" / "mome_c1_m4.toml")["row"]["label"]
    assert (f"- {label}: seed42 trained with other flags than the row's [train]: --num-iterations 2 "
            "(row: 300), not averaged") in err, err
    assert not list(tmp_path.glob("p.*"))
