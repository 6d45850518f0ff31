"""An imported run (meta records --dataset climbmix, no data_dir) evaluated without --data-dir reads climbmix's
default directory: where that directory's manifest records another dataset, base_eval's bpb and the analyses'
val/train domains refuse it, naming the directory, both datasets and --data-dir (before, they measured the other
dataset's data under this run's name). The training side is tests/test_data_guard33.py."""

import pytest

from data_fixtures import write_numbered_docs
from reference_fixtures import make_their_files, run_import


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("imported")
    src, _, _ = make_their_files(tmp, "mome_token")
    run = tmp / "run"
    assert run_import(src, run, "--dataset", "climbmix") == 0
    return run


@pytest.fixture
def other_in_default(tmp_path, monkeypatch):
    """climbmix's default directory holding the prepared data of fineweb-edu (copied there by hand)."""
    root = tmp_path / "data_root"
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(root))
    (root / "climbmix").mkdir(parents=True)
    write_numbered_docs(root / "climbmix", 400, 50, 100, dataset="fineweb-edu")
    return root / "climbmix"


def test_run_data_dir_marks_only_the_recorded_datasets_default():
    from nanochat.dataset import run_data_dir

    assert run_data_dir(None, {"dataset": "climbmix"}).recorded_default
    assert not run_data_dir("/d/flag", {"dataset": "climbmix"}).recorded_default
    assert not run_data_dir(None, {"dataset": "climbmix", "data_dir": "/d/trained"}).recorded_default
    assert not run_data_dir(None, {}).recorded_default  # embedded, the checkpoint records none: nothing to compare


def test_base_eval_refuses_another_datasets_data(imported, other_in_default, capsys):
    from scripts import base_eval

    assert base_eval.main(["--run", str(imported), "--eval", "bpb", "--splits", "val", "--eval-tokens", "256"]) == 2
    err = capsys.readouterr().err
    assert f"{other_in_default} (default directory of the run's dataset 'climbmix'" in err
    assert "holds the data of dataset 'fineweb-edu'" in err and "--data-dir DIR of 'climbmix'" in err
    assert not list(imported.glob("eval/step_*/bpb.json"))


def test_analyses_refuse_another_datasets_data(imported, other_in_default, tmp_path, capsys):
    from scripts import analyze_memory

    assert analyze_memory.main(["--run", str(imported), "--corpus", "val", "--max-tokens", "256", "--batch-size",
                                "2", "--no-progress", "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --corpus val: {other_in_default} (default directory")
    assert "holds the data of dataset 'fineweb-edu'" in err and not (tmp_path / "out").exists()


def test_an_explicit_data_dir_is_read_whatever_it_holds(imported, other_in_default, capsys):
    """--data-dir is the user's choice (as in training): the same directory named by the flag is evaluated."""
    from scripts import base_eval

    assert base_eval.main(["--run", str(imported), "--eval", "bpb", "--splits", "val", "--eval-tokens", "256",
                           "--data-dir", str(other_in_default)]) == 0
    assert f"bpb data: {other_in_default} (--data-dir)" in capsys.readouterr().out
