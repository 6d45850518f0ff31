"""Routing statistics of the paper's analysis section (slot-utilisation audit, WiC sense probe).

Conventions: a *site* is one (memory layer, head) pair; ``topk`` holds selected slot ids (N, S, K) and
``weights`` the matching routing weights (N, S, K) for N token positions and S sites; ``probs`` the full
routing distribution over M slots (N, S, M). All functions are pure tensor code, tested on hand-made inputs.
"""

import math

import torch

LN2 = math.log(2.0)


def entropy(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Shannon entropy in nats, with 0 log 0 = 0."""
    p = p / p.sum(dim=dim, keepdim=True).clamp_min(1e-30)
    return -(p * p.clamp_min(1e-30).log()).sum(dim=dim)


def effective_count(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """exp(H(p)): 1 for a one-hot distribution, M for the uniform one."""
    return entropy(p, dim).exp()


def membership_distribution(topk: torch.Tensor, M: int) -> torch.Tensor:
    """(N, S, K) slot ids -> (S, M) share of top-K memberships per site (rows sum to 1)."""
    N, S, K = topk.shape
    counts = torch.zeros(S, M, dtype=torch.float64, device=topk.device)
    site = torch.arange(S, device=topk.device).view(1, S, 1).expand(N, S, K)
    counts.index_put_((site.reshape(-1), topk.reshape(-1)), torch.ones(N * S * K, dtype=torch.float64,
                      device=topk.device), accumulate=True)
    return counts / counts.sum(-1, keepdim=True).clamp_min(1e-30)


def weight_distribution(topk: torch.Tensor, weights: torch.Tensor, M: int) -> torch.Tensor:
    """(N, S, K) ids + weights -> (S, M) routing-weight mass per site (rows sum to 1)."""
    N, S, K = topk.shape
    mass = torch.zeros(S, M, dtype=torch.float64, device=topk.device)
    site = torch.arange(S, device=topk.device).view(1, S, 1).expand(N, S, K)
    mass.index_put_((site.reshape(-1), topk.reshape(-1)), weights.reshape(-1).double(), accumulate=True)
    return mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)


def per_token_effective_slots(topk: torch.Tensor, token_ids: torch.Tensor, M: int, min_count: int = 32) -> torch.Tensor:
    """Mean over sites of the mean over frequent tokens (>= min_count occurrences) of exp(H) of the token's
    top-K membership distribution. Returns a 0-d tensor (nan if no token qualifies)."""
    N, S, K = topk.shape
    uniq, inverse, counts = torch.unique(token_ids, return_inverse=True, return_counts=True)
    keep = counts >= min_count
    if not bool(keep.any()):
        return torch.tensor(float("nan"))
    U = uniq.numel()
    tok = inverse.view(N, 1, 1).expand(N, S, K)
    site = torch.arange(S, device=topk.device).view(1, S, 1).expand(N, S, K)
    flat = (tok * S + site) * M + topk  # (token, site, slot) -> flat cell
    cells = torch.zeros(U * S * M, dtype=torch.float64, device=topk.device)
    cells.index_add_(0, flat.reshape(-1), torch.ones(N * S * K, dtype=torch.float64, device=topk.device))
    per_token = effective_count(cells.view(U, S, M)[keep], dim=-1)  # (U_keep, S)
    return per_token.mean(0).mean()


def inactive_cells(topk: torch.Tensor, M: int) -> tuple[int, int]:
    """Number of (site, slot) cells never selected, and the total number of cells."""
    dist = membership_distribution(topk, M)
    return int((dist == 0).sum()), dist.numel()


def jsd_base2(p: torch.Tensor, q: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Base-2 Jensen-Shannon divergence in [0, 1] along ``dim``."""
    p = p.double() / p.double().sum(dim, keepdim=True)
    q = q.double() / q.double().sum(dim, keepdim=True)
    m = 0.5 * (p + q)

    def kl(a, b):
        return torch.where(a > 0, a * (a.clamp_min(1e-300).log() - b.clamp_min(1e-300).log()), torch.zeros_like(a)).sum(dim)

    return (0.5 * kl(p, m) + 0.5 * kl(q, m)) / LN2


def chance_corrected_overlap(a: torch.Tensor, b: torch.Tensor, M: int) -> torch.Tensor:
    """Õ = (o - K²/M) / (K - K²/M) for top-K sets a, b of shape (..., K); 1 = identical, 0 = chance level."""
    K = a.size(-1)
    if K >= M:
        raise ValueError(f"chance-corrected overlap needs K < M (got K={K}, M={M})")
    o = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1).double()
    expected = K * K / M
    return (o - expected) / (K - expected)


def audit(topk, weights, token_ids, M: int, min_count: int = 32, reference_weight_dist=None) -> dict:
    """The appendix slot-utilisation table row for one domain (macro-averaged over sites).

    "Largest-slot mass" (the paper: 60.95-64.01% at K = 2) cannot be the top-K membership share, which is at most
    1/K; the paper does not define it further, so both readings that fit are reported: ``largest_slot_mass``, the
    routing-weight share of each site's heaviest slot, and ``largest_slot_positions``, the share of positions
    whose top-K contains each site's most-selected slot."""
    member = membership_distribution(topk, M)
    wdist = weight_distribution(topk, weights, M)
    inactive, cells = inactive_cells(topk, M)
    row = {
        "marginal_effective_slots": effective_count(member).mean().item(),
        "weight_effective_slots": effective_count(wdist).mean().item(),
        "largest_slot_mass": wdist.max(-1).values.mean().item(),
        "largest_slot_positions": (member.max(-1).values * topk.size(-1)).mean().item(),
        "per_token_effective_slots": per_token_effective_slots(topk, token_ids, M, min_count).item(),
        "inactive_cells": inactive,
        "total_cells": cells,
    }
    if reference_weight_dist is not None:
        j = jsd_base2(wdist, reference_weight_dist)
        row["jsd_mean"], row["jsd_max"] = j.mean().item(), j.max().item()
    return row


def stratified_bootstrap(stat_fn, labels: torch.Tensor, n_boot: int = 1000, seed: int = 0, alpha: float = 0.05):
    """Pair-stratified bootstrap: resample T pairs and F pairs separately (with replacement), keep the class
    sizes, and return the (alpha/2, 1-alpha/2) quantiles of ``stat_fn(index_tensor)``; labels is a bool tensor."""
    g = torch.Generator().manual_seed(seed)
    t_idx, f_idx = labels.nonzero().flatten(), (~labels).nonzero().flatten()
    stats = []
    for _ in range(n_boot):
        rt = t_idx[torch.randint(len(t_idx), (len(t_idx),), generator=g)]
        rf = f_idx[torch.randint(len(f_idx), (len(f_idx),), generator=g)]
        stats.append(stat_fn(torch.cat([rt, rf])))
    s = torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in stats])
    return torch.quantile(s, alpha / 2, dim=0), torch.quantile(s, 1 - alpha / 2, dim=0)
