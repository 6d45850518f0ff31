"""A checkpoint's recorded training flags (meta "config" -> "args") are read through one helper,
nanochat.checkpoint.recorded_run_args: a meta without them (an imported run), or with "args": null, reads as no
flags recorded, in base_eval and the analyses alike, never as an AttributeError."""

import pytest

NO_FLAGS = [{}, {"config": None}, {"config": {}}, {"config": {"args": None}}, {"config": {"args": {}}}]


@pytest.mark.parametrize("meta", NO_FLAGS)
def test_a_checkpoint_that_records_no_flags_reads_as_none_recorded(meta):
    from nanochat.analysis import train_rows_order
    from scripts.base_eval import PAPER_EVAL_TOKENS, check_not_synthetic, eval_dtype, eval_tokens_of

    assert eval_tokens_of("run", meta) == (PAPER_EVAL_TOKENS, "default (the checkpoint does not record --eval-tokens)")
    assert eval_dtype("run", meta, "cpu") == ("float32", "default for this device (the checkpoint does not record one)")
    check_not_synthetic(meta, "this run")  # nothing recorded: not refused
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
