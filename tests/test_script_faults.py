"""Faults in the small entry points (export_reference, build_slot_map, wic_probe, sample, make_core_subset): bad
flags, outputs that cannot be written, Ctrl-C midway. Each is one error line naming the flag or file, exit 2 (130
for Ctrl-C), and no partial output left behind."""

import errno
import json
from pathlib import Path

import pytest
import torch

from reference_fixtures import our_base_run

from nanochat.checkpoint import save_checkpoint
from scripts import export_reference


def full_disk(path, *args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


def full_disk_save(obj, path, *args, **kwargs):  # torch.save's signature
    full_disk(path)


def files_under(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() else {}


@pytest.fixture
def our_run(tmp_path):
    return our_base_run(tmp_path)


@pytest.mark.parametrize("fault", ["model", "meta", "ctrl-c"])
def test_export_that_fails_midway_leaves_the_shared_base_dir_as_it_was(our_run, tmp_path, monkeypatch, capsys, fault):
    """A second export into a base dir that already holds one (their layout shares tokenizer/): a full disk at the
    weights or at the meta, or Ctrl-C, is one line naming the file, and only what this export added is removed."""
    out = tmp_path / "base"
    assert export_reference.main(["--run", str(our_run), "--out", str(out), "--model-tag", "first"]) == 0
    before = files_under(out)
    capsys.readouterr()

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    if fault == "meta":
        monkeypatch.setattr(Path, "write_text", full_disk)
    else:
        monkeypatch.setattr(torch, "save", full_disk_save if fault == "model" else interrupt)
    rc = export_reference.main(["--run", str(our_run), "--out", str(out), "--model-tag", "second"])
    err = capsys.readouterr().err
    assert rc == (130 if fault == "ctrl-c" else 2)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    if fault != "ctrl-c":  # the file asked for, not the temp name it was written under (unique since session 20)
        name = "model_000012.pt" if fault == "model" else "meta_000012.json"
        assert "No space left on device" in err and f"{name}: No space" in err, err
    assert files_under(out) == before
    assert not (out / "base_checkpoints" / "second").exists()


def test_export_into_a_new_dir_on_a_full_disk_leaves_nothing(our_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch, "save", full_disk_save)  # the first write: the tokenizer's token_bytes.pt
    out = tmp_path / "new" / "base"
    assert export_reference.main(["--run", str(our_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "token_bytes.pt" in err and "Traceback" not in err, err
    assert not (tmp_path / "new").exists()


def test_export_into_a_file_is_one_clear_error(our_run, tmp_path, capsys):
    out = tmp_path / "a_file"
    out.write_text("x")
    assert export_reference.main(["--run", str(our_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"could not write {out / 'base_checkpoints'}" in err and "Traceback" not in err, err
    assert out.read_text() == "x"


@pytest.mark.parametrize("tag", ["../escape", "a/b", ".."])
def test_export_refuses_a_model_tag_that_is_a_path(our_run, tmp_path, capsys, tag):
    with pytest.raises(SystemExit) as e:
        export_reference.main(["--run", str(our_run), "--out", str(tmp_path / "base"), "--model-tag", tag])
    assert e.value.code == 2 and "--model-tag" in capsys.readouterr().err
    assert not (tmp_path / "base").exists() and not (tmp_path / "escape").exists()


@pytest.fixture
def ve_run(tmp_path, tiny_tokenizer_dir):
    from conftest import tiny_config
    from nanochat.gpt import build_model

    run = tmp_path / "run"
    save_checkpoint(run, 3, build_model(tiny_config(memory="ve", vocab_size=1024), seed=0),
                    {"tokenizer_dir": str(tiny_tokenizer_dir)})
    return run


def slot_map_argv(run, output, *extra):
    return ["--checkpoint", str(run), "--group-size", "4", "--knn", "8", "--output", str(output), *extra]


@pytest.mark.parametrize("extra, needle", [(["--knn", "0"], "--knn"), (["--group-size", "0"], "--group-size"),
                                           (["--output", "DIR"], "is not a regular file"),
                                           (["--output", "DIR/missing/x.json"], "does not exist")])
def test_build_slot_map_refuses_bad_flags_before_the_build(ve_run, tmp_path, capsys, extra, needle):
    """An --output that is a directory (or a device: as root the temp file was renamed over /dev/full) or lies in
    no directory is refused up front, not after the build."""
    from scripts import build_slot_map

    extra = [x.replace("DIR", str(tmp_path)) for x in extra]
    with pytest.raises(SystemExit) as e:
        build_slot_map.main(slot_map_argv(ve_run, tmp_path / "m.json", *extra))
    assert e.value.code == 2 and needle in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_build_slot_map_errors_exit_2_with_one_line(ve_run, tmp_path, capsys):
    from scripts import build_slot_map

    assert build_slot_map.main(slot_map_argv(ve_run, tmp_path / "m.json", "--group-size", "3")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --group-size 3 must divide the vocab size 1024") and len(err.splitlines()) == 1


@pytest.mark.parametrize("fault", ["full disk", "ctrl-c"])
def test_build_slot_map_that_cannot_finish_keeps_the_old_map(ve_run, tmp_path, monkeypatch, capsys, fault):
    from scripts import build_slot_map

    out = tmp_path / "m.json"
    assert build_slot_map.main(slot_map_argv(ve_run, out)) == 0
    old = out.read_bytes()
    capsys.readouterr()

    def torn_write(path, *a, **k):  # part of the file reaches the disk, then the write fails
        Path.write_bytes(path, b'{"vers')
        if fault == "ctrl-c":
            raise KeyboardInterrupt
        full_disk(path)

    monkeypatch.setattr(Path, "write_text", torn_write)
    rc = build_slot_map.main(slot_map_argv(ve_run, out, "--knn", "16"))
    err = capsys.readouterr().err
    assert rc == (130 if fault == "ctrl-c" else 2) and len(err.splitlines()) == 1 and "--output" in err, err
    assert out.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "run"]


@pytest.fixture
def subset_src(tmp_path):
    """A --src whose eval_bundle is the shipped subset (small; the same layout as the full bundle)."""
    from nanochat.eval_bundle import SUBSET_DIR

    src = tmp_path / "shared"
    src.mkdir()
    (src / "eval_bundle").symlink_to(SUBSET_DIR)
    return src


def test_core_subset_refuses_an_out_dir_that_is_not_a_subset(subset_src, tmp_path, capsys):
    """--out is replaced wholesale: a directory of other files was deleted."""
    from scripts import make_core_subset

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert make_core_subset.main(["--src", str(subset_src), "--out", str(out), "--rows", "3"]) == 2
    assert "is not a CORE subset" in capsys.readouterr().err and (out / "notes.txt").read_text() == "keep me"
    with pytest.raises(SystemExit) as e:
        make_core_subset.main(["--src", str(subset_src), "--out", str(tmp_path / "new"), "--rows", "0"])
    assert e.value.code == 2 and "--rows" in capsys.readouterr().err


@pytest.mark.parametrize("fault", ["ctrl-c", "full disk"])
def test_core_subset_rebuild_that_stops_midway_keeps_the_old_subset(subset_src, tmp_path, monkeypatch, capsys,
                                                                    fault):
    from scripts import make_core_subset

    out = tmp_path / "sub"
    assert make_core_subset.main(["--src", str(subset_src), "--out", str(out), "--rows", "3"]) == 0
    (out / "README.md").write_text("provenance notes")
    before = files_under(out)
    real, calls = make_core_subset.subset_rows, []

    def stops_at_the_third_task(*a):
        calls.append(1)
        if len(calls) == 3:
            if fault == "ctrl-c":
                raise KeyboardInterrupt
            full_disk("sub.building/eval_data/x.jsonl")
        return real(*a)

    monkeypatch.setattr(make_core_subset, "subset_rows", stops_at_the_third_task)
    rc = make_core_subset.main(["--src", str(subset_src), "--out", str(out), "--rows", "2"])
    assert rc == (130 if fault == "ctrl-c" else 2) and "Traceback" not in capsys.readouterr().err
    assert files_under(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared", "sub"]  # no .building or .old left
    monkeypatch.setattr(make_core_subset, "subset_rows", real)
    assert make_core_subset.main(["--src", str(subset_src), "--out", str(out), "--rows", "2"]) == 0
    assert (out / "README.md").read_text() == "provenance notes"  # hand-written notes survive a rebuild
    assert json.loads((out / "SUBSET.json").read_text())["rows_per_task"] == 2


@pytest.mark.parametrize("suffix", [".old", ".building"])
def test_core_subset_rebuild_keeps_a_users_folder_beside_out(subset_src, tmp_path, suffix):
    """The swap's work folders were <out>.old and <out>.building, removed with rmtree before use: a user's copy
    of the old subset kept there (cp -r core_subset core_subset.old) was deleted by the next rebuild."""
    from scripts import make_core_subset

    out = tmp_path / "sub"
    assert make_core_subset.main(["--src", str(subset_src), "--out", str(out), "--rows", "3"]) == 0
    mine = tmp_path / f"sub{suffix}"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert make_core_subset.main(["--src", str(subset_src), "--out", str(out), "--rows", "2"]) == 0
    assert (mine / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["shared", "sub", mine.name])
    assert json.loads((out / "SUBSET.json").read_text())["rows_per_task"] == 2


def test_grouped_export_into_a_new_dir_that_fails_at_the_weights_leaves_nothing(tmp_path, monkeypatch, capsys):
    """A grouped (their table mapping) export writes the tokenizer and the slot map, both shared files, before the
    weights: a full disk there removes both and every folder it made (the tokenizer stayed when it was judged while
    the slot map still sat in the checkpoint folder, as if another checkpoint might use it)."""
    from reference_fixtures import make_their_files

    _, source, _ = make_their_files(tmp_path, "mome_table")
    run = tmp_path / "ours"
    save_checkpoint(run, 12, source, {"tokenizer_dir": str(tmp_path / "our_tok")})
    real_save = torch.save

    def full_at_weights(obj, path, *a, **k):
        return (full_disk_save if Path(path).name.startswith("model_") else real_save)(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", full_at_weights)
    out = tmp_path / "new" / "base"
    assert export_reference.main(["--run", str(run), "--out", str(out)]) == 2
    assert "model_000012.pt: No space left on device" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
