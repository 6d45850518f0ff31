"""JTok and JTok-M: token-indexed tables acting on the FFN output increment (Yang et al. 2026, arXiv 2602.00800;
spec ``appendix_adaptations.md`` §4). No code of the original is public; both are the paper's adaptations.

Norm_eps(u) = u / (||u||_2 + eps) with the L2 norm (not RMS), computed in fp32. On a memory layer, with x~ the
residual after attention, delta = MLP(norm(x~)) the FFN increment and h the block input (after the resid/x0 mix),
both blocks act through the ``mlp_out`` hook:

JTok (``--memory jtok``): a table E_l (padded V x C) and a scale vector s_l (C) per memory layer; only the FFN
increment is modulated, the skip path is untouched:

    x <- x~ + delta ⊙ (1 + s_l ⊙ Norm_eps(E_l[x_t]))

Its structure is forced by the paper's total (spec §4.2, J1): 12 V x C tables plus vector-sized extras make
1,384,138,800 parameters on d24, so one table per odd layer (the VE/MoME convention, the default layers).

JTok-M (``--memory jtokm``) is RECONSTRUCTED: the paper gives only the name and 1,384.1M, which forces
(layers x n_e) = 12 V x C tables with ~30K of routers and scales; n_e = 4 at 3 layers (d24: {7, 15, 23}), K = 2
is the layout that keeps per-layer pools and full-width routers as in the original (spec §4.3, M1). Per memory
layer a pool of n_e tables E_{l,i}, a router R_l (C -> n_e, no bias) reading RMSNorm(h), and s_l:

    g = R_l RMSNorm(h)     G = TopK(g, K)     w_i = sigmoid(g_i) / sum_{j in G} sigmoid(g_j)      (fp32)
    e = sum_{i in G} w_i E_{l,i}[x_t]     dr = s_l ⊙ Norm_eps(e) / sqrt(2 N_l)     x <- x~ + delta + dr

with N_l = n_layer (without the 1/sqrt(2 N_l) the original's hidden-state std blew up). K = 1 is refused: the
normalised weight would be identically 1 and the router would get no gradient. Load balance: the Switch-style
auxiliary loss lambda * n_e * sum_i f_i P_i per layer, summed over the JTok-M layers (f_i: fraction of the
B*T*K assignments that go to expert i; P_i: mean routing probability), returned by ``aux_loss`` and added to the
LM loss by the trainer (training forwards only).

Init (OPEN, spec J3/M2/M3): tables U(+-bound) with the family's table bound (nanochat sqrt(3/C)), s = 1 (near-
identity gate, gradients for E from step 0), router U(+-sqrt(3/C)) (zero would tie every logit and top-K would
pick by index). Optimiser (J5): tables in the memory AdamW group (wd 0.001 as the MoME d24 tables), s in the
scalar group (excluded from FLOPs), the router to Muon by shape. Nothing is carried across decode steps: both
blocks read only the current token and the current hidden state.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.cli_types import check_int_at_least

from .base import MemoryBlock
from .mome_mix import mome_mix, topk_indices
from .mome_options import finite_number_at_least


def l2_normalize(u: torch.Tensor, eps: float) -> torch.Tensor:
    """Norm_eps(u) = u / (||u||_2 + eps) over the last dim, in fp32 (at least)."""
    u = u.to(torch.promote_types(u.dtype, torch.float32))
    return u / (u.norm(dim=-1, keepdim=True) + eps)


@dataclass
class JTokOptions:
    eps: float = 1e-6  # --jtok-eps (spec J4)

    def __post_init__(self):
        finite_number_at_least("--jtok-eps", self.eps, 0, strict=True)  # inf: Norm(u) = 0


@dataclass
class JTokMOptions:
    experts: int = 4  # n_e, --jtokm-experts: tables in each layer's pool
    topk: int = 2  # K, --jtokm-topk
    aux_weight: float = 1e-4  # lambda, --jtokm-aux-weight
    eps: float = 1e-6  # --jtokm-eps

    def __post_init__(self):
        check_int_at_least("--jtokm-experts", self.experts)
        check_int_at_least("--jtokm-topk", self.topk)
        if self.topk == 1:
            raise ValueError("--jtokm-topk 1: with K = 1 the sigmoid-normalised weight is identically 1, so the "
                             "router would get no gradient from the LM loss (spec §4.3 M1); use K >= 2")
        if self.topk > self.experts:
            raise ValueError(f"--jtokm-topk {self.topk} exceeds --jtokm-experts {self.experts} (need K <= n_e)")
        finite_number_at_least("--jtokm-aux-weight", self.aux_weight, 0)
        finite_number_at_least("--jtokm-eps", self.eps, 0, strict=True)


class _ScaledTokenTables(MemoryBlock):
    """What JTok and JTok-M share: per memory layer ``pool_size()`` token tables stored as one
    (padded V * n) x C embedding (row of token x, table i: x * n + i) and a scale vector s_l (C,)."""

    uses_layers = True
    table_weight_decay = 0.001  # as the MoME d24 tables (spec J5)

    def __init__(self, config):
        super().__init__(config)
        self.n_embd = config.n_embd
        self.table_bound = config.memory_table_bound
        self.layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        rows = config.padded_vocab_size * self.pool_size()
        self.tables = nn.ModuleList(nn.Embedding(rows, config.n_embd) for _ in self.layers)
        self.scales = nn.Parameter(torch.empty(len(self.layers), config.n_embd))  # s_l, one row per memory layer

    @torch.no_grad()
    def init_weights(self) -> None:
        for table in self.tables:
            nn.init.uniform_(table.weight, -self.table_bound, self.table_bound)
        self.scales.fill_(1.0)

    def pool_size(self) -> int:
        """Tables per memory layer (the options are parsed when this is asked)."""
        return 1

    def memory_tables(self) -> list[nn.Parameter]:
        return [t.weight for t in self.tables]

    def scalar_params(self) -> list[nn.Parameter]:
        return [self.scales]

    @torch.no_grad()
    def stats(self) -> dict[str, float]:
        """RMS of s_l per memory layer (1 at init)."""
        rms = self.scales.float().square().mean(dim=-1).sqrt().tolist()
        return {f"memory/s_rms/layer{layer}": v for layer, v in zip(self.layers, rms)}


class JTokMemory(_ScaledTokenTables):
    Options = JTokOptions

    def prepare(self, idx, state):
        return idx

    def mlp_out(self, layer, h, delta, ctx):
        pos = self.layer_pos.get(layer)
        if pos is None:
            return delta
        n = l2_normalize(self.tables[pos](ctx), self.opts.eps)  # (B, T, C) fp32
        # the product in fp32: in bf16, 1 + s*n (|s*n| ~ 1/sqrt(C)) would round to steps of 2^-7 around 1
        return (delta.float() * (1.0 + self.scales[pos].float() * n)).to(delta.dtype)


class JTokMMemory(_ScaledTokenTables):
    Options = JTokMOptions
    training_options = ("aux_weight",)  # scales the auxiliary balance loss, not the LM output
    STATS_BUFFERS = ("load_counts",)  # summed over ranks before stats() and kept in checkpoints

    def __init__(self, config):
        super().__init__(config)
        o = self.opts
        self.n_experts, self.K = o.experts, o.topk
        self.residual_scale = 1.0 / math.sqrt(2 * config.n_layer)  # 1/sqrt(2 N_l)
        self.router_bound = math.sqrt(3.0 / config.n_embd)
        self.routers = nn.ModuleList(nn.Linear(config.n_embd, o.experts, bias=False) for _ in self.layers)
        # int64: a log interval's assignments per expert pass 2^24, where fp32 stops adding 1
        self.register_buffer("load_counts", torch.empty(len(self.layers), o.experts, dtype=torch.int64),
                             persistent=False)

    def pool_size(self) -> int:
        return self.opts.experts

    def active_table_params(self) -> int:
        """A token reads the rows of its K selected tables on each JTok-M layer."""
        return len(self.layers) * self.K * self.n_embd

    @classmethod
    def default_layers(cls, n_layer: int) -> tuple[int, ...]:
        """3 layers ending at the last one, n_layer // 3 apart (d24: 7, 15, 23); fewer when n_layer < 3."""
        step = max(1, n_layer // 3)
        return tuple(sorted({n_layer - 1 - k * step for k in range(3)} & set(range(n_layer))))

    @torch.no_grad()
    def init_weights(self) -> None:
        super().init_weights()
        for router in self.routers:
            nn.init.uniform_(router.weight, -self.router_bound, self.router_bound)
        self.load_counts.zero_()

    def prepare(self, idx, state):
        return {"idx": idx.long(), "balance": []}  # balance: one aux term per JTok-M layer of this forward

    def route(self, pos: int, h: torch.Tensor):
        """-> selected experts (B, T, K), their weights (B, T, K) fp32, all logits (B, T, n_e) fp32."""
        logits = self.routers[pos](F.rms_norm(h, (h.size(-1),))).float()
        sel = topk_indices(logits, self.K)
        w = torch.sigmoid(logits.gather(-1, sel))
        return sel, w / w.sum(dim=-1, keepdim=True), logits

    def mlp_out(self, layer, h, delta, ctx):
        pos = self.layer_pos.get(layer)
        if pos is None:
            return delta
        sel, w, logits = self.route(pos, h)
        flat = ctx["idx"][..., None] * self.n_experts + sel  # (B, T, K) rows of the pool's flat table
        e = mome_mix(self.tables[pos].weight, flat, w)  # (B, T, C): sum_i w_i E_i[x_t]
        dr = self.scales[pos].float() * l2_normalize(e, self.opts.eps) * self.residual_scale
        if self.training:
            hits = (sel[..., None] == torch.arange(self.n_experts, device=sel.device)).sum(dim=-2)  # (B, T, n_e)
            with torch.no_grad():  # load bookkeeping without host syncs (read by stats())
                self.load_counts[pos] += hits.reshape(-1, self.n_experts).sum(dim=0, dtype=self.load_counts.dtype)
            ctx["balance"].append(self.balance_term(logits, hits))
        return delta + dr.to(delta.dtype)

    def balance_term(self, logits: torch.Tensor, hits: torch.Tensor) -> torch.Tensor:
        """n_e * sum_i f_i P_i of one layer: f_i = share of the B*T*K assignments given to expert i (no gradient),
        P_i = mean over tokens of sigmoid(g_i) / sum_j sigmoid(g_j) over ALL n_e experts.
        OPEN (spec §4.4): the original's P_i for a sigmoid router is not recovered; this normalisation makes
        uniform routing give exactly 1 (so the loss is lambda per layer)."""
        n_e = self.n_experts
        p = torch.sigmoid(logits)
        P = (p / p.sum(dim=-1, keepdim=True)).reshape(-1, n_e).mean(dim=0)  # (n_e,)
        f = hits.reshape(-1, n_e).sum(dim=0).float() / (hits.size(0) * hits.size(1) * self.K)  # (n_e,)
        return n_e * (f * P).sum()

    def aux_loss(self, ctx):
        terms = ctx["balance"]
        return self.opts.aux_weight * torch.stack(terms).sum() if terms else None

    @torch.no_grad()
    def stats(self) -> dict[str, float]:
        """s RMS per layer, and per layer the share of assignments each expert got since the last call and
        MaxVio = (max load - mean load) / mean load."""
        out = super().stats()
        for layer, load in zip(self.layers, self.load_counts.tolist()):
            total = sum(load)
            if total > 0:
                mean = total / self.n_experts
                out[f"memory/maxvio/layer{layer}"] = (max(load) - mean) / mean
                out.update({f"memory/expert_load/layer{layer}/expert{i}": c / total for i, c in enumerate(load)})
        self.load_counts.zero_()
        return out
