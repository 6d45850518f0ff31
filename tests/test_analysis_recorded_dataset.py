"""An imported run (import_reference --dataset D records D, not a data directory) gives the analyses' val/train
domains the directory base_eval reads for its bpb: --data-dir, else the meta's data_dir, else the directory
scripts.prepare_data fills for D; missing data is refused naming the directory, D and the command to prepare it."""

import json

import pytest

from data_fixtures import write_numbered_docs
from reference_fixtures import imported_climbmix_run


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A MoME run imported with --dataset climbmix (its meta records "dataset", no "data_dir")."""
    return imported_climbmix_run(tmp_path_factory.mktemp("imported"))


@pytest.fixture
def data_root(tmp_path, monkeypatch):
    root = tmp_path / "data_root"
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(root))
    return root


def _prepare(data_dir, max_words=60):
    data_dir.mkdir(parents=True)
    return write_numbered_docs(data_dir, 400, 50, 100, dataset="climbmix", max_words=max_words)


def _memory(run, out, *extra):
    from scripts import analyze_memory

    return analyze_memory.main(["--run", str(run), "--corpus", "val", "train", "--max-tokens", "256",
                                "--batch-size", "2", "--no-progress", "--out-dir", str(out), *extra])


def test_run_data_dir_order():
    """--data-dir, else meta data_dir, else the recorded dataset's default directory (embedded where none)."""
    from nanochat.dataset import default_data_dir, run_data_dir

    meta = {"data_dir": "/d/trained", "dataset": "climbmix"}
    found = run_data_dir("/d/flag", meta)
    assert (str(found.path), found.source) == ("/d/flag", "--data-dir")
    found = run_data_dir(None, meta)
    assert str(found.path) == "/d/trained" and found.dataset == "climbmix"
    found = run_data_dir(None, {"dataset": "climbmix"})
    assert found.path == default_data_dir("climbmix") and "'climbmix'" in found.source
    found = run_data_dir(None, {})
    assert found.path == default_data_dir("embedded") and found.dataset is None


def test_missing_recorded_dataset_names_dir_dataset_and_command(imported, data_root, tmp_path, capsys):
    from scripts import analyze_routing

    want = data_root / "climbmix"
    assert _memory(imported, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert str(want) in err and "'climbmix'" in err and "`python -m scripts.prepare_data --dataset climbmix`" in err
    assert not (tmp_path / "out").exists()
    text = tmp_path / "text.txt"
    text.write_text("the sea and the whale\n" * 20)
    assert analyze_routing.main(["--run", str(imported), "--corpus", f"file:{text}", "--reference", "val",
                                 "--no-progress", "--out-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --reference val: ") and str(want) in err


def test_analyses_read_the_recorded_datasets_directory(imported, data_root, tmp_path, capsys):
    """Without --data-dir the analyses read data_root/climbmix: the same numbers as --data-dir naming it; an
    explicit --data-dir still wins (another directory gives other numbers)."""
    from scripts import analyze_routing, base_eval

    recorded = _prepare(data_root / "climbmix")
    assert _memory(imported, tmp_path / "rec") == 0
    assert f"data: {recorded} (default directory of the run's dataset 'climbmix'" in capsys.readouterr().out
    assert _memory(imported, tmp_path / "flag", "--data-dir", str(recorded)) == 0
    assert f"data: {recorded} (--data-dir)" in capsys.readouterr().out
    rec, flag = (json.loads((tmp_path / d / "memory_use.json").read_text()) for d in ("rec", "flag"))
    assert rec["domains"] == flag["domains"] and rec["data_dir"] == flag["data_dir"] == str(recorded)

    # base_eval reads the same directory, said the same way
    assert base_eval.main(["--run", str(imported), "--eval", "bpb", "--splits", "val", "--eval-tokens", "256"]) == 0
    assert f"bpb data: {recorded} (default directory of the run's dataset 'climbmix'" in capsys.readouterr().out
    assert json.loads(next((imported / "eval").glob("step_*/bpb.json")).read_text())["data_dir"] == str(recorded)

    assert _memory(imported, tmp_path / "big", "--max-tokens", "1000000") == 2  # an error line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("error: --corpus val: --max-tokens 1,000,000 is more than the split "
                          f"holds: the val split of {recorded} yields only "), err
    assert "lower --max-tokens or prepare a larger val split" in err and "--eval-tokens" not in err, err  # its flag

    other = _prepare(tmp_path / "other", max_words=20)  # other documents
    assert _memory(imported, tmp_path / "other_out", "--data-dir", str(other)) == 0
    res = json.loads((tmp_path / "other_out" / "memory_use.json").read_text())
    assert res["data_dir"] == str(other) and res["domains"] != rec["domains"]

    assert analyze_routing.main(["--run", str(imported), "--corpus", "val", "--reference", "train",
                                 "--max-tokens", "256", "--no-progress", "--out-dir", str(tmp_path / "r")]) == 0
    assert f"data: {recorded} (" in capsys.readouterr().out
    assert json.loads((tmp_path / "r" / "routing_audit.json").read_text())["data_dir"] == str(recorded)
