"""A rename reaches the disk: after write_atomic / replace_atomic / a checkpoint save renames its temp file or folder
into place, the folder is fsynced (else a power cut can bring back the old file, or none). One helper,
jsonfile.fsync_dir, which ignores only what a file system that cannot fsync a folder says (EINVAL, ENOTSUP)."""

import errno
import os

import pytest
import torch

from nanochat import checkpoint as ckpt
from nanochat.jsonfile import replace_atomic, write_text_atomic


def spy_fsyncs(monkeypatch, watched):
    """Record (inode, whether ``watched`` holds the new content) at each os.fsync."""
    synced, real = [], os.fsync

    def spy(fd):
        synced.append((os.fstat(fd).st_ino, watched.exists() and watched.read_text() == "new"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return synced


def test_write_atomic_fsyncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    path.write_text("old")
    synced = spy_fsyncs(monkeypatch, path)
    write_text_atomic(path, "new")
    assert synced == [(path.stat().st_ino, False), (tmp_path.stat().st_ino, True)]


def test_replace_atomic_fsyncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    path, source = tmp_path / "link", tmp_path / "source"
    source.write_text("new")
    path.write_text("old")
    synced = spy_fsyncs(monkeypatch, path)
    replace_atomic(path, lambda tmp: os.link(source, tmp))
    assert synced == [(tmp_path.stat().st_ino, True)]


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTSUP])
def test_a_file_system_that_cannot_fsync_a_folder_is_no_error(tmp_path, monkeypatch, code):
    def refuse(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", lambda fd: refuse(fd) if os.path.isdir(f"/proc/self/fd/{fd}") else None)
    write_text_atomic(tmp_path / "f.json", "new")
    assert (tmp_path / "f.json").read_text() == "new"


def eio_on_folders(monkeypatch):
    real = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_folder_fsync_that_fails_is_an_error(tmp_path, monkeypatch):
    """EIO: the rename may not be on the disk; the writer is told, not left to believe it is."""
    eio_on_folders(monkeypatch)
    with pytest.raises(OSError, match="Input/output error"):
        write_text_atomic(tmp_path / "f.json", "new")


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 2)
        self.config = type("Config", (), {"to_dict": lambda self: {}})()


def test_a_checkpoint_save_uses_the_same_helper(tmp_path, monkeypatch):
    """checkpoint.py's own copy swallowed every error, EIO included: a save the disk did not confirm passed as done."""
    eio_on_folders(monkeypatch)
    with pytest.raises(ckpt.CheckpointWriteError, match="Input/output error"):
        ckpt.save_checkpoint(tmp_path, 1, Tiny(), {})
