"""Session 33's fresh-eyes review of the backbone families (MobileLLM, Qwen3): the edges it found uncovered."""

import dataclasses

import pytest

from nanochat.families import build_model, config_from_dict
from nanochat.llama import LlamaConfig
from nanochat.qwen3 import Qwen3Config

SMALL = dict(sequence_len=16, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, head_dim=16, ffn_hidden=96)


@pytest.mark.parametrize("cls,other", [(LlamaConfig, "qwen3"), (Qwen3Config, "mobilellm"), (LlamaConfig, "nanochat")])
def test_a_config_whose_family_field_names_another_family_is_refused(cls, other):
    """``family`` is a dataclass field of the SwiGLU configs (meta.json records it) and ``build_model`` dispatches on
    it, while the init rules (``memory_table_bound``, ``init_token_table``) come from the class: LlamaConfig(
    family="qwen3") built a Qwen3 model with MobileLLM's U(+-C^-0.5) memory tables and truncated token tables, and
    Qwen3Config(family="mobilellm") a MobileLLM model with Qwen3's 0.02 inits, which saved and reloaded as a
    LlamaConfig. The class and the field must agree."""
    with pytest.raises(ValueError, match=f"family={other!r}"):
        cls(**SMALL, family=other)
    with pytest.raises(ValueError, match=f"family={other!r}"):
        dataclasses.replace(cls(**SMALL), family=other)
    own = cls(**SMALL)
    assert config_from_dict(own.to_dict()) == own and type(build_model(own).config) is cls
