"""MoVE-Input adaptation (paper appendix "Token-indexed memory comparisons"; spec appendix_adaptations.md §5).

RECONSTRUCTED: the paper gives only the name and the 1,386.7M total, and MoVE (Mixture-of-Vocabulary-Experts, an
encoder-only method) has no public equations, so the structure below is inferred from that total and MoVE's
described ingredients (spec §5.2, decisions V1-V7; other fits of the total exist).

MoVE builds a large vocabulary from base tokens and produces each expanded token's embedding by hash-routing it
to one two-matrix expert that reads the mean-pooled base embeddings. Here the expanded token is the bigram
b_t = (x_{t-1}, x_t). On each memory layer l (default: the odd layers), after the resid/x0 mix:

    u   = (B_l[x_{t-1}] + B_l[x_t]) / 2                B_l: (padded V) x C base table per layer (memory group)
    k_t = bigram_hash(b_t) mod E                       no router parameters; the same k_t on every layer
    m   = Bexp_k relu^2(Aexp_k norm(u))                E experts shared by all layers: Aexp (r x C), Bexp (C x r)
    x  <- x + gamma ⊙_heads m,   gamma = 2 sigmoid(W_gamma norm(x))        W_gamma: H x C per layer, one per head

Sequence starts: training rows begin with BOS (nanochat's BOS-aligned loader), so the first position's
predecessor is taken to be the row's own first token: b_0 = (BOS, BOS), which is the spec's "use BOS" without
the block needing the tokenizer. In KV-cache decoding the previous chunk's last token is carried in
``state["prev_token"]`` (as the Bigram hash does), so chunked decoding equals the full forward.

Precompute property (MoVE's point): m depends on the bigram only (not on the context), so after training the
pre-gate vector of every bigram could be tabulated offline; only the gate reads the hidden state.

Expert dispatch: the E experts are evaluated as ONE (E*r)-wide relu^2 MLP, i.e. the concatenated Aexp (E*r x C)
and Bexp (C x E*r), with every hidden unit outside the routed expert's r units zeroed. That equals the per-token
dispatch exactly (the zeroed units contribute nothing and get no gradient), has no data-dependent shapes or host
syncs (so it compiles), and costs a C -> 768 -> C matmul pair at d24 (E*r = 768), about 1/8 of a layer's MLP.
Gathering each token's expert matrices instead would materialise (tokens, r, C) weights (6.4 GB at a d24 micro
batch); sorting tokens per expert needs data-dependent sizes.

Init: B_l uniform +-sqrt(3/C) (the project's table init), Aexp uniform +-sqrt(3/C), Bexp and W_gamma zero, so
m = 0, gamma = 1 and the model equals Base at step 0. Aexp, Bexp (one 2-D parameter per expert) and W_gamma go
to Muon by shape; the base tables to the memory AdamW group (default wd 0.001, as MoME's d24 tables).
d24 total: 780,140,592 + 12 V C + 12 (2 r C) + 12 H C = 1,386,700,848.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.cli_types import check_int_at_least

from .base import MemoryBlock
from .hashing import bigram_hash
from .ve import GammaTracker, init_table_uniform, record


@dataclass
class MoVEOptions:
    experts: int = 12  # E, --move-experts (shared by all memory layers)
    rank: int = 64  # r, --move-rank (hidden width of each expert)

    def __post_init__(self):
        check_int_at_least("--move-experts", self.experts)
        check_int_at_least("--move-rank", self.rank)


def bigram_experts(idx: torch.Tensor, experts: int, state: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (prev (B, T) the token before each position, expert ids (B, T) in [0, experts)).

    Position 0 takes the carried ``state["prev_token"]`` when decoding, else its own token (rows start with BOS).
    ``bigram_hash`` with rows = E + 1 hashes mod E; passing ``prev`` always means its reserved row is never used."""
    carried = state.get("prev_token") if state is not None else None
    first = carried if carried is not None else idx[:, 0]
    prev = torch.cat([first.view(-1, 1).to(idx.dtype), idx[:, :-1]], dim=1)
    expert = bigram_hash(idx, experts + 1, prev=first)
    if state is not None:
        state["prev_token"] = idx[:, -1].detach().clone()
    return prev, expert


class MoVEInputMemory(MemoryBlock):
    Options = MoVEOptions
    uses_layers = True
    table_weight_decay = 0.001

    def __init__(self, config):
        super().__init__(config)
        C, H = config.n_embd, config.n_head
        if C % H:
            raise ValueError(f"--memory move_input gates the residual stream in n_head = {H} groups; the width {C} "
                             f"is not divisible by it")
        self.n_embd, self.n_head = C, H
        self.E, self.r = self.opts.experts, self.opts.rank
        self.table_bound = config.memory_table_bound
        self.layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        self.tables = nn.ModuleList(nn.Embedding(config.padded_vocab_size, C) for _ in self.layers)
        self.expert_in = nn.ParameterList(nn.Parameter(torch.empty(self.r, C)) for _ in range(self.E))  # Aexp_k
        self.expert_out = nn.ParameterList(nn.Parameter(torch.empty(C, self.r)) for _ in range(self.E))  # Bexp_k
        self.gates = nn.ModuleList(nn.Linear(C, H, bias=False) for _ in self.layers)  # W_gamma, reads all of C
        self.tracker = GammaTracker(len(self.layers))
        self.capture: dict | None = None

    @torch.no_grad()
    def init_weights(self) -> None:
        bound = (3.0 / self.n_embd) ** 0.5
        for table in self.tables:
            init_table_uniform(table.weight, self.table_bound)
        for a, b in zip(self.expert_in, self.expert_out):
            nn.init.uniform_(a, -bound, bound)
            nn.init.zeros_(b)  # m = 0 at init: the model is Base
        for gate in self.gates:
            nn.init.zeros_(gate.weight)  # gamma = 1 at init
        self.tracker.init_weights()

    def memory_tables(self) -> list[nn.Parameter]:
        return [t.weight for t in self.tables]

    def active_table_params(self) -> int:
        """A token reads two rows (x_{t-1}, x_t) of each layer's base table (one when they are equal: an upper
        bound). Only one of the E experts runs per token, but experts are not tables: they count as stored."""
        return len(self.layers) * 2 * self.n_embd

    def prepare(self, idx, state):
        prev, expert = bigram_experts(idx, self.E, state)
        return {"cur": idx, "prev": prev, "expert": expert}

    def expert_output(self, u: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """The pre-gate vector m: u (..., C) pooled embeddings, expert (...) ids -> (..., C); see the docstring."""
        a = torch.cat(list(self.expert_in), dim=0).to(u.dtype)  # (E*r, C)
        b = torch.cat(list(self.expert_out), dim=1).to(u.dtype)  # (C, E*r)
        hidden = F.relu(F.linear(F.rms_norm(u, (u.size(-1),)), a)).square()  # (..., E*r)
        keep = (expert[..., None] == torch.arange(self.E, device=u.device)).to(u.dtype)  # (..., E) one-hot
        hidden = (hidden.unflatten(-1, (self.E, self.r)) * keep[..., None]).flatten(-2)  # only expert k's r units
        return F.linear(hidden, b)

    def pooled(self, layer: int, prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
        """u = (B_l[prev] + B_l[cur]) / 2 for memory layer ``layer``."""
        table = self.tables[self.layer_pos[layer]]
        return 0.5 * (table(prev) + table(cur))

    def residual(self, layer, x, ctx):
        pos = self.layer_pos.get(layer)
        if pos is None:
            return x
        B, T, C = x.shape
        m = self.expert_output(self.pooled(layer, ctx["prev"], ctx["cur"]).to(x.dtype), ctx["expert"])  # (B, T, C)
        gamma = 2.0 * torch.sigmoid(self.gates[pos](F.rms_norm(x, (C,))))  # (B, T, H)
        inject = gamma[..., None].to(x.dtype) * m.view(B, T, self.n_head, C // self.n_head)  # (B, T, H, C/H)
        if self.training:
            self.tracker.add(pos, gamma)
        if self.capture is not None:
            record(self.capture, layer, gamma=gamma, inject_norm=inject.float().norm(dim=-1), expert=ctx["expert"])
        return x + inject.view(B, T, C)

    def stats(self) -> dict[str, float]:
        return self.tracker.pop(self.layers)
