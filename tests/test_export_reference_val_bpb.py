"""The val_bpb that export_reference writes into their meta is the one measured at the exported step (session 32).

base_train's checkpoint meta keeps the last PERIODIC val bpb under loop.val_bpb: at the final step that is an earlier
step's (the final evaluation's number goes to metrics.jsonl and summary.json), or None with --eval-every -1. Their
meta_<step>.json pairs val_bpb with its step, so the export takes the metrics.jsonl record of that step."""

import json

import pytest

from reference_fixtures import make_their_files
from nanochat.checkpoint import save_checkpoint
from scripts import export_reference


def export_meta(tmp_path, loop_val, records):
    """Export a step-12 checkpoint of ours whose meta holds loop.val_bpb = loop_val, beside a metrics.jsonl of
    ``records`` (None: no metrics.jsonl); returns their meta."""
    _, source, _ = make_their_files(tmp_path, "base")
    run = tmp_path / "ours"
    save_checkpoint(run, 12, source, {"tokenizer_dir": str(tmp_path / "our_tok"), "loop": {"val_bpb": loop_val}})
    if records is not None:
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "export"
    assert export_reference.main(["--run", str(run), "--out", str(out)]) == 0
    return json.loads((out / "base_checkpoints" / "d4" / "meta_000012.json").read_text())


TRAIN = {"kind": "train", "step": 11, "loss": 3.0}


@pytest.mark.parametrize("records, expected", [
    # the last step: periodic eval at 10, the final evaluation at 12 (what base_train logs)
    ([{"kind": "eval", "step": 10, "val_bpb": 0.9}, TRAIN, {"kind": "final", "step": 12, "val_bpb": 0.8}], 0.8),
    # a periodic checkpoint evaluated at its own step
    ([{"kind": "eval", "step": 12, "val_bpb": 0.85}, TRAIN], 0.85),
    # no val bpb measured at step 12 (e.g. a save between evals): none, rather than step 10's
    ([{"kind": "eval", "step": 10, "val_bpb": 0.9}, TRAIN], None),
])
def test_export_writes_the_val_bpb_of_the_exported_step(tmp_path, records, expected):
    assert export_meta(tmp_path, 0.9, records)["val_bpb"] == expected


def test_a_run_without_metrics_keeps_the_checkpoints_val_bpb(tmp_path):
    assert export_meta(tmp_path, 0.9, None)["val_bpb"] == 0.9
