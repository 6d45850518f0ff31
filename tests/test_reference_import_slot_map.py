"""The table slot mapping (the d12 grouped rows) through scripts/import_reference and scripts/export_reference:
their slot-map JSON read, checked against the meta and tokenizer, kept with the run, and written back."""

import json
from pathlib import Path

import torch

from reference_fixtures import _edit_meta, logits, make_their_files, run_import

from nanochat.checkpoint import load_model, save_checkpoint
from scripts import export_reference


def test_table_mapped_import_reads_their_slots_and_is_self_contained(tmp_path, capsys):
    """Each token reads the slot whose token_ids list it in their JSON (read here without our loader); the run
    keeps a copy of the JSON and, in its checkpoint, the map: it loads and samples after the JSON and the run
    are moved."""
    from nanochat.memory.slot_map import load_slot_map
    from scripts import sample

    src, source, _ = make_their_files(tmp_path, "mome_table")
    their_json = src / "slotmaps" / "tiny_k2.json"
    slot_of = {t: s["slot_id"] for s in json.loads(their_json.read_text())["slots"] for t in s["token_ids"]}
    assert run_import(src, tmp_path / "run") == 0  # found through the meta's moe_ve_slot_map_path
    model, meta = load_model(tmp_path / "run")
    idx = torch.arange(model.config.vocab_size).view(4, -1)
    rows = model.memory.prepare(idx, None)[1]
    assert rows.tolist() == [[slot_of[t] for t in r] for r in idx.tolist()]
    assert model.memory.tables[0].weight.shape == (len(slot_of) // 2 * 4, 32)  # S*E x d, S = V/c
    copy = tmp_path / "run" / "slot_map" / "tiny_k2.json"
    assert copy.read_bytes() == their_json.read_bytes() and model.config.memory_options["slot_map"] == str(copy)
    assert meta["imported_from"]["files"]["slot_map"] == str(their_json)
    assert meta["imported_from"]["sha256"]["slot_map"] == model.config.memory_options["slot_map_sha256"]
    assert torch.equal(load_slot_map(copy, len(slot_of), 2, meta["imported_from"]["sha256"]["slot_map"]).token_to_row,
                       model.memory.slot_map)  # the config's path and hash name the run's copy
    their_json.rename(tmp_path / "gone.json")
    (tmp_path / "run").rename(tmp_path / "moved")
    moved, _ = load_model(tmp_path / "moved")
    assert torch.equal(logits(moved.eval()), logits(source))
    sample.main(["--run", str(tmp_path / "moved"), "--prompt", "the bank", "--max-tokens", "2", "--device-type", "cpu"])
    assert "--- sample 0" in capsys.readouterr().out
    # the moved run's export gives back their JSON byte for byte (from the run's copy, not one written anew)
    assert export_reference.main(["--run", str(tmp_path / "moved"), "--out", str(tmp_path / "export")]) == 0
    exported = json.loads(next((tmp_path / "export").rglob("meta_*.json")).read_text())["model_config"]
    assert Path(exported["moe_ve_slot_map_path"]).read_bytes() == (tmp_path / "gone.json").read_bytes()
    assert run_import(src, tmp_path / "run2", "--slot-map", str(tmp_path / "gone.json")) == 0  # the flag
    assert torch.equal(logits(load_model(tmp_path / "run2")[0].eval()), logits(source))


def test_table_mapped_import_refuses_a_slot_map_that_does_not_fit(tmp_path, capsys):
    from reference_fixtures import shuffled_rows, their_slot_map_json

    src, _, tok = make_their_files(tmp_path, "mome_table")
    good = src / "slotmaps" / "tiny_k2.json"
    V = tok.vocab_size

    def refused(needle, *extra):
        assert run_import(src, tmp_path / "run", *extra) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "run").exists()

    def variant(name, rows=None, **edits):
        data = {**their_slot_map_json(tok, rows or shuffled_rows(V, 2)), **edits}
        (tmp_path / name).write_text(json.dumps(data))
        return str(tmp_path / name)

    refused(f"--slot-map {tmp_path / 'nope.json'}: no such file", "--slot-map", str(tmp_path / "nope.json"))
    path = variant("vocab.json", vocab_size=V + 2)
    refused(f"--slot-map {path}: built for vocab size {V + 2}, the checkpoint's model_config vocab_size is {V}",
            "--slot-map", path)
    path = variant("k4.json", shuffled_rows(V, 4))  # 110 slots of 4 for a table of 220 slots
    refused(f"--slot-map {path}: has slot_vocab_size {V // 4}, the checkpoint's table has {V // 2} slots",
            "--slot-map", path)
    data = their_slot_map_json(tok, shuffled_rows(V, 2))
    data["slots"][0]["token_ids"][0] = data["slots"][1]["token_ids"][0]  # a token in two slots
    (tmp_path / "dup.json").write_text(json.dumps(data))
    refused(f"--slot-map {tmp_path / 'dup.json'}: rows are not a disjoint full partition", "--slot-map",
            str(tmp_path / "dup.json"))
    data = their_slot_map_json(tok, shuffled_rows(V, 2))
    slot = next(s for s in data["slots"] if tok.encode("the")[0] in s["token_ids"])
    slot["token_texts"][slot["token_ids"].index(tok.encode("the")[0])] = "not it"  # another tokenizer's text
    (tmp_path / "tok.json").write_text(json.dumps(data))
    refused(f"--slot-map {tmp_path / 'tok.json'}: 1 token texts differ", "--slot-map", str(tmp_path / "tok.json"))
    for fields, needle in (({"moe_ve_slot_vocab_size": 150}, "moe_ve_slot_vocab_size=150: with moe_ve_slot_mapping "
                            "'table' the slot count S must divide vocab_size 440"),
                           ({"moe_ve_slot_vocab_size": V // 8}, "moe_ve_setting='0_2_4': E=4 is not a multiple of "
                            "the group size c = vocab_size/moe_ve_slot_vocab_size = 8"),
                           ({"moe_ve_slot_vocab_size": V // 2, "moe_ve_slot_index_mode": "bigram",
                             "moe_ve_network_shared_table": True}, "moe_ve_slot_mapping='table': with "
                            "moe_ve_slot_index_mode 'bigram'")):
        _edit_meta(src, **fields)
        refused(needle)
    _edit_meta(src, moe_ve_slot_mapping="none", moe_ve_slot_index_mode="token", moe_ve_network_shared_table=False)
    refused("--slot-map x.json: the checkpoint reads no slot map (model_config moe_ve_slot_mapping is 'none'",
            "--slot-map", "x.json")
    assert good.is_file()


def test_table_mapped_import_parses_the_slot_map_once(tmp_path, monkeypatch):
    """The checks against their meta and our loader's checks share one parse of the JSON (a d12 map: 32768 ids
    and their texts)."""
    src, _, _ = make_their_files(tmp_path, "mome_table")
    text = (src / "slotmaps" / "tiny_k2.json").read_text()
    parsed, real = [], json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: parsed.append(s == text) or real(s, *a, **k))
    assert run_import(src, tmp_path / "run") == 0
    assert parsed.count(True) == 1


def test_table_mapped_import_opens_the_slot_map_once(tmp_path, monkeypatch):
    """One read of the file per import (a d12 map is ~1 MB): the config's hash, the parse, the run's copy and the
    provenance hash all come from the same bytes (before, four reads: a file changed during the import could give
    a copy other than the map parsed), and the digests recorded are the file's sha256."""
    import builtins
    import hashlib
    import io

    src, _, _ = make_their_files(tmp_path, "mome_table")
    path = src / "slotmaps" / "tiny_k2.json"
    opens, real_open = [], builtins.open

    def counting_open(file, *a, **k):
        opens.append(isinstance(file, (str, Path)) and Path(file) == path)
        return real_open(file, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", counting_open)
        m.setattr(io, "open", counting_open)  # Path.read_bytes/read_text open through io.open
        assert run_import(src, tmp_path / "run") == 0
    assert opens.count(True) == 1
    model, meta = load_model(tmp_path / "run")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert meta["imported_from"]["sha256"]["slot_map"] == model.config.memory_options["slot_map_sha256"] == digest
    assert (tmp_path / "run" / "slot_map" / path.name).read_bytes() == path.read_bytes()


def test_grouped_run_with_our_slot_map_exports_their_json_and_round_trips(tmp_path):
    """A run trained here reads our slot-map format: the export writes the map the model holds in theirs."""
    from nanochat.gpt import build_model
    from nanochat.memory.slot_map import write_slot_map
    from reference_fixtures import COMMON, pairable_tokenizer, shuffled_rows

    from conftest import tiny_config

    tok = pairable_tokenizer(tmp_path / "tok")
    rows = shuffled_rows(tok.vocab_size, 2, seed=3)
    digest = write_slot_map(tmp_path / "ours.map", rows, tok.vocab_size, 2, bos_token_id=tok.bos_token_id,
                            tokenizer_fingerprint=tok.fingerprint())
    opts = dict(slots=4, topk=2, index="grouped", group_size=2, slot_map=str(tmp_path / "ours.map"),
                slot_map_sha256=digest)
    source = build_model(tiny_config(vocab_size=tok.vocab_size, memory="mome", memory_options=opts, **COMMON),
                         seed=0).eval()
    save_checkpoint(tmp_path / "ours", 3, source, {"tokenizer_dir": str(tmp_path / "tok")})
    out = tmp_path / "export"
    assert export_reference.main(["--run", str(tmp_path / "ours"), "--out", str(out)]) == 0
    meta = json.loads((out / "base_checkpoints" / "d4" / "meta_000003.json").read_text())
    assert (meta["model_config"]["moe_ve_slot_mapping"], meta["model_config"]["moe_ve_slot_vocab_size"]) == \
        ("table", tok.vocab_size // 2)
    theirs = json.loads(Path(meta["model_config"]["moe_ve_slot_map_path"]).read_text())
    assert Path(meta["model_config"]["moe_ve_slot_map_path"]).name == "slot_map.json"  # .map is not theirs
    assert (theirs["format"], theirs["mapping"], theirs["slot_factor"]) == ("nanochat_slot_map_v1", "table", 2)
    assert [s["slot_id"] for s in theirs["slots"]] == list(range(len(rows)))
    assert [sorted(s["token_ids"]) for s in theirs["slots"]] == [sorted(r) for r in rows]
    assert run_import(out, tmp_path / "back") == 0  # their texts check against the tokenizer on the way back
    back, _ = load_model(tmp_path / "back")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in source.state_dict().items())
    assert torch.equal(logits(back.eval()), logits(source))
