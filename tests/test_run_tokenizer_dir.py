"""nanochat.analysis.run_tokenizer_dir: the one rule by which base_eval, the analyses and export_reference find a
run's tokenizer directory, with the source base_eval prints."""

from pathlib import Path

from nanochat.analysis import run_tokenizer_dir


def test_flag_then_meta_then_recorded_flag_then_default(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOCHAT_TOKENIZER_DIR", str(tmp_path / "default"))
    meta = {"tokenizer_dir": "/runs/a/tok", "config": {"args": {"tokenizer_dir": "/old/tok"}}}
    assert run_tokenizer_dir("/flag/tok", meta) == (Path("/flag/tok"), "--tokenizer-dir")
    assert run_tokenizer_dir(None, meta) == (Path("/runs/a/tok"), "checkpoint meta 'tokenizer_dir'")
    # a checkpoint saved before meta.json recorded the directory: the training flag it records
    older = {"config": {"args": {"tokenizer_dir": "/old/tok"}}}
    assert run_tokenizer_dir(None, older) == (
        Path("/old/tok"), "the run's recorded --tokenizer-dir (no 'tokenizer_dir' in meta.json)")
    default = (tmp_path / "default", "default (no --tokenizer-dir and no 'tokenizer_dir' in meta.json)")
    for meta in ({}, {"config": None}, {"config": {"args": None}}, {"config": {"args": {"tokenizer_dir": None}}},
                 {"tokenizer_dir": ""}):
        assert run_tokenizer_dir("", meta) == default, meta
