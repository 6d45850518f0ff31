"""Eval-time slot balance of MoME routing: the authors' final-evaluation "MaxVio" and "absolute load deviation"
(reference model notes §3.10; training notes §1.7), measured during the final train and val bpb passes.

For each routing site (memory layer, row n, head h) with c_m the number of times slot m was selected there and
total = sum_m c_m (visits x K):

    MaxVio          (max_m c_m - total/M) / (total/M)
    abs load dev    max_m |c_m / total - 1/M|

each averaged over the VISITED sites of a layer (total > 0; a row no token reached does not count), then over
the layers. Counts are summed over the ranks first, so the numbers do not depend on the world size (the eval
rows are a fixed set whatever the world size).

What is counted: the selection the eval forward mixes. The authors count top-K without their balancing bias, which
is also what their eval forward selects (their bias is train-only); ours routes with the bias in eval too when
--mome-balance bias is on, so ours then counts the biased selection. Without balancing (every paper run) the two
are the same. K == M selects every slot, so both metrics are exactly 0.

``window_maxvio`` is the training-time counterpart (--mome-maxvio-window): the same MaxVio over the selections of
W optimizer steps, on sites with total >= M, computed on the device (MoMEMemory.close_window).
"""

from typing import Callable, TypeVar

import torch

from nanochat.balance import sum_over_ranks

T = TypeVar("T")


@torch.no_grad()
def site_balance(counts: torch.Tensor) -> tuple[float, float, int]:
    """counts (N, H, M) selections of one layer -> (MaxVio, abs load deviation, visited sites), the means over the
    visited (row, head) sites; (nan, nan, 0) when none was visited."""
    M = counts.size(-1)
    total = counts.sum(dim=-1, dtype=torch.int64)  # (N, H)
    visited = total > 0
    n = int(visited.sum())
    if n == 0:
        return float("nan"), float("nan"), 0
    total = total[visited].double()
    most, least = counts.amax(dim=-1)[visited].double(), counts.amin(dim=-1)[visited].double()
    maxvio = _maxvio(most, total, M)
    # |c/total - 1/M| is largest at the most or the least loaded slot
    deviation = torch.maximum(most / total - 1.0 / M, 1.0 / M - least / total)
    return float(maxvio.mean()), float(deviation.mean()), n


def _maxvio(most: torch.Tensor, total: torch.Tensor, M: int) -> torch.Tensor:
    return (most * M - total) / total  # (max - mean) / mean, mean = total / M


@torch.no_grad()
def window_maxvio(loads: torch.Tensor) -> torch.Tensor:
    """The training-window MaxVio (--mome-maxvio-window; reference notes §3.10) of loads (L, N, H, M), already
    summed over the ranks -> float64 [mean MaxVio, mean eligible sites per layer, layers with an eligible site],
    computed on the loads' device without a host sync (the trainer reads it at its next log step).

    A site is ELIGIBLE when total >= M (the authors' rule for their window; the final evaluation's rule is
    total > 0): per layer the mean MaxVio over its eligible sites, then the mean over the layers that have one
    (nan when none has)."""
    M = loads.size(-1)
    total = loads.sum(dim=-1, dtype=torch.int64).double()  # (L, N, H)
    eligible = total >= M
    per_site = torch.where(eligible, _maxvio(loads.amax(dim=-1).double(), total.clamp_min(1), M), 0.0)
    sites = eligible.sum(dim=(1, 2)).double()  # (L,)
    has = sites > 0
    layers = has.sum().double()
    mean = torch.where(has, per_site.sum(dim=(1, 2)) / sites.clamp_min(1), 0.0).sum() / layers
    return torch.stack([mean, sites.mean(), layers])


@torch.no_grad()
def slot_balance(loads: torch.Tensor) -> dict[str, float]:
    """loads (L, N, H, M), already summed over the ranks -> {"maxvio", "abs_load_dev"}: the per-layer means over
    visited sites, averaged over the layers that have any ({} if none has)."""
    per_layer = [site_balance(layer) for layer in loads]
    seen = [(v, d) for v, d, n in per_layer if n > 0]
    if not seen:
        return {}
    return {"maxvio": sum(v for v, _ in seen) / len(seen), "abs_load_dev": sum(d for _, d in seen) / len(seen)}


def describe(balance: dict[str, float]) -> str:
    return f"MoME slot MaxVio {balance['maxvio']:.6f}, absolute load deviation {balance['abs_load_dev']:.6f}"


def with_slot_balance(model, evaluate: Callable[[], T]) -> tuple[T, dict[str, float]]:
    """Run ``evaluate()`` (forwards of ``model``) while its MoME block counts the selections; returns (its result,
    ``slot_balance`` of the counts summed over the ranks). {} for a model without MoME routing. Collective under
    torchrun: every rank calls it (whether a model has MoME is its config, the same on every rank).

    Call it with the uncompiled model: the counting is eager Python in the block's forward (a compiled model
    would recompile once to trace it); when no collection runs the forward only tests ``eval_loads is None``."""
    memory = getattr(getattr(model, "_orig_mod", model), "memory", None)
    if not hasattr(memory, "start_eval_loads"):
        return evaluate(), {}
    memory.start_eval_loads()
    try:
        result = evaluate()
    finally:
        loads = memory.pop_eval_loads()
    sum_over_ranks(loads)
    return result, slot_balance(loads)
