"""scripts/import_reference and scripts/export_reference refuse what they cannot express and fail with one clear
line: designs and meta fields their code (or ours) lacks, broken state dicts, missing files, a full disk; and the
hub as a source (a stand-in for huggingface_hub's downloads)."""

import shutil

import pytest
import torch

from reference_fixtures import STEP, _edit_meta, logits, make_their_files, run_import, write_their_checkpoint

from nanochat.checkpoint import load_model, save_checkpoint
from nanochat.tokenizer import get_tokenizer
from scripts import export_reference


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
    ({"moe_ve_bias_update": "trust-region"}, "moe_ve_bias_update='trust-region': expected one of"),  # a moving
    # bias of a known rule imports (their evaluation routes without it): tests/test_interop33.py
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


@pytest.mark.parametrize("stop_at", ["convert", "checkpoint"])
def test_ctrl_c_midway_is_one_line_exit_130_and_leaves_no_run(tmp_path, monkeypatch, capsys, stop_at):
    """Ctrl-C while the source is read (convert) or the checkpoint written: one line, exit 130, no traceback, no
    run dir and no work folder (a rerun imports afresh)."""
    from nanochat import checkpoint as ckpt
    from scripts import import_reference

    src, _, _ = make_their_files(tmp_path, "base")

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(*((import_reference, "convert") if stop_at == "convert" else (ckpt, "_write_file")), ctrl_c)
    assert run_import(src, tmp_path / "run") == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "interrupted" in err, err
    assert str(tmp_path / "run") in err
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
