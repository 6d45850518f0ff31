"""Bigram baseline (modded-nanogpt hashed bigram embedding; paper appendix "Baseline Implementation Details").

ONE zero-init table of factor*V rows x C (V = unpadded vocab) shared by all memory layers, indexed by the bigram
hash of (previous, current) token (``hashing.bigram_hash``, computed once per forward in ``prepare``). On each
memory layer, after the resid/x0 mix and before the block:

    x <- x + lambda_l * (gamma ⊙ e),   e = table[h].view(B, T, n_head, C/n_head),   gamma = 2*sigmoid(G_l norm(x)[..., :32])

G_l is Linear(32 -> n_head, no bias), zero-init. ``lambdas`` has one entry per layer (n_layer of them, as in the
reference: 0.1 on memory layers, 0 elsewhere and never used there), so d12 has 12 lambdas, giving the reference
total of 286,262,436 params. Because the table is zero, the model equals Base exactly at init.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.cli_types import check_int_at_least

from .base import MemoryBlock
from .hashing import prepare_bigram_rows
from .ve import GammaTracker, ValueGate, record

LAMBDA_INIT = 0.1


@dataclass
class BigramOptions:
    factor: int = 6  # --bigram-factor: table rows = factor * vocab_size

    def __post_init__(self):
        check_int_at_least("--bigram-factor", self.factor)


class BigramMemory(MemoryBlock):
    Options = BigramOptions
    uses_layers = True
    table_weight_decay = 0.0  # reference base_train passes no decay for the bigram table

    def __init__(self, config):
        super().__init__(config)
        if config.n_embd % config.n_head:
            raise ValueError(f"--memory bigram gates the residual stream in n_head = {config.n_head} groups; "
                             f"the width {config.n_embd} is not divisible by it")
        # one gate per n_head channel group of the residual stream (= head_dim on nanochat; Qwen3's H*d != C)
        self.n_embd, self.n_head, self.group_width = config.n_embd, config.n_head, config.n_embd // config.n_head
        self.rows = self.opts.factor * config.vocab_size
        self.layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        self.table = nn.Embedding(self.rows, config.n_embd)
        self.gates = nn.ModuleList(ValueGate(config.n_embd, config.n_head) for _ in self.layers)
        self.lambdas = nn.Parameter(torch.empty(config.n_layer))
        self.tracker = GammaTracker(len(self.layers))
        self.capture: dict | None = None

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.zeros_(self.table.weight)  # zero table: the model is exactly Base at init
        for gate in self.gates:
            gate.init_weights()
        self.lambdas.zero_()
        self.lambdas[list(self.layers)] = LAMBDA_INIT
        self.tracker.init_weights()

    def memory_tables(self) -> list[nn.Parameter]:
        return [self.table.weight]

    def scalar_params(self) -> list[nn.Parameter]:
        return [self.lambdas]

    def prepare(self, idx, state):
        return self.table(prepare_bigram_rows(idx, self.rows, state))  # (B, T, C), once per forward

    def residual(self, layer, x, ctx):
        pos = self.layer_pos.get(layer)
        if pos is None:
            return x
        B, T, C = x.shape
        gamma = self.gates[pos](F.rms_norm(x, (C,)))  # (B, T, n_head)
        e = ctx.to(x.dtype).view(B, T, self.n_head, self.group_width)
        inject = self.lambdas[layer].to(x.dtype) * (gamma[..., None].to(x.dtype) * e)  # (B, T, H, C/H)
        if self.training:
            self.tracker.add(pos, gamma)
        if self.capture is not None:
            record(self.capture, layer, gamma=gamma, inject_norm=inject.float().norm(dim=-1))
        return x + inject.view(B, T, C)

    def stats(self) -> dict[str, float]:
        out = self.tracker.pop(self.layers)
        out.update({f"memory/lambda/layer{layer}": float(self.lambdas[layer].detach()) for layer in self.layers})
        return out
