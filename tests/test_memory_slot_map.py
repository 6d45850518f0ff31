"""Slot maps: the kNN builder yields exact groups of near tokens, files round-trip, bad files are rejected."""

import shutil
import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, tiny_config
from reference_fixtures import their_slot_map_json
from nanochat.download import file_sha256
from nanochat.memory.slot_map import build_groups, load_slot_map, write_slot_map


def _clustered(V=120, c=3, D=16, seed=0):
    """V/c tight clusters of c points each, shuffled: the right grouping is known."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(V // c, D, generator=g)
    emb = centers.repeat_interleave(c, 0) + 0.01 * torch.randn(V, D, generator=g)
    perm = torch.randperm(V, generator=g)
    return emb[perm], perm


def test_builder_recovers_clusters_with_exact_sizes():
    emb, perm = _clustered()
    rows = build_groups(emb, 3, k=8)
    assert len(rows) == 40 and all(len(r) == 3 for r in rows)
    assert sorted(t for r in rows for t in r) == list(range(120))
    cluster = (perm // 3).tolist()  # original cluster of each shuffled token
    assert all(len({cluster[t] for t in r}) == 1 for r in rows)


def test_builder_specials_get_their_own_rows():
    emb, _ = _clustered(V=120, c=4, seed=1)
    specials = [115, 116, 117, 118, 119]  # 5 specials, c = 4: one full special row + one completed by 3 leftovers
    rows = build_groups(emb, 4, special_ids=specials, k=8)
    assert len(rows) == 30 and all(len(r) == 4 for r in rows)
    assert sorted(t for r in rows for t in r) == list(range(120))
    with_specials = [r for r in rows if set(r) & set(specials)]
    assert with_specials[0] == specials[:4] and with_specials[1][0] == 119 and len(with_specials) == 2


def test_builder_falls_back_to_exact_search_when_lists_run_out():
    emb = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    rows = build_groups(emb, 4, k=1)
    assert sorted(t for r in rows for t in r) == list(range(64)) and all(len(r) == 4 for r in rows)


def test_round_trip_and_validation(tmp_path):
    rows = [[2 * i + 1, 2 * i] for i in range(8)]
    path = tmp_path / "m.json"
    digest = write_slot_map(path, rows, 16, 2, source_checkpoint="run@step5", tokenizer_fingerprint="abc")
    sm = load_slot_map(path, 16, 2, digest)
    assert sm.token_to_row.tolist() == [i // 2 for i in range(16)]
    assert sm.header["source_checkpoint"] == "run@step5" and sm.header["num_rows"] == 8
    with pytest.raises(ValueError, match="--mome-slot-map .*vocab size 16 but the model has vocab size 32"):
        load_slot_map(path, 32, 2)
    with pytest.raises(ValueError, match="--mome-group-size is 4"):
        load_slot_map(path, 16, 4)
    with pytest.raises(ValueError, match="content hash"):
        load_slot_map(path, 16, 2, "0" * 64)
    path.write_text(path.read_text()[:-5])
    with pytest.raises(ValueError, match="--mome-slot-map .*corrupt"):
        load_slot_map(path, 16, 2)


@pytest.mark.parametrize("rows,msg", [
    ([[0, 1], [1, 2]], "disjoint full partition"),
    ([[0, 1, 2], [3, 4, 5]], "exactly 2"),
    ([[0, 1], [2, 9]], "in \\[0, 4\\)"),
    ([[0, 1]], "expected vocab 4"),
    ([[0.9, 1.2], [2.0, 3.7]], "must be integers"),  # torch.tensor would have truncated them to a valid map
])
def test_bad_partitions(tmp_path, rows, msg):
    path = tmp_path / "bad.json"
    data = {"format": "mome_nanochat_slot_map", "version": 1, "vocab_size": 4, "group_size": 2,
            "num_rows": len(rows), "rows": rows}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=msg):
        load_slot_map(path, 4, 2)


def test_grouped_model_uses_the_map_and_checks_it(tmp_path):
    from nanochat.gpt import build_model

    path = tmp_path / "m.json"
    rows = [list(range(i, i + 2)) for i in range(0, 512, 2)]
    digest = write_slot_map(path, rows, 512, 2)
    opts = dict(index="grouped", group_size=2, slots=6, slot_map=str(path), slot_map_sha256=digest)
    model = build_model(tiny_config(memory="mome", memory_options=opts), seed=0)
    assert model.memory.slot_map.tolist() == [i // 2 for i in range(512)]
    assert model.memory.tables[0].weight.shape == (256 * 6, 64)
    write_slot_map(tmp_path / "w.json", [list(range(i, i + 2)) for i in range(0, 256, 2)], 256, 2)
    wrong = build_model(tiny_config(memory="mome", memory_options={**opts, "slot_map": str(tmp_path / "w.json"),
                                                                   "slot_map_sha256": ""}))
    # a bad map is refused when nothing replaces it: before training (check_ready) and at any forward
    with pytest.raises(ValueError, match="--mome-slot-map .*vocab size 256.*no checkpoint supplied the map"):
        wrong.memory.check_ready()
    with pytest.raises(ValueError, match="--mome-slot-map .*vocab size 256"):
        wrong(torch.zeros(1, 4, dtype=torch.long))


def test_grouped_checkpoint_carries_its_map_without_the_file(tmp_path):
    """Evaluating or resuming elsewhere: the checkpoint holds the exact map, so the file may be gone or rebuilt
    (another hash); the checkpoint's map is used, not the file's."""
    from nanochat.checkpoint import load_model, save_checkpoint
    from nanochat.gpt import build_model

    path = tmp_path / "m.json"
    digest = write_slot_map(path, [list(range(i, i + 2)) for i in range(0, 512, 2)], 512, 2)
    opts = dict(index="grouped", group_size=2, slots=6, slot_map=str(path), slot_map_sha256=digest)
    model = build_model(tiny_config(memory="mome", memory_options=opts), seed=0).eval()
    save_checkpoint(tmp_path / "run", 1, model, {})
    idx = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    path.unlink()
    loaded, _ = load_model(tmp_path / "run")
    assert loaded.memory.slot_map.tolist() == [i // 2 for i in range(512)]
    torch.testing.assert_close(loaded.eval()(idx), model(idx), rtol=0, atol=0)
    write_slot_map(path, [[i, (i + 256) % 512] for i in range(256)], 512, 2)  # rebuilt: another grouping
    loaded, _ = load_model(tmp_path / "run")
    assert loaded.memory.slot_map.tolist() == [i // 2 for i in range(512)]


def test_fresh_training_without_the_slot_map_fails_before_the_first_step(tmp_path, capsys):
    from scripts import base_train

    rc = base_train.main(["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32",
                          "--head-dim", "32", "--max-seq-len", "32", "--eval-tokens", "256", "--no-final-core",
                          "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "2",
                          "--memory", "mome", "--mome-index", "grouped", "--mome-group-size", "2",
                          "--mome-slot-map", str(tmp_path / "missing.json"), "--run-dir", str(tmp_path / "r")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--mome-slot-map" in err and "missing.json: file does not exist" in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_build_slot_map_script(tmp_path, tiny_tokenizer_dir, tiny_tokenizer, capsys):
    from nanochat.checkpoint import save_checkpoint
    from nanochat.gpt import build_model

    model = build_model(tiny_config(memory="ve", vocab_size=1024), seed=0)
    save_checkpoint(tmp_path / "run", 3, model, meta={"tokenizer_dir": str(tiny_tokenizer_dir)})
    save_checkpoint(tmp_path / "bare", 3, model, meta={})

    def argv(run, *extra):
        return ["--checkpoint", str(tmp_path / run), "--group-size", "4", "--source", "ve", *extra,
                "--output", str(tmp_path / f"{run}.json")]

    # as a script from the command line once (its own sys.path set-up); the other cases call main() here
    r = subprocess.run([sys.executable, "scripts/build_slot_map.py", *argv("run")], cwd=REPO, capture_output=True,
                       text=True, timeout=120)  # the tokenizer the checkpoint's run recorded
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run.json"
    sm = load_slot_map(out, 1024, 4, file_sha256(out))
    specials = sorted(tiny_tokenizer.special_tokens.values())
    assert sm.header["special_token_ids"] == specials and sm.header["source"] == "ve"
    assert sm.header["tokenizer_fingerprint"] == tiny_tokenizer.fingerprint()
    assert sm.header["bos_token_id"] == tiny_tokenizer.bos_token_id and "step3" in sm.header["source_checkpoint"]
    assert len({int(sm.token_to_row[i]) for i in specials}) == -(-len(specials) // 4)  # specials keep to themselves
    assert torch.bincount(sm.token_to_row).tolist() == [4] * 256
    from scripts.build_slot_map import main as build_slot_map

    # no tokenizer anywhere: refused (specials would be grouped with ordinary tokens)
    assert build_slot_map(argv("bare")) == 2 and "--tokenizer-dir" in capsys.readouterr().err
    assert build_slot_map(argv("bare", "--tokenizer-dir", str(tiny_tokenizer_dir))) == 0
    assert load_slot_map(tmp_path / "bare.json", 1024, 4).header["tokenizer_fingerprint"] == tiny_tokenizer.fingerprint()


def test_the_authors_slot_maps_load_and_are_checked_against_the_tokenizer(tmp_path, tiny_tokenizer):
    """Their format gives the same map as ours for the same rows, and a map of another tokenizer is refused:
    BOS id, vocab size, token texts (theirs) or fingerprint (ours)."""
    from nanochat.memory.slot_map import check_slot_map_tokenizer

    tok = tiny_tokenizer
    V = tok.vocab_size
    rows = [[i, (i + V // 2)] for i in range(V // 2)]
    theirs, ours = tmp_path / "theirs.json", tmp_path / "ours.json"
    theirs.write_text(json.dumps(their_slot_map_json(tok, rows)))
    write_slot_map(ours, rows, V, 2, tokenizer_fingerprint=tok.fingerprint(), bos_token_id=tok.bos_token_id)
    a, b = load_slot_map(theirs, V, 2), load_slot_map(ours, V, 2)
    assert torch.equal(a.token_to_row, b.token_to_row)
    for sm, path in ((a, theirs), (b, ours)):
        check_slot_map_tokenizer(sm.header, tok, path)  # built for this tokenizer: accepted
    with pytest.raises(ValueError, match="--mome-group-size is 4"):
        load_slot_map(theirs, V, 4)
    data = their_slot_map_json(tok, rows)
    data["slots"][1]["slot_id"] = 5
    theirs.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="slot 1 must be an object with slot_id 1"):
        load_slot_map(theirs, V, 2)
    data = their_slot_map_json(tok, rows)
    data["tokenizer"]["bos_token_id"] = tok.bos_token_id - 1
    theirs.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="BOS id"):
        check_slot_map_tokenizer(load_slot_map(theirs, V, 2).header, tok, theirs)
    data = their_slot_map_json(tok, rows)
    ascii_id = tok.encode("the")[0]
    slot = data["slots"][ascii_id % (V // 2)]
    slot["token_texts"][slot["token_ids"].index(ascii_id)] = "not it"
    theirs.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="1 token texts differ"):
        check_slot_map_tokenizer(load_slot_map(theirs, V, 2).header, tok, theirs)
    write_slot_map(ours, rows, V, 2, tokenizer_fingerprint="0" * 64)
    with pytest.raises(ValueError, match="another tokenizer"):
        check_slot_map_tokenizer(load_slot_map(ours, V, 2).header, tok, ours)
    # the model asks when the trainer binds the run's tokenizer (build_run), before any step
    from nanochat.gpt import build_model

    opts = dict(index="grouped", group_size=2, slots=4, slot_map=str(ours))
    model = build_model(tiny_config(memory="mome", memory_options=opts, vocab_size=V), seed=0)
    with pytest.raises(ValueError, match="--mome-slot-map .*another tokenizer"):
        model.memory.bind_tokenizer(tok)


def test_resume_without_the_slot_map_file_takes_the_checkpoints_map(tmp_path):
    """The checkpoint holds the map, so a resume needs no file (moved to another cluster, or rebuilt): the resumed
    run continues with the checkpoint's map, bit-exactly like an uninterrupted run."""
    from nanochat import checkpoint as ckpt
    from test_train_e2e import losses, train

    path = tmp_path / "map.json"
    write_slot_map(path, [[i, i + 128] for i in range(128)], 256, 2)
    flags = ["--memory", "mome", "--mome-index", "grouped", "--mome-group-size", "2", "--mome-slots", "4",
             "--mome-slot-map", str(path), "--num-iterations", "4", "--save-every", "2"]
    assert train(tmp_path / "full", *flags) == 0
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(ckpt.step_dir(tmp_path / "cut", 4))
    (tmp_path / "cut" / "summary.json").unlink()
    path.unlink()
    with pytest.warns(UserWarning, match="map.json does not exist yet"):  # the preflight still says so
        assert train(tmp_path / "cut", *flags, "--resume", "auto", "--dry-run") == 0
    assert train(tmp_path / "cut", *flags, "--resume", "latest") == 0
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")
    model, _ = ckpt.load_model(tmp_path / "cut")
    assert model.memory.slot_map.tolist() == [i % 128 for i in range(256)]


def test_a_failed_slot_map_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path, monkeypatch):
    from pathlib import Path

    path = tmp_path / "map.json"
    digest = write_slot_map(path, [[0, 1], [2, 3]], 4, 2)
    assert digest == file_sha256(path)  # the returned hash is the file's
    old = path.read_bytes()

    def full_disk(self, target):
        raise OSError(28, "No space left on device", str(self))
    monkeypatch.setattr(Path, "replace", full_disk)
    with pytest.raises(OSError):
        write_slot_map(path, [[0, 2], [1, 3]], 4, 2)
    assert path.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["map.json"]
