"""Loss-free load balancing (DeepSeek-V3), shared by the MoME memory block and the MoE FFN.

A selection bias b (persistent fp32 buffer, added to the routing scores for the top-K choice only, never to the
mixture weights) moves against the load: after each optimizer step, with c the selection counts since the last
update (summed over micro-steps in the forwards, without host syncs, then over the data-parallel ranks here),
one of two rules runs over the last dim (the M slots or E experts of one routing site, a "row"):

* sign rule (``loss_free_bias_update``; MoME --mome-balance bias, the MoE FFN):

      b_i += lr * sign(mean_j c_j - c_i)

  rows with no selection at all keep their bias.

* trust region (``trust_region_bias_update``; MoME --mome-balance trust-region, the authors' ``trust_region``,
  reference notes §3.9): no push toward the exact mean, only back into a band of load shares. With the
  power-law shares q_r = n^-r / sum_{r'<M} n^-r' (r = 0..M-1) the band is [q_{M-1}, q_0] of the row's total T:

      c_i < T q_{M-1}: b_i += lr;   c_i > T q_0: b_i -= lr;   inside: b_i -= sign(b_i) min(|b_i|, lr)

  (inside the band the bias decays to 0, so a balanced row ends unbiased), on rows with T >= min_visits only
  (0 means M): rows with too few visits to tell a skew from noise keep their bias.
"""

import torch
import torch.distributed as dist

from nanochat.common import is_dist


def sum_over_ranks(counts: torch.Tensor) -> None:
    """In place: every rank ends with the global counts (so every rank applies the same update). Collective with
    several processes, a no-op with one."""
    if is_dist():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)


@torch.no_grad()
def loss_free_bias_update(bias: torch.Tensor, counts: torch.Tensor, lr: float) -> None:
    """Sign update of ``bias`` from ``counts`` (same shape (..., M)); ``counts`` is all-reduced, then reset.
    Collective: every rank calls it, and every rank then applies the same update."""
    sum_over_ranks(counts)
    total = counts.sum(dim=-1, keepdim=True)  # (..., 1) selections of each site
    step = torch.sign(total / counts.size(-1) - counts) * (total > 0)
    bias.add_(lr * step)
    counts.zero_()


def power_law_band(base: float, slots: int) -> tuple[float, float]:
    """(q_min, q_max) = (q_{M-1}, q_0) of the power-law shares q_r = base^-r / sum_{r'<M} base^-r' (float64)."""
    norm = sum(base ** -r for r in range(slots))
    return base ** -(slots - 1) / norm, 1.0 / norm


@torch.no_grad()
def trust_region_bias_update(bias: torch.Tensor, counts: torch.Tensor, lr: float, band_base: float,
                             min_visits: int) -> None:
    """Trust-region update of ``bias`` from ``counts`` (same shape (..., M)); ``counts`` is all-reduced, then reset.
    Collective like ``loss_free_bias_update``."""
    sum_over_ranks(counts)
    slots = counts.size(-1)
    q_min, q_max = power_law_band(band_base, slots)
    total = counts.sum(dim=-1, keepdim=True).double()  # (..., 1); fp64 bounds: exact integer counts compare exactly
    eligible = total >= (min_visits or slots)  # implies visited (min_visits >= 0, M >= 1)
    below, above = counts < total * q_min, counts > total * q_max
    decay = -bias.sign() * bias.abs().clamp_max(lr)  # inside the band: toward 0, never past it
    step = torch.where(below, lr, torch.where(above, -lr, decay))
    bias.add_(step * eligible)
    counts.zero_()
