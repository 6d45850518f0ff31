"""Sparse MoE FFN: a backbone FFN option of the nanochat GPT (``--mlp moe``), combinable with any memory block.

The appendix's "Sparse-MoE interaction" rows (spec appendix_adaptations §6: E6/K2 + 1 shared expert in every
layer). Per layer, E routed experts and S shared (always-on) experts, all relu^2 MLPs C -> h -> C without bias,
and a router W_r = Linear(C -> E, no bias). For the FFN input x_t (the normed residual, as the dense MLP's):

    s_t   = sigmoid(W_r x_t)                      (E,) affinities, fp32
    A_t   = TopK(s_t + b, K)                      b: the selection bias, a persistent fp32 buffer (E,)
    g_t,i = s_t,i / sum_{j in A_t} s_t,j          i in A_t: the bias picks experts, it never weights them
    y_t   = sum_{shared j} FFN_j(x_t) + sum_{i in A_t} g_t,i FFN_i(x_t)

DeepSeek-V3's gating (spec F2). Loss-free balancing: each training forward adds its per-expert selection counts to
a device buffer (no host sync); ``after_optimizer_step`` (the trainer calls it on every module that has one)
all-reduces them over the data-parallel ranks and sets b += gamma sign(mean load - load)
(``nanochat.balance``, the rule MoME's --mome-balance bias uses), gamma = --moe-balance-lr.

Dropless (spec F3): no capacity, no token dropping. The N*K (token, expert) assignments are sorted by expert
(a stable argsort: fixed shapes, no host sync), the tokens gathered in that order, and the experts run on their
contiguous segments; the weighted outputs are put back by the inverse permutation and summed over K (a gather,
deterministic). Two ways to run the segments (``GROUPED_MM``, None = by dtype):
* grouped: ``torch._grouped_mm`` over the stacked expert matrices with the segment ends as device offsets: one
  kernel per matrix for all experts, no host sync, and it compiles (``torch.compile`` traces it only in bf16,
  the CUDA training dtype, and its kernels want row strides in multiples of 16 bytes: C and h multiples of 8).
* looped: one F.linear per expert on its slice, the slice lengths read on the host (one sync per layer); the
  loop is excluded from compilation (a lazy ``torch.compiler.disable``). Compiled in fp32 (CPU, ``--dtype
  float32``, or C, h not multiples of 8), that break sits inside GPT.forward's loop over the blocks, so dynamo
  compiles each Block on its own instead, recompiling per layer up to its recompile limit (8): deeper layers then
  run eager. Results are unchanged
  (compiled == eager, measured); only speed suffers. The CUDA training path (bf16, grouped) compiles whole.

Parameters (spec F5): every expert matrix is its own 2-D parameter (experts.i.c_fc (h, C), experts.i.c_proj
(C, h), shared.j.* alike), so the optimizer's shape routing sends them to Muon unchanged and each expert is
orthogonalised on its own, as a separate dense FFN would be; the grouped path stacks them per forward (a copy of
the layer's expert weights, small next to the expert GEMMs). The router (E, C) is 2-D too: Muon (spec F5's
default). Init (spec F4): c_fc and the router uniform +-sqrt(3/C), c_proj zero, so the layer outputs 0 at init
like the dense MLP. FLOPs and "active" parameters count the shared experts, K routed experts and the router
(``inactive_params``); stored parameters count all E.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.balance import loss_free_bias_update
from nanochat.memory.mome_mix import topk_indices
from nanochat.cli_types import check_int_at_least
from nanochat.memory.mome_options import finite_number_at_least

MLP_KINDS = ("dense", "moe")
FFN_FIELDS = ("mlp", "moe_experts", "moe_topk", "moe_shared", "moe_hidden", "moe_balance_lr")  # GPTConfig's
HIDDEN_MULTIPLE = 64  # the default expert width 4C/(S+K) is rounded to a multiple of this
GROUPED_MM: bool | None = None  # torch._grouped_mm segments; None = in bf16 only (see the module docstring)


def moe_hidden_size(n_embd: int, shared: int, topk: int, hidden: int = 0) -> int:
    """The expert width: ``hidden`` when set, else 4C/(S+K) (shared + active routed experts together as wide as the
    dense 4C MLP) rounded to a multiple of 64: 2048 at C=1536 with S=1, K=2 (exact), 1024 at C=768."""
    if hidden:
        return hidden
    return max(HIDDEN_MULTIPLE, HIDDEN_MULTIPLE * round(4 * n_embd / (shared + topk) / HIDDEN_MULTIPLE))


def check_mlp_config(config) -> None:
    """Validate the FFN fields of a GPTConfig; errors name the base_train flag."""
    if config.mlp not in MLP_KINDS:
        raise ValueError(f"--mlp {config.mlp!r} is unknown; allowed: {', '.join(MLP_KINDS)}")
    check_int_at_least("--moe-experts", config.moe_experts, 1)
    check_int_at_least("--moe-topk", config.moe_topk, 1)
    check_int_at_least("--moe-shared", config.moe_shared, 0)
    check_int_at_least("--moe-hidden", config.moe_hidden, 0)
    finite_number_at_least("--moe-balance-lr", config.moe_balance_lr, 0)
    if config.moe_topk > config.moe_experts:
        raise ValueError(f"--moe-topk {config.moe_topk} exceeds --moe-experts {config.moe_experts} (need K <= E)")
    if config.mlp == "moe" and config.moe_topk == 1:
        raise ValueError("--moe-topk 1: the normalised gate s_i / sum_sel s_j is then identically 1, so the router "
                         "would get no gradient; use --moe-topk >= 2")


class ReluSquaredMLP(nn.Module):
    """relu^2 FFN C -> hidden -> C without bias: the dense MLP (hidden 4C) and every MoE expert."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, n_embd, bias=False)

    def init_weights(self, bound: float) -> None:
        nn.init.uniform_(self.c_fc.weight, -bound, bound)
        nn.init.zeros_(self.c_proj.weight)  # residual output projection: the FFN adds 0 at init

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


# torch.compiler.disable, but importing torch._dynamo on the first call instead of at load (~2.5 s of CPU in every
# process that imports the model and never compiles: dry runs, evals, refusals). torch's own lazy form: its
# wrapper lives in a file dynamo always skips, so a first call inside a compiled forward breaks the graph and runs
# eagerly too (tested).
@torch._disable_dynamo
def _looped_experts(experts, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Expert e on rows [off_e, off_e + counts_e) of the expert-sorted xs (N*K, C) -> (N*K, C)."""
    sizes = counts.tolist()  # host sync: the segment lengths decide the slices
    return torch.cat([expert(seg) for expert, seg in zip(experts, xs.split(sizes))])


def _grouped_experts(experts, xs: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Same as ``_looped_experts`` with one grouped GEMM per matrix; offsets = segment ends, on the device."""
    offs = counts.cumsum(0).to(torch.int32)
    w_fc = torch.stack([e.c_fc.weight.to(dtype) for e in experts])  # (E, h, C)
    w_proj = torch.stack([e.c_proj.weight.to(dtype) for e in experts])  # (E, C, h)
    hidden = torch._grouped_mm(xs, w_fc.transpose(-2, -1), offs=offs)  # (N*K, h); xs already in dtype
    # autocast does not cover _grouped_mm, and CUDA autocast runs square (pow) in fp32: cast back explicitly
    act = F.relu(hidden).square().to(dtype)
    return torch._grouped_mm(act, w_proj.transpose(-2, -1), offs=offs)  # (N*K, C)


class MoEFFN(nn.Module):
    """The MoE FFN of one layer: (B, T, C) normed input -> (B, T, C) increment; see the module docstring."""

    STATS_BUFFERS = ("load_counts",)  # summed over ranks before stats() and kept in checkpoints

    def __init__(self, config, layer_idx: int):
        super().__init__()
        check_mlp_config(config)
        C = config.n_embd
        self.layer_idx = layer_idx
        self.E, self.K, self.balance_lr = config.moe_experts, config.moe_topk, config.moe_balance_lr
        self.hidden = moe_hidden_size(C, config.moe_shared, config.moe_topk, config.moe_hidden)
        self.router = nn.Linear(C, self.E, bias=False)
        self.experts = nn.ModuleList(ReluSquaredMLP(C, self.hidden) for _ in range(self.E))
        self.shared = nn.ModuleList(ReluSquaredMLP(C, self.hidden) for _ in range(config.moe_shared))
        self.register_buffer("bias", torch.empty(self.E, dtype=torch.float32))  # persistent: part of the model
        # balance_counts hold one optimizer step's assignments (reset by the update; a token goes to an expert at most
        # once): exact in fp32 below 2^24 tokens per step (d24 sparse: 2^20), fp32 like MoME's (the same update)
        self.register_buffer("balance_counts", torch.empty(self.E, dtype=torch.float32), persistent=False)
        # load_counts add up a log interval: int64, as fp32 stops adding 1 past 2^24 (d24 sparse, K/E = 2/6: ~48
        # steps of 2^20 tokens; 16 if one expert took every token)
        self.register_buffer("load_counts", torch.empty(self.E, dtype=torch.int64), persistent=False)

    @torch.no_grad()
    def init_weights(self, bound: float) -> None:
        for expert in (*self.experts, *self.shared):
            expert.init_weights(bound)
        nn.init.uniform_(self.router.weight, -bound, bound)  # zero init would tie every score: picks by index
        self.bias.zero_()
        self.balance_counts.zero_()
        self.load_counts.zero_()

    def inactive_params(self) -> int:
        """Stored parameters one token does not use: the E - K routed experts it was not sent to."""
        return (self.E - self.K) * sum(p.numel() for p in self.experts[0].parameters())

    # -- forward ----------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, C) -> selected experts (N, K) int64 and their weights s / sum_sel s (N, K) fp32."""
        logits = self.router(x)
        s = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))  # (N, E)
        sel = topk_indices(s + self.bias, self.K)  # the bias changes the choice only
        w = s.gather(-1, sel)
        return sel, w / w.sum(dim=-1, keepdim=True)

    def _use_grouped(self, x: torch.Tensor, dtype: torch.dtype) -> bool:
        if GROUPED_MM is not None:
            return GROUPED_MM
        aligned = x.size(-1) % 8 == 0 and self.hidden % 8 == 0  # 16-byte row strides in bf16
        return dtype == torch.bfloat16 and x.device.type in ("cuda", "cpu") and aligned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x = x.reshape(B * T, C)
        sel, w = self.route(x)  # (N, K)
        counts = (sel.reshape(-1, 1) == torch.arange(self.E, device=x.device)).sum(dim=0)  # (E,) assignments
        if self.training:
            with torch.no_grad():
                self.balance_counts += counts
                self.load_counts += counts
        order = torch.argsort(sel.reshape(-1), stable=True)  # (N*K,) assignment ids grouped by expert
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        xs = x.to(dtype)[order // self.K]  # (N*K, C) each assignment's token, in expert order (cast first: K x)
        if self._use_grouped(x, dtype):
            ys = _grouped_experts(self.experts, xs, counts, dtype)
        else:
            ys = _looped_experts(self.experts, xs, counts)
        ys = ys * w.reshape(-1)[order, None].to(ys.dtype)  # gate weight of each sorted assignment
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        routed = ys[inverse].view(B * T, self.K, C).sum(dim=1)  # back to (token, k) order, summed over K
        for expert in self.shared:
            routed = routed + expert(x).to(routed.dtype)
        return routed.view(B, T, C)

    # -- balancing and logging ----------------------------------------------------------------------------
    def after_optimizer_step(self) -> None:
        loss_free_bias_update(self.bias, self.balance_counts, self.balance_lr)

    @torch.no_grad()
    def stats(self) -> dict[str, float]:
        """Load fraction of each expert and MaxVio = (max load - mean) / mean since the last call (one host sync)."""
        load = self.load_counts.double()  # exact below 2^53
        total = load.sum()
        values = torch.cat([load / total.clamp_min(1), (load.max() * self.E / total.clamp_min(1) - 1)[None],
                            self.bias.abs().max()[None].double(), total[None]]).tolist()
        self.load_counts.zero_()
        if values[-1] == 0:
            return {}
        out = {f"moe/load/layer{self.layer_idx}/expert{e}": values[e] for e in range(self.E)}
        out[f"moe/maxvio/layer{self.layer_idx}"] = values[self.E]
        out[f"moe/bias_absmax/layer{self.layer_idx}"] = values[self.E + 1]
        return out


def inactive_expert_params(model: nn.Module) -> int:
    """Stored but per-token unused expert parameters of every MoE FFN in ``model`` (0 for dense models)."""
    return sum(m.inactive_params() for m in model.modules() if isinstance(m, MoEFFN))


__all__ = ["FFN_FIELDS", "MLP_KINDS", "MoEFFN", "ReluSquaredMLP", "check_mlp_config", "inactive_expert_params",
           "moe_hidden_size"]
