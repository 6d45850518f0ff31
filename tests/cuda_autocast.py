"""A CPU emulation of where CUDA autocast's cast policy differs from CPU autocast's, for tests (CI has no GPU).

Under ``torch.autocast("cuda")`` the ops of CUDA's fp32 list (pow, so ``x.square()`` and ``x ** 2``, sum,
softmax, exp, rsqrt, the norms, rms_norm, the losses...) return fp32 from bf16 inputs; CPU autocast keeps most of
them in bf16. An op autocast does not cover (``torch._grouped_mm``, an in-place write, ``index_add_``, a
``scatter_``, ``embedding_bag``'s per_sample_weights) that is then fed such an fp32 tensor next to bf16 ones
raises or silently changes a dtype on the GPU only: the 2026-11-26 H100 failure of the MoE grouped path.

``CudaAutocastPolicy`` is a ``TorchFunctionMode``: while CPU autocast is on, it casts the low-precision floating
inputs of those ops to fp32 (as CUDA's fp32 policy does), the fp32 inputs of the few matmul-like ops that CUDA
but not CPU autocast runs in low precision (einsum, mv, ...) to the autocast dtype, widens the inputs of CUDA's
"promote" ops (CPU raises on mixed dtypes there), and runs the few ops of CPU's fp32 list that CUDA's lacks
(trace, svdvals, ...) without CPU autocast. Outside CPU autocast it changes nothing.

The lists are those of aten/src/ATen/autocast_mode.cpp for CUDA, checked against the installed torch by
``cuda_autocast_dtype``: the real AutocastCUDA kernels run on fake CUDA tensors (FakeTensorMode tensors carry
the CUDA dispatch keys on a CPU-only build), so tests/test_cuda_autocast_policy.py compares every entry here with
what CUDA autocast itself returns. Not emulated: which kernels run (the model's ``device.type == "cuda"``
branches stay CPU ones) and the numerics of CUDA's kernels.
"""

import torch
import torch.nn.functional as F

T = torch.Tensor
_LOW = (torch.bfloat16, torch.float16)

# CUDA's fp32 policy (AT_FORALL_FP32, pow, norm; rms_norm where the installed torch has it) as the Python callables
# that reach those aten ops.
# Composite Python functions whose inner ops are on the list (F.normalize: norm; F.cross_entropy: log_softmax and
# nll_loss; F.softmin: softmax; F.cosine_similarity) are listed themselves: a TorchFunctionMode does not see the
# calls inside a function it intercepted.
FP32_FUNCS = {
    torch.pow, T.pow, T.__pow__, T.__rpow__, torch.square, T.square, torch.arccos, T.arccos, torch.arcsin, T.arcsin,
    torch.special.erfinv, torch.special.expm1, torch.special.log1p, torch.nuclear_norm, torch.norm_except_dim,
    torch.pairwise_distance, F.pairwise_distance, torch.trapezoid, torch.trapz, torch.cumulative_trapezoid,
    F.gumbel_softmax, F.multilabel_soft_margin_loss,
    torch.exp, T.exp, torch.expm1, T.expm1, torch.log, T.log, torch.log1p, T.log1p, torch.log2, T.log2,
    torch.log10, T.log10, torch.rsqrt, T.rsqrt, torch.reciprocal, T.reciprocal,
    torch.acos, T.acos, torch.asin, T.asin, torch.cosh, T.cosh, torch.sinh, T.sinh, torch.tan, T.tan,
    torch.erfinv, T.erfinv, torch.logsumexp, T.logsumexp, torch.special.logsumexp,
    torch.norm, T.norm, torch.linalg.vector_norm, torch.linalg.matrix_norm, torch.linalg.norm, F.normalize,
    torch.layer_norm, F.layer_norm, torch.group_norm, F.group_norm,  # rms_norm: below, as the installed torch has it
    torch.dist, T.dist, torch.cdist, F.pdist, torch.renorm, T.renorm, torch.cosine_similarity, F.cosine_similarity,
    F.softplus, F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
    F.binary_cross_entropy_with_logits, F.poisson_nll_loss, F.soft_margin_loss, F.margin_ranking_loss,
    F.hinge_embedding_loss, F.cosine_embedding_loss, F.triplet_margin_loss,
}
# fp32 unless the call passes dtype= (CUDA's AT_FORALL_FP32_SET_OPT_DTYPE: the given dtype wins)
FP32_UNLESS_DTYPE_FUNCS = {
    torch.sum, T.sum, torch.prod, T.prod, torch.cumsum, T.cumsum, torch.cumprod, T.cumprod,
    torch.softmax, T.softmax, F.softmax, torch.log_softmax, T.log_softmax, F.log_softmax, F.softmin,
    torch.special.softmax, torch.special.log_softmax,
}
# run in the autocast dtype by CUDA autocast, left alone by CPU autocast
LOWER_FUNCS = {torch.einsum, torch.mv, T.mv, torch.addmv, T.addmv, torch.addr, T.addr, torch.linalg.multi_dot,
               torch.chain_matmul}
# CPU autocast changes these and CUDA's does not (trace, svdvals, cond: CPU's fp32 list; pinv: a matmul inside it
# that CPU autocast casts down): they run with CPU autocast off, uncast
UNCAST_FUNCS = {torch.trace, T.trace, torch.linalg.svdvals, torch.linalg.cond, torch.linalg.pinv}
# CUDA's promote list (the widest floating input type); CPU autocast has none of these, so they raise there
PROMOTE_FUNCS = {torch.scatter_add, T.scatter_add, torch.addcmul, T.addcmul, torch.addcdiv, T.addcdiv, torch.atan2,
                 T.atan2, torch.dot, T.dot, torch.vdot, T.vdot, torch.tensordot, torch.cross, T.cross, F.bilinear,
                 torch.inner, T.inner}  # inner: tensordot inside (CUDA promotes there, then runs its mm uncast)
_ALL = FP32_FUNCS | FP32_UNLESS_DTYPE_FUNCS | LOWER_FUNCS | PROMOTE_FUNCS | UNCAST_FUNCS


def _map_tensors(fn, obj):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(fn, o) for o in obj)
    return obj


def _floats(args, kwargs):
    found = []
    _map_tensors(lambda t: found.append(t) if t.is_floating_point() else None, (args, tuple(kwargs.values())))
    return found


class CudaAutocastPolicy(torch.overrides.TorchFunctionMode):
    """While active and ``torch.is_autocast_enabled("cpu")``: CUDA autocast's fp32, lower-precision and promote
    casts where CPU autocast's differ (see the module docstring). Only CPU tensors are touched. ``calls`` counts
    the calls it handled, so a test can check that the code under test reached it at all."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_autocast_enabled("cpu") and func in _ALL:
            self.calls += 1
            args, kwargs = self._cast(func, args, kwargs)
            # CUDA's autocast kernels call the op with autocast off: CPU autocast must not re-cast its inner ops
            # (tensordot's mm would go back to bf16)
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _cast(func, args, kwargs):
        def cast(dtype, which):
            def one(t):
                return t.to(dtype) if t.is_floating_point() and t.dtype in which else t
            return _map_tensors(one, args), {k: _map_tensors(one, v) for k, v in kwargs.items()}

        if func in FP32_FUNCS or (func in FP32_UNLESS_DTYPE_FUNCS and kwargs.get("dtype") is None):
            return cast(torch.float32, _LOW)
        if func in LOWER_FUNCS:
            return cast(torch.get_autocast_dtype("cpu"), (torch.float32,))
        if func in PROMOTE_FUNCS:
            floats = _floats(args, kwargs)
            if floats:
                widest = floats[0].dtype
                for t in floats[1:]:
                    widest = torch.promote_types(widest, t.dtype)
                return cast(widest, tuple(t.dtype for t in floats if t.dtype != widest))
        return args, kwargs


def cuda_autocast_dtype(fn, *tensors, dtype=torch.bfloat16):
    """The ground truth: ``fn(*fakes)``'s output dtype(s) under real CUDA autocast, ``fakes`` being fake CUDA copies
    of ``tensors`` (the AutocastCUDA kernels are compiled into every torch build; fake CUDA tensors reach them
    without a GPU). Raises what CUDA autocast would raise (e.g. a dtype mismatch in an uncovered op). Single ops
    only: a whole model on fake CUDA tensors aborts the process (autocast's cache of cast parameters asks for a
    CUDA device guard, which a CPU-only build does not have), hence the Python-level emulation above."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty(t.shape, dtype=t.dtype, device="cuda") if t.is_floating_point()
                 else torch.zeros(t.shape, dtype=t.dtype, device="cuda") for t in tensors]
    enabled, old_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        with mode:
            out = fn(*fakes)
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", old_dtype)
        torch.clear_autocast_cache()
    return _map_tensors(lambda t: t.dtype, out)


def _cuda_autocast_runs_rms_norm_in_fp32() -> bool:
    """Whether the installed torch's CUDA autocast puts rms_norm on its fp32 list: torch 2.13's does, 2.11's (the GPU
    machine's image) leaves it in the autocast dtype, so the emulation follows the torch it runs under."""
    return cuda_autocast_dtype(lambda t: F.rms_norm(t, (4,)), torch.ones(2, 4, dtype=torch.bfloat16)) == torch.float32


if _cuda_autocast_runs_rms_norm_in_fp32():
    FP32_FUNCS |= {torch.rms_norm, F.rms_norm}
    _ALL |= {torch.rms_norm, F.rms_norm}


__all__ = ["UNCAST_FUNCS", "CudaAutocastPolicy", "FP32_FUNCS", "FP32_UNLESS_DTYPE_FUNCS", "LOWER_FUNCS",
           "PROMOTE_FUNCS", "cuda_autocast_dtype"]
