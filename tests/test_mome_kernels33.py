"""Session 33's review of the MoME GPU path (the row-mix kernels, the mix and the selection they serve): one test
per finding or suspicion that the other MoME kernel tests did not pin down.

The selection tests run everywhere; the kernel tests need triton and ``TRITON_INTERPRET=1`` (set before the import)
and skip without them, as tests/test_mome_triton.py's:

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest tests/test_mome_kernels33.py
"""

import pytest
import torch

from nanochat.memory import mome_mix as mix_paths
from test_mome_triton import _close, _reference, needs_interpreter  # noqa: F401  (the kernel tests below)

INF = float("inf")


# -- the top-K selection (mome_mix.topk_indices) ---------------------------------------------------------------
@pytest.mark.parametrize("by_argmax", [True, False], ids=["argmax", "topk"])
def test_topk_never_picks_a_slot_twice_with_minus_inf_scores(by_argmax, monkeypatch):
    """Overflowed (-inf) logits: the masked-argmax passes (CUDA's path) masked a picked slot with -inf, so once only
    -inf scores were left a pass picked slot 0 again, and slot_weights then counted its weight twice. Now every
    path picks K distinct slots holding the K largest scores, as torch.topk does."""
    monkeypatch.setattr(mix_paths, "TOPK_BY_ARGMAX", by_argmax)
    scores = torch.tensor([[5.0, -INF, -INF, 1.0],  # 2 finite scores for K = 3: one -inf slot must be added
                           [-INF, -INF, -INF, -INF],  # nothing finite
                           [-INF, 2.0, -INF, -INF],
                           [0.5, 0.5, 0.5, 0.5]])  # exact ties (a zero-initialised router)
    for k in (1, 2, 3, 4):
        sel = mix_paths.topk_indices(scores, k)
        assert sel.shape == (4, k)
        assert all(len(set(r.tolist())) == k for r in sel), sel  # K distinct slots per row
        want = scores.topk(k, dim=-1).values  # sorted, descending
        torch.testing.assert_close(scores.gather(-1, sel).sort(dim=-1, descending=True).values, want)
    # the weights over M (what the row-mix kernels read): each selected slot's weight once
    sel = mix_paths.topk_indices(scores, 3)
    dense = mix_paths.slot_weights(sel, torch.ones(4, 3), 4)
    assert torch.equal(dense.sum(dim=-1), torch.full((4,), 3.0)) and dense.max() == 1.0


def test_topk_by_argmax_keeps_nan_first_and_the_dtype(monkeypatch):
    """NaN scores are picked first, as torch.topk ranks them; bf16 scores (the router's under autocast) work."""
    monkeypatch.setattr(mix_paths, "TOPK_BY_ARGMAX", True)
    scores = torch.tensor([[1.0, float("nan"), 3.0, -INF]])
    assert mix_paths.topk_indices(scores, 2).tolist() == [[1, 2]]
    assert mix_paths.topk_indices(scores.bfloat16(), 3).tolist() == [[1, 2, 0]]
