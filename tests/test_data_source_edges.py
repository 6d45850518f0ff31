"""Local sources and default data directories: edge cases that changed a user's data without a word (session 33).

A UTF-8 byte order mark at the start of a file, hidden files and folders under --text-dir."""
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.dataset import iter_documents, load_manifest
from scripts.prepare_data import local_sources, main

BOM = "\ufeff"


def _documents(data_dir) -> dict:
    return {split: list(iter_documents(data_dir, split)) for split in ("train", "val")}


def _prepare(text_dir, data_dir, *extra) -> dict:
    assert main(["--dataset", "local", "--text-dir", str(text_dir), "--data-dir", str(data_dir), *extra]) == 0
    return _documents(data_dir)


def _write_sources(src, bom: str) -> None:
    """20 paragraphs in a .txt (a BOM mid-file too: it is text there) and 20 lines in a .jsonl, each file starting
    with ``bom``; --doc-chars 10 makes every paragraph a document."""
    src.mkdir()
    paragraphs = [f"paragraph {i}" for i in range(20)]
    paragraphs[7] = BOM + "paragraph 7 starts with a BOM of its own"
    (src / "a.txt").write_text(bom + "\n\n".join(paragraphs) + "\n", encoding="utf-8")
    (src / "b.jsonl").write_text(bom + "".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(20)),
                                 encoding="utf-8")
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(20)]}), src / "c.parquet")


def test_a_leading_bom_is_not_part_of_the_first_document(tmp_path, capsys):
    """A .txt saved with a BOM (Notepad, some exports) kept U+FEFF in its first train document; a .jsonl with one
    failed at line 1 ("Unexpected UTF-8 BOM"). Both now read as the same file without it; a BOM inside the text is
    text and stays."""
    _write_sources(tmp_path / "plain", bom="")
    _write_sources(tmp_path / "bom", bom=BOM)
    assert (tmp_path / "bom" / "a.txt").read_bytes()[:3] == b"\xef\xbb\xbf"
    plain = _prepare(tmp_path / "plain", tmp_path / "out_plain", "--doc-chars", "10")
    with_bom = _prepare(tmp_path / "bom", tmp_path / "out_bom", "--doc-chars", "10")
    assert with_bom == plain
    docs = plain["train"] + plain["val"]
    assert len(docs) == 60 and "paragraph 0" in docs and "line 0" in docs
    assert BOM + "paragraph 7 starts with a BOM of its own" in docs  # mid-file: untouched
    assert sum(BOM in d for d in docs) == 1
    capsys.readouterr()


def test_a_build_kept_from_before_the_bom_was_dropped_is_rebuilt(tmp_path, capsys):
    """A build of a BOM file made before (same sources and flags) has the BOM in a document: a re-run must build
    it again, not keep it. Builds of files without a BOM are still kept."""
    _write_sources(tmp_path / "bom", bom=BOM)
    out = tmp_path / "out"
    _prepare(tmp_path / "bom", out, "--doc-chars", "10")
    manifest = load_manifest(out)
    assert manifest["request"]["leading_bom"] == ["a.txt", "b.jsonl"]
    del manifest["request"]["leading_bom"]  # what the reader that kept the BOM recorded
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    capsys.readouterr()
    _prepare(tmp_path / "bom", out, "--doc-chars", "10")
    assert "already prepared" not in capsys.readouterr().out
    assert load_manifest(out)["request"]["leading_bom"] == ["a.txt", "b.jsonl"]
    _write_sources(tmp_path / "plain", bom="")
    _prepare(tmp_path / "plain", tmp_path / "out_plain", "--doc-chars", "10")
    assert "leading_bom" not in load_manifest(tmp_path / "out_plain")["request"]
    capsys.readouterr()
    _prepare(tmp_path / "plain", tmp_path / "out_plain", "--doc-chars", "10")
    assert "already prepared" in capsys.readouterr().out


def test_hidden_files_and_folders_under_text_dir_are_not_sources(tmp_path, capsys):
    """Jupyter's .ipynb_checkpoints/ (a near-copy of a source, whose train part can hold the source's val
    documents), .git/, editor temp files: names starting with "." are skipped at every level, and said so."""
    _write_sources(tmp_path / "src", bom="")
    clean = _prepare(tmp_path / "src", tmp_path / "out_clean", "--doc-chars", "10")
    src = tmp_path / "src"
    (src / ".ipynb_checkpoints").mkdir()
    shutil.copy(src / "a.txt", src / ".ipynb_checkpoints" / "a-checkpoint.txt")
    (src / "sub" / ".git").mkdir(parents=True)
    shutil.copy(src / "b.jsonl", src / "sub" / ".git" / "b.jsonl")
    shutil.copy(src / "c.parquet", src / ".c.parquet")
    (src / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    assert local_sources(src) == [src / "a.txt", src / "b.jsonl", src / "c.parquet"]
    capsys.readouterr()
    assert _prepare(src, tmp_path / "out_hidden", "--doc-chars", "10") == clean
    err = capsys.readouterr().err
    assert "skipped 3 hidden files" in err and ".ipynb_checkpoints/a-checkpoint.txt" in err
    # a hidden --text-dir (or one below a hidden folder) is the user's own choice: read
    hidden = tmp_path / ".cache" / ".corpus"
    shutil.copytree(src, hidden)
    assert local_sources(hidden) == [hidden / "a.txt", hidden / "b.jsonl", hidden / "c.parquet"]
