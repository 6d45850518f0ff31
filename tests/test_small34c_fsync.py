"""The renames that publish data a later step trusts reach the disk: after download_file's ``.part`` -> file, the
eval bundle's extraction, an import's publish and --overwrite's trash moves, the folder that changed is fsynced (a
power cut could otherwise bring back the old entry, or lose the new one), and a file whose name says "done" has
its data fsynced before the rename (else a power cut can leave the name over empty data)."""

import os
import zipfile

from nanochat import download, run_dir as run_dir_mod
from nanochat.eval_bundle import _extract
from scripts.import_reference import publish


def spy_fsyncs(monkeypatch, state):
    """Record (inode, state()) at each os.fsync."""
    synced, real = [], os.fsync

    def spy(fd):
        synced.append((os.fstat(fd).st_ino, state()))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return synced


def test_download_fsyncs_the_file_then_the_folder_after_the_rename(tmp_path, monkeypatch):
    dest = tmp_path / "shard_00000.parquet"
    monkeypatch.setattr(download, "_fetch_into", lambda url, part, **kw: part.write_bytes(b"payload"))
    synced = spy_fsyncs(monkeypatch, dest.exists)
    download.download_file("http://127.0.0.1:1/x", dest, progress=False)
    assert dest.read_bytes() == b"payload"
    # the data before the name (dest absent), then the folder holding the name
    assert synced == [(dest.stat().st_ino, False), (tmp_path.stat().st_ino, True)]


def test_an_existing_download_costs_no_fsync(tmp_path, monkeypatch):
    dest = tmp_path / "done.bin"
    dest.write_bytes(b"x")
    synced = spy_fsyncs(monkeypatch, dest.exists)
    download.download_file("http://127.0.0.1:1/x", dest, progress=False)
    assert synced == []


def test_bundle_extraction_fsyncs_its_files_then_the_folder_after_the_rename(tmp_path, monkeypatch):
    zip_path = tmp_path / "eval_bundle.zip"
    with zipfile.ZipFile(zip_path, "w") as zf:  # upstream's layout: a top-level eval_bundle/ folder
        zf.writestr("eval_bundle/core.yaml", "icl_tasks: []\n")
        zf.writestr("eval_bundle/eval_data/a/task.jsonl", '{"q": 1}\n')
    base = tmp_path / "cache"
    base.mkdir()
    target = base / "eval_bundle"
    synced = spy_fsyncs(monkeypatch, target.exists)
    _extract(zip_path, target)
    inodes = {p.stat().st_ino for p in [target, *target.rglob("*")]}
    # every extracted file and folder before the rename (target absent), then the folder holding the bundle
    assert {ino for ino, _ in synced[:-1]} == inodes and not any(seen for _, seen in synced[:-1])
    assert synced[-1] == (base.stat().st_ino, True)


def test_an_import_publish_fsyncs_the_parent_after_the_rename(tmp_path, monkeypatch):
    work, run = tmp_path / ".run.importing-x" / "run", tmp_path / "runs" / "run"
    work.mkdir(parents=True)
    (work / "config.json").write_text("{}")
    run.parent.mkdir()
    synced = spy_fsyncs(monkeypatch, run.exists)
    publish(work, run)
    assert synced == [(run.parent.stat().st_ino, True)]


def test_overwrite_fsyncs_the_run_dir_after_the_trash_moves(tmp_path, monkeypatch):
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "checkpoints").mkdir()
    synced = spy_fsyncs(monkeypatch, lambda: sorted(p.name for p in tmp_path.iterdir()))
    assert sorted(run_dir_mod.remove_run(tmp_path)) == ["checkpoints", "summary.json"]
    assert len(synced) == 1
    ino, names = synced[0]
    assert ino == tmp_path.stat().st_ino
    assert len(names) == 1 and names[0].startswith(run_dir_mod.TRASH_PREFIX)  # moved out, trash not yet deleted


def test_setting_aside_stale_results_fsyncs_both_folders_after_the_moves(tmp_path, monkeypatch):
    (tmp_path / "summary.json").write_text('{"step": 9}')
    (tmp_path / "report.md").write_text("stale")
    folder = tmp_path / "checkpoints" / "step_000005"
    folder.mkdir(parents=True)
    moved = lambda: (not (tmp_path / "summary.json").exists() and not (tmp_path / "report.md").exists()
                     and (folder / "summary.json").exists() and (folder / "report.md").exists())
    synced = spy_fsyncs(monkeypatch, moved)
    run_dir_mod.set_aside_stale_results(tmp_path, 5, folder)
    assert sorted(synced) == sorted([(folder.stat().st_ino, True), (tmp_path.stat().st_ino, True)])
