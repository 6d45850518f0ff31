import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_fixtures import embedded_data_dir  # noqa: F401 (fixture)

from nanochat.dataset import (DataError, iter_documents, load_manifest, remote_shard_plan, split_files,
                              validate_parquet)
from scripts.prepare_data import build_text_dataset, local_sources, main, split_paragraph_documents


def test_embedded_manifest_and_disjoint_split(embedded_data_dir):  # noqa: F811
    m = load_manifest(embedded_data_dir)
    assert m["dataset"] == "embedded" and m["train"] and m["val"]
    assert not set(m["train"]) & set(m["val"])
    for name in m["train"] + m["val"]:
        path = embedded_data_dir / name
        assert m["shards"][name] == {"rows": pq.ParquetFile(path).metadata.num_rows, "bytes": path.stat().st_size}
    train, val = list(iter_documents(embedded_data_dir, "train")), list(iter_documents(embedded_data_dir, "val"))
    assert len(train) == m["documents"]["train"] and len(val) == m["documents"]["val"]
    assert not set(train) & set(val)
    # 11 source files, each contributes its last 5% (>= 1 doc) to val
    assert 11 <= len(val) < 0.07 * (len(train) + len(val))
    assert sum(len(d) for d in train) > 5_000_000


def test_split_follows_manifest_not_file_names(tmp_path):
    docs = [f"document number {i}" for i in range(4)]
    for name, chunk in (("a.parquet", docs[:2]), ("z.parquet", docs[2:])):
        pq.write_table(pa.table({"text": chunk}), tmp_path / name)
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"dataset": "x", "train": ["z.parquet"], "val": ["a.parquet"], "shards": {}}))
    assert [p.name for p in split_files(tmp_path, "val")] == ["a.parquet"]
    assert list(iter_documents(tmp_path, "train")) == docs[2:]


def test_paragraph_grouping():
    text = "p1 aaaa\n\np2 bbbb\n\n\n\np3 cccc\r\n\r\np4 " + "d" * 50
    assert split_paragraph_documents(text, 20) == ["p1 aaaa\n\np2 bbbb", "p3 cccc", "p4 " + "d" * 50]
    assert split_paragraph_documents(text, 1000) == ["p1 aaaa\n\np2 bbbb\n\np3 cccc\n\np4 " + "d" * 50]


def test_local_dataset_txt_jsonl_parquet(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("\n\n".join(f"txt paragraph {i}" for i in range(20)))
    (src / "b.jsonl").write_text("\n".join(json.dumps({"text": f"json doc {i}", "id": i}) for i in range(20)))
    pq.write_table(pa.table({"text": [f"parquet doc {i}" for i in range(20)]}), src / "c.parquet")
    (src / "ignored.md").write_text("not used")
    out = tmp_path / "out"
    assert main(["--dataset", "local", "--text-dir", str(src), "--data-dir", str(out), "--doc-chars", "10"]) == 0
    train, val = list(iter_documents(out, "train")), list(iter_documents(out, "val"))
    assert len(train) + len(val) == 60 and len(val) == 3  # ceil(5% of 20) per file
    assert val == ["txt paragraph 19", "json doc 19", "parquet doc 19"]


def test_bad_local_inputs_give_clear_errors(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--dataset", "local", "--text-dir", str(empty), "--data-dir", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no input files")
    assert main(["--dataset", "local", "--data-dir", str(tmp_path / "o")]) == 1
    assert "--text-dir" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(pa.table({"content": ["x", "y"]}), bad / "wrong.parquet")
    with pytest.raises(DataError, match=r"wrong.parquet has no 'text' column"):
        build_text_dataset(local_sources(bad), tmp_path / "o2", "local", str(bad))
    (bad / "wrong.parquet").unlink()
    (bad / "x.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"x.jsonl:2: expected a JSON object with a 'text' field"):
        build_text_dataset(local_sources(bad), tmp_path / "o2", "local", str(bad))
    assert not (tmp_path / "o2" / "manifest.json").exists()


def test_validate_parquet_rejects_corrupt_and_empty(tmp_path):
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match="junk.parquet is not a readable parquet file"):
        validate_parquet(tmp_path / "junk.parquet")
    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(DataError, match="empty.parquet has 0 rows"):
        validate_parquet(tmp_path / "empty.parquet")


def test_missing_manifest_or_shard(tmp_path, embedded_data_dir):  # noqa: F811
    with pytest.raises(DataError, match="prepare_data --dataset embedded"):
        split_files(tmp_path, "train")
    (tmp_path / "manifest.json").write_text((embedded_data_dir / "manifest.json").read_text())
    with pytest.raises(DataError, match="train_00000.parquet listed in the manifest is missing"):
        split_files(tmp_path, "train")


def test_remote_shard_plans():
    train, val = remote_shard_plan("fineweb-edu", 371)
    assert val == 369 and 369 not in train and train == list(range(369)) + [370, 371]
    assert remote_shard_plan("fineweb-edu", 3) == ([0, 1, 2], 369)
    assert remote_shard_plan("climbmix", 2) == ([0, 1], 6542)
    assert remote_shard_plan("fineweb-edu", 1822)[0][-1] == 1822
    with pytest.raises(ValueError, match="--num-shards must be in 1..1822"):
        remote_shard_plan("fineweb-edu", 1823)
    with pytest.raises(ValueError, match="--dataset 'nope'"):
        remote_shard_plan("nope", 1)
