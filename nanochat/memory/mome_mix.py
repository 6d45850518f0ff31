"""MoME's mix and selection fast paths: the K-row mix, the row mix and the top-K selection (split from
nanochat.memory.mome, which calls them; nanochat.memory.jtok and nanochat.moe use them too).

Fast paths (docs/performance.md), chosen per device because the best one differs:
* CPU (eager): the K selected rows of every (token, head) are gathered AND mixed by ONE
  ``F.embedding_bag(mode="sum", per_sample_weights=alpha)`` over flat (B*T*H, K) int64 ids, so the (B,T,H,K,d)
  intermediate of the plain gather-multiply-sum never exists.
* CUDA: for a per-layer table, the row mix below as one fused Triton kernel pair (``ROW_SUM = "triton"``,
  nanochat.memory.mome_triton): 0.32 ms of kernels per d12 call (fwd+bwd) on an H100 against 0.74 for the plain
  gather + weighted sum (bench/mome_ops.py, 2026-11-26); the d12 step went from 295.6 to 289.3 ms against the
  unrolled row mix on the same machine. Where the kernel does not apply (triton missing, a shape it refuses):
  the plain gather + weighted sum, which inductor fuses into the value injection (no (B,T,H,K,d) tensor either)
  with a scatter-add backward, measured 4% faster per d12 training step than embedding_bag's sort-based backward
  on an H100. The top-K selection is K masked argmax passes over the M logits, which inductor fuses, instead of
  ``torch.topk``'s radix select (0.5 ms per layer call at d12 for M = 6).
* The row mix: gather ALL M slots of n_t once per token, (B, T, M, d), and mix them per head with weights that are
  zero off the top-K, (B, T, H, M) (equal to the top-K mix: the extra terms are exact zeros). Used for K == M, and
  by default for the bigram-indexed table: that table is shared by every memory layer and n_t is the same for all
  of them, so ``prepare`` gathers it ONCE per forward and its backward builds one table-sized gradient instead of
  one per memory layer plus their sum (L - 1 table-sized zero-fills, scatters and additions per micro-step: at
  the d12 compound-scaling row n24/M6 each is 604M fp32 entries). Measured on CPU: a depth-6 model's backward
  2.25x -> 1.03x VE's when compiled, fwd+bwd 2-3% faster in eager mode; on an H100 (d12, 2026-11-26) the step
  takes the same time as the plain mix's (295.1 vs 294.4 ms) with 1.5 GB less peak memory.
  Compiled, its sum over M is M unrolled multiply-adds (``ROW_SUM``): autograd's backward of a broadcast multiply +
  sum reduces over H at stride d, and took 0.96 ms of kernels per d12 call on an H100 against 0.55 ms
  (bench/mome_ops.py); the bigram-indexed d12 step on an H200 went from 269.5 to 263.5 ms.
  For a per-layer table the row mix scatters M*d values per token (VE's count at equal memory) instead of H*K*d.
  In torch ops it is not the default there (slower on CPU in eager mode; per d12 step on the H100 1.2% slower
  with the old sum, on an H200 0.5% faster with the unrolled one, inside the spread between processes); as the
  Triton kernel pair it is the CUDA default (above).
  ``ROW_SUM = "triton"`` (the default): for a per-layer (not per-head) fp32 table where
  ``mome_triton.applies`` (CUDA with triton), MoMEMemory.value calls the kernel pair (table, row ids, dense
  weights; no (B, T, M, d) gather) in place of the gather + ``mome_row_mix``, compiled or eager; every other row
  mix (the shared table unless ``SHARED_TABLE_KERNEL``, per-head tables, the CPU) is the unrolled sum. "unrolled" / "reduce" keep the kernel off.
  ``FUSE_INJECT = True`` (the default): where that kernel pair serves a per-layer table, MoMEMemory.value instead
  calls ``mome_triton.row_mix_inject``, one kernel pair that also does the value injection ``v + gamma * mem``:
  mem never leaves the kernels (no (B, T, H, d) write and read-back, not saved for the backward, which recomputes
  it from the M rows it loads anyway). The d12 step on an H100 went from 289.0 to 285.8 ms (VE: 284.7; 2 rounds
  of fresh processes each, 2026-11-26). Not with a shared expert (added to mem before the cast) or while
  ``capture`` records the injection's norm: there, the kernel pair above. False: that pair, then the injection in
  torch.
``SHARED_TABLE_KERNEL = False`` (the default; opt-in by ``set_shared_table_kernel``: base_train's and base_eval's
  ``--mome-shared-table-kernel on``, bench/train_step.py's ``--shared-table-kernel``; not measured on a GPU yet): the
  shared table's layers take the same kernel pair where it applies (ROW_SUM "triton"; ``FUSE_INJECT`` picks the
  fused or the row-mix pair, as for a per-layer table) on the rows ``prepare`` gathered once, flattened to a
  (B*T*M, d) "table" read with ids 0..B*T-1: the kernels' table gradient is then (B*T*M, d), not the shared
  table's size (604 MB fp32 at d12's n6/M6, 2.4 GB at n24/M6) per layer call, and, each row read by one token,
  declared ``unique_rows``: the backward kernels store it (no zero fill, no atomics; the atomics' values bit for bit); autograd sums the
  layers' row gradients and the one gather's backward scatters them into the shared table, as the torch row mix
  does.
``MIX`` ("bag", "plain", "row"; None = the defaults above) and ``TOPK_BY_ARGMAX`` (None = by device) force one
path for every table; the tests compare them.
``set_kernels`` installs a name of ``KERNEL_SETTINGS`` into ROW_SUM / FUSE_INJECT: scripts/base_train.py's
``--mome-kernels`` (resolved by ``mome_triton.resolve_kernels``), e.g. "torch" to compare paths or to take the
kernels' fp32 atomics out of the table gradients (they sum in a free order; so does a compiled scatter-add).
"""

import torch
import torch.nn.functional as F

MIXES = ("bag", "plain", "row")
# one of MIXES; None = row for the shared table and, where the Triton kernel applies, per-layer tables; else bag on
# CPU, plain on CUDA (see above)
MIX: str | None = None
TOPK_BY_ARGMAX: bool | None = None  # masked-argmax selection; None = on CUDA only
ROW_SUMS = ("triton", "unrolled", "reduce")
# the row mix: the Triton kernel pair for per-layer tables on CUDA, else (and compiled) M unrolled multiply-adds;
# "unrolled" keeps the kernel off; "reduce": a broadcast multiply + sum over M (see above)
ROW_SUM = "triton"
# the row mix and the value injection as one kernel pair where the row-mix kernels serve a per-layer table (above)
FUSE_INJECT = True
# the kernel pair (above) for the shared bigram-indexed table too, on its rows gathered once (above); off by default
SHARED_TABLE_KERNEL = False
# --mome-kernels (scripts/base_train.py): "auto" resolves to one of the others (mome_triton.resolve_kernels), each
# of which sets these globals; "torch" keeps the kernels off, so FUSE_INJECT does nothing there and is left alone
MOME_KERNELS = ("auto", "fused", "row", "torch")
KERNEL_SETTINGS = {"fused": {"ROW_SUM": "triton", "FUSE_INJECT": True},
                   "row": {"ROW_SUM": "triton", "FUSE_INJECT": False},
                   "torch": {"ROW_SUM": "unrolled"}}


def set_kernels(name: str) -> dict:
    """Install a resolved --mome-kernels name (a key of KERNEL_SETTINGS); returns the globals it set. Call it
    before the model is compiled: dynamo guards on these globals, so a later change costs a recompile."""
    if name not in KERNEL_SETTINGS:
        raise ValueError(f"mome kernels {name!r} is unknown; allowed: {', '.join(KERNEL_SETTINGS)} (--mome-kernels "
                         "auto is resolved first, by nanochat.memory.mome_triton.resolve_kernels)")
    globals().update(KERNEL_SETTINGS[name])
    return dict(KERNEL_SETTINGS[name])


# the path settings a benchmark or a test may force for every table (set_path), with their allowed values
FORCEABLE = {"MIX": (None, *MIXES), "TOPK_BY_ARGMAX": (None, True, False), "ROW_SUM": ROW_SUMS}


def set_path(name: str, value) -> None:
    """Force one path setting (a key of FORCEABLE) for every table, checked here rather than at the model's first
    call; the kernels (ROW_SUM's "triton", FUSE_INJECT) are ``set_kernels``'. Call it before the model is compiled
    (dynamo guards on these globals)."""
    allowed = FORCEABLE.get(name)
    if allowed is None:
        raise ValueError(f"mome_mix.set_path: {name!r} is not a path setting; allowed: {', '.join(FORCEABLE)}")
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):  # True is no 1
        raise ValueError(f"mome_mix.set_path: {name} {value!r} is unknown; allowed: {', '.join(map(repr, allowed))}")
    globals()[name] = value


def mome_mix_reference(table: torch.Tensor, flat: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Plain top-K mix: flat ids (B, T, H, K) -> gather (B, T, H, K, d) -> weighted sum over K -> (B, T, H, d)."""
    return (w.to(table.dtype)[..., None] * F.embedding(flat, table)).sum(dim=-2)


def mome_mix_fused(table: torch.Tensor, flat: torch.Tensor, w: torch.Tensor, sparse: bool = False) -> torch.Tensor:
    """Same result as ``mome_mix_reference`` with one embedding_bag over (B*T*H) bags of K rows: the gather and
    the weighted sum are one kernel and the table gradient is one scatter-add of K*H rows per token.
    ``sparse=True`` makes that gradient a sparse tensor (see ``MoMEMemory.sparse_shared_grad``)."""
    *lead, K = flat.shape
    out = F.embedding_bag(flat.reshape(-1, K), table, per_sample_weights=w.to(table.dtype).reshape(-1, K),
                          mode="sum", sparse=sparse)  # (B*T*H, d)
    return out.view(*lead, table.size(-1))  # (B, T, H, d)


def forced_mix() -> str | None:
    if MIX is not None and MIX not in MIXES:
        raise ValueError(f"nanochat.memory.mome_mix.MIX {MIX!r} is unknown; allowed: None, {', '.join(MIXES)}")
    return MIX


def mome_mix(table: torch.Tensor, flat: torch.Tensor, w: torch.Tensor, sparse: bool = False) -> torch.Tensor:
    """The K-row mix by ``MIX``: "bag" or "plain"; None (and "row", which only MoME's per-head mix has) by device."""
    mix = forced_mix()
    fused = mix == "bag" or (mix != "plain" and not table.is_cuda)
    return mome_mix_fused(table, flat, w, sparse) if fused or sparse else mome_mix_reference(table, flat, w)


def slot_weights(sel: torch.Tensor, w: torch.Tensor, M: int) -> torch.Tensor:
    """Top-K weights spread over all M slots: sel, w (..., K) -> (..., M), zero off the selection. Exact: a
    head's K slots are distinct, so each output is one weight plus zeros."""
    hits = sel[..., None] == torch.arange(M, device=sel.device)  # (..., K, M)
    return (hits.to(w.dtype) * w[..., None]).sum(dim=-2)


def set_shared_table_kernel(on: bool) -> None:
    """Switch ``SHARED_TABLE_KERNEL`` (base_train's --mome-shared-table-kernel through
    nanochat.train_setup.install_mome_kernels, bench/train_step.py's --shared-table-kernel). Call it before the model is
    compiled (dynamo guards on these globals). It acts only where the kernels serve tables at all (ROW_SUM
    "triton", a device of mome_triton.KERNEL_DEVICES): ``--mome-kernels torch`` keeps them off for every table."""
    if not isinstance(on, bool):
        raise ValueError(f"mome_mix.set_shared_table_kernel takes True or False, got {on!r}")
    global SHARED_TABLE_KERNEL
    SHARED_TABLE_KERNEL = on


def shared_table_kernel() -> bool:
    if not isinstance(SHARED_TABLE_KERNEL, bool):
        raise ValueError(f"nanochat.memory.mome_mix.SHARED_TABLE_KERNEL must be True or False, got "
                         f"{SHARED_TABLE_KERNEL!r}")
    return SHARED_TABLE_KERNEL


def row_sum() -> str:
    if ROW_SUM not in ROW_SUMS:
        raise ValueError(f"nanochat.memory.mome_mix.ROW_SUM {ROW_SUM!r} is unknown; allowed: {', '.join(ROW_SUMS)}")
    return ROW_SUM


def fuse_inject() -> bool:
    if not isinstance(FUSE_INJECT, bool):
        raise ValueError(f"nanochat.memory.mome_mix.FUSE_INJECT must be True or False, got {FUSE_INJECT!r}")
    return FUSE_INJECT


def mome_row_mix(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head mix of a token's M slots: rows (B, T, M, d) (per-head tables: (B, T, H, M, d), each head its own),
    w (B, T, H, M) -> (B, T, H, d)."""
    w = w.to(rows.dtype)
    per_head = rows.dim() == 5
    if torch.compiler.is_compiling():  # elementwise work that inductor fuses with the gather and the gate
        by_slot = rows if per_head else rows[:, :, None]  # (B, T, H or 1, M, d)
        if row_sum() == "reduce":  # "triton" here: a table the kernels do not take (see above), so unrolled
            return (w[..., None] * by_slot).sum(dim=-2)
        out = w[..., 0, None] * by_slot[..., 0, :]  # (B, T, H, d)
        for s in range(1, rows.size(-2)):
            out = out + w[..., s, None] * by_slot[..., s, :]
        return out
    # eager: batched GEMMs, no (B, T, H, M, d) temporary; in the table's dtype, like the K-row mixes (autocast
    # would run this bmm, and so the table gradient, in bf16)
    with torch.autocast(rows.device.type, enabled=False):
        return torch.einsum("bthm,bthmd->bthd" if per_head else "bthm,btmd->bthd", w, rows)


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores over the last dim, unordered like ``topk(sorted=False)``.

    On CUDA (or with TOPK_BY_ARGMAX) as k masked argmax passes: elementwise work and tiny reductions over M that
    inductor fuses with the router's output, where ``torch.topk`` is a separate radix-select kernel. Exact ties
    (every slot at init: the routers start at zero) are broken differently: the argmax passes take the lowest
    indices, CPU ``torch.topk`` others (e.g. slots 3 and 5 of 6 for k = 2), so step 0 may route to other (equally
    initialised) slots on CPU than on CUDA; the outputs are the same set of equal scores either way."""
    by_argmax = scores.is_cuda if TOPK_BY_ARGMAX is None else TOPK_BY_ARGMAX
    if not by_argmax:
        return scores.topk(k, dim=-1, sorted=False).indices
    slots = torch.arange(scores.size(-1), device=scores.device)
    # a picked slot is masked with -inf: scores of -inf (overflowed logits) are raised to the dtype's lowest finite
    # value first, or a pass with only -inf left would pick a masked slot again (NaN stays NaN, picked first)
    scores = scores.clamp_min(torch.finfo(scores.dtype).min)
    picked = []
    for _ in range(k):
        i = scores.argmax(dim=-1, keepdim=True)  # (..., 1)
        picked.append(i)
        scores = scores.masked_fill(slots == i, float("-inf"))
    return torch.cat(picked, dim=-1)  # (..., k)
