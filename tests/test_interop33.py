"""Session 33's interop review: their meta files and state dicts that the importer must refuse with one line naming
the field or key (never a traceback, never a silent inexact conversion)."""

import pytest
import torch

from nanochat.reference_format import (ReferenceFormatError, config_from_reference, expected_shapes,
                                       state_from_reference, state_to_reference)

BASE = {"n_layer": 4, "n_head": 2, "n_kv_head": 2, "n_embd": 64, "sequence_len": 64, "vocab_size": 512,
        "window_pattern": "L"}
MOME = {"moe_ve_enabled": True, "value_embeds_layers": [1, 3], "moe_ve_setting": "0_2_6", "moe_ve_balance_lr": 0.0,
        "moe_ve_bias_update": "none"}


@pytest.mark.parametrize("fields, needle", [
    ({"n_layer": "4"}, "n_layer='4': expected an integer >= 1"),
    ({"vocab_size": None}, "vocab_size=None: expected an integer >= 1"),
    ({"n_embd": 64.0}, "n_embd=64.0: expected an integer >= 1"),
    ({"n_head": True}, "n_head=True: expected an integer >= 1"),
    ({**MOME, "moe_ve_setting": 12}, "moe_ve_setting=12: expected 'shared_active_experts'"),
    ({**MOME, "moe_ve_bias_update": "deepseek_moe", "moe_ve_balance_lr": "0"},
     "moe_ve_balance_lr='0': expected a number"),
    ({"dense_ve_enabled": True, "value_embeds_layers": [1, 5]}, "value_embeds_layers=[1, 5]: layer ids must lie in"),
    ({"bigram_engram_enabled": True, "bigram_engram_layers": [-1, 3]}, "bigram_engram_layers=[-1, 3]: layer ids"),
    ({"bigram_engram_enabled": True, "bigram_engram_vocab_factor": 0}, "bigram_engram_vocab_factor=0: expected an "
     "integer >= 1"),
])
def test_malformed_meta_fields_are_refused_by_their_name(fields, needle):
    """Each of these raised a TypeError/AttributeError traceback (import_reference catches ValueError only) or an
    error naming one of OUR flags (--memory-layers, --bigram-factor) instead of the meta's field."""
    with pytest.raises(ReferenceFormatError) as e:
        expected_shapes(config_from_reference("gpt", {**BASE, **fields}))
    assert needle in str(e.value)


def test_a_float64_tensor_imports_only_when_fp32_holds_it_exactly():
    """'Conversion is a rename plus an exact upcast': a float64 tensor was rounded to fp32 silently."""
    config = config_from_reference("gpt", BASE)
    theirs = state_to_reference({k: torch.randn(v) for k, v in expected_shapes(config).items()}, config)
    exact = dict(theirs, **{"lm_head.weight": theirs["lm_head.weight"].double()})  # fp32 values held in fp64
    ours, report = state_from_reference(exact, config)
    assert torch.equal(ours["lm_head.weight"], theirs["lm_head.weight"])
    assert report["upcast_tensors"] == {"torch.float64": 1}
    inexact = dict(exact, **{"lm_head.weight": exact["lm_head.weight"] + 1e-12})
    with pytest.raises(ReferenceFormatError, match="'lm_head.weight' is float64 and fp32 cannot hold its values"):
        state_from_reference(inexact, config)


def test_a_hub_repo_with_several_checkpoint_folders_says_how_to_pick_one(tmp_path, monkeypatch, capsys):
    """find_meta's "pass the one you want" cannot be followed with a hub repo id (SRC names the repo, not a folder of
    it): the error says how to download the folder and import it as a local directory."""
    import huggingface_hub
    from reference_fixtures import make_their_files, run_import, write_their_checkpoint
    from test_reference_import_faults import FakeHub

    src, source, _ = make_their_files(tmp_path, "base")
    write_their_checkpoint(src / "chatsft_checkpoints" / "d4", source, "base")
    hub = FakeHub(src, tmp_path / "hf_cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub.hf_hub_download)
    monkeypatch.chdir(tmp_path)
    assert run_import("someone/two-checkpoints", tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert "hub repo someone/two-checkpoints holds checkpoints in several folders " \
           "['base_checkpoints/d4', 'chatsft_checkpoints/d4']" in err
    assert "hf download someone/two-checkpoints --include 'FOLDER/*' '*tokenizer.pkl' '*token_bytes.pt' " \
           "--local-dir DIR" in err and "pass DIR/FOLDER as SRC" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
    # the advice works: the folder as SRC, the tokenizer (outside it) named
    assert run_import(src / "chatsft_checkpoints" / "d4", tmp_path / "run", "--tokenizer",
                      str(src / "tokenizer" / "tokenizer.pkl")) == 0


def test_an_imported_run_refuses_another_tokenizer_of_its_size(tmp_path, capsys):
    """An imported run recorded no tokenizer fingerprint (base_train's runs do), so a --tokenizer-dir override of the
    same vocab size but other token ids passed every check of its consumers: export_reference wrote the weights
    beside the wrong tokenizer."""
    from reference_fixtures import make_their_files, run_import

    from nanochat.checkpoint import load_meta
    from nanochat.tokenizer import Tokenizer
    from scripts import export_reference

    src, _, tok = make_their_files(tmp_path, "base")
    run = tmp_path / "run"
    assert run_import(src, run) == 0
    assert load_meta(run)["tokenizer_sha256"] == tok.fingerprint()
    other = Tokenizer(tok.mergeable_ranks, pattern=r"\w+|\s+|.")  # same ranks and size, another split
    other.save(tmp_path / "other_tok")
    assert other.vocab_size == tok.vocab_size and other.encode(" the bank") != tok.encode(" the bank")
    out = tmp_path / "export"
    assert export_reference.main(["--run", str(run), "--out", str(out), "--tokenizer-dir",
                                  str(tmp_path / "other_tok")]) == 2
    assert "the tokenizer is not the one" in capsys.readouterr().err and not out.exists()
    assert export_reference.main(["--run", str(run), "--out", str(out)]) == 0  # its own tokenizer


def test_build_slot_map_refuses_a_tokenizer_the_checkpoint_was_not_trained_with(tmp_path, capsys):
    """--tokenizer-dir was not checked against the checkpoint: a tokenizer of the same size but other token ids gave
    a map stamped with ITS fingerprint (refused by runs on the checkpoint's own tokenizer, accepted by runs on the
    wrong one), and a smaller one put its special-token ids on ordinary tokens of the model's vocabulary."""
    from conftest import tiny_config
    from reference_fixtures import pairable_tokenizer
    from test_analysis import make_tokenizer

    from nanochat.checkpoint import save_checkpoint
    from nanochat.gpt import build_model
    from nanochat.tokenizer import Tokenizer
    from scripts.build_slot_map import main as build_slot_map

    tok = pairable_tokenizer(tmp_path / "tok")  # 440 tokens: rows of 2
    model = build_model(tiny_config(vocab_size=tok.vocab_size), seed=0)
    save_checkpoint(tmp_path / "run", 3, model, {"tokenizer_dir": str(tmp_path / "tok"),
                                                 "tokenizer_sha256": tok.fingerprint()})
    Tokenizer(tok.mergeable_ranks, pattern=r"\w+|\s+|.").save(tmp_path / "same_size")
    smaller = make_tokenizer(tmp_path / "smaller")
    assert smaller.vocab_size == tok.vocab_size - 1

    def build(*extra):
        return build_slot_map(["--checkpoint", str(tmp_path / "run"), "--group-size", "2", *extra,
                               "--output", str(tmp_path / "map.json")])

    assert build("--tokenizer-dir", str(tmp_path / "same_size")) == 2
    assert "the tokenizer is not the one --checkpoint" in capsys.readouterr().err
    assert build("--tokenizer-dir", str(tmp_path / "smaller")) == 2
    assert f"tokenizer vocab size {smaller.vocab_size} does not match vocab_size {tok.vocab_size}" in \
        capsys.readouterr().err
    assert not (tmp_path / "map.json").exists()
    assert build() == 0 and build("--tokenizer-dir", str(tmp_path / "tok")) == 0  # its own, found or named


def test_a_hub_import_verifies_the_small_files_and_only_the_chosen_weights(tmp_path, monkeypatch):
    """fetch_hub checksummed every file of the cached snapshot: with the weights of earlier imported steps in the
    cache (5.5 GB each at d24), each import hashed them all again, besides its own step's (which hub_file checks)."""
    import huggingface_hub
    from reference_fixtures import STEP, make_their_files, run_import, write_their_checkpoint
    from test_reference_import_faults import FakeHub

    from nanochat import download

    src, source, _ = make_their_files(tmp_path, "base")
    write_their_checkpoint(src / "base_checkpoints" / "d4", source, "base", step=2)
    hub = FakeHub(src, tmp_path / "hf_cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub.hf_hub_download)
    verified, real = [], download.verify_hub_blob
    monkeypatch.setattr(download, "verify_hub_blob",
                        lambda path, where="": verified.append(path.name) or real(path, where))
    monkeypatch.chdir(tmp_path)
    assert run_import("someone/steps", tmp_path / "a") == 0  # step 5's weights now in the cache
    verified.clear()
    assert run_import("someone/steps", tmp_path / "b", "--step", "2") == 0
    assert sorted(verified) == ["meta_000002.json", f"meta_{STEP:06d}.json", "model_000002.pt", "token_bytes.pt",
                                "tokenizer.pkl"]


def test_a_moving_router_bias_imports_as_their_evaluation_routes(tmp_path, capsys):
    """Their CLI's default (moe_ve_bias_update deepseek_moe, lr 1e-3) trains with a bias that is neither saved nor
    used outside training forwards (spec model §3.6): the import is their evaluation's model (--mome-balance none),
    with a note saying so; it was refused before. An inert bias (lr 0, every paper run) gets no note."""
    import json

    from nanochat.checkpoint import load_meta
    from nanochat.reference_format import moving_bias_note
    from reference_fixtures import make_their_files, run_import

    src, _, _ = make_their_files(tmp_path, "mome_token")
    meta_path = next(src.glob("base_checkpoints/d4/meta_*.json"))
    meta = json.loads(meta_path.read_text())
    assert moving_bias_note(meta["model_config"]) == ""
    meta["model_config"].update(moe_ve_bias_update="deepseek_moe", moe_ve_balance_lr=0.001)
    meta_path.write_text(json.dumps(meta))
    assert run_import(src, tmp_path / "run", "--dataset", "climbmix") == 0
    out = capsys.readouterr().out
    assert "note: trained with their moving router bias (moe_ve_bias_update 'deepseek_moe', moe_ve_balance_lr " \
           "0.001)" in out and "evaluations are exact" in out and "--mome-balance bias" in out
    options = load_meta(tmp_path / "run")["model_config"]["memory_options"]
    assert options.get("balance", "none") == "none"
