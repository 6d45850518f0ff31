import json
import math
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

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


def test_files_too_small_for_a_val_document_of_their_own_give_the_val_fraction_together(tmp_path):
    """A file of n documents gives its last ceil(n f) to val: with files of 1-2 documents (an article per file)
    --val-fraction 0.05 gave 50% val (1 of 2 each) or none (1 each). Files with n f < 1 now give ceil(N f) of their N
    documents together, one in every 1/f counted from the last; a lone small file still gives its last document."""
    src = tmp_path / "src"
    src.mkdir()
    pooled = []
    for i in range(60):  # 40 files of 2 documents, 20 of 1, in sorted order f00..f59
        docs = [f"file {i} doc {j}" for j in range(2 if i < 40 else 1)]
        (src / f"f{i:02d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        pooled += docs
    (src / "z_big.jsonl").write_text("".join(json.dumps({"text": f"big {j}"}) + "\n" for j in range(30)))
    out = tmp_path / "out"
    assert main(["--dataset", "local", "--text-dir", str(src), "--data-dir", str(out)]) == 0
    val = list(iter_documents(out, "val"))
    # the 100 documents of the small files give 5, the 20th from the end and so on; the big file keeps its last 2
    assert val == ["file 9 doc 1", "file 19 doc 1", "file 29 doc 1", "file 39 doc 1", "file 59 doc 0", "big 28",
                   "big 29"]
    assert pooled[19::20] == val[:5]
    assert len(val) == 7 and load_manifest(out)["documents"] == {"train": 123, "val": 7}
    assert not set(val) & set(iter_documents(out, "train"))
    # one small file alone (3 paragraphs): its last document, as before
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("one paragraph\n\nanother paragraph\n\nand a third\n")
    assert main(["--dataset", "local", "--text-dir", str(tmp_path / "one"), "--data-dir", str(tmp_path / "o1"),
                 "--doc-chars", "10"]) == 0
    assert list(iter_documents(tmp_path / "o1", "val")) == ["and a third"]


def test_a_rerun_of_the_same_local_build_keeps_it(tmp_path, capsys):
    """speedrun.sh runs prepare_data on every start: the same sources and flags into a directory holding their
    complete build keep it (the CPU demo rebuilt the embedded corpus each time); anything else builds again."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))
    flags = ["--dataset", "local", "--text-dir", str(src), "--data-dir", str(out)]

    def prepare(*extra) -> bool:
        """Run it; True when it kept the build (the shards are the same files, untouched)."""
        before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.parquet")}
        assert main([*flags, *extra]) == 0
        kept = "already prepared in" in capsys.readouterr().out
        after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.parquet")}
        assert kept == (bool(before) and before == after), (before, after)
        return kept

    assert not prepare() and prepare()
    assert not prepare("--doc-chars", "5", "--overwrite")  # other flags: another dataset (refused without it)
    assert prepare("--doc-chars", "5") and not prepare("--overwrite")  # and back
    assert not prepare("--rebuild")
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(41)))
    assert not prepare() and load_manifest(out)["documents"] == {"train": 38, "val": 3}  # the sources changed
    (out / load_manifest(out)["val"][0]).unlink()  # a partial directory is never kept
    assert not prepare() and prepare()
    (out / "manifest.json").unlink()  # what a build stopped midway leaves
    assert not prepare()
    pq.write_table(pa.table({"text": ["another document"]}), out / load_manifest(out)["train"][0])  # overwritten
    assert not prepare() and prepare()


def test_bad_local_inputs_give_clear_errors(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    # bad input exits 2 with one line, as in every entry point (prepare_data exited 1 before session 20)
    assert main(["--dataset", "local", "--text-dir", str(empty), "--data-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no input files")
    assert main(["--dataset", "local", "--data-dir", str(tmp_path / "o")]) == 2
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


# ---- hf:ORG/NAME through `datasets`, on local dataset directories (no network) -------------------------------
def test_val_docs_are_an_exact_evenly_spread_fraction():
    from scripts.prepare_data import is_val_doc

    for f, n in ((0.05, 1000), (0.1, 95), (1 / 3, 100), (0.5, 7)):
        picks = [i for i in range(n) if is_val_doc(i, f)]
        assert len(picks) == math.floor(n * f + 1e-9)
        assert all(b - a in (math.floor(1 / f), math.ceil(1 / f)) for a, b in zip(picks, picks[1:]))
    assert [i for i in range(60) if is_val_doc(i, 0.05)] == [19, 39, 59]


def test_hf_dataset_streams_a_local_parquet_dataset(tmp_path):
    src = tmp_path / "my_dataset" / "data"
    src.mkdir(parents=True)
    texts = [f"document {i}" for i in range(30)]
    rows = texts[:10] + ["", None] + texts[10:]  # an empty and a missing text are skipped, not documents
    pq.write_table(pa.table({"content": rows, "id": list(range(32))}), src / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"content": [f"document {i}" for i in range(30, 60)], "id": list(range(30))}),
                   src / "train-00001-of-00002.parquet")
    out = tmp_path / "out"
    spec = f"hf:{tmp_path / 'my_dataset'}"
    assert main(["--dataset", spec, "--text-column", "content", "--max-docs", "45", "--docs-per-shard", "10",
                 "--data-dir", str(out), "--no-progress"]) == 0
    m = load_manifest(out)
    train, val = list(iter_documents(out, "train")), list(iter_documents(out, "val"))
    assert val == ["document 19", "document 39"]  # documents 19 and 39 of the stream: one in 20
    assert train == [f"document {i}" for i in range(45) if i not in (19, 39)]
    assert m["train"] == [f"train_{i:05d}.parquet" for i in range(5)] and m["val"] == ["val_00000.parquet"]
    assert [m["shards"][n]["rows"] for n in m["train"]] == [10, 10, 10, 10, 3]
    assert m["dataset"] == spec and m["documents"] == {"train": 43, "val": 2}
    assert m["hf"] == {"path": str(tmp_path / "my_dataset"), "config": None, "split": "train", "revision": None,
                       "text_column": "content", "max_docs": 45, "val_fraction": 0.05, "docs_per_shard": 10,
                       "skipped_rows": 2, "local_path": str((tmp_path / "my_dataset").resolve())}
    # deterministic: a second run writes the same documents in the same shards
    assert main(["--dataset", spec, "--text-column", "content", "--max-docs", "45", "--docs-per-shard", "10",
                 "--data-dir", str(tmp_path / "again"), "--no-progress"]) == 0
    assert list(iter_documents(tmp_path / "again", "train")) == train


def test_hf_dataset_json_split_and_clear_errors(tmp_path, capsys):
    src = tmp_path / "jds"
    src.mkdir()
    (src / "train.jsonl").write_text("".join(json.dumps({"text": f"train {i}"}) + "\n" for i in range(10)))
    (src / "test.jsonl").write_text("".join(json.dumps({"text": f"test {i}"}) + "\n" for i in range(10)))
    out = tmp_path / "out"
    assert main(["--dataset", f"hf:{src}", "--split", "test", "--val-fraction", "0.25", "--data-dir", str(out),
                 "--no-progress"]) == 0
    assert list(iter_documents(out, "val")) == ["test 3", "test 7"]
    assert main(["--dataset", f"hf:{src}", "--text-column", "body", "--data-dir", str(tmp_path / "x"),
                 "--no-progress"]) == 2
    assert "no column 'body' (columns: ['text']); pick one with --text-column" in capsys.readouterr().err
    assert main(["--dataset", f"hf:{src}", "--split", "nope", "--data-dir", str(tmp_path / "y"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --dataset hf:{src} --split nope: cannot open the dataset") and "nope" in err
    assert main(["--dataset", f"hf:{src}", "--max-docs", "3", "--data-dir", str(tmp_path / "z"),
                 "--no-progress"]) == 2  # 3 documents at 5%: no val document
    assert "3 train and 0 val documents" in capsys.readouterr().err
    assert not (tmp_path / "z" / "manifest.json").exists()


def test_dataset_names_and_default_dirs(monkeypatch, tmp_path):
    import argparse

    from nanochat.dataset import check_dataset_name, default_data_dir
    from nanochat.train_args import parse_args

    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path))
    assert default_data_dir("hf:HuggingFaceFW/fineweb-edu:sample-10BT") == tmp_path / "hf-HuggingFaceFW--fineweb-edu--sample-10BT"
    assert default_data_dir("embedded") == tmp_path / "embedded"
    assert check_dataset_name("hf:a/b") == "hf:a/b"
    for bad in ("hf:", "fineweb", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="hf:ORG/NAME"):
            check_dataset_name(bad)
    assert parse_args(["--dataset", "hf:roneneldan/TinyStories", "--synthetic-data"]).dataset == "hf:roneneldan/TinyStories"


def test_hf_dataset_undecodable_rows_give_a_clear_error(tmp_path, capsys):
    src = tmp_path / "mixed"
    src.mkdir()
    (src / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n")
    (src / "b.jsonl").write_text(json.dumps({"text": "two", "extra": 1}) + "\n")  # a schema the first file lacks
    assert main(["--dataset", f"hf:{src}", "--data-dir", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --dataset hf:{src} --split train: reading the stream failed after 1 rows")
    assert err.count("\n") == 1 and not (tmp_path / "o" / "manifest.json").exists()


def test_failed_rerun_leaves_no_manifest_describing_a_mix_of_shards(tmp_path, capsys):
    """A re-run into an existing --data-dir that fails midway (a dropped stream) had overwritten shards the OLD
    manifest still listed: val documents of one run showed up as train documents of the other."""
    src = tmp_path / "ds"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(100)))
    out = tmp_path / "out"
    args = ["--dataset", f"hf:{src}", "--docs-per-shard", "10", "--data-dir", str(out), "--no-progress"]
    assert main(args + ["--val-fraction", "0.5"]) == 0
    (src / "b.jsonl").write_text(json.dumps({"text": "x", "extra": 1}) + "\n")  # the stream breaks after 100 rows
    assert main(args + ["--val-fraction", "0.05", "--overwrite"]) == 2  # another --val-fraction: refused without
    capsys.readouterr()
    with pytest.raises(DataError, match="manifest.json not found: prepare the data first"):
        split_files(out, "train")
    (src / "b.jsonl").unlink()
    assert main(args + ["--val-fraction", "0.05"]) == 0  # a successful re-run: only its own shards remain
    m = load_manifest(out)
    assert sorted(p.name for p in out.glob("*.parquet")) == sorted(m["train"] + m["val"])
    assert not set(iter_documents(out, "train")) & set(iter_documents(out, "val"))


def test_a_shard_changed_after_the_manifest_is_refused(tmp_path, embedded_data_dir):  # noqa: F811
    import shutil

    data = tmp_path / "d"
    shutil.copytree(embedded_data_dir, data)
    name = load_manifest(data)["train"][0]
    pq.write_table(pa.table({"text": ["a different document"]}), data / name)
    with pytest.raises(DataError, match=f"{name} has .* bytes, the manifest says .*; re-run scripts.prepare_data"):
        split_files(data, "train")


def test_data_dir_inside_text_dir_is_not_read_back(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))
    out = src / "prepared"
    for again in ([], ["--rebuild"]):  # the second build must not read the first one's shards as input
        assert main(["--dataset", "local", "--text-dir", str(src), "--data-dir", str(out), *again]) == 0
        assert load_manifest(out)["documents"] == {"train": 38, "val": 2}
    with pytest.raises(DataError, match="--data-dir .* is --text-dir"):
        build_text_dataset(local_sources(src, data_dir=src), src, "local", str(src))


def test_data_dir_above_text_dir_reads_the_inputs(tmp_path):
    """--data-dir data --text-dir data/raw: the shards land beside raw/, not among the inputs, so the inputs are read
    (every one of them lies under --data-dir, and all were left out: "no input files")."""
    src = tmp_path / "data" / "raw"
    src.mkdir(parents=True)
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))
    (src / "b.txt").symlink_to(tmp_path / "data" / "train_00000.parquet")  # a link to the output is still left out
    out = tmp_path / "data"
    assert local_sources(src, data_dir=out) == [src / "a.jsonl"]
    for again in ([], ["--rebuild"]):
        assert main(["--dataset", "local", "--text-dir", str(src), "--data-dir", str(out), *again]) == 0
        assert load_manifest(out)["documents"] == {"train": 38, "val": 2}


def test_local_sources_with_null_or_non_text_rows_and_bad_encoding(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"text": ["doc a", None, "doc b", "doc c"]}), src / "a.parquet")
    (src / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["doc d", None, 7, "doc e", "doc f"]))
    out = tmp_path / "out"
    assert main(["--dataset", "local", "--text-dir", str(src), "--data-dir", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{src / 'a.parquet'}: skipped 1 row" in err and f"{src / 'b.jsonl'}: skipped 2 rows" in err
    assert sorted([*iter_documents(out, "train"), *iter_documents(out, "val")]) == [f"doc {c}" for c in "abcdef"]
    (src / "c.txt").write_bytes("caf\xe9 latin-1 text\n\nmore".encode("latin-1"))
    assert main(["--dataset", "local", "--text-dir", str(src), "--data-dir", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"error: {src / 'c.txt'} is not UTF-8 text") and err[0].startswith("warning:")


def test_iter_documents_names_a_truncated_shard(tmp_path, embedded_data_dir):  # noqa: F811
    import shutil

    data = tmp_path / "d"
    shutil.copytree(embedded_data_dir, data)
    name = load_manifest(data)["val"][0]
    path = data / name
    body = path.read_bytes()
    path.write_bytes(body[: len(body) // 2])
    with pytest.raises(DataError, match=f"{name}"):
        list(iter_documents(data, "val"))


@pytest.mark.parametrize("flag", ["--docs-per-shard", "--max-attempts", "--workers", "--doc-chars", "--num-shards"])
def test_prepare_data_count_flags_must_be_positive(flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--dataset", "embedded", "--data-dir", str(tmp_path / "o"), flag, "0"])
    assert e.value.code == 2
    assert f"argument {flag}: must be an integer >= 1 (got '0')" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_importing_every_module_creates_no_files_and_fetches_no_kernel(tmp_path):
    """Importing the library and the scripts has no side effects (reference training spec §7.10: their dataset
    module created its data directory at import, and FlashAttention-3 was fetched from the kernels hub at import even
    when SDPA was asked for): a fresh process with HOME and the working directory in empty folders imports every
    module of nanochat/ and scripts/; afterwards both folders are still empty, and no flash-attention, kernels-hub,
    W&B, datasets or hub module was loaded (they load when a run asks for them)."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    code = ("import importlib, pkgutil, sys; import nanochat, scripts\n"
            "names = [m.name for m in pkgutil.walk_packages(nanochat.__path__, 'nanochat.')]\n"
            "names += [m.name for m in pkgutil.iter_modules(scripts.__path__, 'scripts.')]\n"
            "[importlib.import_module(n) for n in names]\n"
            "heavy = ('kernels', 'flash_attn', 'flash_attn_interface', 'wandb', 'datasets', 'huggingface_hub')\n"
            "print(len(names), sorted(k for k in sys.modules if k.split('.')[0] in heavy))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANOCHAT_", "HF_", "XDG_"))}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    count, loaded = r.stdout.split(" ", 1)
    assert int(count) > 40 and loaded.strip() == "[]", r.stdout
    assert not any(home.iterdir()) and not any(cwd.iterdir()), (list(home.rglob("*")), list(cwd.rglob("*")))


def test_a_second_build_into_a_data_dir_in_use_is_refused(tmp_path, capsys):
    """Two builders (embedded/local/hf:) into one --data-dir wrote the same temp shard names: one died with a
    FileNotFoundError traceback at its rename (2 of 3 tries of two `prepare_data --dataset embedded`), and a shard
    torn by both could be renamed in. A second one is refused while the first lives, naming it; the lock goes
    with the first. ~1 s."""
    import subprocess
    import sys

    from conftest import REPO

    data = tmp_path / "data"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(50)))
    hold = subprocess.Popen([sys.executable, "-c", "import sys, time; from nanochat.run_dir import RunDirLock; "
                             "RunDirLock(sys.argv[1]).acquire('--data-dir'); print('held', flush=True); time.sleep(60)",
                             str(data)], cwd=REPO, stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": str(REPO)})
    try:
        assert hold.stdout.readline().strip() == "held"
        assert main(["--dataset", "local", "--text-dir", str(tmp_path / "src"), "--data-dir", str(data)]) == 2
        err = capsys.readouterr().err
        assert f"--data-dir {data} is in use" in err and f"pid {hold.pid}" in err, err
        assert not list(data.glob("*.parquet*")) and not (data / "manifest.json").exists()
    finally:
        hold.kill()
        hold.wait()
    assert main(["--dataset", "local", "--text-dir", str(tmp_path / "src"), "--data-dir", str(data)]) == 0
    assert sorted(p.name for p in data.iterdir()) == ["manifest.json", "train_00000.parquet", "val_00000.parquet"]


@pytest.mark.parametrize("rebuilding", [False, True], ids=["reading-sources", "rebuilding"])
def test_ctrl_c_during_a_local_build_says_what_is_left(tmp_path, monkeypatch, capsys, rebuilding):
    """Ctrl-C while a local build reads its sources leaves the dataset already there as it was (its manifest is
    removed only when the rebuild starts); once the rebuild has started, no manifest is left. Exit 130, one line
    that says which."""
    from scripts import prepare_data

    data = tmp_path / "data"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(50)))
    flags = ["--dataset", "local", "--text-dir", str(tmp_path / "src"), "--data-dir", str(data)]
    assert main(flags) == 0

    def interrupted(args, data_dir, progress):
        if rebuilding:
            (data_dir / "manifest.json").unlink()  # what start_rebuild does first
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_data, "build_local_dataset", interrupted)
    assert main(flags) == 130
    err = capsys.readouterr().err
    if rebuilding:
        assert "no manifest was written (loaders refuse the directory)" in err, err
    else:
        assert "the dataset already there is unchanged" in err and (data / "manifest.json").is_file(), err


def test_missing_data_names_the_command_for_the_runs_dataset(tmp_path, monkeypatch):
    """base_eval's bpb data of an imported climbmix run: the advice named `--dataset embedded --data-dir
    .../climbmix`, which fills that directory with other data."""
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError, match=re.escape("`python -m scripts.prepare_data --dataset climbmix`")):
        load_manifest(tmp_path / "climbmix", "climbmix")
    with pytest.raises(DataError, match=re.escape(f"--dataset climbmix --data-dir {tmp_path / 'x'}`")):
        load_manifest(tmp_path / "x", "climbmix")
    with pytest.raises(DataError, match=re.escape(f"e.g. `python -m scripts.prepare_data --dataset embedded "
                                                  f"--data-dir {tmp_path / 'x'}`")):
        load_manifest(tmp_path / "x")  # no dataset known: the embedded corpus as the example, as before
