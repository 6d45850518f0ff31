"""The analyses' train domain reads the documents the run's loader read first (its recorded --data-seed), as the
final train bpb and base_eval do; --train-rows manifest keeps the split's first documents; the outputs say which."""

import json

import pytest
import torch

from data_fixtures import write_numbered_docs
from test_analysis import make_run

SEED = 7


@pytest.fixture
def run_on_data(tmp_path):
    """A tiny MoME checkpoint whose meta names a data dir of 8 row groups (so epoch 0's permutation moves them) and,
    like base_train's, its --data-seed; the same model saved again without the seed (as an imported run)."""
    from nanochat.checkpoint import save_checkpoint

    (tmp_path / "data").mkdir()
    data = write_numbered_docs(tmp_path / "data", 800, 100, 100)
    run, model, tok = make_run(tmp_path, "mome")
    meta = {"tokenizer_dir": str(tmp_path / "tok"), "data_dir": str(data)}
    save_checkpoint(run, 1, model, {**meta, "config": {"args": {"data_seed": SEED, "seed": 0}}})
    imported = tmp_path / "imported"
    save_checkpoint(imported, 1, model, meta)
    return run, imported, model, tok, data


def _split_rows(data, tok, first_read_seed, tokens=512):
    from nanochat.dataloader import build_eval_rows

    return build_eval_rows(data, "train", tok, 64, tokens, first_read_seed=first_read_seed)[:, :-1]


def test_train_domain_rows_are_the_runs_first_read_documents(run_on_data):
    from nanochat.analysis import build_domains, train_rows_order
    from nanochat.checkpoint import load_model

    run, imported, _, tok, data = run_on_data
    meta = load_model(run, 1)[1]
    first_read, manifest = _split_rows(data, tok, SEED), _split_rows(data, tok, None)
    assert not torch.equal(first_read, manifest)  # the check below can tell the two orders apart

    def domain(order):
        (train,) = build_domains(["train"], tok, 64, data_dir=data, max_tokens=512, train_rows=order)
        return torch.stack(train.rows), train.order

    assert train_rows_order("run", meta) == (SEED, f"first read with --data-seed {SEED}")
    rows, order = domain(train_rows_order("run", meta))
    assert torch.equal(rows, first_read) and order == f"first read with --data-seed {SEED}"
    rows, order = domain(train_rows_order("manifest", meta))
    assert torch.equal(rows, manifest) and order == "manifest order (--train-rows manifest)"
    rows, order = domain(train_rows_order("run", load_model(imported, 1)[1]))
    assert torch.equal(rows, manifest) and order == "manifest order (no --data-seed recorded)"
    (val,) = build_domains(["val"], tok, 64, data_dir=data, max_tokens=512, train_rows=train_rows_order("run", meta))
    assert val.order == "manifest order"


@pytest.mark.parametrize("flag,rows_seed,order", [([], SEED, f"first read with --data-seed {SEED}"),
                                                  (["--train-rows", "manifest"], None,
                                                   "manifest order (--train-rows manifest)")])
def test_analyze_memory_reads_and_records_the_train_rows(run_on_data, tmp_path, capsys, flag, rows_seed, order):
    """memory_use.json's train gates are those of the rows the flag names (the same forwards: equal exactly) and
    its "split_rows" says which rows they are."""
    from nanochat.analysis import Domain
    from scripts import analyze_memory

    run, _, model, tok, data = run_on_data
    out = tmp_path / "out"
    assert analyze_memory.main(["--run", str(run), "--corpus", "train", "val", "--max-tokens", "512",
                                "--batch-size", "2", "--no-progress", "--out-dir", str(out), *flag]) == 0
    assert f"train rows: {order}" in capsys.readouterr().out
    res = json.loads((out / "memory_use.json").read_text())
    assert res["split_rows"] == {"train": order, "val": "manifest order"}
    want = analyze_memory.memory_use(model.eval(), [Domain("train", list(_split_rows(data, tok, rows_seed)), "split")],
                                     2, tok.bos_token_id, progress=False)
    assert res["domains"]["train"] == want["train"]


def test_analyze_routing_records_the_rows_of_a_train_reference(run_on_data, tmp_path, capsys):
    from scripts import analyze_routing

    run, imported, _, _, _ = run_on_data
    for run_dir, order in ((run, f"first read with --data-seed {SEED}"),
                           (imported, "manifest order (no --data-seed recorded)")):
        out = tmp_path / run_dir.name
        assert analyze_routing.main(["--run", str(run_dir), "--corpus", "val", "--reference", "train",
                                     "--max-tokens", "256", "--no-progress", "--out-dir", str(out)]) == 0
        assert f"train rows: {order}" in capsys.readouterr().out
        res = json.loads((out / "routing_audit.json").read_text())
        assert res["split_rows"] == {"val": "manifest order", "train": order} and res["reference"] == "train"
