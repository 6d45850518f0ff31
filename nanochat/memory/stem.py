"""STEM baseline: a token-indexed table replaces the FFN up-projection (paper "Iso-token" table; families spec §4).

On each memory layer of a SwiGLU backbone the FFN loses its up-projection W_up (C -> F) and gains a table
S_l of (padded V) x F rows, looked up by the current token id:

    FFN_l(x) = W_down( silu(W_gate x) ⊙ S_l[token] )        instead of   W_down( silu(W_gate x) ⊙ W_up x )

x is the FFN-normed residual; the gate branch still reads the hidden state, the row depends on the token only
(no context, no extra scale or bias). The paper's "1/2 setting" uses the alternating (odd) layers, the
``--memory-layers`` default. Tables are memory (excluded from FLOPs, their own AdamW group; the reference trains
them like the embedding: ``--memory-lr 0.3 --memory-beta2 0.95 --memory-wd 0``, which the STEM row configs set)
and are initialised like the family's token embedding (``config.init_token_table``).
"""

from dataclasses import dataclass

import torch.nn as nn

from .base import MemoryBlock


@dataclass
class STEMOptions:
    pass


class STEMMemory(MemoryBlock):
    Options = STEMOptions
    uses_layers = True
    table_weight_decay = 0.0  # the reference's STEM group sets no decay

    def __init__(self, config):
        super().__init__(config)
        ffn_hidden = getattr(config, "ffn_hidden", None)  # only SwiGLU families have a separate up-projection
        if ffn_hidden is None:
            raise ValueError("--memory stem replaces the up-projection of a SwiGLU FFN; the nanochat backbone's "
                             "relu^2 MLP has none: use --model-type mobilellm|qwen3 (or a named size)")
        self.init_token_table = config.init_token_table
        self.layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        self.tables = nn.ModuleList(nn.Embedding(config.padded_vocab_size, ffn_hidden) for _ in self.layers)

    def init_weights(self) -> None:
        for table in self.tables:
            self.init_token_table(table.weight)

    def memory_tables(self) -> list[nn.Parameter]:
        return [t.weight for t in self.tables]

    def prepare(self, idx, state):
        return idx

    def owns_ffn_up(self, layer: int) -> bool:
        return layer in self.layer_pos

    def ffn_up(self, layer, xn, ctx):
        return self.tables[self.layer_pos[layer]](ctx).to(xn.dtype)  # (B, T, F)
