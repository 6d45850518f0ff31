"""Model-level gradient comparisons for the MoME kernel tests (tests/test_mome_triton*.py,
tests/test_mome_shared_kernel.py, tests/test_mome_kernels33.py): make gradients reach the memory, then compare every
gradient relative to its norm, the memory's asserted nonzero.

Why: the attention's output projection (c_proj) is zero at init, so nothing downstream reads the attention's output:
no gradient reaches v, where the memory injects, every memory gradient (tables, routers, gates) is exactly 0 in both
compared paths, and the loss does not depend on the memory. And where they do flow the memory's gradients are
~1e-6, under an atol of 1e-6: a comparison with rtol/atol could not fail on them (session 33, dev/LOG.md)."""

import torch

# fp32 paths that sum in another order (the ops' CPU math or the interpreted kernels against the torch path, compiled
# against eager): the memory's gradients within 3e-7 of their norm (measured on 2026-11-28), but the scalar
# resid_lambdas/x0_lambdas gradients are sums over every token and channel that cancel ~100-fold, so rounding moves
# them by up to 7e-6 of their (small) norm; 1e-4 leaves room for another CPU's summation order, and a 1% error
# in one of the ops' gradients is 100 times over it
FP32_REL = 1e-4
# bf16 autocast, the fused injection pair against the unfused path: d_gamma sums fp32 products where autograd rounds
# them to bf16 first (measured: up to 0.56% of the norm), the bound these tests had
BF16_REL = 1e-2


def reach_the_memory(model, g: torch.Generator):
    """Every block's attention output projection made nonzero, 0.02 * randn from ``g`` (as a trained one is)."""
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_proj.weight.copy_(0.02 * torch.randn(block.attn.c_proj.weight.shape, generator=g))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (0 where both are zero)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def assert_grads_close(got: dict, want: dict, rel: float):
    """{name: gradient} of two paths of one model: the same names, the memory's gradients ("memory.*": tables,
    routers, gates) present and nonzero (a comparison of zeros cannot fail), and every gradient within ``rel`` of
    its norm (a memory gradient of ~1e-6 is compared at its own scale, not under an absolute tolerance)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    memory = [n for n in want if n.startswith("memory.")]
    assert memory, "no memory gradients to compare"
    zeros = [n for n in memory if float(want[n].abs().max()) == 0]
    assert not zeros, f"memory gradients exactly zero (does a gradient reach the memory?): {zeros}"
    errs = {n: rel_err(got[n], want[n]) for n in want}
    bad = {n: e for n, e in errs.items() if not e < rel}
    assert not bad, f"gradients off by more than {rel} of their norm: {bad}"
