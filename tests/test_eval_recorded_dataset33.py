"""Evaluations without --data-dir read the data a checkpoint records; base_eval's bpb and the analyses' val/train
domains refuse data whose numbers would be another data's under the run's name (before, they measured it):
- an imported run (meta records --dataset climbmix, no data_dir) whose default directory's manifest records
  another dataset;
- a run whose recorded data_dir holds data prepared anew since the step (another fingerprint than meta.json's
  data_sha256).
Each names the directory and --data-dir, which still reads whatever it names. The training side is
tests/test_data_guard33.py."""

import json
import shutil

import pytest

from data_fixtures import write_numbered_docs
from reference_fixtures import imported_climbmix_run


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return imported_climbmix_run(tmp_path_factory.mktemp("imported"))


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
    meta = {"dataset": "climbmix", "data_dir": "/d/trained", "data_sha256": "ab"}
    assert run_data_dir(None, meta).trained_sha256 == "ab" and run_data_dir("/d/flag", meta).trained_sha256 is None


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


@pytest.fixture
def trained_then_rebuilt(tmp_path):
    """A copy of the imported run whose step records data_dir D and the fingerprint of the data first prepared in D;
    D then holds other documents (prepared anew)."""
    from nanochat.dataset import load_manifest, manifest_fingerprint

    run = imported_climbmix_run(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    write_numbered_docs(data, 400, 50, 100, dataset="climbmix")
    meta_path = next(run.glob("checkpoints/step_*/meta.json"))
    meta = json.loads(meta_path.read_text())
    meta.update(data_dir=str(data), data_sha256=manifest_fingerprint(load_manifest(data)))
    meta_path.write_text(json.dumps(meta))
    shutil.rmtree(data)
    data.mkdir()
    write_numbered_docs(data, 400, 50, 100, dataset="climbmix", max_words=20)
    return run, data


def test_data_prepared_anew_since_the_step_is_refused(trained_then_rebuilt, tmp_path, capsys):
    from scripts import analyze_memory, base_eval

    run, data = trained_then_rebuilt
    bpb = ["--run", str(run), "--eval", "bpb", "--splits", "val", "--eval-tokens", "256"]
    assert base_eval.main(bpb) == 2
    err = capsys.readouterr().err
    assert f"{data} (checkpoint meta 'data_dir') holds other prepared data than the checkpoint was trained on" in err
    assert f"pass --data-dir {data} to evaluate on what is there" in err
    assert analyze_memory.main(["--run", str(run), "--corpus", "val", "--max-tokens", "256", "--batch-size", "2",
                                "--no-progress", "--out-dir", str(tmp_path / "out")]) == 2
    assert "holds other prepared data than the checkpoint was trained on" in capsys.readouterr().err
    assert base_eval.main(bpb + ["--data-dir", str(data)]) == 0
