"""The final train bpb reads the documents the run trains on first (its --data-seed's epoch 0; the rows themselves:
tests/test_dataloader.py), and which rows those are is part of the final evaluation's fingerprint, so a resumed
evaluation never reuses another seed's number."""

import json

import pytest

from data_fixtures import write_numbered_docs
from nanochat import eval_resume
from scripts import base_train

SEQ = 32
GET_OR_RUN = eval_resume.FinishedResults.get_or_run  # the real one: each run below wraps it once


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_numbered_docs(tmp_path_factory.mktemp("data"), 80, row_group_size=4, val_docs=12, dataset="embedded",
                               max_words=30)


def _run(tmp_path, data_dir, tokenizer_dir, name, seed, monkeypatch) -> tuple[dict, dict]:
    """A 2-step run's final evaluation: (the inputs each split was fingerprinted with, summary.json)."""
    keys = {}

    def recording(self, item, inputs, run):
        keys[item] = inputs()
        return GET_OR_RUN(self, item, inputs, run)

    monkeypatch.setattr(eval_resume.FinishedResults, "get_or_run", recording)
    run_dir = tmp_path / name
    rc = base_train.main(["--data-dir", str(data_dir), "--tokenizer-dir", str(tokenizer_dir), "--run-dir",
                          str(run_dir), "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len",
                          str(SEQ), "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "2",
                          "--eval-tokens", "128", "--eval-every", "-1", "--no-final-core", "--data-seed", str(seed),
                          "--device-type", "cpu"])
    assert rc == 0
    return keys, json.loads((run_dir / "summary.json").read_text())


def test_the_train_rows_and_their_fingerprint_follow_the_data_seed(tmp_path, data_dir, tiny_tokenizer_dir,
                                                                   monkeypatch):
    runs = {seed: _run(tmp_path, data_dir, tiny_tokenizer_dir, f"s{seed}", seed, monkeypatch) for seed in (1, 2)}
    keys = {seed: run_keys for seed, (run_keys, _) in runs.items()}
    assert all(summary["train_bpb"] > 0 for _, summary in runs.values())
    assert keys[1]["split val"] == keys[2]["split val"]
    assert keys[1]["split train"]["rows"] == "first read with --data-seed 1"
    assert keys[1]["split train"] != keys[2]["split train"]


def test_summary_and_base_eval_record_which_rows_the_train_bpb_read(tmp_path, data_dir, tiny_tokenizer_dir,
                                                                      monkeypatch):
    """Nothing said which rows a train bpb used (summary.json and bpb.json alike), while base_eval moved every
    checkpoint to the first-read rows: summary.json and bpb.json name them, and base_eval's train bpb on the run's
    last checkpoint is the one its training ended with, on the same rows."""
    from scripts import base_eval

    _, summary = _run(tmp_path, data_dir, tiny_tokenizer_dir, "s3", 3, monkeypatch)
    assert summary["train_bpb_rows"] == "first read with --data-seed 3"
    run_dir = tmp_path / "s3"
    assert base_eval.main(["--run", str(run_dir), "--eval", "bpb", "--splits", "train", "--eval-tokens", "128",
                           "--device-batch-size", "4", "--no-progress", "--device-type", "cpu"]) == 0
    bpb = json.loads((run_dir / "eval" / "step_000002" / "bpb.json").read_text())
    assert bpb["train_bpb_rows"] == summary["train_bpb_rows"]
    assert bpb["splits"]["train"] == pytest.approx(summary["train_bpb"], rel=1e-4)  # other batches: sums reorder
