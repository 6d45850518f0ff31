"""Value Embedding baseline (modded-nanogpt / nanochat; paper appendix "Baseline Implementation Details").

Per memory layer a dense table of (padded V) x (H_kv * d) rows: one d-wide slice per KV head, looked up by the
current token and added to the attention values before RoPE/SDPA:

    v <- v + gamma[..., None] * VE_l[idx].view(B, T, H_kv, d),   gamma = 2 * sigmoid(W_g xn[..., :32])

W_g is Linear(32 -> H_kv, no bias), zero-init, so gamma == 1 at init. The same gate is reused by MoME.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from .base import MemoryBlock

GATE_CHANNELS = 32  # the gate reads only the first 32 channels of the normed hidden state (reference choice)


class ValueGate(nn.Module):
    """gamma = 2*sigmoid(W xn[..., :32]) per head: (B, T, C) -> (B, T, n_heads)."""

    def __init__(self, n_embd: int, n_heads: int):
        super().__init__()
        if n_embd < GATE_CHANNELS:
            raise ValueError(f"memory gates read {GATE_CHANNELS} channels but n_embd is {n_embd}")
        self.proj = nn.Linear(GATE_CHANNELS, n_heads, bias=False)

    def init_weights(self) -> None:
        nn.init.zeros_(self.proj.weight)  # gamma == 1 at init: a neutral injection scale

    def forward(self, xn: torch.Tensor) -> torch.Tensor:
        return 2.0 * torch.sigmoid(self.proj(xn[..., :GATE_CHANNELS]))


def init_table_uniform(weight: torch.Tensor, bound: float) -> None:
    """U(-bound, bound), with the backbone family's bound (``config.memory_table_bound``): nanochat sqrt(3/C)
    (its matrix init, std 1/sqrt(C)), MobileLLM C^-0.5, Qwen3 0.02 (reference families spec §2.4, §3.3)."""
    nn.init.uniform_(weight, -bound, bound)


class GammaTracker(nn.Module):
    """Running mean of the gate gamma per memory layer, accumulated in training forwards (no host sync) and
    read and reset by ``stats()`` at log steps."""

    STATS_BUFFERS = ("gamma_sum", "count")  # summed over ranks before stats() and kept in checkpoints

    def __init__(self, n_layers: int):
        super().__init__()
        self.register_buffer("gamma_sum", torch.zeros(n_layers), persistent=False)
        self.register_buffer("count", torch.zeros(n_layers, dtype=torch.int64), persistent=False)  # forwards

    def init_weights(self) -> None:
        self.gamma_sum.zero_()
        self.count.zero_()

    @torch.no_grad()
    def add(self, pos: int, gamma: torch.Tensor) -> None:
        self.gamma_sum[pos] += gamma.float().mean()
        self.count[pos] += 1

    @torch.no_grad()
    def pop(self, layers: tuple[int, ...]) -> dict[str, float]:
        means = (self.gamma_sum / self.count.clamp_min(1)).tolist()
        seen = self.count.tolist()
        self.init_weights()
        return {f"memory/gamma_mean/layer{layer}": m for layer, m, c in zip(layers, means, seen) if c > 0}


def record(capture: dict | None, layer: int, **tensors) -> None:
    """Opt-in analysis capture: store detached tensors under capture[layer] (no work when capture is None)."""
    if capture is not None:
        capture.setdefault(layer, {}).update({k: t.detach() for k, t in tensors.items()})


@dataclass
class VEOptions:
    pass


class ValueEmbedding(MemoryBlock):
    Options = VEOptions
    uses_layers = True
    table_weight_decay = 0.001

    def __init__(self, config):
        super().__init__(config)
        self.n_embd, self.n_kv_head, self.head_dim = config.n_embd, config.n_kv_head, config.head_dim
        self.table_bound = config.memory_table_bound
        self.layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        width = config.n_kv_head * config.head_dim
        self.tables = nn.ModuleList(nn.Embedding(config.padded_vocab_size, width) for _ in self.layers)
        self.gates = nn.ModuleList(ValueGate(config.n_embd, config.n_kv_head) for _ in self.layers)
        self.tracker = GammaTracker(len(self.layers))
        self.capture: dict | None = None

    def init_weights(self) -> None:
        self.tracker.init_weights()
        for table in self.tables:
            init_table_uniform(table.weight, self.table_bound)
        for gate in self.gates:
            gate.init_weights()

    def memory_tables(self) -> list[nn.Parameter]:
        return [t.weight for t in self.tables]

    def prepare(self, idx, state):
        return idx

    def value(self, layer, xn, v, ctx):
        pos = self.layer_pos.get(layer)
        if pos is None:
            return v
        B, T, H, d = v.shape
        ve = self.tables[pos](ctx).view(B, T, H, d).to(v.dtype)  # (B, T, H_kv, d)
        gamma = self.gates[pos](xn)  # (B, T, H_kv)
        inject = gamma[..., None].to(v.dtype) * ve
        if self.training:
            self.tracker.add(pos, gamma)
        if self.capture is not None:
            record(self.capture, layer, gamma=gamma, inject_norm=inject.float().norm(dim=-1))
        return v + inject

    def stats(self) -> dict[str, float]:
        return self.tracker.pop(self.layers)
