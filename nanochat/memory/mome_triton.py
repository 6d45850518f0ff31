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

so no (B, T, M, d) or (B, T, H, M, d) tensor exists in either direction. ``unique_rows=True`` (every op here takes
it; default False) is the caller's promise that each table row is read by exactly one token (R == N*M, distinct ids:
``check_unique_rows``), as for the shared table's rows gathered once (MoMEMemory._kernel_operands): then no two
programs touch one row, and the backward kernels (constexpr UNIQUE_ROWS) store each row's gradient into an unfilled
tensor, no zero fill (B*T*M*d*4 bytes per call: 201 MB at B*T = 65536, M = 6, d = 128) and no atomics, bit for bit
the atomics' values (one add into a zero; the stores add +0.0 so that a sum of -0.0 becomes +0.0 as there), but for
a subnormal sum (below 1.2e-38), which the PTX ISA says fp32 atomics flush to a zero and the stores keep. A
per-layer table's ids repeat: False. The op's CPU math checks the promise in full; the CUDA launchers check the
shapes only (the ids would cost a host sync).

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

By default (``nanochat.memory.mome_mix.FUSE_INJECT``; the d12 step on an H100 289.0 -> 285.8 ms): ``row_mix_inject``
(``torch.ops.nanochat.mome_row_mix_inject``) also does the value injection, v_out = v + gamma * mem, so mem is
neither written to memory, read back by the injection, nor saved for the backward. Its forward kernel rounds as
the eager injection (mem and gamma to v's dtype, their product, then the sum; launched with FP fusion off, so the
multiply and the add stay two roundings); its backward kernel
(``nanochat::mome_row_mix_inject_backward``) reads grad_out once and the M rows, recomputes mem from them and writes

    d_gamma[t, h]     = sum_d grad_out[t, h, d] * mem[t, h, d]         (mem rounded to v's dtype; in gamma's dtype)
    dw[t, h, m]       = gamma[t, h] * <E[n_t*M + m], grad_out[t, h]>
    d_table[n_t*M+m] += sum_h w[t, h, m] * gamma[t, h] * grad_out[t, h]

with grad v = grad_out itself. It differs from the unfused eager backward by bf16 rounding only: autograd rounds
grad_out * mem and gamma * grad_out to bf16 before summing them, the kernel keeps them fp32.
"""

import contextlib

import torch

from .mome_mix import MOME_KERNELS

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


def row_mix_backward_torch(grad, table, row, w, unique_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """grad (N, H, d) -> (d_table (R, d) in the table's dtype, dw (N, H, M) in w's dtype). ``unique_rows``: the
    caller's promise that the kernels' stores may replace their atomics (``check_unique_rows``), checked here in
    full (the ids too: cheap off the GPU); the sum is the same, each row's d_rows added once into a zero."""
    if unique_rows:
        check_unique_rows(table, w, row)
    with torch.autocast(table.device.type, enabled=False):
        ids = _slot_ids(row, w.size(-1))  # (N, M)
        rows, g = table[ids], grad.to(table.dtype)  # (N, M, d), (N, H, d)
        dw = torch.einsum("nhd,nmd->nhm", g, rows).to(w.dtype).contiguous()
        d_rows = torch.einsum("nhm,nhd->nmd", w.to(table.dtype), g)  # (N, M, d)
        d_table = torch.zeros_like(table).index_add_(0, ids.reshape(-1), d_rows.reshape(-1, table.size(1)))
    return d_table, dw


def row_mix_inject_torch(table, row, w, gamma, v) -> torch.Tensor:
    """The injection fused with the row mix: v (N, H, d) + gamma (N, H) * mem -> (N, H, d) in v's dtype, rounded
    as the model's eager ``v + gamma[..., None].to(v.dtype) * mem.to(v.dtype)``: mem (the fp32 mix) and gamma
    rounded to v's dtype, their product rounded, then the sum."""
    with torch.autocast(table.device.type, enabled=False):
        mem = row_mix_torch(table, row, w, v.dtype)  # (N, H, d)
        return (v + gamma.to(v.dtype)[..., None] * mem).contiguous()


def row_mix_inject_backward_torch(grad, table, row, w, gamma,
                                  unique_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad (N, H, d) of v_out, in v's dtype -> (d_table (R, d), dw (N, H, M), d_gamma (N, H)) in the inputs'
    dtypes (grad v is grad itself). In fp32 from gamma and mem rounded to grad's dtype, as the forward multiplies
    them: d_gamma = sum_d grad * mem, dw = gamma * <E_m, grad>, d_table += sum_h w * gamma * grad. ``unique_rows``
    as ``row_mix_backward_torch``'s."""
    with torch.autocast(table.device.type, enabled=False):
        g = grad.to(table.dtype)  # (N, H, d)
        gam = gamma.to(grad.dtype).to(table.dtype)  # (N, H)
        mem = row_mix_torch(table, row, w, grad.dtype).to(table.dtype)
        d_gamma = (g * mem).sum(dim=-1).to(gamma.dtype)
        d_table, dw = row_mix_backward_torch(g * gam[..., None], table, row, w, unique_rows)
    return d_table, dw, d_gamma


def check_unique_rows(table, w, row=None) -> None:
    """The contract of ``unique_rows`` (the backward stores each table row's gradient once into an unfilled
    tensor): every table row is read by exactly one token, i.e. R == N*M and the N row ids are distinct (then a
    permutation of 0..N-1). The shapes are checked always; the ids where ``row`` is given (off the GPU: checking
    them there would sync the host)."""
    N, M = w.size(0), w.size(-1)
    if table.size(0) != N * M:
        raise ValueError(f"unique_rows: each of the table's rows must be read by exactly one token, so R == N*M; got "
                         f"a table of {table.size(0)} rows for N={N} tokens of M={M} slots")
    if row is not None and torch.unique(row).numel() != row.numel():
        raise ValueError(f"unique_rows: the {row.numel()} row ids repeat (the per-layer tables' ids do: "
                         f"unique_rows=False there)")


def _table_grad(table, w, unique_rows: bool) -> torch.Tensor:
    """The backward kernels' fp32 (R, d) table gradient: zero-filled for their atomics; unfilled (no R*d*4-byte
    fill) where ``unique_rows`` has the kernels store every row once."""
    if unique_rows:
        check_unique_rows(table, w)
        if w.numel():  # else no kernel runs to store the rows
            return torch.empty_like(table, memory_format=torch.contiguous_format)
    return torch.zeros_like(table, memory_format=torch.contiguous_format)


# -- the Triton kernels: one program per token t -------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _mixed_rows(table_ptr, row_ptr, w_ptr, t, h, c, h_ok, c_ok, H: tl.constexpr, D: tl.constexpr,
                    M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """Token t's mix (BLOCK_H, BLOCK_D) fp32: w[t] (H, M) @ E[n_t*M : n_t*M + M] (M, D), each of the M rows
        loaded once for all heads (the forward kernels' shared part; inlined by Triton)."""
        base = tl.load(row_ptr + t) * M  # int64 (the ids are int64): the row's first flat slot
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        for m in tl.static_range(M):
            e = tl.load(table_ptr + (base + m) * D + c, mask=c_ok, other=0.0)  # (BLOCK_D,) fp32
            wm = tl.load(w_ptr + (t * H + h) * M + m, mask=h_ok, other=0.0)  # (BLOCK_H,) fp32
            acc = tl.fma(wm[:, None], e[None, :], acc)  # explicit: kept where a launch turns FP fusion off
        return acc

    @triton.jit
    def _add_row_grad(ptr, d_row, c_ok, UNIQUE_ROWS: tl.constexpr):
        """d_table[row] += d_row (BLOCK_D,) fp32. UNIQUE_ROWS (every table row read by exactly one token, e.g. the
        shared table's gathered rows): no other program writes this row, so a plain store into the unfilled
        gradient; ``+ 0.0`` is the atomic add into the zero fill (-0.0 becomes +0.0), so the two are bitwise equal
        (subnormal sums aside: the atomics flush them). The compiler keeps the add (no identity for -0.0).
        Else relaxed fp32 atomics into the zero fill: tokens sharing a row collide."""
        if UNIQUE_ROWS:
            tl.store(ptr, d_row + 0.0, mask=c_ok)
        else:
            tl.atomic_add(ptr, d_row, mask=c_ok, sem="relaxed")

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
        acc = _mixed_rows(table_ptr, row_ptr, w_ptr, t, h, c, h_ok, c_ok, H, D, M, BLOCK_H, BLOCK_D)
        out = out_ptr + (t * H + h[:, None]) * D + c[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & c_ok[None, :])

    @triton.jit
    def _row_mix_bwd_kernel(grad_ptr, table_ptr, row_ptr, w_ptr, dtable_ptr, dw_ptr, H: tl.constexpr,
                            D: tl.constexpr, M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                            UNIQUE_ROWS: tl.constexpr):
        """grad[t] (H, D) read once (any float dtype, upcast to fp32); per slot m: dw[t, :, m] = grad[t] @ E_m
        and d_table[n_t*M + m] += w[t, :, m] @ grad[t] (``_add_row_grad``: atomics, or stores for UNIQUE_ROWS)."""
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
            _add_row_grad(dtable_ptr + (base + m) * D + c, tl.sum(wm[:, None] * g, axis=0), c_ok, UNIQUE_ROWS)

    @triton.jit
    def _row_mix_inject_fwd_kernel(table_ptr, row_ptr, w_ptr, gamma_ptr, v_ptr, out_ptr, H: tl.constexpr,
                                   D: tl.constexpr, M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[t] (H, D) = v[t] + gamma[t, :, None] * mem[t], mem the forward kernel's fp32 mix; rounded as the
        eager injection in out's dtype (v's): mem, gamma and their product each rounded to it, then the sum."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        c = tl.arange(0, BLOCK_D)
        h_ok = h < H
        c_ok = c < D
        hc_ok = h_ok[:, None] & c_ok[None, :]
        dt = out_ptr.dtype.element_ty  # v's dtype
        acc = _mixed_rows(table_ptr, row_ptr, w_ptr, t, h, c, h_ok, c_ok, H, D, M, BLOCK_H, BLOCK_D)
        mem = acc.to(dt).to(tl.float32)
        gam = tl.load(gamma_ptr + t * H + h, mask=h_ok, other=0.0).to(dt).to(tl.float32)  # (BLOCK_H,)
        offs = (t * H + h[:, None]) * D + c[None, :]
        v = tl.load(v_ptr + offs, mask=hc_ok, other=0.0).to(tl.float32)
        inject = (gam[:, None] * mem).to(dt).to(tl.float32)
        tl.store(out_ptr + offs, (v + inject).to(dt), mask=hc_ok)

    @triton.jit
    def _row_mix_inject_bwd_kernel(grad_ptr, table_ptr, row_ptr, w_ptr, gamma_ptr, dtable_ptr, dw_ptr, dgamma_ptr,
                                   H: tl.constexpr, D: tl.constexpr, M: tl.constexpr, BLOCK_H: tl.constexpr,
                                   BLOCK_D: tl.constexpr, UNIQUE_ROWS: tl.constexpr):
        """grad[t] (H, D) (v's dtype) read once; per slot m: dw[t, :, m] = gamma * (grad[t] @ E_m), d_table[n_t*M
        + m] += (w[t, :, m] * gamma) @ grad[t] (``_add_row_grad``), and mem recomputed from the same M rows (rounded
        to grad's dtype, as the forward's multiply) for d_gamma[t] = sum_d grad[t] * mem[t]."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        c = tl.arange(0, BLOCK_D)
        h_ok = h < H
        c_ok = c < D
        dt = grad_ptr.dtype.element_ty
        g = tl.load(grad_ptr + (t * H + h[:, None]) * D + c[None, :], mask=h_ok[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)  # (BLOCK_H, BLOCK_D)
        gam = tl.load(gamma_ptr + t * H + h, mask=h_ok, other=0.0).to(dt).to(tl.float32)  # (BLOCK_H,)
        base = tl.load(row_ptr + t) * M
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        for m in tl.static_range(M):
            e = tl.load(table_ptr + (base + m) * D + c, mask=c_ok, other=0.0)  # (BLOCK_D,)
            wm = tl.load(w_ptr + (t * H + h) * M + m, mask=h_ok, other=0.0)  # (BLOCK_H,)
            acc = tl.fma(wm[:, None], e[None, :], acc)  # as the forward, fusion on or off
            tl.store(dw_ptr + (t * H + h) * M + m, gam * tl.sum(g * e[None, :], axis=1), mask=h_ok)
            _add_row_grad(dtable_ptr + (base + m) * D + c, tl.sum((wm * gam)[:, None] * g, axis=0), c_ok,
                          UNIQUE_ROWS)
        mem = acc.to(dt).to(tl.float32)
        d_gamma = tl.sum(g * mem, axis=1)  # (BLOCK_H,)
        tl.store(dgamma_ptr + t * H + h, d_gamma.to(dgamma_ptr.dtype.element_ty), mask=h_ok)


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
    block_h, block_d = _next_pow2(H), _next_pow2(d)
    if not _tile_fits(H, d, M):
        raise ValueError(f"row-mix kernels: H={H}, d={d}, M={M} unsupported (H and d rounded up to powers of 2 "
                         f"may hold at most {MAX_TILE} values per token, M at most 64)")
    warps = max(1, min(8, block_h * block_d // ACC_PER_WARP))
    return dict(H=H, D=d, M=M, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _tile_fits(H: int, d: int, M: int) -> bool:
    """One program's (H, d) tile, each rounded up to a power of 2, within MAX_TILE accumulators; M at most 64."""
    return _next_pow2(H) * _next_pow2(d) <= MAX_TILE and M <= 64


def applies(table: torch.Tensor, H: int, M: int) -> bool:
    """Whether the model may take this op for an (R, d) table read by H heads over M slots: a device of
    ``KERNEL_DEVICES``, an fp32 table, a shape the kernels take, and triton importable where they must run (CUDA;
    elsewhere the op is its torch math)."""
    if table.device.type not in KERNEL_DEVICES or table.dtype != torch.float32:
        return False
    if table.device.type == "cuda" and triton is None:
        return False
    return _tile_fits(H, table.size(-1), M)


def resolve_kernels(requested: str, device) -> tuple[str, str]:
    """--mome-kernels -> (the ``mome_mix.KERNEL_SETTINGS`` name to install, why, for the log; "" if as asked).
    Depends only on the device kind and whether triton imports, so every rank of a run resolves alike.

    auto = "fused" where the kernels can run (a device of KERNEL_DEVICES; triton on CUDA), else "torch": the module
    defaults' behaviour. fused/row on a device outside KERNEL_DEVICES (the CPU) change nothing there: "torch",
    said so. fused/row on CUDA without triton are an error naming the flag, never a silent torch path."""
    allowed = ", ".join(MOME_KERNELS)
    if requested not in MOME_KERNELS:
        raise ValueError(f"--mome-kernels must be one of {allowed} (got {requested!r})")
    device = torch.device(device)
    if requested == "torch":
        return "torch", ""
    if device.type not in KERNEL_DEVICES:
        return "torch", (f"--mome-kernels {requested}: the MoME Triton kernels run on "
                         f"{' and '.join(KERNEL_DEVICES)} only, this run is on {device.type}")
    if device.type == "cuda" and triton is None:
        if requested == "auto":
            return "torch", "--mome-kernels auto: triton cannot be imported"
        raise ValueError(f"--mome-kernels {requested}: the MoME Triton kernels need triton, which cannot be imported "
                         f"here; install triton (pip install triton), or pass --mome-kernels torch or auto "
                         f"(allowed: {allowed})")
    return ("fused" if requested == "auto" else requested), ""


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


def row_mix_backward_triton(grad, table, row, w, unique_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward kernel: grad (N, H, d) (any float dtype) -> (d_table (R, d) fp32, dw (N, H, M) fp32).
    ``unique_rows``: stores into an unfilled d_table in place of atomics into a zero-filled one (``_add_row_grad``;
    the ids are the caller's promise, ``check_unique_rows``)."""
    cfg = _launch_config(table, row, w)
    grad, table, row, w = grad.contiguous(), table.contiguous(), row.contiguous(), w.contiguous()
    d_table = _table_grad(table, w, unique_rows)
    dw = torch.empty_like(w, memory_format=torch.contiguous_format)
    if w.numel():
        with _device_guard(table):
            _row_mix_bwd_kernel[(w.size(0),)](grad, table, row, w, d_table, dw, **cfg, UNIQUE_ROWS=unique_rows)
    return d_table, dw


def _inject_launch_config(table, row, w, gamma, v) -> dict:
    """``_launch_config`` plus the injection's inputs: gamma (N, H) and v (N, H, d), floating point."""
    cfg = _launch_config(table, row, w)
    N, H, d = w.size(0), cfg["H"], cfg["D"]
    if tuple(gamma.shape) != (N, H) or tuple(v.shape) != (N, H, d):
        raise ValueError(f"row-mix inject kernels take gamma (N, H) = {(N, H)} and v (N, H, d) = {(N, H, d)}; got "
                         f"{tuple(gamma.shape)}, {tuple(v.shape)}")
    if not (gamma.is_floating_point() and v.is_floating_point()):
        raise ValueError(f"row-mix inject kernels take floating gamma and v, got {gamma.dtype}, {v.dtype}")
    return cfg


# FP fusion off for the injection forward: with it on, Triton turns v + round(gamma * mem) into one bf16 FMA, whose
# single rounding differed from the eager model's in a quarter of the outputs (H100, 2026-11-26). The mix over M keeps
# its FMAs (explicit tl.fma). Also read by the sm_90 build test; the interpreter ignores it.
INJECT_FWD_OPTIONS = {"enable_fp_fusion": False}


def row_mix_inject_forward_triton(table, row, w, gamma, v) -> torch.Tensor:
    """The fused forward kernel: -> a new (N, H, d) tensor v + gamma * mem in v's dtype."""
    cfg = _inject_launch_config(table, row, w, gamma, v)
    table, row, w, gamma, v = (x.contiguous() for x in (table, row, w, gamma, v))
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    if out.numel():
        with _device_guard(table):
            _row_mix_inject_fwd_kernel[(w.size(0),)](table, row, w, gamma, v, out, **cfg, **INJECT_FWD_OPTIONS)
    return out


def row_mix_inject_backward_triton(grad, table, row, w, gamma,
                                   unique_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused backward kernel: grad (N, H, d) in v's dtype -> (d_table (R, d) fp32, dw (N, H, M) fp32,
    d_gamma (N, H) in gamma's dtype). ``unique_rows`` as ``row_mix_backward_triton``'s."""
    cfg = _inject_launch_config(table, row, w, gamma, grad)
    grad, table, row, w, gamma = (x.contiguous() for x in (grad, table, row, w, gamma))
    d_table = _table_grad(table, w, unique_rows)
    dw = torch.empty_like(w, memory_format=torch.contiguous_format)
    d_gamma = torch.empty_like(gamma, memory_format=torch.contiguous_format)
    if w.numel():
        with _device_guard(table):
            _row_mix_inject_bwd_kernel[(w.size(0),)](grad, table, row, w, gamma, d_table, dw, d_gamma, **cfg,
                                                     UNIQUE_ROWS=unique_rows)
    return d_table, dw, d_gamma


# -- the custom ops ----------------------------------------------------------------------------------------------
@torch.library.custom_op("nanochat::mome_row_mix", mutates_args=())
def mome_row_mix_op(table: torch.Tensor, row: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
                    unique_rows: bool = False) -> torch.Tensor:
    """table (R, d), row (N,) int64, w (N, H, M) -> (N, H, d) in out_dtype. Devices other than CUDA: torch math.
    ``unique_rows`` (every table row read by one token: ``check_unique_rows``) changes only how the backward
    writes the table gradient (stores, no zero fill), not a value."""
    return row_mix_torch(table, row, w, out_dtype)


@mome_row_mix_op.register_kernel("cuda")
def _row_mix_cuda(table, row, w, out_dtype, unique_rows=False):
    return row_mix_forward_triton(table, row, w, out_dtype)


@mome_row_mix_op.register_fake
def _row_mix_fake(table, row, w, out_dtype, unique_rows=False):
    return table.new_empty((w.size(0), w.size(1), table.size(1)), dtype=out_dtype)


@torch.library.custom_op("nanochat::mome_row_mix_backward", mutates_args=())
def mome_row_mix_backward_op(grad: torch.Tensor, table: torch.Tensor, row: torch.Tensor, w: torch.Tensor,
                             unique_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """grad (N, H, d) -> (d_table (R, d), dw (N, H, M)), fresh tensors. Devices other than CUDA: torch math."""
    return row_mix_backward_torch(grad, table, row, w, unique_rows)


@mome_row_mix_backward_op.register_kernel("cuda")
def _row_mix_backward_cuda(grad, table, row, w, unique_rows=False):
    return row_mix_backward_triton(grad, table, row, w, unique_rows)


@mome_row_mix_backward_op.register_fake
def _row_mix_backward_fake(grad, table, row, w, unique_rows=False):
    return table.new_empty(table.shape), w.new_empty(w.shape)


def _setup_context(ctx, inputs, output):
    table, row, w, _, ctx.unique_rows = inputs
    ctx.save_for_backward(table, row, w)


def _backward(ctx, grad):
    table, row, w = ctx.saved_tensors
    d_table, dw = mome_row_mix_backward_op(grad, table, row, w, ctx.unique_rows)
    return d_table, None, dw, None, None  # row ids, out_dtype and unique_rows take no gradient


mome_row_mix_op.register_autograd(_backward, setup_context=_setup_context)


def row_mix(table: torch.Tensor, row: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
            unique_rows: bool = False) -> torch.Tensor:
    """The model's call: table (R, d), row ids n_t (B, T), dense weights w (B, T, H, M) -> mem (B, T, H, d) in
    out_dtype. w is cast to the table's dtype first, as mome_row_mix does (its gradient flows back through).
    ``unique_rows``: every table row read by one token (``check_unique_rows``; the shared table's gathered rows)."""
    B, T, H, M = w.shape
    out = mome_row_mix_op(table, row.reshape(B * T).long(), w.to(table.dtype).reshape(B * T, H, M), out_dtype,
                          unique_rows)
    return out.view(B, T, H, table.size(1))


# -- the row mix fused with the injection (mome_mix.FUSE_INJECT; on by default) ---------------------------------------
@torch.library.custom_op("nanochat::mome_row_mix_inject", mutates_args=())
def mome_row_mix_inject_op(table: torch.Tensor, row: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor,
                           v: torch.Tensor, unique_rows: bool = False) -> torch.Tensor:
    """table (R, d) fp32, row (N,) int64, w (N, H, M) fp32, gamma (N, H), v (N, H, d) -> v + gamma * mem,
    (N, H, d) in v's dtype (``row_mix_inject_torch``'s roundings). Devices other than CUDA: torch math.
    ``unique_rows`` as ``mome_row_mix_op``'s (the backward only)."""
    return row_mix_inject_torch(table, row, w, gamma, v)


@mome_row_mix_inject_op.register_kernel("cuda")
def _row_mix_inject_cuda(table, row, w, gamma, v, unique_rows=False):
    return row_mix_inject_forward_triton(table, row, w, gamma, v)


@mome_row_mix_inject_op.register_fake
def _row_mix_inject_fake(table, row, w, gamma, v, unique_rows=False):
    return v.new_empty(v.shape)


@torch.library.custom_op("nanochat::mome_row_mix_inject_backward", mutates_args=())
def mome_row_mix_inject_backward_op(grad: torch.Tensor, table: torch.Tensor, row: torch.Tensor, w: torch.Tensor,
                                    gamma: torch.Tensor, unique_rows: bool = False
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad (N, H, d) in v's dtype -> (d_table (R, d), dw (N, H, M), d_gamma (N, H)), fresh tensors."""
    return row_mix_inject_backward_torch(grad, table, row, w, gamma, unique_rows)


@mome_row_mix_inject_backward_op.register_kernel("cuda")
def _row_mix_inject_backward_cuda(grad, table, row, w, gamma, unique_rows=False):
    return row_mix_inject_backward_triton(grad, table, row, w, gamma, unique_rows)


@mome_row_mix_inject_backward_op.register_fake
def _row_mix_inject_backward_fake(grad, table, row, w, gamma, unique_rows=False):
    return table.new_empty(table.shape), w.new_empty(w.shape), gamma.new_empty(gamma.shape)


def _inject_setup_context(ctx, inputs, output):
    table, row, w, gamma, v, ctx.unique_rows = inputs
    ctx.save_for_backward(table, row, w, gamma)  # not mem, not v: the backward recomputes mem from the table
    ctx.v_dtype = v.dtype


def _inject_backward(ctx, grad):
    table, row, w, gamma = ctx.saved_tensors
    grad = grad.to(ctx.v_dtype)  # the rounding dtype of the forward (autograd gives v_out's dtype already)
    d_table, dw, d_gamma = mome_row_mix_inject_backward_op(grad, table, row, w, gamma, ctx.unique_rows)
    return d_table, None, dw, d_gamma, grad, None  # grad v = grad v_out (the identity)


mome_row_mix_inject_op.register_autograd(_inject_backward, setup_context=_inject_setup_context)


def row_mix_inject(table: torch.Tensor, row: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor,
                   v: torch.Tensor, unique_rows: bool = False) -> torch.Tensor:
    """The model's fused call: table (R, d), row ids (B, T), dense weights w (B, T, H, M), gate gamma (B, T, H),
    values v (B, T, H, d) -> v + gamma * mem, (B, T, H, d) in v's dtype. w is cast to the table's dtype.
    ``unique_rows`` as ``row_mix``'s."""
    B, T, H, M = w.shape
    d = v.size(-1)
    out = mome_row_mix_inject_op(table, row.reshape(B * T).long(), w.to(table.dtype).reshape(B * T, H, M),
                                 gamma.reshape(B * T, H), v.reshape(B * T, H, d), unique_rows)
    return out.view(B, T, H, d)
