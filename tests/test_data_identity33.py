"""Prepared-data identity (session 33): two preparations of one dataset that differ in a flag that changes the
documents or shards must not silently replace each other's data in one directory, a relative local hf: path names
the folder it resolves to, and a run records the dataset it trained on (the manifest's), not only --dataset.

Before: `prepare_data --dataset hf:X --split train` then `--split validation` (no --data-dir: `--split` is not part
of the default directory's name) rebuilt the second over the first without a word; base_eval's bpb and the analyses
of a run trained on the first then read the second (resume refused it, by data_sha256). The same for --text-column,
--max-docs, --val-fraction, --revision, --docs-per-shard, and for embedded/local's --doc-chars, --val-fraction,
--docs-per-shard and --text-dir (two local corpora shared `<root>/local`)."""
import json

import pytest

from nanochat.dataset import default_data_dir, hf_dir_name, iter_documents, load_manifest, manifest_fingerprint
from scripts.prepare_data import main


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "root"))
    return tmp_path / "root"


def _documents(data_dir) -> dict:
    return {split: list(iter_documents(data_dir, split)) for split in ("train", "val")}


def _hf_source(path):
    """A local dataset directory with a train and a validation split (the `datasets` json builder)."""
    path.mkdir(parents=True)
    for split, n in (("train", 40), ("validation", 20)):
        (path / f"{split}.jsonl").write_text("".join(json.dumps({"text": f"{split} {i}", "body": f"b{split} {i}"})
                                                     + "\n" for i in range(n)))
    return path


def test_an_hf_build_with_another_split_is_refused_not_built_over(root, tmp_path, capsys):
    src = _hf_source(tmp_path / "ds")
    spec = f"hf:{src}"
    out = default_data_dir(spec)
    assert main(["--dataset", spec, "--no-progress"]) == 0
    first, fingerprint = _documents(out), manifest_fingerprint(load_manifest(out))
    assert first["val"][0] == "train 19"
    capsys.readouterr()
    assert main(["--dataset", spec, "--split", "validation", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out} (the default directory of --dataset {spec}) holds --dataset {spec} prepared "
                          "with --split train; this build (--split validation) would replace it"), err
    assert "give this build a --data-dir of its own, or pass --overwrite to replace it" in err, err
    assert err.count("\n") == 1, err
    assert _documents(out) == first and manifest_fingerprint(load_manifest(out)) == fingerprint  # untouched
    # the same request again builds as before (an hf: build is streamed again: the same documents)
    assert main(["--dataset", spec, "--no-progress"]) == 0
    assert manifest_fingerprint(load_manifest(out)) == fingerprint
    # --overwrite replaces it, and records the new request
    assert main(["--dataset", spec, "--split", "validation", "--overwrite", "--no-progress"]) == 0
    assert load_manifest(out)["hf"]["split"] == "validation" and _documents(out)["val"] == ["validation 19"]


def test_every_document_changing_hf_flag_is_named_with_both_values(tmp_path, capsys):
    src = _hf_source(tmp_path / "ds")
    out = tmp_path / "out"
    base = ["--dataset", f"hf:{src}", "--data-dir", str(out), "--no-progress"]
    assert main(base) == 0
    capsys.readouterr()
    changed = ["--text-column", "body", "--max-docs", "30", "--val-fraction", "0.1", "--docs-per-shard", "7",
               "--revision", "main"]
    assert main(base + changed) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --data-dir {out} holds --dataset hf:{src} prepared with --text-column text "
                          "--max-docs none --val-fraction 0.05 --docs-per-shard 20000 --revision none; this build "
                          "(--text-column body --max-docs 30 --val-fraction 0.1 --docs-per-shard 7 --revision main) "
                          "would replace it"), err


def test_an_hf_build_recorded_before_docs_per_shard_was_recorded_is_compared_on_the_rest(tmp_path, capsys):
    src = _hf_source(tmp_path / "ds")
    out = tmp_path / "out"
    base = ["--dataset", f"hf:{src}", "--data-dir", str(out), "--no-progress"]
    assert main(base + ["--docs-per-shard", "9"]) == 0
    manifest = load_manifest(out)
    del manifest["hf"]["docs_per_shard"]  # a manifest written before this session
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert main(base) == 0  # its shard size is unknown: not compared
    assert main(base + ["--max-docs", "10"]) == 2
    assert "prepared with --max-docs none; this build (--max-docs 10)" in capsys.readouterr().err


def _local_source(path, n=40, prefix="p"):
    path.mkdir(parents=True)
    (path / "a.txt").write_text("\n\n".join(f"{prefix} paragraph {i}" for i in range(n)) + "\n")
    return path


def test_local_builds_with_other_flags_or_another_text_dir_are_refused(root, tmp_path, capsys):
    a, b = _local_source(tmp_path / "a"), _local_source(tmp_path / "b", prefix="q")
    out = root / "local"
    assert main(["--dataset", "local", "--text-dir", str(a), "--doc-chars", "10"]) == 0
    first = _documents(out)
    assert first["train"][0] == "p paragraph 0"
    capsys.readouterr()
    assert main(["--dataset", "local", "--text-dir", str(a), "--doc-chars", "10"]) == 0  # the same: kept
    assert "already prepared" in capsys.readouterr().out
    assert main(["--dataset", "local", "--text-dir", str(b), "--doc-chars", "10"]) == 2
    err = capsys.readouterr().err
    assert f"holds --dataset local prepared with --text-dir {a.resolve()}; this build (--text-dir {b.resolve()})" \
        in err, err
    assert main(["--dataset", "local", "--text-dir", str(a), "--doc-chars", "30"]) == 2
    assert "prepared with --doc-chars 10; this build (--doc-chars 30)" in capsys.readouterr().err
    assert _documents(out) == first
    # edited sources under the same flags are the same dataset, updated: built again, as before
    (a / "a.txt").write_text("\n\n".join(f"edited {i}" for i in range(40)) + "\n")
    assert main(["--dataset", "local", "--text-dir", str(a), "--doc-chars", "10"]) == 0
    assert _documents(out)["train"][0] == "edited 0"
    assert main(["--dataset", "local", "--text-dir", str(b), "--doc-chars", "10", "--overwrite"]) == 0
    assert _documents(out)["train"][0] == "q paragraph 0"


def test_a_data_dir_holding_another_dataset_is_refused(tmp_path, capsys):
    a = _local_source(tmp_path / "a")
    out = tmp_path / "out"
    assert main(["--dataset", "local", "--text-dir", str(a), "--doc-chars", "10", "--data-dir", str(out)]) == 0
    first = _documents(out)
    capsys.readouterr()
    src = _hf_source(tmp_path / "ds")
    assert main(["--dataset", f"hf:{src}", "--data-dir", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --data-dir {out} holds --dataset local; this build (--dataset hf:{src}) would "
                          "replace it"), err
    assert _documents(out) == first


# ---- a relative local hf: path -----------------------------------------------------------------------------
def test_a_relative_local_hf_path_has_a_default_dir_per_folder_it_resolves_to(root, tmp_path, monkeypatch):
    one, two = tmp_path / "one", tmp_path / "two"
    for where, n in ((one, 40), (two, 60)):
        data = where / "data" / "x"
        data.mkdir(parents=True)
        (data / "train.jsonl").write_text("".join(json.dumps({"text": f"{where.name} {i}"}) + "\n"
                                                  for i in range(n)))
    dirs = {}
    for where in (one, two):
        monkeypatch.chdir(where)
        dirs[where] = default_data_dir("hf:data/x")
        assert dirs[where] == root / hf_dir_name(str((where / "data" / "x").resolve()))
        assert main(["--dataset", "hf:data/x", "--no-progress"]) == 0
        assert load_manifest(dirs[where])["hf"]["local_path"] == str((where / "data" / "x").resolve())
    assert dirs[one] != dirs[two]
    assert _documents(dirs[one])["train"][0] == "one 0" and _documents(dirs[two])["train"][0] == "two 0"
    # where no such folder exists, hf:data/x is the hub dataset data/x
    monkeypatch.chdir(tmp_path)
    assert default_data_dir("hf:data/x") == root / "hf-data--x"


def test_a_relative_local_hf_path_prepared_under_its_text_name_is_still_found(root, tmp_path, monkeypatch):
    from data_fixtures import write_numbered_docs

    (tmp_path / "data" / "x").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    legacy = root / "hf-data--x"  # the name `hf:data/x` had before: no local_path recorded
    legacy.mkdir(parents=True)
    write_numbered_docs(legacy, 20, row_group_size=8, val_docs=4, dataset="hf:data/x")
    assert default_data_dir("hf:data/x") == legacy
    # one recording another folder's path is that folder's: not this one's
    manifest = load_manifest(legacy)
    manifest["hf"] = {"path": "data/x", "local_path": str(tmp_path / "elsewhere" / "data" / "x")}
    (legacy / "manifest.json").write_text(json.dumps(manifest))
    assert default_data_dir("hf:data/x") == root / hf_dir_name(str((tmp_path / "data" / "x").resolve()))
    manifest["hf"]["local_path"] = str((tmp_path / "data" / "x").resolve())
    (legacy / "manifest.json").write_text(json.dumps(manifest))
    assert default_data_dir("hf:data/x") == legacy


# ---- what a run records ------------------------------------------------------------------------------------
def test_a_run_records_the_dataset_it_trained_on(tmp_path):
    """docs/extending.md's flow: the embedded corpus prepared into a --data-dir, trained with the default --dataset
    (fineweb-edu). meta.json's "dataset" said fineweb-edu; it is the manifest's now, config.json's "data" records it
    too, --dataset stays in config.json's args, and the report names the data trained on."""
    from data_fixtures import train_tiny_tokenizer, write_numbered_docs

    from nanochat import checkpoint as ckpt
    from nanochat import report
    from scripts import base_train

    data = tmp_path / "data"
    data.mkdir()
    write_numbered_docs(data, 40, row_group_size=8, val_docs=8, dataset="embedded")
    tok = tmp_path / "tok"
    train_tiny_tokenizer(data, tok, vocab_size=280)
    run = tmp_path / "run"
    assert base_train.main(["--data-dir", str(data), "--tokenizer-dir", str(tok), "--depth", "1", "--aspect-ratio",
                            "32", "--head-dim", "32", "--max-seq-len", "32", "--eval-tokens", "128",
                            "--eval-every", "-1", "--no-final-core", "--device-batch-size", "2",
                            "--total-batch-size", "64", "--num-iterations", "1", "--run-dir", str(run)]) == 0
    meta = ckpt.load_meta(run, ckpt.list_steps(run)[-1])
    config = json.loads((run / "config.json").read_text())
    assert meta["dataset"] == "embedded" and config["data"]["dataset"] == "embedded"
    assert config["args"]["dataset"] == "fineweb-edu"  # the flag as given
    row = [line for line in report.run_report(run).splitlines() if line.startswith("| data | ")]
    assert row == [f"| data | embedded in `{data.resolve()}` (source: test; --dataset fineweb-edu) |"], row
