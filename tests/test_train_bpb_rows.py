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
