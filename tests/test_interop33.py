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
