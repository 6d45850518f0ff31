"""A hand-fused row mix for MoME's per-layer token-indexed tables: a Triton kernel pair behind one custom op.

The row mix (nanochat.memory.mome_mix, "The row mix") reads all M slots of a token's row n_t and mixes them per
head with dense weights w, zero off the top-K:

    mem[t, h, :] = sum_m w[t, h, m] * E[n_t*M + m, :]                  (E: the flat (N*M, d) fp32 table)

Compiled, inductor gathers the M slots into a (B, T, M, d) fp32 tensor and mixes it in separate kernels that run
at ~2.2x the compulsory bytes on an H100 (docs/performance.md). Here one forward kernel reads each token's M rows
once and writes the H mixed vectors (in the output dtype: bf16 under autocast, what the model casts mem to), and
one backward kernel reads grad_mem and the M rows once per token and writes

    dw[t, h, m]       = <E[n_t*M + m], grad_mem[t, h]>                 (fp32)
    d_table[n_t*M+m] += sum_h w[t, h, m] * grad_mem[t, h]              (fp32 atomics into a zero-filled table-sized
                                                                        gradient, as embedding's dense backward)

so no (B, T, M, d) or (B, T, H, M, d) tensor exists in either direction.

``mome_row_mix_op`` (``torch.ops.nanochat.mome_row_mix``) is a ``torch.library.custom_op``: opaque to
``torch.compile(fullgraph=True)`` (fake impl for the shapes), differentiable (its backward is the custom op
``nanochat::mome_row_mix_backward``). Its CUDA implementation launches the Triton kernels; every other device runs
the plain torch math below (the reference the kernels are tested against), so the op and its autograd plumbing are
testable on a CPU without triton. Triton is imported guarded: this module imports on the CPU wheel. With
``TRITON_INTERPRET=1`` (set before this module is imported) the kernel launchers also run on CPU tensors, in
Triton's interpreter (tests/test_mome_triton.py).

MoMEMemory.value calls ``row_mix`` for a per-layer, not per-head, fp32 table where ``applies`` (CUDA with triton)
while ``nanochat.memory.mome_mix.ROW_SUM == "triton"`` (the default). Measured on an H100 (bench/mome_ops.py, d12
shapes, 2026-11-26): 0.32 ms of kernels per call, forward and backward, against 0.74 for the compiled gather + unrolled
sum.
"""

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheel has no triton: the op's CPU math works, the kernels do not exist
    triton = None

# where MoMEMemory.value takes this op for ROW_SUM "triton" (its Triton kernels run on CUDA; tests add "cpu" to run
# the model through the op's CPU math)
KERNEL_DEVICES = ("cuda",)
MAX_TILE = 16384  # H (to a power of 2) * d (to a power of 2) fp32 accumulators per program: registers, not spills
# accumulators per warp: d12's (8, 128) tile gets ONE warp, whose layout gives each thread 4 contiguous columns of
# every head: 128-bit loads of the M rows and of grad_mem, 128-bit atomics (red.global.add.v4.f32) and the sum over
# heads inside each thread. 4 warps split the heads over warps: scalar loads, 4x the atomic instructions and
# shared-memory reductions (read in triton 3.9's sm_90 PTX, compiled on a CPU; not timed)
ACC_PER_WARP = 1024


# -- the plain torch math (every device but CUDA; the kernels' reference) ------------------------------------------
def _slot_ids(row: torch.Tensor, M: int) -> torch.Tensor:
    """(N,) row ids n_t -> (N, M) flat table rows n_t*M + m."""
    return row[:, None] * M + torch.arange(M, device=row.device)


def row_mix_torch(table: torch.Tensor, row: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """table (R, d), row (N,) int64, w (N, H, M) -> (N, H, d) in out_dtype, computed in the table's dtype."""
    with torch.autocast(table.device.type, enabled=False):  # the table's dtype, as the eager row mix
        rows = table[_slot_ids(row, w.size(-1))]  # (N, M, d)
        # contiguous, as the fake impl says (inductor takes the fake's strides for the op's outputs)
        return torch.einsum("nhm,nmd->nhd", w.to(table.dtype), rows).to(out_dtype).contiguous()


def row_mix_backward_torch(grad, table, row, w) -> tuple[torch.Tensor, torch.Tensor]:
    """grad (N, H, d) -> (d_table (R, d) in the table's dtype, dw (N, H, M) in w's dtype)."""
    with torch.autocast(table.device.type, enabled=False):
        ids = _slot_ids(row, w.size(-1))  # (N, M)
        rows, g = table[ids], grad.to(table.dtype)  # (N, M, d), (N, H, d)
        dw = torch.einsum("nhd,nmd->nhm", g, rows).to(w.dtype).contiguous()
        d_rows = torch.einsum("nhm,nhd->nmd", w.to(table.dtype), g)  # (N, M, d)
        d_table = torch.zeros_like(table).index_add_(0, ids.reshape(-1), d_rows.reshape(-1, table.size(1)))
    return d_table, dw


# -- the Triton kernels: one program per token t -------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _row_mix_fwd_kernel(table_ptr, row_ptr, w_ptr, out_ptr, H: tl.constexpr, D: tl.constexpr,
                            M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[t] (H, D) = w[t] (H, M) @ E[n_t*M : n_t*M + M] (M, D): each of the M rows is loaded once for all
        heads; fp32 accumulation, one store in the output's dtype."""
        t = tl.program_id(0).to(tl.int64)  # int64 offsets: N*M*D and R*D can pass 2^31
        h = tl.arange(0, BLOCK_H)
        c = tl.arange(0, BLOCK_D)
        h_ok = h < H  # H and D need not be powers of 2: masked up to BLOCK_H, BLOCK_D
        c_ok = c < D
        base = tl.load(row_ptr + t) * M  # int64 (the ids are int64): the row's first flat slot
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        for m in tl.static_range(M):
            e = tl.load(table_ptr + (base + m) * D + c, mask=c_ok, other=0.0)  # (BLOCK_D,) fp32
            wm = tl.load(w_ptr + (t * H + h) * M + m, mask=h_ok, other=0.0)  # (BLOCK_H,) fp32
            acc += wm[:, None] * e[None, :]
        out = out_ptr + (t * H + h[:, None]) * D + c[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & c_ok[None, :])

    @triton.jit
    def _row_mix_bwd_kernel(grad_ptr, table_ptr, row_ptr, w_ptr, dtable_ptr, dw_ptr, H: tl.constexpr,
                            D: tl.constexpr, M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """grad[t] (H, D) read once (any float dtype, upcast to fp32); per slot m: dw[t, :, m] = grad[t] @ E_m
        and d_table[n_t*M + m] += w[t, :, m] @ grad[t] by fp32 atomics (tokens sharing a row collide)."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        c = tl.arange(0, BLOCK_D)
        h_ok = h < H
        c_ok = c < D
        g = tl.load(grad_ptr + (t * H + h[:, None]) * D + c[None, :], mask=h_ok[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)  # (BLOCK_H, BLOCK_D)
        base = tl.load(row_ptr + t) * M
        for m in tl.static_range(M):
            e = tl.load(table_ptr + (base + m) * D + c, mask=c_ok, other=0.0)  # (BLOCK_D,)
            tl.store(dw_ptr + (t * H + h) * M + m, tl.sum(g * e[None, :], axis=1), mask=h_ok)
            wm = tl.load(w_ptr + (t * H + h) * M + m, mask=h_ok, other=0.0)  # (BLOCK_H,)
            tl.atomic_add(dtable_ptr + (base + m) * D + c, tl.sum(wm[:, None] * g, axis=0), mask=c_ok,
                          sem="relaxed")


def _launch_config(table, row, w) -> dict:
    """Check the kernels' contract and return their shape constants. table (R, d) fp32, row (N,) int64,
    w (N, H, M) fp32, all on one device."""
    if triton is None:
        raise RuntimeError("nanochat.memory.mome_triton: the row-mix kernels need triton, which is not installed")
    if table.dtype != torch.float32 or w.dtype != torch.float32 or row.dtype != torch.int64:
        raise ValueError(f"row-mix kernels take an fp32 table and weights and int64 row ids, got "
                         f"{table.dtype}, {w.dtype}, {row.dtype}")
    if table.dim() != 2 or row.dim() != 1 or w.dim() != 3 or w.size(0) != row.size(0):
        raise ValueError(f"row-mix kernels take table (R, d), row (N,), w (N, H, M); got {tuple(table.shape)}, "
                         f"{tuple(row.shape)}, {tuple(w.shape)}")
    H, M, d = w.size(1), w.size(2), table.size(1)
    block_h, block_d = triton.next_power_of_2(H), triton.next_power_of_2(d)
    if block_h * block_d > MAX_TILE or M > 64:
        raise ValueError(f"row-mix kernels: H={H}, d={d}, M={M} unsupported (H and d rounded up to powers of 2 "
                         f"may hold at most {MAX_TILE} values per token, M at most 64)")
    warps = max(1, min(8, block_h * block_d // ACC_PER_WARP))
    return dict(H=H, D=d, M=M, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps)


def applies(table: torch.Tensor, H: int, M: int) -> bool:
    """Whether the model may take this op for an (R, d) table read by H heads over M slots: a device of
    ``KERNEL_DEVICES``, an fp32 table, a shape the kernels take, and triton importable where they must run (CUDA;
    elsewhere the op is its torch math)."""
    if table.device.type not in KERNEL_DEVICES or table.dtype != torch.float32:
        return False
    if table.device.type == "cuda" and triton is None:
        return False
    pow2 = 1 << max(H - 1, 0).bit_length(), 1 << max(table.size(-1) - 1, 0).bit_length()  # next powers of 2
    return pow2[0] * pow2[1] <= MAX_TILE and M <= 64


def _device_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' (no-op on the CPU interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def row_mix_forward_triton(table, row, w, out_dtype: torch.dtype) -> torch.Tensor:
    """The forward kernel: table (R, d), row (N,), w (N, H, M) -> a new (N, H, d) tensor in out_dtype."""
    cfg = _launch_config(table, row, w)
    table, row, w = table.contiguous(), row.contiguous(), w.contiguous()
    out = torch.empty((w.size(0), cfg["H"], cfg["D"]), dtype=out_dtype, device=table.device)
    if out.numel():
        with _device_guard(table):
            _row_mix_fwd_kernel[(w.size(0),)](table, row, w, out, **cfg)
    return out


def row_mix_backward_triton(grad, table, row, w) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward kernel: grad (N, H, d) (any float dtype) -> (d_table (R, d) fp32, dw (N, H, M) fp32)."""
    cfg = _launch_config(table, row, w)
    grad, table, row, w = grad.contiguous(), table.contiguous(), row.contiguous(), w.contiguous()
    d_table = torch.zeros_like(table, memory_format=torch.contiguous_format)
    dw = torch.empty_like(w, memory_format=torch.contiguous_format)
    if w.numel():
        with _device_guard(table):
            _row_mix_bwd_kernel[(w.size(0),)](grad, table, row, w, d_table, dw, **cfg)
    return d_table, dw


# -- the custom ops ----------------------------------------------------------------------------------------------
@torch.library.custom_op("nanochat::mome_row_mix", mutates_args=())
def mome_row_mix_op(table: torch.Tensor, row: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """table (R, d), row (N,) int64, w (N, H, M) -> (N, H, d) in out_dtype. Devices other than CUDA: torch math."""
    return row_mix_torch(table, row, w, out_dtype)


@mome_row_mix_op.register_kernel("cuda")
def _row_mix_cuda(table, row, w, out_dtype):
    return row_mix_forward_triton(table, row, w, out_dtype)


@mome_row_mix_op.register_fake
def _row_mix_fake(table, row, w, out_dtype):
    return table.new_empty((w.size(0), w.size(1), table.size(1)), dtype=out_dtype)


@torch.library.custom_op("nanochat::mome_row_mix_backward", mutates_args=())
def mome_row_mix_backward_op(grad: torch.Tensor, table: torch.Tensor, row: torch.Tensor,
                             w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grad (N, H, d) -> (d_table (R, d), dw (N, H, M)), fresh tensors. Devices other than CUDA: torch math."""
    return row_mix_backward_torch(grad, table, row, w)


@mome_row_mix_backward_op.register_kernel("cuda")
def _row_mix_backward_cuda(grad, table, row, w):
    return row_mix_backward_triton(grad, table, row, w)


@mome_row_mix_backward_op.register_fake
def _row_mix_backward_fake(grad, table, row, w):
    return table.new_empty(table.shape), w.new_empty(w.shape)


def _setup_context(ctx, inputs, output):
    table, row, w, _ = inputs
    ctx.save_for_backward(table, row, w)


def _backward(ctx, grad):
    table, row, w = ctx.saved_tensors
    d_table, dw = mome_row_mix_backward_op(grad, table, row, w)
    return d_table, None, dw, None  # row ids and out_dtype take no gradient


mome_row_mix_op.register_autograd(_backward, setup_context=_setup_context)


def row_mix(table: torch.Tensor, row: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The model's call: table (R, d), row ids n_t (B, T), dense weights w (B, T, H, M) -> mem (B, T, H, d) in
    out_dtype. w is cast to the table's dtype first, as mome_row_mix does (its gradient flows back through)."""
    B, T, H, M = w.shape
    out = mome_row_mix_op(table, row.reshape(B * T).long(), w.to(table.dtype).reshape(B * T, H, M), out_dtype)
    return out.view(B, T, H, table.size(1))
