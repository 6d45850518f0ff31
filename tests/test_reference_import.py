"""Importing the authors' checkpoints and exporting ours to their format (scripts/import_reference.py,
scripts/export_reference.py), against synthetic checkpoints written from the spec's name tables."""

from dataclasses import replace
import json
from pathlib import Path
import shutil

import pytest
import torch

from reference_fixtures import (DESIGNS, STEP, make_their_files, their_model_config, their_state_dict,
                                write_their_checkpoint)

from nanochat.checkpoint import load_model, save_checkpoint
from nanochat.memory import MEMORY_BLOCKS
from nanochat.tokenizer import get_tokenizer
from scripts import export_reference, import_reference

TEXT = "She deposited her salary at the bank. They had a picnic on the grassy river bank. \u00e9t\u00e9 42"


def run_import(src, run_dir, *extra) -> int:
    return import_reference.main([str(src), "--run-dir", str(run_dir), *extra])


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


def logits(model, seed=0):
    idx = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(idx)


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


def test_export_refuses_designs_their_code_lacks(tmp_path, capsys):
    from nanochat.gpt import build_model

    tok_dir = tmp_path / "our_tok"
    make_their_files(tmp_path, "base")
    for opts, needle in ((dict(routing="token-only"), "--mome-routing token-only"),
                         (dict(balance="bias"), "--mome-balance bias"),
                         (dict(router_type="conv1d"), "--mome-router-type conv1d")):
        from conftest import tiny_config

        cfg = tiny_config(vocab_size=get_tokenizer(tok_dir).vocab_size, memory="mome", n_embd=64,
                          memory_options=dict(slots=4, topk=2, **opts))
        run = tmp_path / needle.split()[-1]
        save_checkpoint(run, 1, build_model(cfg, seed=0), {"tokenizer_dir": str(tok_dir)})
        assert export_reference.main(["--run", str(run), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("model_type", ["mobilellm-125m", "qwen3-0.6b"])
def test_export_refuses_other_backbone_families(tmp_path, capsys, model_type):
    from nanochat.families import build_model
    from nanochat.train_args import parse_args
    from scripts.base_train import model_config

    tok_dir = tmp_path / "our_tok"
    make_their_files(tmp_path, "base")
    vocab = get_tokenizer(tok_dir).vocab_size
    args = parse_args(["--model-type", model_type, "--depth", "2", "--model-dim", "64", "--num-heads", "4",
                       "--num-kv-heads", "2", "--head-dim", "16", "--max-seq-len", "32", "--memory", "ve"])
    run = tmp_path / "run"
    save_checkpoint(run, 1, build_model(model_config(args, vocab), seed=0), {"tokenizer_dir": str(tok_dir)})
    assert export_reference.main(["--run", str(run), "--out", str(tmp_path / "x")]) == 2
    assert f"--model-type {model_type.split('-')[0]} has no counterpart" in capsys.readouterr().err


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


# -- errors -----------------------------------------------------------------------------------------------
def _edit_meta(src, **fields):
    path = src / "base_checkpoints" / "d4" / f"meta_{STEP:06d}.json"
    meta = json.loads(path.read_text())
    meta["model_config"].update(fields)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("fields, needle", [
    ({"window_pattern": "SSXL"}, "window_pattern='SSXL': expected a non-empty string of L/S"),
    ({"moe_ve_gate_type": "conv1d"}, "moe_ve_gate_type='conv1d': their conv1d router's parameter names and kernel "
     "layout are not in the verified name table"),
    ({"moe_ve_gate_type": "conv2d"}, "moe_ve_gate_type='conv2d': expected linear or conv1d"),
    ({"moe_ve_slot_mapping": "modulo"}, "moe_ve_slot_mapping='modulo'"),
    ({"moe_ve_slot_mapping": "headmod", "moe_ve_slot_vocab_size": 100}, "moe_ve_slot_dedicated_size=0"),
    ({"moe_ve_slot_mapping": "headmod", "moe_ve_slot_vocab_size": 100, "moe_ve_slot_dedicated_size": 100},
     "moe_ve_slot_dedicated_size=100: headmod needs 0 < D < S = 100"),
    ({"moe_ve_slot_mapping": "mod", "moe_ve_slot_dedicated_size": 5}, "moe_ve_slot_dedicated_size=5"),
    ({"moe_ve_slot_mapping": "mod", "moe_ve_slot_vocab_size": 449}, "moe_ve_slot_vocab_size=449"),
    ({"moe_ve_slot_mapping": "mod", "moe_ve_slot_vocab_size": 100, "moe_ve_slot_index_mode": "bigram",
      "moe_ve_network_shared_table": True}, "moe_ve_slot_mapping='mod': with moe_ve_slot_index_mode 'bigram'"),
    ({"moe_ve_slot_mapping": "table", "moe_ve_slot_map_path": "/nowhere/k2.json"},  # no --slot-map, no file
     "pass it with --slot-map FILE (the meta's moe_ve_slot_map_path '/nowhere/k2.json' is not a file here)"),
    ({"moe_ve_per_head_table": 1}, "moe_ve_per_head_table=1: expected true or false"),
    ({"moe_ve_bias_update": "trust_region", "moe_ve_balance_lr": 0.001}, "moe_ve_bias_update='trust_region'"),
    ({"moe_ve_setting": "2_2_6"}, "moe_ve_setting='2_2_6': the shared-expert field is 0 or 1"),
    ({"moe_ve_setting": "1_0_0"}, "moe_ve_setting='1_0_0': a shared expert without routed slots"),
    ({"moe_ve_setting": ""}, "moe_ve_setting='': a shared expert without routed slots"),  # their parser: (1, 0, 0)
    ({"moe_ve_gate_nl": "softmax-norm-detach"}, "moe_ve_gate_nl='softmax-norm-detach'"),
    ({"moe_ve_network_shared_table": True}, "moe_ve_network_shared_table=True"),
    ({"dense_ve_enabled": True}, "'dense_ve_enabled', 'moe_ve_enabled'"),
    ({"value_embeds_layers": [3, 1]}, "value_embeds_layers=[3, 1]"),
    ({"fancy_new_field": 1}, "unknown field(s) ['fancy_new_field']"),
    ({"moe_ve_slot_mapping": "mod", "moe_ve_slot_factor": 2},  # their CLI flag: base_train resolves it into S
     "moe_ve_slot_factor=2: not a field of their GPTConfig"),
    ({"moe_ve_slot_index_mode": "bigram", "moe_ve_network_shared_table": True, "moe_ve_bigram_slot_factor": 0},
     "moe_ve_bigram_slot_factor=0: must be an integer >= 1"),  # their field, not our --mome-bigram-factor
])
def test_unsupported_design_fields_are_refused_by_name(tmp_path, capsys, fields, needle):
    src, _, _ = make_their_files(tmp_path, "mome_token")
    _edit_meta(src, **fields)
    assert run_import(src, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run.importing-*"))


def _rewrite_state(src, fn):
    path = src / "base_checkpoints" / "d4" / f"model_{STEP:06d}.pt"
    state = torch.load(path, weights_only=True)
    fn(state)
    torch.save(state, path)


def test_state_dict_errors_name_the_key(tmp_path, capsys):
    src, source, _ = make_their_files(tmp_path, "ve")
    key = "_orig_mod.embed_value_dense.layers.3.weight"
    rows = source.config.padded_vocab_size
    cases = [
        (lambda s: s.update({"_orig_mod.transformer.h.0.attn.mystery.weight": torch.zeros(2)}),
         "unknown state dict key(s) for this model_config: ['transformer.h.0.attn.mystery.weight']"),
        (lambda s: s.pop(key), "state dict lacks key(s) ['embed_value_dense.layers.3.weight']"),
        (lambda s: s.update({key: s[key][:-1]}), f"'embed_value_dense.layers.3.weight' has shape ({rows - 1}, 64), the model_config needs ({rows}, 64)"),
        (lambda s: s.update({key[len("_orig_mod."):]: s[key]}), "appears with and without the _orig_mod. prefix"),
    ]
    pristine = (src / "base_checkpoints" / "d4" / f"model_{STEP:06d}.pt").read_bytes()
    for edit, needle in cases:
        (src / "base_checkpoints" / "d4" / f"model_{STEP:06d}.pt").write_bytes(pristine)
        _rewrite_state(src, edit)
        assert run_import(src, tmp_path / "run") == 2
        assert needle in capsys.readouterr().err


@pytest.mark.parametrize("full_at", ["checkpoint", "tokenizer"])
def test_a_checkpoint_that_cannot_be_written_is_one_clear_error(tmp_path, monkeypatch, capsys, full_at):
    """A full disk while the imported checkpoint (or the run's tokenizer copy) is written: exit 2 with the write's
    error, no run dir, and the partial import removed."""
    import errno

    from nanochat import checkpoint as ckpt
    from nanochat import tokenizer as tokmod

    src, _, _ = make_their_files(tmp_path, "base")

    def full_disk(path, *args):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(*((ckpt, "_write_file") if full_at == "checkpoint" else (tokmod, "write_bytes_atomic")), full_disk)
    assert run_import(src, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "Traceback" not in err, err
    assert ("error: could not write checkpoint step" in err) == (full_at == "checkpoint"), err
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run.importing-*"))


def test_missing_files_and_vocab_mismatch(tmp_path, capsys):
    src, source, tok = make_their_files(tmp_path, "base")
    (src / "base_checkpoints" / "d4" / f"model_{STEP:06d}.pt").rename(tmp_path / "moved.pt")
    assert run_import(src, tmp_path / "run") == 2
    assert f"model_{STEP:06d}.pt is missing" in capsys.readouterr().err
    (tmp_path / "moved.pt").rename(src / "base_checkpoints" / "d4" / f"model_{STEP:06d}.pt")

    assert run_import(src, tmp_path / "run", "--step", "7") == 2
    assert "no meta_000007.json (steps found: [5])" in capsys.readouterr().err

    (src / "tokenizer" / "tokenizer.pkl").rename(tmp_path / "tokenizer.pkl")
    assert run_import(src, tmp_path / "run") == 2
    assert "no tokenizer.pkl found; pass --tokenizer" in capsys.readouterr().err
    assert run_import(src, tmp_path / "run", "--tokenizer", str(tmp_path / "tokenizer.pkl")) == 0  # no token_bytes
    assert load_model(tmp_path / "run")[1]["imported_from"]["token_bytes"] == {"path": None}

    _edit_meta(src, vocab_size=tok.vocab_size + 1)
    assert run_import(src, tmp_path / "run2", "--tokenizer", str(tmp_path / "tokenizer.pkl")) == 2
    assert f"vocab mismatch: {tmp_path / 'tokenizer.pkl'} has {tok.vocab_size} tokens" in capsys.readouterr().err

    assert run_import(tmp_path / "nowhere", tmp_path / "run3") == 2
    assert "not a directory and not a hub repo id" in capsys.readouterr().err
    assert run_import(src, tmp_path / "run") == 2  # never over an existing run
    assert "exists and is not empty" in capsys.readouterr().err


def test_token_bytes_that_break_their_rule_are_refused(tmp_path, capsys):
    src, _, tok = make_their_files(tmp_path, "base")
    tb = torch.load(src / "tokenizer" / "token_bytes.pt")
    assert int(tb[0xE2]) == 3 and int(tok.token_bytes()[0xE2]) == 1  # a lone UTF-8 lead byte decodes to U+FFFD
    tb[0xE2] = 1  # raw bytes instead of their rule
    torch.save(tb, src / "tokenizer" / "token_bytes.pt")
    assert run_import(src, tmp_path / "run") == 2
    assert "token_bytes.pt: 1 entries differ" in capsys.readouterr().err


# -- hub --------------------------------------------------------------------------------------------------
class FakeHub:
    """Stands in for huggingface_hub's downloads: serves files from a local 'remote' directory, honouring
    allow_patterns like the real one (fnmatch on repo paths), and records what was fetched."""

    COMMIT = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, remote, cache):
        self.remote, self.cache, self.fetched, self.calls = remote, cache / self.COMMIT, [], []

    def _copy(self, rel):
        dst = self.cache / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.remote / rel, dst)
        self.fetched.append(rel)
        return dst

    def snapshot_download(self, repo_id, revision=None, allow_patterns=None, **kw):
        import fnmatch

        self.calls.append(("snapshot", repo_id, revision))
        for p in sorted(self.remote.rglob("*")):
            rel = p.relative_to(self.remote).as_posix()
            if p.is_file() and any(fnmatch.fnmatch(rel, pat) for pat in allow_patterns):
                self._copy(rel)
        return str(self.cache)

    def hf_hub_download(self, repo_id, filename, revision=None, **kw):
        self.calls.append(("file", repo_id, revision))
        return str(self._copy(filename))


def test_hub_download_fetches_only_the_chosen_step(tmp_path, monkeypatch):
    import huggingface_hub

    src, source, _ = make_their_files(tmp_path, "mome_token")
    write_their_checkpoint(src / "base_checkpoints" / "d4", source, "mome_token", step=2)  # an older step
    hub = FakeHub(src, tmp_path / "hf_cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub.hf_hub_download)
    monkeypatch.chdir(tmp_path)  # "owner/name" must not exist as a local path
    assert run_import("jojo23333/MOME-NanoChat-D24-100B", tmp_path / "run") == 0
    weights = [f for f in hub.fetched if f.endswith(".pt") and "model_" in f]
    assert weights == [f"base_checkpoints/d4/model_{STEP:06d}.pt"]
    assert hub.calls[-1] == ("file", "jojo23333/MOME-NanoChat-D24-100B", FakeHub.COMMIT)  # pinned to the snapshot
    model, meta = load_model(tmp_path / "run")
    assert meta["imported_from"]["hub_repo"] == "jojo23333/MOME-NanoChat-D24-100B"
    assert meta["imported_from"]["commit"] == FakeHub.COMMIT
    assert torch.equal(logits(model.eval()), logits(source))


def test_local_directory_never_touches_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    def offline(*a, **k):
        raise AssertionError("hub called for a local directory")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    src, _, _ = make_their_files(tmp_path, "base")
    assert run_import(src, tmp_path / "run") == 0


def test_hub_failure_is_one_clear_error(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    def unreachable(*a, **k):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.chdir(tmp_path)
    assert run_import("someone/missing-model", tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert "SRC someone/missing-model: not a local directory, and the hub download failed (OSError: network" in err


def test_weights_download_failure_names_the_file(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    src, _, _ = make_their_files(tmp_path, "base")
    hub = FakeHub(src, tmp_path / "hf_cache")

    def broken(*a, **k):
        raise OSError("connection reset")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", broken)
    monkeypatch.chdir(tmp_path)
    assert run_import("jojo23333/MOME-NanoChat-D24-100B", tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert f"file base_checkpoints/d4/model_{STEP:06d}.pt: download failed (OSError: connection reset)" in err
    assert not (tmp_path / "run").exists()


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


# -- the table slot mapping (the d12 grouped rows) ----------------------------------------------------------
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
    """read_for_import parses and hashes the same bytes: one read of the file (a d12 map is ~1 MB), and the
    digest it records is the file's sha256."""
    import builtins
    import hashlib
    import io

    from nanochat import reference_slot_map

    src, _, _ = make_their_files(tmp_path, "mome_table")
    path = src / "slotmaps" / "tiny_k2.json"
    opens, results, real_open, real_read = [], [], builtins.open, reference_slot_map.read_for_import

    def counting_open(file, *a, **k):
        opens.append(Path(file) == path if isinstance(file, (str, Path)) else False)
        return real_open(file, *a, **k)

    def read_counting_opens(*a, **k):
        with monkeypatch.context() as m:
            m.setattr(builtins, "open", counting_open)
            m.setattr(io, "open", counting_open)  # Path.read_bytes/read_text open through io.open
            results.append(real_read(*a, **k))
        return results[-1]

    monkeypatch.setattr(reference_slot_map, "read_for_import", read_counting_opens)
    assert run_import(src, tmp_path / "run") == 0
    assert opens.count(True) == 1
    assert results[0].sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


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
