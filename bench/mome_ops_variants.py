"""The variants bench/mome_ops.py compares: for each MoME op, functions of the same inputs that compute the same
function (checked there against a float64 reference, forward and gradients). Every variant takes the op's input
tensors and the keywords m (slots M), k (top-K) and out_dtype (the compute dtype its mix output is cast to, as
``mem.to(v.dtype)`` in the model); the first of each op in ``mome_ops.default_ops`` is today's path.
"""

import torch
import torch.nn.functional as F

from nanochat.memory.mome import NORM_EPS
from nanochat.memory.mome_mix import mome_mix_fused, mome_mix_reference, mome_row_mix, slot_weights
from nanochat.memory.mome_triton import row_mix as kernel_row_mix
from nanochat.memory.mome_triton import row_mix_inject as kernel_row_mix_inject


# -- selection and gate weights: (B, T, H, M) logits -> (sel, w) over K, or dense weights over M ----------------
def _norm(w: torch.Tensor) -> torch.Tensor:
    return w / (w.sum(dim=-1, keepdim=True) + NORM_EPS)


def _argmax_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """nanochat.memory.mome_mix.topk_indices's CUDA branch (k masked argmax passes), copied so the variant does
    not depend on that module's device switch (tests/test_bench_mome_ops.py checks they agree)."""
    slots = torch.arange(scores.size(-1), device=scores.device)
    picked = []
    for _ in range(k):
        i = scores.argmax(dim=-1, keepdim=True)
        picked.append(i)
        scores = scores.masked_fill(slots == i, float("-inf"))
    return torch.cat(picked, dim=-1)


def gate_argmax(logits, *, m, k, out_dtype):
    """Today's CUDA path (MoMEMemory.route, sigmoid fast path): argmax passes, gather K logits, sigmoid, norm."""
    sel = _argmax_topk(logits, k)
    return sel, _norm(torch.sigmoid(logits.gather(-1, sel).float()))


def gate_topk(logits, *, m, k, out_dtype):
    """torch.topk gives values and indices at once (no gather); a radix-select kernel of its own on CUDA."""
    top = logits.topk(k, dim=-1, sorted=False)
    return top.indices, _norm(torch.sigmoid(top.values.float()))


def gate_max_pass(logits, *, m, k, out_dtype):
    """k passes of max() returning values AND indices: no gather of the selected logits."""
    slots = torch.arange(logits.size(-1), device=logits.device)
    scores, vals, idx = logits, [], []
    for _ in range(k):
        v, i = scores.max(dim=-1, keepdim=True)
        vals.append(v)
        idx.append(i)
        scores = scores.masked_fill(slots == i, float("-inf"))
    return torch.cat(idx, dim=-1), _norm(torch.sigmoid(torch.cat(vals, dim=-1).float()))


def gate_argmax_dense(logits, *, m, k, out_dtype):
    """Today's row-mix input: the argmax path's weights spread over M by slot_weights."""
    sel, w = gate_argmax(logits, m=m, k=k, out_dtype=out_dtype)
    return slot_weights(sel, w, logits.size(-1))


def gate_mask_dense(logits, *, m, k, out_dtype):
    """Dense weights with no index tensors: k argmax passes build a mask (exactly k slots even with ties),
    sigmoid on all M, zero off the mask, normalise over M."""
    slots = torch.arange(logits.size(-1), device=logits.device)
    scores, mask = logits, torch.zeros_like(logits, dtype=torch.bool)
    for _ in range(k):
        hit = slots == scores.argmax(dim=-1, keepdim=True)
        mask, scores = mask | hit, scores.masked_fill(hit, float("-inf"))
    return _norm(torch.where(mask, torch.sigmoid(logits.float()), 0.0))


# -- the row mix: rows (B, T, M, d) shared by the heads, sel/w (B, T, H, K) -> (B, T, H, d) ---------------------
def _mix_bcast_sum(rows, wd):
    """The compiled mome_row_mix until 2026-11-26 (ROW_SUM "reduce"): dense weights (B, T, H, M), a broadcast
    multiply and a reduction over M."""
    return (wd.to(rows.dtype)[..., None] * rows[:, :, None]).sum(dim=-2)


def _mix_unrolled(rows, wd):
    """M unrolled as fused multiply-adds: pointwise over (B, T, H, d), no reduction dimension (the compiled
    mome_row_mix since 2026-11-26)."""
    wd = wd.to(rows.dtype)
    out = wd[..., 0, None] * rows[:, :, None, 0]
    for s in range(1, rows.size(2)):
        out = out + wd[..., s, None] * rows[:, :, None, s]
    return out


def _mix_einsum(rows, wd):
    """A batched GEMM (B*T of (H, M) x (M, d)); under autocast in bf16, so the rows' gradient is bf16 too."""
    return torch.einsum("bthm,btmd->bthd", wd.to(rows.dtype), rows)


class RowMixUnrolled(torch.autograd.Function):
    """The unrolled mix with an explicit backward free of reductions over broadcast dimensions (what autograd
    derives sums over H at stride d): grad rows as H unrolled multiply-adds, grad w an inner sum over d."""

    @staticmethod
    def forward(ctx, rows, wd):  # rows (B, T, M, d), wd (B, T, H, M), both in the table's dtype
        ctx.save_for_backward(rows, wd)
        return _mix_unrolled(rows, wd)

    @staticmethod
    def backward(ctx, grad):  # grad (B, T, H, d)
        rows, wd = ctx.saved_tensors
        grad = grad.to(rows.dtype)
        H, M = wd.size(2), wd.size(3)
        grad_rows = torch.stack([sum(wd[:, :, h, s, None] * grad[:, :, h] for h in range(H)) for s in range(M)], 2)
        return grad_rows, (grad[:, :, :, None] * rows[:, :, None]).sum(dim=-1)


def rowmix_bcast_sum(rows, sel, w, *, m, k, out_dtype):
    return _mix_bcast_sum(rows, slot_weights(sel, w, rows.size(2))).to(out_dtype)


def rowmix_unrolled(rows, sel, w, *, m, k, out_dtype):
    return _mix_unrolled(rows, slot_weights(sel, w, rows.size(2))).to(out_dtype)


def rowmix_einsum(rows, sel, w, *, m, k, out_dtype):
    return _mix_einsum(rows, slot_weights(sel, w, rows.size(2))).to(out_dtype)


def rowmix_unrolled_fn(rows, sel, w, *, m, k, out_dtype):
    wd = slot_weights(sel, w, rows.size(2)).to(rows.dtype)
    return RowMixUnrolled.apply(rows, wd).to(out_dtype)


def _rows_as_table(rows):
    """Gathered rows (B, T, M, d) as the kernels' (table (B*T*M, d), row ids (B, T) = 0..B*T-1): token t reads
    its own M rows (MoMEMemory._kernel_operands for the shared table)."""
    B, T, M, d = rows.shape
    return rows.reshape(B * T * M, d), torch.arange(B * T, device=rows.device).view(B, T)


def rowmix_triton(rows, sel, w, *, m, k, out_dtype):
    """Row mix: triton kernel (nanochat.memory.mome_triton; on the CPU its torch math). The gathered rows are the
    kernel's table, (B*T*M, d), token t reading its own rows: the op's rows gradient is the kernel's table
    gradient, stored (``unique_rows``: no zero fill, no atomics), as MoMEMemory._kernel_operands declares it."""
    return kernel_row_mix(*_rows_as_table(rows), slot_weights(sel, w, rows.size(2)), out_dtype, unique_rows=True)


def rowmix_kgather(rows, sel, w, *, m, k, out_dtype):
    """The K-row mix on the same gathered rows: gather each head's K slots (B, T, H, K, d), weighted sum."""
    B, T, M, d = rows.shape
    base = torch.arange(B * T, device=rows.device).view(B, T, 1, 1) * M
    picked = F.embedding(base + sel, rows.reshape(B * T * M, d))
    return (w.to(rows.dtype)[..., None] * picked).sum(dim=-2).to(out_dtype)


# -- gate + row mix end to end: rows (B, T, M, d), logits (B, T, H, M) -> (B, T, H, d) ---------------------------
# In the model inductor fuses the gate into the row mix (the profile's 0.71 ms kernel is named ..._sigmoid_sum_...)
def gate_rowmix_today(rows, logits, *, m, k, out_dtype):
    """The model until 2026-11-26: argmax passes, sigmoid-norm of the K logits, slot_weights, the bcast-sum row
    mix."""
    return _mix_bcast_sum(rows, gate_argmax_dense(logits, m=m, k=k, out_dtype=out_dtype)).to(out_dtype)


def gate_rowmix_mask_unrolled(rows, logits, *, m, k, out_dtype):
    """No index tensors at all: the mask-dense gate and the unrolled mix."""
    return _mix_unrolled(rows, gate_mask_dense(logits, m=m, k=k, out_dtype=out_dtype)).to(out_dtype)


def gate_rowmix_unrolled_fn(rows, logits, *, m, k, out_dtype):
    """Today's gate and the unrolled mix with its explicit backward."""
    wd = gate_argmax_dense(logits, m=m, k=k, out_dtype=out_dtype).to(rows.dtype)
    return RowMixUnrolled.apply(rows, wd).to(out_dtype)


def gate_rowmix_kgather(rows, logits, *, m, k, out_dtype):
    """Today's gate, then each head's K slots gathered from the rows (no dense weights)."""
    sel, w = gate_argmax(logits, m=m, k=k, out_dtype=out_dtype)
    return rowmix_kgather(rows, sel, w, m=m, k=k, out_dtype=out_dtype)


# -- the mix from a table: table (N*M, d), row ids n_t (B, T), sel/w (B, T, H, K) -> (B, T, H, d) ---------------
class GatherIndexAdd(torch.autograd.Function):
    """table[ids] whose backward is an explicit zeros + index_add_ (embedding's backward in another form)."""

    @staticmethod
    def forward(ctx, table, ids):
        ctx.save_for_backward(ids)
        ctx.rows = table.size(0)
        return F.embedding(ids, table)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.rows, grad.size(-1))
        return out.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.size(-1))), None


def _flat(row, sel, m):
    return row[..., None, None] * m + sel  # (B, T, H, K) flat table row ids


def _slots(row, m):
    return row[..., None] * m + torch.arange(m, device=row.device)  # (B, T, M): all M slots of n_t


def table_plain(table, row, sel, w, *, m, k, out_dtype):
    """Today's CUDA K-row mix (mome_mix_reference): gather (B, T, H, K, d) + weighted sum; embedding backward."""
    return mome_mix_reference(table, _flat(row, sel, m), w).to(out_dtype)


def table_bag(table, row, sel, w, *, m, k, out_dtype):
    """embedding_bag with per-sample weights (the CPU fast path; its CUDA backward sorts the ids)."""
    return mome_mix_fused(table, _flat(row, sel, m), w).to(out_dtype)


def table_index_add(table, row, sel, w, *, m, k, out_dtype):
    """The plain mix with the table gradient as an explicit index_add_."""
    picked = GatherIndexAdd.apply(table, _flat(row, sel, m))
    return (w.to(table.dtype)[..., None] * picked).sum(dim=-2).to(out_dtype)


def table_rowmix(table, row, sel, w, *, m, k, out_dtype):
    """The shared-table path until 2026-11-26: gather the M slots of n_t (B, T, M, d), then the row mix
    (bcast_sum)."""
    return rowmix_bcast_sum(F.embedding(_slots(row, m), table), sel, w, m=m, k=k, out_dtype=out_dtype)


def table_rowmix_eager(table, row, sel, w, *, m, k, out_dtype):
    """Today's EAGER row mix (mome_row_mix outside compile: an fp32 einsum) on aten's embedding backward."""
    return mome_row_mix(F.embedding(_slots(row, m), table), slot_weights(sel, w, m)).to(out_dtype)


def table_rowmix_index_add(table, row, sel, w, *, m, k, out_dtype):
    rows = GatherIndexAdd.apply(table, _slots(row, m))
    return rowmix_bcast_sum(rows, sel, w, m=m, k=k, out_dtype=out_dtype)


def table_rowmix_unrolled(table, row, sel, w, *, m, k, out_dtype):
    """The per-layer row mix as the compiled model runs it with ROW_SUM "unrolled": gather (B, T, M, d), the
    unrolled sum; embedding's backward."""
    return rowmix_unrolled(F.embedding(_slots(row, m), table), sel, w, m=m, k=k, out_dtype=out_dtype)


def table_rowmix_rows_triton(table, row, sel, w, *, m, k, out_dtype):
    """The shared table with mome_mix.SHARED_TABLE_KERNEL: gather the M slots of n_t (B, T, M, d) (once per
    forward in the model, here per call), then the row-mix kernel pair on those rows (``rowmix_triton``)."""
    return rowmix_triton(F.embedding(_slots(row, m), table), sel, w, m=m, k=k, out_dtype=out_dtype)


def table_rowmix_triton(table, row, sel, w, *, m, k, out_dtype):
    """Row mix: triton kernel on the table itself (ROW_SUM "triton" in the model): no (B, T, M, d) gather; the
    table gradient is one zero-fill + fp32 atomics of M rows per token. On the CPU: the custom op's torch math."""
    return kernel_row_mix(table, row, slot_weights(sel, w, m), out_dtype)


# -- the row mix and the value injection: table, row ids, sel/w, gamma (B, T, H), v (B, T, H, d) -> v_out ----------
def _inject(v, gamma, mem):
    """The model's injection (MoMEMemory.value): v + gamma * mem, gamma and mem cast to v's dtype."""
    return v + gamma[..., None].to(v.dtype) * mem.to(v.dtype)


def inject_rowmix_unrolled(table, row, sel, w, gamma, v, *, m, k, out_dtype):
    """ROW_SUM "unrolled": gather (B, T, M, d), the unrolled sum, then the injection; inductor fuses them."""
    return _inject(v, gamma, table_rowmix_unrolled(table, row, sel, w, m=m, k=k, out_dtype=v.dtype))


def inject_triton(table, row, sel, w, gamma, v, *, m, k, out_dtype):
    """Today's default: the row-mix kernel pair writes mem (B, T, H, d) in v's dtype, inductor injects it (and
    saves mem for gamma's gradient)."""
    return _inject(v, gamma, table_rowmix_triton(table, row, sel, w, m=m, k=k, out_dtype=v.dtype))


def inject_triton_fused(table, row, sel, w, gamma, v, *, m, k, out_dtype):
    """mome_mix.FUSE_INJECT: one kernel pair for the row mix and the injection; mem never leaves it."""
    return kernel_row_mix_inject(table, row, slot_weights(sel, w, m), gamma, v)


def inject_rows_triton(table, row, sel, w, gamma, v, *, m, k, out_dtype):
    """The shared table with SHARED_TABLE_KERNEL and FUSE_INJECT off: gather, the row-mix pair on the rows storing
    mem in v's dtype, then inductor's injection."""
    return _inject(v, gamma, table_rowmix_rows_triton(table, row, sel, w, m=m, k=k, out_dtype=v.dtype))


def inject_rows_triton_fused(table, row, sel, w, gamma, v, *, m, k, out_dtype):
    """The shared table with SHARED_TABLE_KERNEL (FUSE_INJECT on): gather, then the fused pair on the rows."""
    rows = F.embedding(_slots(row, m), table)  # (B, T, M, d)
    return kernel_row_mix_inject(*_rows_as_table(rows), slot_weights(sel, w, m), gamma, v, unique_rows=True)
