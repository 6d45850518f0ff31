"""Registry-driven checks: every ``MEMORY_BLOCKS`` design and every ``FAMILIES`` family is covered the moment it is
registered (docs/extending.md). Tiny dims, depth 2, vocab 128, no training loop: the file runs in seconds."""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from conftest import MEMORY_OPTION_SETS, tiny_config
from nanochat import families
from nanochat.families import FAMILIES, Family, build_model, config_from_args, config_from_dict, param_groups
from nanochat.gpt import GPT, GPTConfig
from nanochat.memory import BLOCK_FLAGS, MEMORY_BLOCKS
from nanochat.optim import OptimConfig
from nanochat.train_args import parse_args


# -- a family is its own config and model class, whatever its FFN ----------------------------------------------
@dataclass
class VariantGPTConfig(GPTConfig):
    family: ClassVar[str] = "gpt-variant"


class VariantGPT(GPT):
    pass


class ForgotFamilyConfig(GPTConfig):  # inherits family "nanochat": registered under another key, it is refused
    pass


@pytest.fixture
def variant_family(monkeypatch):
    monkeypatch.setitem(FAMILIES, "gpt-variant", Family(VariantGPTConfig, VariantGPT, None, True))
    monkeypatch.setattr(families, "MODEL_TYPES", (*families.MODEL_TYPES, "gpt-variant"))


def test_a_nanochat_gpt_variant_family_builds_trains_and_loads_its_own_classes(variant_family):
    args = parse_args(["--synthetic-data", "--vocab-size", "128", "--depth", "2", "--model-dim", "64",
                       "--head-dim", "32"])
    args.model_type = "gpt-variant"  # the parser's choices are fixed at import; the registry is read at build time
    config = config_from_args(args, 128, dict(memory="base", memory_layers=[], memory_options={}))
    assert type(config) is VariantGPTConfig
    model = build_model(config, seed=0)
    assert type(model) is VariantGPT
    groups = param_groups(model, OptimConfig())
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(p) for p in model.parameters())
    d = config.to_dict()
    assert d["family"] == "gpt-variant"
    assert config_from_dict(d) == config and type(config_from_dict(d)) is VariantGPTConfig
    assert "family" not in tiny_config().to_dict()  # the nanochat GPT's meta.json is as it was
    assert type(config_from_dict(tiny_config().to_dict())) is GPTConfig


def test_a_family_whose_config_names_another_family_is_refused(monkeypatch):
    monkeypatch.setitem(FAMILIES, "forgot", Family(ForgotFamilyConfig, GPT, None, True))
    with pytest.raises(ValueError, match="'forgot'.*ForgotFamilyConfig.family is 'nanochat'"):
        families.check_families()
    with pytest.raises(ValueError, match="'forgot'.*ForgotFamilyConfig.family is 'nanochat'"):
        families.family_of(ForgotFamilyConfig())


@dataclass
class ExplicitHeadConfig(families.Qwen3Config):
    family: str = "explicit-head"


def test_head_size_flags_follow_the_registry_rule_not_a_family_name(monkeypatch):
    """--num-heads with a --head-dim that C/H contradicts: refused where d = C/H, kept where d = --head-dim."""
    from nanochat.train_args import check_geometry

    monkeypatch.setitem(FAMILIES, "explicit-head", Family(ExplicitHeadConfig, families.Qwen3, lambda c: 3 * c, False))
    args = parse_args(["--model-type", "qwen3", "--model-dim", "64", "--num-heads", "3", "--head-dim", "16"])
    for name, refused in (("explicit-head", False), ("qwen3", False), ("mobilellm", True), ("nanochat", True)):
        args.model_type = name
        if refused:
            with pytest.raises(ValueError, match="--model-dim 64 must split into --num-heads 3 heads of even size"):
                check_geometry(args)
        else:
            check_geometry(args)


# -- every registered design -------------------------------------------------------------------------------------
# BLOCK_FLAGS keys that memory_config_from_args resolves into another option before the block sees them
RESOLVED_BEFORE_THE_BLOCK = {("mome", "slot_factor"): "rows"}


@pytest.mark.parametrize("block, flag, key, kwargs", BLOCK_FLAGS, ids=[row[1] for row in BLOCK_FLAGS])
def test_block_flag_default_is_the_options_default(block, flag, key, kwargs):
    """An unset flag must build what the block's Options build (and what a config without the key loads as);
    memory_config_from_args also takes "equals the default" to mean "not given" for another block's flags."""
    assert block in MEMORY_BLOCKS, f"{flag}: BLOCK_FLAGS names an unregistered design {block!r}"
    defaults = {f.name: f.default for f in dataclasses.fields(MEMORY_BLOCKS[block].Options)}
    if (block, key) in RESOLVED_BEFORE_THE_BLOCK:
        assert key not in defaults and RESOLVED_BEFORE_THE_BLOCK[block, key] in defaults
        return
    assert key in defaults, f"{flag}: {MEMORY_BLOCKS[block].Options.__name__} has no field {key!r}"
    assert kwargs["default"] == defaults[key] and type(kwargs["default"]) is type(defaults[key]), \
        f"{flag} default {kwargs['default']!r} != {MEMORY_BLOCKS[block].Options.__name__}.{key} {defaults[key]!r}"


def test_reference_numerics_refuse_a_family_the_authors_code_lacks(variant_family):
    from nanochat.numerics import apply_numerics

    model = build_model(VariantGPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2,
                                         n_embd=32), seed=0)
    with pytest.raises(ValueError, match="--numerics reference: .*--model-type gpt-variant.*--numerics ours"):
        apply_numerics(model, "reference")
    assert apply_numerics(model, "ours") == {"numerics": "ours"}
