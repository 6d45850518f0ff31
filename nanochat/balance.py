"""Loss-free load balancing (DeepSeek-V3), shared by the MoME memory block and the MoE FFN.

A selection bias b (persistent fp32 buffer, added to the routing scores for the top-K choice only, never to the
mixture weights) moves against the load: after each optimizer step, with c the selection counts since the last
update (summed over micro-steps in the forwards, without host syncs, then over the data-parallel ranks here),

    b_i += lr * sign(mean_j c_j - c_i)

over the last dim (the M slots or E experts of one routing site); sites with no selection at all keep their bias.
"""

import torch
import torch.distributed as dist


@torch.no_grad()
def loss_free_bias_update(bias: torch.Tensor, counts: torch.Tensor, lr: float) -> None:
    """Sign update of ``bias`` from ``counts`` (same shape (..., M)); ``counts`` is all-reduced, then reset.
    Collective: every rank calls it, and every rank then applies the same update."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    total = counts.sum(dim=-1, keepdim=True)  # (..., 1) selections of each site
    step = torch.sign(total / counts.size(-1) - counts) * (total > 0)
    bias.add_(lr * step)
    counts.zero_()
