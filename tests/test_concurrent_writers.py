"""Two processes writing one output at once (forced here as one deterministic interleaving: the second runs whole
while the first is midway) and writers that fail midway: place_file, the reference tokenizer, the slot-map export,
export_reference and import_reference. Each writer has a temp name of its own (the last rename wins) or, for an
import into one run directory, the second is refused with a clear error; a failure leaves no temp file behind."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reference_fixtures import make_their_files, our_base_run
from test_analysis import make_tokenizer

from nanochat import download, jsonfile, reference_slot_map, reference_tokenizer, work_dirs
from nanochat.checkpoint import load_model
from scripts import export_reference, import_reference


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_two_placers_of_one_file_both_succeed(tmp_path, monkeypatch):
    """A second place_file of the same dest while the first is between its link and its rename. Before: one
    fixed ``<dest>.link-tmp``, which the second deleted first, so the first failed (FileNotFoundError)."""
    blob = tmp_path / "cache" / "blob"
    blob.parent.mkdir()
    blob.write_bytes(b"shard")
    dest = tmp_path / "data" / "shard.parquet"
    dest.parent.mkdir()
    real_link, calls = os.link, []

    def link(src, tmp):
        real_link(src, tmp)
        calls.append(tmp)
        if len(calls) == 1:
            download.place_file(blob, dest)

    monkeypatch.setattr(os, "link", link)
    assert download.place_file(blob, dest) == dest
    assert len(calls) == 2 and calls[0] != calls[1]
    assert os.path.samefile(dest, blob) and names(dest.parent) == ["shard.parquet"]


def test_placing_a_file_placed_already_leaves_no_temp_link(tmp_path):
    """A rename of a hard link over another link of the same file does nothing (POSIX), so the temp link stayed
    (``<dest>.link-tmp`` before, found and deleted only by the next placer)."""
    blob = tmp_path / "blob"
    blob.write_bytes(b"shard")
    dest = tmp_path / "data" / "shard.parquet"
    dest.parent.mkdir()
    for _ in range(2):
        download.place_file(blob, dest)
        assert os.path.samefile(dest, blob) and names(dest.parent) == ["shard.parquet"]


def test_a_failed_place_file_leaves_no_link_behind(tmp_path):
    """The rename fails (dest is a non-empty directory): the error is raised and no temp link stays beside it."""
    blob = tmp_path / "blob"
    blob.write_bytes(b"shard")
    dest = tmp_path / "data" / "shard.parquet"
    (dest / "x").mkdir(parents=True)
    with pytest.raises(OSError):
        download.place_file(blob, dest)
    assert names(dest.parent) == ["shard.parquet"] and dest.is_dir()


def test_two_writers_of_one_reference_tokenizer_both_succeed(tmp_path, monkeypatch):
    """Two exports into one base dir write its shared tokenizer/ at once: the second runs whole while the first is
    between its torch.save and its rename. Before: fixed ``token_bytes.pt.tmp``, renamed away under the first."""
    tok = make_tokenizer(tmp_path / "tok")
    out = tmp_path / "base" / "tokenizer"
    real_save, saved = torch.save, []

    def save(obj, path, *a, **k):
        real_save(obj, path, *a, **k)
        saved.append(Path(path))
        if len(saved) == 1:
            assert reference_tokenizer.write_reference_tokenizer(tok, out) is True

    monkeypatch.setattr(torch, "save", save)
    assert reference_tokenizer.write_reference_tokenizer(tok, out) is True
    assert saved[0] != saved[1] and names(out) == ["token_bytes.pt", "tokenizer.pkl"]
    assert reference_tokenizer.read_reference_tokenizer(out / "tokenizer.pkl").mergeable_ranks == tok.mergeable_ranks
    assert reference_tokenizer.read_reference_token_bytes(out / "token_bytes.pt", tok)["matches_reference_rule"]


def grouped_stand_in(tmp_path):
    """What reference_slot_map.export reads of a model and tokenizer: a 4-token vocabulary in 2 slots of 2."""
    opts = SimpleNamespace(slot_map=str(tmp_path / "gone" / "map.json"), group_size=2)
    model = SimpleNamespace(memory=SimpleNamespace(opts=opts, slot_map=torch.tensor([1, 0, 0, 1])))
    tok = SimpleNamespace(vocab_size=4, bos_token_id=3, decode=lambda ids: f"t{ids[0]}")
    return model, tok


def test_a_slot_map_export_on_a_full_disk_leaves_no_temp_file(tmp_path, monkeypatch):
    """Before: ``<map>.json.tmp`` half written and left in the checkpoint folder."""
    model, tok = grouped_stand_in(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()

    def half_then_full(self, data):
        with open(self, "wb") as f:
            f.write(data[:10])
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", half_then_full)
    with pytest.raises(OSError) as e:
        reference_slot_map.export(model, tok, ckpt)
    assert jsonfile.written_path(e.value.filename) == ckpt / "map.json" and names(ckpt) == []


def test_two_slot_map_exports_into_one_folder_both_succeed(tmp_path, monkeypatch):
    model, tok = grouped_stand_in(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    real_write, written = Path.write_bytes, []

    def write_bytes(self, data):
        n = real_write(self, data)
        written.append(self)
        if len(written) == 1:
            assert reference_slot_map.export(model, tok, ckpt) == ckpt / "map.json"
        return n

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    assert reference_slot_map.export(model, tok, ckpt) == ckpt / "map.json"
    assert written[0] != written[1] and names(ckpt) == ["map.json"]
    rows = [s["token_ids"] for s in json.loads((ckpt / "map.json").read_text())["slots"]]
    assert rows == [[1, 2], [0, 3]]


@pytest.fixture
def our_run(tmp_path):
    return our_base_run(tmp_path)


def test_two_exports_of_one_step_at_once_both_finish_whole(our_run, tmp_path, monkeypatch, capsys):
    """The second export starts after the first passed its "already exists" check and finishes while the first is
    between its weights' torch.save and rename. Before: fixed ``model_000012.pt.tmp``; the second renamed it away,
    the first failed and its clean-up then removed what the second had written."""
    out = tmp_path / "base"
    real_save, saved = torch.save, []

    def save(obj, path, *a, **k):
        real_save(obj, path, *a, **k)
        saved.append(Path(path))
        if Path(path).name.startswith("model_") and len([p for p in saved if p.name.startswith("model_")]) == 1:
            assert export_reference.main(["--run", str(our_run), "--out", str(out)]) == 0

    monkeypatch.setattr(torch, "save", save)
    assert export_reference.main(["--run", str(our_run), "--out", str(out)]) == 0, capsys.readouterr().err
    ckpt = out / "base_checkpoints" / "d4"
    assert names(ckpt) == ["meta_000012.json", "model_000012.pt"] and names(out / "tokenizer") == [
        "token_bytes.pt", "tokenizer.pkl"]
    assert json.loads((ckpt / "meta_000012.json").read_text())["step"] == 12


def test_a_second_import_into_a_run_being_imported_is_refused(tmp_path, monkeypatch, capsys):
    """The second import starts while the first writes its checkpoint: it is refused at once (exit 2, one line
    naming --run-dir), and the first finishes. Before: the second deleted the first's ``<run>.importing`` folder,
    wrote its own into place, and the first failed."""
    from nanochat import checkpoint

    src, _, _ = make_their_files(tmp_path, "base")
    run = tmp_path / "runs" / "run"
    real_save, second = checkpoint.save_checkpoint, []

    def save(folder, *a, **k):
        if not second:  # the first import's call; the second's own call (nested) goes straight through
            second.append("running")
            second[:] = [import_reference.main([str(src), "--run-dir", str(run)]), capsys.readouterr().err]
        return real_save(folder, *a, **k)

    monkeypatch.setattr(checkpoint, "save_checkpoint", save)
    assert import_reference.main([str(src), "--run-dir", str(run)]) == 0, capsys.readouterr().err
    assert second[0] == 2 and len(second[1].strip().splitlines()) == 1, second
    assert f"--run-dir {run} is being written by another import" in second[1], second
    assert load_model(run)[1]["step"] == 5 and names(run.parent) == ["run"]


def test_an_import_killed_midway_leaves_a_folder_the_next_import_removes(tmp_path, capsys):
    """A SIGKILLed import cannot clean up: its hidden work folder beside --run-dir (named for a pid now gone) is
    removed by the next import into that run, which then succeeds."""
    src, _, _ = make_their_files(tmp_path, "base")
    run = tmp_path / "runs" / "run"
    run.parent.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = run.parent / f"{import_reference.work_prefix(run)}{gone.pid}-{work_dirs._host()}-{work_dirs._boot()}.x1"
    (left / "checkpoints").mkdir(parents=True)
    assert import_reference.main([str(src), "--run-dir", str(run)]) == 0
    assert "removed 1 work folder(s)" in capsys.readouterr().err
    assert names(run.parent) == ["run"]


@pytest.mark.parametrize("tag", ["other", "d4"])
def test_a_failed_export_keeps_what_a_concurrent_export_wrote(our_run, tmp_path, monkeypatch, capsys, tag):
    """A second export into the same new base dir (another --model-tag, or the same one) runs whole while the first
    is at its weights' torch.save, which then fails (a full disk). The first removes only what it created: the
    second's checkpoint and the tokenizer it shares stay whole. Before: the first's clean-up removed everything new
    under the base dir since its snapshot (all of it: the base dir was new), the second's export too."""
    out = tmp_path / "base"
    real_save, nested = torch.save, []

    def save(obj, path, *a, **k):
        if nested or not Path(path).name.startswith("model_"):
            return real_save(obj, path, *a, **k)
        nested.append("running")
        nested[:] = [export_reference.main(["--run", str(our_run), "--out", str(out), "--model-tag", tag])]
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(torch, "save", save)
    assert export_reference.main(["--run", str(our_run), "--out", str(out)]) == 2
    assert nested == [0] and "No space left on device" in capsys.readouterr().err
    monkeypatch.setattr(torch, "save", real_save)
    assert names(out) == ["base_checkpoints", "tokenizer"]
    assert names(out / "base_checkpoints") == [tag] and names(out / "tokenizer") == ["token_bytes.pt", "tokenizer.pkl"]
    assert names(out / "base_checkpoints" / tag) == ["meta_000012.json", "model_000012.pt"]
    reimported = tmp_path / "reimported"
    assert import_reference.main([str(out / "base_checkpoints" / tag), "--run-dir", str(reimported),
                                  "--tokenizer", str(out / "tokenizer" / "tokenizer.pkl")]) == 0
    assert load_model(reimported)[1]["step"] == 12


def test_an_imported_run_directory_has_the_mode_mkdir_gives(tmp_path):
    """The import's work folder (mkdtemp: 0o700) used to become --run-dir itself, so an imported run was private
    to its user on a shared file system; it is made like every other folder, under the umask."""
    import stat

    src, _, _ = make_their_files(tmp_path, "base")
    run = tmp_path / "runs" / "run"
    old = os.umask(0o022)
    try:
        assert import_reference.main([str(src), "--run-dir", str(run)]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(run.stat().st_mode) == 0o755 and names(run.parent) == ["run"]
