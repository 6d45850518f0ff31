"""Importing the authors' checkpoints and exporting ours to their format (scripts/import_reference.py,
scripts/export_reference.py), against synthetic checkpoints written from the spec's name tables: the imported model
equals the source, the export round-trips bit for bit. Refusals, faults and the hub: test_reference_import_faults.py;
the table slot mapping: test_reference_import_slot_map.py."""

from dataclasses import replace
import json
from pathlib import Path

import pytest
import torch

from reference_fixtures import (DESIGNS, STEP, _edit_meta, logits, make_their_files, run_import, their_model_config,
                                their_state_dict)

from nanochat.checkpoint import load_model, save_checkpoint
from nanochat.memory import MEMORY_BLOCKS
from nanochat.tokenizer import get_tokenizer
from scripts import export_reference


TEXT = "She deposited her salary at the bank. They had a picnic on the grassy river bank. \u00e9t\u00e9 42"


def assert_same_config(a, b):
    """Equal design: same fields, and the block options equal once parsed (defaults spelled out or not). A
    grouped index's slot map is the same file (name and sha256), wherever each run keeps its copy."""
    da, db = a.to_dict(), b.to_dict()
    oa, ob = da.pop("memory_options"), db.pop("memory_options")
    assert da == db
    oa, ob = MEMORY_BLOCKS[a.memory].Options(**oa), MEMORY_BLOCKS[b.memory].Options(**ob)
    if getattr(oa, "slot_map", ""):
        assert Path(oa.slot_map).name == Path(ob.slot_map).name
        ob = replace(ob, slot_map=oa.slot_map)
    assert oa == ob


@pytest.mark.parametrize("design", list(DESIGNS))
def test_import_gives_the_source_model_exactly(tmp_path, design):
    src, source, tok = make_their_files(tmp_path, design)
    run = tmp_path / "run"
    assert run_import(src, run, "--dataset", "climbmix") == 0
    model, meta = load_model(run)
    assert meta["step"] == STEP and meta["dataset"] == "climbmix"
    assert_same_config(model.config, source.config)
    for k, v in source.state_dict().items():
        # fp32 (the source's dtype; a grouped index's int64 map, from the slot-map JSON)
        assert model.state_dict()[k].dtype == v.dtype and torch.equal(model.state_dict()[k], v), k
    assert torch.equal(logits(model.eval()), logits(source))  # fp32: the mapping is exact
    imported = meta["imported_from"]
    assert imported["compiled_prefix"] is True and imported["dropped_keys"] == []
    assert imported["upcast_tensors"] == {"torch.bfloat16": sum(k.startswith(("transformer.wte", "embed_value",
                                                                              "bigram_engram_embedding"))
                                                                for k in their_state_dict(source, design, prefix=""))}
    assert imported["reference_meta"]["val_bpb"] == 1.25 and imported["token_bytes"]["matches_reference_rule"]
    assert len(imported["sha256"]["model"]) == 64
    ours = get_tokenizer(meta["tokenizer_dir"])
    assert ours.encode(TEXT) == tok.encode(TEXT) and ours.special_tokens == tok.special_tokens
    assert not list(tmp_path.glob(".run.importing-*"))


def test_import_of_a_slot_factor_run_equals_ours_with_the_factor(tmp_path):
    """Their meta of a --moe-ve-slot-factor 4 mod run (user_config: the factor and slot size 0 = derived;
    model_config: the S = ceil(V / 4) their base_train resolved) imports as our --mome-slot-factor 4 run with the
    tokenizer's 439 tokens, i.e. --mome-rows 110, and its weights load exactly."""
    import argparse

    from nanochat.memory import add_memory_args, memory_config_from_args

    src, source, tok = make_their_files(tmp_path, "mome_mod_factor")
    meta = json.loads((src / "base_checkpoints" / "d4" / f"meta_{STEP:06d}.json").read_text())
    assert meta["user_config"]["moe_ve_slot_factor"] == 4 and meta["user_config"]["moe_ve_slot_vocab_size"] == 0
    assert run_import(src, tmp_path / "run") == 0
    model, _ = load_model(tmp_path / "run")
    parser = argparse.ArgumentParser()
    add_memory_args(parser)
    ours = memory_config_from_args(parser.parse_args(["--memory", "mome", "--mome-slots", "4", "--mome-index", "mod",
                                                      "--mome-slot-factor", "4"]), tok.vocab_size)
    assert tok.vocab_size == 439 and ours["memory_options"]["rows"] == 110
    assert_same_config(model.config, replace(source.config, memory_options=ours["memory_options"]))
    assert torch.equal(logits(model.eval()), logits(source))


def test_import_drops_rotary_buffers_and_reads_unprefixed_fp32(tmp_path):
    src, source, _ = make_their_files(tmp_path, "mome_token")
    ckpt = src / "base_checkpoints" / "d4"
    state = their_state_dict(source, "mome_token", bf16=False, prefix="")
    state["cos"], state["sin"] = torch.ones(1, 640, 1, 16).bfloat16(), torch.zeros(1, 640, 1, 16).bfloat16()
    torch.save(state, ckpt / f"model_{STEP:06d}.pt")
    assert run_import(src, tmp_path / "run") == 0
    model, meta = load_model(tmp_path / "run")
    assert meta["imported_from"]["dropped_keys"] == ["cos", "sin"] and meta["imported_from"]["upcast_tensors"] == {}
    assert torch.equal(logits(model.eval()), logits(source))
    # their MoME layers' balance bookkeeping buffers, if a checkpoint carries them: metrics only, dropped by name
    extra = {f"embed_value_moe.layers.0.{name}": torch.zeros(3) for name in ("last_load", "maxvio_counts",
                                                                             "last_maxvio", "router_bias")}
    torch.save({**state, **extra}, ckpt / f"model_{STEP:06d}.pt")
    assert run_import(src, tmp_path / "run2") == 0
    model, meta = load_model(tmp_path / "run2")
    assert meta["imported_from"]["dropped_keys"] == ["cos", *sorted(extra), "sin"]
    assert torch.equal(logits(model.eval()), logits(source))
    state["embed_value_moe.layers.0.other_buffer"] = torch.zeros(3)  # anything else is still refused
    torch.save(state, ckpt / f"model_{STEP:06d}.pt")
    assert run_import(src, tmp_path / "run3") == 2


@pytest.mark.parametrize("design", list(DESIGNS))
def test_export_matches_their_names_and_round_trips_bit_exactly(tmp_path, design):
    _, source, tok = make_their_files(tmp_path, design)
    ours = tmp_path / "ours"
    save_checkpoint(ours, 12, source, {"tokenizer_dir": str(tmp_path / "our_tok"), "loop": {"val_bpb": 0.9}})
    out = tmp_path / "export"
    assert export_reference.main(["--run", str(ours), "--out", str(out)]) == 0
    ckpt = out / "base_checkpoints" / "d4"
    exported = torch.load(ckpt / "model_000012.pt", weights_only=True)
    oracle = their_state_dict(source, design, bf16=False, prefix="")
    assert sorted(exported) == sorted(oracle)  # the spec's names, independently written out
    assert all(torch.equal(exported[k], oracle[k]) and exported[k].dtype == torch.float32 for k in oracle)
    meta = json.loads((ckpt / "meta_000012.json").read_text())
    assert meta["model_type"] == DESIGNS[design][0] and meta["val_bpb"] == 0.9
    assert meta["model_config"]["window_pattern"] == "L"
    theirs = their_model_config(source, design)
    for k in [*DESIGNS[design][1], "moe_ve_slot_vocab_size"]:  # the design fields come out as their code writes
        assert meta["model_config"][k] == theirs[k], k
    if theirs["moe_ve_slot_mapping"] == "table":  # their JSON beside the checkpoint, byte for byte
        exported_map = Path(meta["model_config"]["moe_ve_slot_map_path"])
        assert exported_map.is_absolute() and exported_map.parent == ckpt.resolve()
        assert exported_map.read_bytes() == Path(theirs["moe_ve_slot_map_path"]).read_bytes()

    back = tmp_path / "back"
    assert run_import(out, back) == 0
    model, back_meta = load_model(back, 12)
    assert_same_config(model.config, source.config)
    sd = source.state_dict()
    assert sorted(model.state_dict()) == sorted(sd)
    assert all(torch.equal(model.state_dict()[k], sd[k]) for k in sd)
    tok_back = get_tokenizer(back_meta["tokenizer_dir"])
    assert (tok_back.mergeable_ranks, tok_back.special_tokens, tok_back.pattern) == \
        (tok.mergeable_ranks, tok.special_tokens, tok.pattern)


def test_sliding_windows_import_and_export(tmp_path):
    """Their window_pattern SSSL is our --window-pattern SSSL: the imported model computes what the source weights
    compute with those windows (not what they compute with full attention), and export writes the pattern back."""
    from nanochat.gpt import build_model

    src, source, _ = make_their_files(tmp_path, "mome_token")
    _edit_meta(src, window_pattern="SSSL")  # sequence_len 64: S layers see 32 keys back, the test rows are 48 long
    assert run_import(src, tmp_path / "run") == 0
    model, _ = load_model(tmp_path / "run")
    windowed = build_model(replace(source.config, window_pattern="SSSL"))
    windowed.load_state_dict(source.state_dict())
    assert model.config.window_pattern == "SSSL" and torch.equal(logits(model.eval()), logits(windowed.eval()))
    assert not torch.allclose(logits(model), logits(source))
    out = tmp_path / "export"
    assert export_reference.main(["--run", str(tmp_path / "run"), "--out", str(out)]) == 0
    meta = json.loads((out / "base_checkpoints" / "d4" / f"meta_{STEP:06d}.json").read_text())
    assert meta["model_config"]["window_pattern"] == "SSSL"
    assert run_import(out, tmp_path / "back") == 0
    assert_same_config(load_model(tmp_path / "back")[0].config, model.config)


def test_window_pattern_config_round_trip():
    """Their SSSL config is our --window-pattern SSSL (their lower case too), and the config exports back."""
    from nanochat.reference_format import config_from_reference, reference_from_config

    theirs = {"n_layer": 4, "n_head": 2, "n_kv_head": 2, "n_embd": 64, "sequence_len": 64, "vocab_size": 512,
              "window_pattern": "sssl"}
    ours = config_from_reference("gpt", theirs)
    assert ours.window_pattern == "SSSL" and ours.attention_windows == (32, 32, 32, None)
    model_type, back = reference_from_config(ours)
    assert (model_type, back["window_pattern"]) == ("gpt", "SSSL") and config_from_reference(model_type, back) == ours
    assert config_from_reference("gpt", {k: v for k, v in theirs.items() if k != "window_pattern"}).window_pattern \
        == "SSSL"  # a meta without the field takes their GPTConfig default, as their loader would
    assert reference_from_config(replace(ours, window_pattern="L"))[1]["window_pattern"] == "L"


def test_export_of_an_imported_run_and_a_shared_base_dir(tmp_path, capsys):
    src, source, _ = make_their_files(tmp_path, "bigram")
    assert run_import(src, tmp_path / "run") == 0
    out = tmp_path / "export"
    assert export_reference.main(["--run", str(tmp_path / "run"), "--out", str(out)]) == 0
    meta = json.loads((out / "base_checkpoints" / "d4" / f"meta_{STEP:06d}.json").read_text())
    assert meta["val_bpb"] == 1.25  # carried from their meta through the import
    assert export_reference.main(["--run", str(tmp_path / "run"), "--out", str(out)]) == 2
    assert "already exists; choose a new directory or --model-tag" in capsys.readouterr().err
    # a second run into the same base dir shares the (identical) tokenizer
    assert export_reference.main(["--run", str(tmp_path / "run"), "--out", str(out), "--model-tag", "other"]) == 0
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == ["token_bytes.pt", "tokenizer.pkl"]


def test_an_imported_run_still_works_after_it_is_moved_and_cannot_be_resumed(tmp_path, capsys):
    """Its meta held the absolute path of its own tokenizer: a moved (or copied) run pointed at the old place.
    base_train --resume on it blamed the filesystem for the missing optimizer state."""
    from scripts import base_train, sample

    src, source, tok = make_their_files(tmp_path, next(iter(DESIGNS)))
    run = tmp_path / "run"
    assert run_import(src, run) == 0
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    run.rename(moved)
    model, meta = load_model(moved)
    assert Path(meta["tokenizer_dir"]) == moved / "tokenizer"
    assert get_tokenizer(meta["tokenizer_dir"]).encode(TEXT) == tok.encode(TEXT)
    sample.main(["--run", str(moved), "--prompt", "the bank", "--max-tokens", "2", "--device-type", "cpu"])
    assert "--- sample 0" in capsys.readouterr().out
    cfg = model.config
    rc = base_train.main(["--synthetic-data", "--vocab-size", str(cfg.vocab_size), "--depth", str(cfg.n_layer),
                          "--model-dim", str(cfg.n_embd), "--num-heads", str(cfg.n_head), "--max-seq-len", "32",
                          "--eval-tokens", "256",  # the default 20M builds 655k synthetic eval rows (~25 s) first
                          "--num-iterations", str(STEP + 1), "--run-dir", str(moved), "--resume", str(STEP)])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"checkpoint step {STEP} of {moved} was imported (weights only: no optimizer or data-loader state)" in err
    assert "start a new run from its weights with --init-from" in err
