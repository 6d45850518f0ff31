"""Local sources and default data directories: edge cases that changed a user's data without a word (session 33).

A UTF-8 byte order mark at the start of a file, hidden files and folders under --text-dir, and two hf: datasets
whose default directories had one name."""
import json
import random
import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.dataset import default_data_dir, hf_dir_name, iter_documents, load_manifest
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


def test_default_data_dirs_of_different_hf_datasets_differ(monkeypatch, tmp_path):
    """hf:a/b and a local dataset directory hf:a--b (or hf:/a/b and hf:a/b, hf:a/b/c and hf:a/b:c, hf:w:c and
    hf:w/c) had one default directory: preparing one overwrote the other, and a run of one trained on the other."""
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path))
    pairs = [("hf:a/b", "hf:a--b"), ("hf:a/b", "hf:/a/b"), ("hf:a/b:c", "hf:a/b/c"), ("hf:w:c", "hf:w/c"),
             ("hf:a/b", "hf:a/b-"), ("hf:a/b", "hf:a b"), ("hf:a/b", "hf:a//b"), ("hf:x/y z", "hf:x/y%20z")]
    for one, other in pairs:
        assert default_data_dir(one) != default_data_dir(other), (one, other)
    long_ones = [f"hf:/{'d' * 300}/{i}" for i in range(2)]
    names = [default_data_dir(s).name for s in long_ones]
    assert names[0] != names[1] and all(len(n.encode()) <= 255 for n in names)
    # the documented forms keep their names (data prepared before is found)
    assert default_data_dir("hf:HuggingFaceFW/fineweb-edu:sample-10BT") == \
        tmp_path / "hf-HuggingFaceFW--fineweb-edu--sample-10BT"
    assert default_data_dir("hf:roneneldan/TinyStories") == tmp_path / "hf-roneneldan--TinyStories"
    assert default_data_dir("hf:imdb") == tmp_path / "hf-imdb"
    assert default_data_dir("hf:a/b:") == default_data_dir("hf:a/b")  # an empty config is no config
    # one name per dataset over random specs of the characters that decide it (the empty config normalised away)
    rng = random.Random(0)
    names = {}
    for _ in range(5_000):
        spec = "".join(rng.choice("ab-_./: %~") for _ in range(rng.randint(1, 7)))
        path, _, config = spec.partition(":")
        dataset = path + (f":{config}" if config else "")
        names.setdefault(hf_dir_name(spec), set()).add(dataset)
    assert len(names) > 2_000 and all(len(datasets) == 1 for datasets in names.values())


def test_a_dataset_prepared_under_its_old_default_name_is_still_found(monkeypatch, tmp_path, capsys):
    """A local hf: dataset prepared before its default name changed (hf:/path/x was hf-path--x) is read from
    there, but only when that directory's manifest names this very dataset (not hf:path/x's data)."""
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "data"))
    src = tmp_path / "ds"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))
    spec = f"hf:{src}"
    old = tmp_path / "data" / ("hf-" + "--".join(src.parts[1:]))
    assert default_data_dir(spec) != old
    assert main(["--dataset", spec, "--data-dir", str(old), "--no-progress"]) == 0  # as the old default put it
    assert default_data_dir(spec) == old
    assert main(["--dataset", spec, "--no-progress"]) == 0
    assert f"in {old}" in capsys.readouterr().out
    other = "hf:" + "/".join(src.parts[1:])  # a relative path whose old name was the same: not its data
    assert default_data_dir(other) != old


def _jsonl_dataset(path, word: str) -> None:
    path.mkdir(parents=True)
    (path / "a.jsonl").write_text("".join(json.dumps({"text": f"{word} {i}"}) + "\n" for i in range(40)))


def test_a_build_into_a_default_dir_holding_another_datasets_old_data_is_refused(monkeypatch, tmp_path, capsys):
    """hf:my ds (a local folder) was prepared under its old default name hf-my--ds, which is hf:my/ds's name now:
    preparing hf:my/ds there would overwrite the data hf:my ds's runs read. Refused naming both, until moved."""
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    _jsonl_dataset(tmp_path / "my ds", "spaced")
    shared = tmp_path / "data" / "hf-my--ds"  # the hub dataset my/ds's (no folder my/ds here: session 33's
    assert default_data_dir("hf:my/ds") == shared  # test_data_identity33 names a local one by where it resolves)
    assert main(["--dataset", "hf:my ds", "--data-dir", str(shared), "--no-progress"]) == 0  # the old default
    assert default_data_dir("hf:my ds") == shared  # found there
    capsys.readouterr()
    assert main(["--dataset", "hf:my/ds", "--no-progress"]) == 2  # refused before any download
    err = capsys.readouterr().err
    moved = tmp_path / "data" / hf_dir_name(str((tmp_path / "my ds").resolve()))  # "my ds": a local folder
    assert err == (f"error: {shared}, the default directory of --dataset hf:my/ds, holds the data of --dataset hf:my "
                   f"ds (prepared there under the default name it had before session 33); move it to {moved} (where "
                   f"--dataset hf:my ds finds it) or give --dataset hf:my/ds a --data-dir of its own\n")
    assert set(iter_documents(shared, "train")) <= {f"spaced {i}" for i in range(40)}  # untouched
    shared.rename(moved)
    assert default_data_dir("hf:my ds") == moved and default_data_dir("hf:my/ds") == shared
    assert {d.split()[0] for d in iter_documents(moved, "train")} == {"spaced"}
    # the same for any builder's default directory holding another dataset (put there with --data-dir)
    _jsonl_dataset(tmp_path / "mine", "local")
    embedded = tmp_path / "data" / "embedded"
    assert main(["--dataset", "local", "--text-dir", str(tmp_path / "mine"), "--data-dir", str(embedded)]) == 0
    capsys.readouterr()
    assert main(["--dataset", "embedded", "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"error: {embedded}, the default directory of --dataset embedded, holds the "
                                       "data of --dataset local; give --dataset embedded a --data-dir of its own\n")
    assert load_manifest(embedded)["dataset"] == "local"
