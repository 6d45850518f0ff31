"""MoME: Mixture-of-Memory Embeddings (paper Sec. 3; reference notes §3).

Per memory layer a table E in R^{N x M x d} (stored flat as N*M rows of width d = head_dim, flat id = row*M + slot),
shared by the layer's KV heads. For token t and KV head i:

    n_t   = f(x_t)                                   row indexer (--mome-index token | grouped | bigram | mod | headmod)
    l_t,i = W_g^(i) h_t + b_g^(i)       in R^M       router (--mome-router-input hidden: h = norm(x); value: h = v_t,i;
                                                     --mome-router-type conv1d: a causal conv over h_t-k+1..h_t)
    A_t,i = TopK(l_t,i, K)                           K = --mome-topk of M = --mome-slots
    alpha = sigmoid-norm over A for K > 1, softmax over all M for K = 1   (--mome-gate overrides)
    m~    = sum_{a in A} alpha_a E[n_t, a]                  only the K selected rows are gathered
    v~    = v + gamma_i m~,  gamma = 2 sigmoid(W_gamma norm(x)[..., :32])   (the VE gate)

Indexers: ``token`` N = padded V; ``grouped`` N = V / c_grp from a frozen slot-map file (nanochat.memory.slot_map);
``bigram`` N = n * V via the bigram hash, with ONE table shared by all memory layers (per-layer routers and gates);
``mod`` / ``headmod`` N = --mome-rows by the authors' arithmetic slot mappings (nanochat.memory.slot_index).
--mome-slots is the M actually stored per row. The paper keeps memory constant when grouping by multiplying the
identity-indexed M by c_grp (A2/6 c1 == A2/12 c2 == A2/24 c4 at 151M), so M must be a multiple of c_grp and the
multiplied value is what you pass.

Shared expert (--mome-shared-expert; the authors' "1_K_E", off in every paper run, reference notes §3.3/§3.7): one
more table S in R^{N x d} beside each routed table (network-shared with the bigram-indexed one), read at the same row
and added with weight 1 and no router, the same d-vector for every head: m~ = sum_a alpha_a E[n_t, a] + S[n_t]. It is
a memory table (AdamW table group, no FLOPs, U(-s, s) init) and takes no part in the load counts or balancing.

Per-head tables (--mome-per-head-table; the authors' moe_ve_per_head_table, off in every paper run, reference notes
§3.3): each KV head h reads its own M slots, E[n_t, h, a] at flat row (n_t*H + h)*M + a, so a routed table has
N*H*M rows (H times the shared layout's memory, still per layer or network-shared as the indexer says) and the shared
expert N*H rows read at n_t*H + h (a different d-vector per head). Routing, gates, load and balance counts (per
(row, head, slot) already) are unchanged.

Routing controls (appendix "Context-Conditioned Routing"): ``token-only`` replaces the router by ONE learned
per-token logit table (padded V x H*M) shared by all memory layers, zero-init, in the memory-table group
(+ padded_V*H*M params vs fixed-random; with L_mem == H, as in d12 and d24, this equals the paper's d24 count of
1,388.8M); ``fixed-random`` has no router: head i of token x reads the K consecutive slots starting at a fixed
pseudo-random offset (seeded at init, the same on every run) with weights 1/K; its parameter count equals VE's.

Optional loss-free balancing (--mome-balance bias | trust-region, off in every paper run): a persistent fp32
buffer router_bias (L_mem, N, H, M) is added to the selection scores sigmoid/softmax(l) (never to the weights), in
training and eval alike (it is part of the saved model). Training forwards only accumulate counts (in-place, no
host sync, compile-friendly); ``update_balance()`` -- to be called by the trainer after each optimizer step --
all-reduces them and applies, per (row, head), the sign rule b += lr * sign(mean - count) on visited rows (bias)
or the authors' power-law trust region on rows with enough visits (trust-region; nanochat.balance).

The final evaluation's slot balance (per-(row, head) MaxVio and absolute load deviation, nanochat.slot_balance)
counts the selections per (layer, row, head, slot) between ``start_eval_loads`` and ``pop_eval_loads`` only.
--mome-maxvio-window W > 0 counts the training forwards' selections the same way (int64, in place, no host sync)
and, every W optimizer steps, all-reduces them into the authors' windowed MaxVio (logged at the next log step; a
checkpoint written between the two keeps it).

Fast paths: the K-row mix, the row mix and the top-K selection, chosen per device, live in
nanochat.memory.mome_mix (its docstring says which path runs where; its ``MIX``, ``ROW_SUM`` and ``TOPK_BY_ARGMAX``
force one); the row mix's Triton kernels for per-layer tables on CUDA in nanochat.memory.mome_triton, which by
default (``mome_mix.FUSE_INJECT``) also do the value injection: the row mix and the injection as one kernel pair;
for the shared table too, on its rows gathered once, with ``mome_mix.SHARED_TABLE_KERNEL`` (off by default).

The options (--mome-* flags) and their validation live in nanochat.memory.mome_options; the counters (training
loads, balancing counts and the bias update, the MaxVio window, the evaluation's slot-balance counts) and
``stats()`` in nanochat.memory.mome_counts (a mixin: the buffers and methods stay the block's own).
"""

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import mome_triton
from .base import MemoryBlock
from .hashing import prepare_bigram_rows
from .mome_counts import MoMECounters
from .mome_mix import (forced_mix, fuse_inject, mome_mix, mome_row_mix, row_sum, shared_table_kernel, slot_weights,
                       topk_indices)
from .mome_options import MoMEOptions
from .mome_router import CausalConvRouter
from .mome_triton import row_mix as kernel_row_mix
from .mome_triton import row_mix_inject as kernel_row_mix_inject
from .slot_index import ARITHMETIC_INDEXERS, arithmetic_rows, check_rows_fit_vocab
from .slot_map import check_slot_map_tokenizer, load_slot_map
from .ve import GammaTracker, ValueGate, init_table_uniform, record

NORM_EPS = 1e-10
FIXED_RANDOM_SEED = 1234


def gate_weights(logits: torch.Tensor, sel: torch.Tensor | None, mode: str):
    """Mixture weights of the selected slots. logits (..., M); sel (..., K) or None (= all M in slot order).
    Returns (weights (..., K or M), scores p (..., M)) in fp32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32 (bf16 under autocast)
    p = torch.softmax(logits, dim=-1) if mode.startswith("softmax") else torch.sigmoid(logits)
    w = p if sel is None else p.gather(-1, sel)
    if mode.endswith("-norm"):
        w = w / (w.sum(dim=-1, keepdim=True) + NORM_EPS)
    return w, p


def reference_gate(logits: torch.Tensor, K: int, mode: str):
    """The authors' rule (reference notes §3.6/3.8), for ``--numerics reference``: scores p = sigmoid(l) in the
    logits' dtype (bf16 under autocast) or softmax(l) (fp32 under autocast), top-K on p, weights p[sel]
    normalised as theirs (CUDA autocast sums in fp32, so there the weights come out fp32). K == M: every slot, no
    selection. Same outputs as ``route``'s."""
    p = torch.softmax(logits, dim=-1) if mode.startswith("softmax") else torch.sigmoid(logits)
    sel = None if K == p.size(-1) else p.topk(K, dim=-1, sorted=False).indices  # torch.topk, as theirs
    w = p if sel is None else p.gather(-1, sel)
    if mode.endswith("-norm"):
        w = w / (w.sum(dim=-1, keepdim=True) + NORM_EPS)
    return sel, w, p


class MoMEMemory(MoMECounters, MemoryBlock):
    Options = MoMEOptions
    uses_layers = True
    table_weight_decay = 0.001
    # steer the routing-bias update or the logging only
    training_options = ("balance_lr", "balance_band", "balance_min_visits", "maxvio_window")
    reference_gating = False  # set by nanochat.numerics.apply_numerics(model, "reference") only

    @classmethod
    def resolved_options(cls, config) -> MoMEOptions:
        o = super().resolved_options(config)
        return replace(o, gate=o.gate_mode, balance_min_visits=o.balance_min_visits or o.slots)  # 0 means M

    def __init__(self, config):
        super().__init__(config)  # parses and validates the options: every flag error is raised before allocation
        o = self.opts
        if o.index == "grouped" and config.vocab_size % o.group_size:
            raise ValueError(f"--mome-group-size {o.group_size} must divide the vocab size {config.vocab_size}")
        self.n_embd, self.H, self.d = config.n_embd, config.n_kv_head, config.head_dim
        self.table_bound = config.memory_table_bound
        self.M, self.K, self.mode = o.slots, o.topk, o.gate_mode
        self.vocab_size, self.padded_vocab = config.vocab_size, config.padded_vocab_size
        if o.index in ARITHMETIC_INDEXERS:
            check_rows_fit_vocab(o.index, o.rows, config.padded_vocab_size)
        self.rows = {"token": config.padded_vocab_size, "grouped": config.vocab_size // o.group_size,
                     "bigram": o.bigram_factor * config.vocab_size}.get(o.index, o.rows)
        self.layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        L, H, M = len(self.layers), self.H, self.M
        self.per_head = o.per_head_table
        table_rows = self.rows * (H if self.per_head else 1)  # rows n (or, per head, n*H + h) of M slots each
        if o.index == "bigram":  # compound scaling: one table for the whole network
            self.table = nn.Embedding(table_rows * M, self.d)
        else:
            self.tables = nn.ModuleList(nn.Embedding(table_rows * M, self.d) for _ in range(L))
        if o.shared_expert:  # N (x H) x d, beside the routed table it follows: network-shared with it or one per layer
            if o.index == "bigram":
                self.shared_expert = nn.Embedding(table_rows, self.d)
            else:
                self.shared_experts = nn.ModuleList(nn.Embedding(table_rows, self.d) for _ in range(L))
        if o.routing == "context":  # hidden mode: C -> H*M, per-head logits; value mode: d -> M shared by the heads
            shape = (config.n_embd, H * M) if o.router_input == "hidden" else (self.d, M)
            if o.router_type == "conv1d":  # causal over the last k positions (nanochat.memory.mome_router)
                self.routers = nn.ModuleList(CausalConvRouter(*shape, o.conv_kernel_size) for _ in range(L))
            else:
                self.routers = nn.ModuleList(nn.Linear(*shape, bias=True) for _ in range(L))
        elif o.routing == "token-only":
            self.route_table = nn.Embedding(config.padded_vocab_size, H * M)
        else:
            self.register_buffer("fixed_offset", torch.empty(config.padded_vocab_size, H, dtype=torch.long),
                                 persistent=False)
        self.gates = nn.ModuleList(ValueGate(config.n_embd, H) for _ in range(L))
        if o.index == "grouped":
            # read and validated now (host side), before any device allocation. Shapes depend on c only, so a
            # plan (--dry-run: built on the meta device) works before the file exists; init_weights needs it.
            # A missing, changed or invalid file is an error only if no checkpoint supplies the map: evaluating or
            # resuming a run elsewhere must not need the file (check_ready / prepare raise the message).
            self._slot_map_cpu, self._slot_map_error = None, None
            if Path(o.slot_map).is_file() or torch.get_default_device().type != "meta":
                self._try_load_slot_map(config.vocab_size)
            # persistent: checkpoints carry the exact map they were trained with
            self.register_buffer("slot_map", torch.empty(config.vocab_size, dtype=torch.long))
            self.slot_map_ready = False
            self.register_load_state_dict_post_hook(MoMEMemory._loaded)
        self._register_counters()  # load, balance and window counts, the routing bias (nanochat.memory.mome_counts)
        self.tracker = GammaTracker(L)
        self.capture: dict | None = None
        # The bigram-indexed table is read by every memory layer: dense gradients would build one full-size
        # table gradient per layer and sum them; sparse ones are concatenated and densified once by the
        # optimizer (MuonAdamW). Eager mode only: inductor cannot compile embedding_bag's sparse backward.
        self.sparse_shared_grad = o.index == "bigram"

    # -- parameters -------------------------------------------------------------------------------------
    def _try_load_slot_map(self, vocab_size: int) -> None:
        o = self.opts
        try:
            loaded = load_slot_map(o.slot_map, vocab_size, o.group_size, o.slot_map_sha256 or None)
            self._slot_map_cpu, self._slot_map_header = loaded.token_to_row, loaded.header
        except ValueError as e:
            self._slot_map_error = str(e)

    @staticmethod
    def _loaded(module, incompatible_keys) -> None:
        if not any(k.endswith("slot_map") for k in incompatible_keys.missing_keys):
            module.slot_map_ready = True  # the checkpoint's map, whatever the file says now

    def bind_tokenizer(self, tokenizer) -> None:
        """A grouped map read from its file must have been built for this run's tokenizer (a resume then loads the
        checkpoint's map, checked when its run started)."""
        if tokenizer is not None and getattr(self, "_slot_map_cpu", None) is not None:
            check_slot_map_tokenizer(self._slot_map_header, tokenizer, self.opts.slot_map)

    def check_ready(self, training: bool = False) -> None:
        if hasattr(self, "slot_map") and not self.slot_map_ready:
            raise ValueError(f"{self._slot_map_error} (no checkpoint supplied the map either)")
        file_map = getattr(self, "_slot_map_cpu", None) if training else None  # prepare() asks every forward
        if file_map is not None and not torch.equal(self.slot_map.cpu(), file_map):
            # e.g. a run that started without the file (so recorded no hash) continued with another file:
            # the model keeps the checkpoint's map, and this run's config would record the other file's hash
            raise ValueError(f"--mome-slot-map {self.opts.slot_map} holds another map than the one in the "
                             "checkpoint this run continues (--resume or --init-from): pass the file the "
                             "checkpoint's map was built from, or a path that does not exist (the checkpoint "
                             "carries its map)")

    @torch.no_grad()
    def init_weights(self) -> None:
        for table in self._tables() + self._shared_experts():  # U(-s, s) as the routed tables (spec §1.4)
            init_table_uniform(table.weight, self.table_bound)
        for router in getattr(self, "routers", []):
            nn.init.zeros_(router.weight)  # zero-init as in the reference: top-K ties at step 0 (see notes)
            nn.init.zeros_(router.bias)
        if hasattr(self, "route_table"):
            nn.init.zeros_(self.route_table.weight)
        if hasattr(self, "fixed_offset"):
            g = torch.Generator().manual_seed(FIXED_RANDOM_SEED)
            self.fixed_offset.copy_(torch.randint(0, self.M, tuple(self.fixed_offset.shape), generator=g))
        for gate in self.gates:
            gate.init_weights()
        if hasattr(self, "slot_map"):
            if self._slot_map_cpu is None and self._slot_map_error is None:  # built on the meta device
                self._try_load_slot_map(self.slot_map.numel())
            self.slot_map_ready = self._slot_map_cpu is not None
            if self.slot_map_ready:
                self.slot_map.copy_(self._slot_map_cpu)
            else:
                self.slot_map.zero_()  # a placeholder until a checkpoint is loaded; prepare refuses it
        self._zero_counters()
        self.tracker.init_weights()

    def _tables(self) -> list[nn.Embedding]:
        return [self.table] if hasattr(self, "table") else list(self.tables)

    def _shared_experts(self) -> list[nn.Embedding]:
        if hasattr(self, "shared_expert"):
            return [self.shared_expert]
        return list(getattr(self, "shared_experts", []))

    def _table(self, pos: int) -> torch.Tensor:
        return self.table.weight if hasattr(self, "table") else self.tables[pos].weight

    def memory_tables(self) -> list[nn.Parameter]:
        extra = [self.route_table.weight] if hasattr(self, "route_table") else []
        return [t.weight for t in self._tables() + self._shared_experts()] + extra

    def active_table_params(self) -> int:
        """Per memory layer a token reads one row n_t, where its H heads pick at most min(M, H*K) distinct slots
        of width d (the appendix's "<= 12 distinct slots x 128 per layer" at A2/12, H = 12); the shared
        bigram-indexed table is one row n_t for every layer, so at most min(M, L*H*K) distinct slots in all.
        Token-only routing also reads its H*M logits row; the shared expert one d-wide row per table. Per-head
        tables: each head reads K of its own M slots per layer (min(M, L*K) of them from the shared table), and
        the shared expert one d-wide row per head."""
        route = self.H * self.M if hasattr(self, "route_table") else 0
        heads = self.H if self.per_head else 1
        shared = len(self._shared_experts()) * heads * self.d
        L, H, M, K = len(self.layers), self.H, self.M, self.K
        if self.per_head:
            slots = H * min(M, L * K) if hasattr(self, "table") else L * H * K
        else:
            slots = min(M, L * H * K) if hasattr(self, "table") else L * min(M, H * K)
        return slots * self.d + route + shared

    # -- forward ----------------------------------------------------------------------------------------
    def prepare(self, idx, state):
        """Row ids n_t = f(x_t), (B, T) int64, computed once per forward (the bigram hash carries state)."""
        index = self.opts.index
        if index == "bigram":
            row = prepare_bigram_rows(idx, self.rows, state)
        elif index == "grouped":
            self.check_ready()
            row = self.slot_map[idx]
        elif index in ARITHMETIC_INDEXERS:
            row = arithmetic_rows(idx, index, self.rows, self.opts.dedicated_size)
        else:
            row = idx.long()
        # the shared table's M slots of n_t, read by every memory layer: gathered once (see "row mix" above)
        shared_rows = hasattr(self, "table") and self._row_mix(self.table.weight)
        rows = self._gather_rows(self.table.weight, row) if shared_rows else None
        # token-only routing: one logit table for every layer, so one lookup (and one gradient) per forward
        token_logits = self.route_table(idx) if self.opts.routing == "token-only" else None  # (B, T, H*M)
        # the network-shared shared expert's row of n_t, the same for every layer: one lookup per forward too
        shared = self._shared_row(self.shared_expert, row) if hasattr(self, "shared_expert") else None
        return idx, row, rows, token_logits, shared, state  # state: the conv1d router's look-back when decoding

    def _row_mix(self, table: torch.Tensor) -> bool:
        if self.K == self.M:
            return True
        mix = forced_mix()
        if mix is not None:
            return mix == "row"
        # by default: the shared table, and a per-layer table where the fused kernel takes it (CUDA)
        return hasattr(self, "table") or self._kernel_row_mix(table)

    def _kernel_row_mix(self, table: torch.Tensor) -> bool:
        """ROW_SUM "triton" (the default; nanochat.memory.mome_triton) on a per-layer, not per-head, fp32 table
        where ``mome_triton.applies`` (CUDA with triton; the tests add the CPU, where the op runs its torch math);
        the shared table too with ``mome_mix.SHARED_TABLE_KERNEL``, on its gathered rows (``_kernel_operands``:
        ``applies`` holds for them iff for the table, the same device, dtype and d: embedding is not autocast).
        The kernel stores mem in v's dtype: the fp32 mix rounded once, as today's fp32 mix then
        ``mem.to(v.dtype)``; with a shared expert (added to mem before that cast) it stores the table's dtype."""
        if row_sum() != "triton" or self.per_head or (hasattr(self, "table") and not shared_table_kernel()):
            return False
        return mome_triton.applies(table, self.H, self.M)

    def _kernel_operands(self, table, row, rows) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The kernels' (table, row ids, unique_rows): a per-layer table and n_t (ids repeat); for the shared table
        its rows gathered once, (B, T, M, d) -> a (B*T*M, d) table read at ids 0..B*T-1, each row by one token: the
        kernels' table gradient is (B*T*M, d), stored without a zero fill or atomics (unique_rows), and the gather's
        backward scatters the layers' summed gradient into the table once."""
        if not hasattr(self, "table"):
            return table, row, False
        B, T = row.shape
        return rows.reshape(B * T * self.M, self.d), torch.arange(B * T, device=row.device).view(B, T), True

    def _head_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Per-head tables: each head's row n_t*H + h, (B, T) -> (B, T, H)."""
        return row[..., None] * self.H + torch.arange(self.H, device=row.device)

    def _gather_rows(self, table: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """All M slots of rows n_t: (B, T) -> (B, T, M, d); per-head tables: each head's own, (B, T, H, M, d)."""
        base = self._head_rows(row) if self.per_head else row  # (B, T, H) or (B, T)
        flat = base[..., None] * self.M + torch.arange(self.M, device=row.device)  # (..., M) flat row ids
        return F.embedding(flat, table, sparse=self._sparse_grad(table))

    def _shared_row(self, shared: nn.Embedding, row: torch.Tensor) -> torch.Tensor:
        """The shared expert's row of n_t: (B, T, 1, d), the same for every head; per-head tables (B, T, H, d)."""
        return shared(self._head_rows(row) if self.per_head else row[..., None])

    def route(self, pos: int, xn, v, idx, row, probs: bool = True, token_logits=None, state=None):
        """Selected slots sel (B, T, H, K) (None when K == M: all slots in order), weights (B, T, H, K or M),
        scores p over all M (B, T, H, M) or None (fixed-random, or ``probs=False`` on the sigmoid fast path,
        which then never evaluates the gate on the M - K unselected logits). ``token_logits``: token-only
        routing's lookup from ``prepare`` (looked up here when None). ``state``: the KV cache's memory state (the
        conv1d router's inputs before this forward; None: zeros, a sequence start)."""
        o, (B, T, H, _) = self.opts, v.shape
        if o.routing == "fixed-random":
            offset = self.fixed_offset[idx]  # (B, T, H)
            sel = (offset[..., None] + torch.arange(self.K, device=v.device)) % self.M  # (B, T, H, K)
            return sel, torch.full(sel.shape, 1.0 / self.K, device=v.device), None
        if o.routing == "token-only":
            logits = (self.route_table(idx) if token_logits is None else token_logits).view(B, T, H, self.M)
        elif o.router_type == "conv1d":
            logits = self._conv_logits(pos, xn, v, state)
        elif o.router_input == "hidden":
            logits = self.routers[pos](xn).view(B, T, H, self.M)  # (B, T, H*M) -> per-head logits
        else:
            logits = self.routers[pos](v)  # (B, T, H, d) -> (B, T, H, M), router shared across heads
        if self.reference_gating:
            return reference_gate(logits, self.K, self.mode)
        if self.K == self.M:  # full routing: every slot, weights normalised over all M
            w, p = gate_weights(logits, None, self.mode)
            return None, w, p
        if hasattr(self, "router_bias"):  # loss-free balancing: bias the scores used for selection only
            _, p = gate_weights(logits, None, self.mode)
            scores = p + self.router_bias[pos][row]  # (B, T, H, M)
        elif not probs and self.mode.startswith("sigmoid"):
            # sigmoid(l).gather(sel) == sigmoid(top-K values of l): no gather, gate on K logits only (equal up to
            # 1 ulp: torch's vectorised and scalar-tail sigmoid can round differently)
            sel = topk_indices(logits, self.K)  # partial selection, never a full sort of M
            top = logits.gather(-1, sel)
            w = torch.sigmoid(top.to(torch.promote_types(top.dtype, torch.float32)))
            if self.mode.endswith("-norm"):
                w = w / (w.sum(dim=-1, keepdim=True) + NORM_EPS)
            return sel, w, None
        else:
            scores = logits  # TopK(l) as in the paper (monotone in p, so the same selection)
        sel = topk_indices(scores, self.K)  # (B, T, H, K)
        w, p = gate_weights(logits, sel, self.mode)
        return sel, w, p

    def _conv_logits(self, pos: int, xn, v, state) -> torch.Tensor:
        """The causal conv1d router's per-head logits (B, T, H, M): over norm(x)'s sequence (hidden mode), or over
        each head's sequence of value vectors separately, as (B*H, T, d) (value mode)."""
        B, T, H, d = v.shape
        key = f"mome_router{pos}"
        if self.opts.router_input == "hidden":
            return self.routers[pos](xn, state, key).view(B, T, H, self.M)
        per_head = v.transpose(1, 2).reshape(B * H, T, d)  # each head's sequence on its own
        return self.routers[pos](per_head, state, key).view(B, H, T, self.M).transpose(1, 2)

    def _sparse_grad(self, table: torch.Tensor) -> bool:
        # CPU only: on CUDA the sparse gradient's coalescing costs ~4x the dense scatter-add's bytes
        return self.sparse_shared_grad and self.training and not table.is_cuda and not torch.compiler.is_compiling()

    def value(self, layer, xn, v, ctx):
        pos = self.layer_pos.get(layer)
        if pos is None:
            return v
        idx, row, rows, token_logits, shared, state = ctx
        sel, w, p = self.route(pos, xn, v, idx, row, probs=self.capture is not None, token_logits=token_logits,
                               state=state)
        table = self._table(pos)
        gamma = self.gates[pos](xn)  # (B, T, H)
        if self.training:
            self._count(pos, sel, row, gamma)
        if self.eval_loads is not None:
            self._count_eval_loads(pos, sel, row)
        if self._fused_inject(table):  # v + gamma * mem in one kernel pair: mem never leaves it
            k_table, k_row, unique = self._kernel_operands(table, row, rows)
            return kernel_row_mix_inject(k_table, k_row, self._dense_weights(sel, w), gamma, v, unique)
        mem = self._mem(pos, table, row, rows, sel, w, shared, v.dtype)  # (B, T, H, d)
        inject = gamma[..., None].to(v.dtype) * mem.to(v.dtype)
        if self.capture is not None:
            sel_c = sel if sel is not None else torch.arange(self.M, device=v.device).expand(w.shape)
            record(self.capture, layer, slots=sel_c, weights=w, gamma=gamma, inject_norm=inject.float().norm(dim=-1),
                   rows=row, **({"probs": p} if p is not None else {}))
        return v + inject

    def kernel_path(self) -> str:
        """Which Triton kernels the memory layers take with the current settings and table devices: "fused" (row
        mix + injection), "row" (row mix only) or "torch" (none), "+"-joined where layers differ. What
        ``--mome-kernels`` recorded as having run (the flag is only a setting: a shared expert, per-head tables, the
        shared table unless ``mome_mix.SHARED_TABLE_KERNEL``, the CPU keep some or all kernels off)."""
        tables = (self._table(pos) for pos in range(len(self.layers)))
        paths = ("fused" if self._fused_inject(t) else "row" if self._kernels_serve(t) else "torch" for t in tables)
        return "+".join(dict.fromkeys(paths))  # in layer order, each once

    def _fused_inject(self, table: torch.Tensor) -> bool:
        """``mome_mix.FUSE_INJECT`` (on by default) where the row-mix kernel pair serves this table, except with a
        shared expert (added to mem before the cast to v's dtype) or while ``capture`` records the injection's norm."""
        if not fuse_inject() or self.capture is not None or self._shared_experts():
            return False
        return self._kernels_serve(table)

    def _kernels_serve(self, table: torch.Tensor) -> bool:
        """The row mix (not forced off by MIX) through the Triton row-mix kernels."""
        return self._row_mix(table) and self._kernel_row_mix(table)

    def _dense_weights(self, sel, w) -> torch.Tensor:
        """The row mix's weights (B, T, H, M): w itself (K == M, no selection) or zero off the top-K."""
        return w if sel is None else slot_weights(sel, w, self.M)

    def _mem(self, pos, table, row, rows, sel, w, shared, v_dtype) -> torch.Tensor:
        """The mixed memory vectors (B, T, H, d), the shared expert's row added: in the table's dtype, or v's where
        the row-mix kernels store it (no shared expert)."""
        if self._row_mix(table):  # the M slots of n_t once per token, mixed per head (K == M: all of them)
            wd = self._dense_weights(sel, w)  # (B, T, H, M)
            if self._kernel_row_mix(table):  # mem already in its cast dtype; per-layer: no (B, T, M, d) gather
                k_table, k_row, unique = self._kernel_operands(table, row, rows)
                mem = kernel_row_mix(k_table, k_row, wd, table.dtype if self._shared_experts() else v_dtype, unique)
            else:
                rows = self._gather_rows(table, row) if rows is None else rows  # (B, T, M, d)
                mem = mome_row_mix(rows, wd)
        else:
            base = self._head_rows(row) if self.per_head else row[..., None]  # (B, T, H) or (B, T, 1)
            flat = base[..., None] * self.M + sel  # (B, T, H, K) int64 flat row ids: only K rows per head
            mem = mome_mix(table, flat, w, self._sparse_grad(table))  # (B, T, H, d)
        if hasattr(self, "shared_experts"):
            shared = self._shared_row(self.shared_experts[pos], row)  # (B, T, 1 or H, d)
        if shared is not None:  # always on, weight 1 (one d-vector for all heads, or each its own); before the cast
            mem = mem + shared.to(mem.dtype)  # (B, T, 1 or H, d) -> (B, T, H, d)
        return mem
