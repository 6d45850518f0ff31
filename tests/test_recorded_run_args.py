"""A checkpoint's recorded training flags (meta "config" -> "args") are read through one helper,
nanochat.checkpoint.recorded_run_args: a meta without them (an imported run), or with "args": null, reads as no
flags recorded, in base_eval and the analyses alike, never as an AttributeError."""

import pytest

NO_FLAGS = [{}, {"config": None}, {"config": {}}, {"config": {"args": None}}, {"config": {"args": {}}}]


@pytest.mark.parametrize("meta", NO_FLAGS)
def test_a_checkpoint_that_records_no_flags_reads_as_none_recorded(meta):
    from nanochat.analysis import train_rows_order
    from nanochat.checkpoint import check_not_synthetic
    from scripts.base_eval import PAPER_EVAL_TOKENS, eval_dtype, eval_tokens_of

    assert eval_tokens_of("run", meta) == (PAPER_EVAL_TOKENS, "default (the checkpoint does not record --eval-tokens)")
    assert eval_dtype("run", meta, "cpu") == ("float32", "default for this device (the checkpoint does not record one)")
    check_not_synthetic(meta, "this run", "why", "evaluate")  # nothing recorded: not refused
    # no --data-seed recorded (an imported run): the train split's first documents, as base_eval's train rows
    assert train_rows_order("run", meta)[0] is None


def test_recorded_flags_are_read():
    from nanochat.analysis import train_rows_order
    from nanochat.checkpoint import recorded_run_args
    from scripts.base_eval import eval_tokens_of

    meta = {"config": {"args": {"data_seed": 7, "eval_tokens": 65536}}}
    assert recorded_run_args(meta) == {"data_seed": 7, "eval_tokens": 65536}
    assert all(recorded_run_args(m) == {} for m in NO_FLAGS)
    assert train_rows_order("run", meta)[0] == 7
    assert eval_tokens_of("run", meta) == (65536, "the run's --eval-tokens (its checkpoint)")
    # a run of a seed but no --data-seed key at all (older config): no seed recorded
    assert train_rows_order("run", {"config": {"args": {"seed": 3}}})[0] is None


# config.json (and meta.json "config") with "args": null, as a hand edit or another tool writes it: each reader a
# user reaches reads it as no flags recorded (nanochat.cli_types.recorded_args), where .get("args", {}) gave None


def write_json(path, obj):
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_the_report_of_a_run_that_records_null_args_says_not_recorded(tmp_path):
    from nanochat import report

    write_json(tmp_path / "config.json", {"args": None, "model_config": {"memory": "base"}, "plan": None})
    write_json(tmp_path / "summary.json", {"stop_reason": "completed", "step": 4, "num_iterations": 4})
    facts = report.run_facts(tmp_path)
    assert (facts["args"], facts["plan"], facts["run_name"]) == ({}, {}, tmp_path.name)
    md = report.run_report(tmp_path)
    assert "| initial weights | random init (--seed n/a) |" in md
    assert "| batch | n/a tokens per step, sequence length n/a |" in md


def test_init_from_a_source_that_records_null_args_adds_no_data_order_note():
    import argparse

    from nanochat.init_from import same_data_order_note

    meta = {"config": {"args": None}, "data_sha256": "abc"}
    assert same_data_order_note(meta, argparse.Namespace(seed=42, data_seed=None), "abc") == ""
    meta = {"config": {"args": {"seed": 42, "data_seed": None}}, "data_sha256": "abc"}  # the note, for contrast
    assert "same data and data seed (42)" in same_data_order_note(meta, argparse.Namespace(seed=42, data_seed=None),
                                                                   "abc")


def test_base_eval_run_defaults_pass_over_a_config_json_with_null_args(tmp_path):
    """--eval-tokens run and --bundle/--max-per-task run: a config.json of "args": null is passed over for the
    checkpoint's record, and its "data" bundle (what the search order found) still counts."""
    from nanochat.eval_bundle import run_core_inputs
    from scripts.base_eval import eval_tokens_of

    write_json(tmp_path / "config.json", {"args": None, "data": {"bundle": "subset"}})
    meta = {"config": {"args": {"eval_tokens": 65536, "core_max_per_task": 8}}}
    assert eval_tokens_of("run", meta, tmp_path) == (65536, "the run's --eval-tokens (its checkpoint)")
    inputs = run_core_inputs("run", "run", meta, tmp_path)
    assert (inputs.bundle, inputs.bundle_source) == ("subset", "the run's bundle, its config.json")
    assert (inputs.max_per_task, inputs.max_per_task_source) == (8, "the run's --core-max-per-task, its checkpoint")
    inputs = run_core_inputs("run", "run", {"config": {"args": None}})  # records nothing: the defaults, said so
    assert (inputs.bundle, inputs.max_per_task) == (None, -1)
    assert inputs.max_per_task_source == "default: the run records no --core-max-per-task"


def test_results_reads_a_seed_whose_config_records_null_args_as_one_without_config(tmp_path):
    from nanochat.row_config import find_configs, load_row_config
    from scripts.results import flag_differences

    write_json(tmp_path / "config.json", {"args": None})
    assert flag_differences(load_row_config(find_configs()[0]), tmp_path) == []
