"""scripts.results: which runs count as seeds of a paper row."""

import json
import shutil


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
