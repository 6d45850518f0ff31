import math

import pytest
import torch

from nanochat.routing_metrics import (
    audit, chance_corrected_overlap, effective_count, inactive_cells, jsd_base2, membership_distribution,
    per_token_effective_slots, stratified_bootstrap, weight_distribution,
)


def test_effective_count_extremes_and_two_point():
    assert effective_count(torch.tensor([1.0, 0, 0, 0])).item() == pytest.approx(1.0)
    assert effective_count(torch.full((6,), 1 / 6)).item() == pytest.approx(6.0)
    p = torch.tensor([0.75, 0.25])
    assert effective_count(p).item() == pytest.approx(math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))))


def test_membership_and_weight_distributions_by_hand():
    # 2 tokens, 1 site, K=2, M=4: token0 picks {0,1} w (0.75,0.25); token1 picks {1,2} w (0.5,0.5)
    topk = torch.tensor([[[0, 1]], [[1, 2]]])
    w = torch.tensor([[[0.75, 0.25]], [[0.5, 0.5]]])
    assert torch.allclose(membership_distribution(topk, 4), torch.tensor([[0.25, 0.5, 0.25, 0.0]], dtype=torch.float64))
    assert torch.allclose(weight_distribution(topk, w, 4), torch.tensor([[0.375, 0.375, 0.25, 0.0]], dtype=torch.float64))
    assert inactive_cells(topk, 4) == (1, 4)


def test_per_token_effective_slots():
    # token 7 seen 32 times always picking {0,1}; token 9 seen 32 times alternating {0,1} and {2,3}
    a = torch.tensor([[[0, 1]]]).repeat(32, 1, 1)
    b = torch.tensor([[[0, 1]], [[2, 3]]]).repeat(16, 1, 1)
    topk = torch.cat([a, b])
    toks = torch.tensor([7] * 32 + [9] * 32)
    # token 7: uniform over 2 slots -> 2; token 9: uniform over 4 -> 4; mean 3
    assert per_token_effective_slots(topk, toks, 4).item() == pytest.approx(3.0)
    assert math.isnan(per_token_effective_slots(topk, toks, 4, min_count=33).item())


def test_jsd_identical_disjoint_and_bounds():
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.5, 0.5])
    assert jsd_base2(p, p).item() == pytest.approx(0.0, abs=1e-12)
    assert jsd_base2(p, q).item() == pytest.approx(1.0)
    r = torch.tensor([0.5, 0.0, 0.5, 0.0])  # half overlap: JSD = 0.5 bit
    assert jsd_base2(p, r).item() == pytest.approx(0.5)


def test_chance_corrected_overlap_identical_disjoint_random():
    K, M = 2, 12
    a = torch.tensor([3, 5])
    assert chance_corrected_overlap(a, torch.tensor([5, 3]), M).item() == pytest.approx(1.0)
    assert chance_corrected_overlap(a, torch.tensor([0, 1]), M).item() == pytest.approx((0 - 4 / 12) / (2 - 4 / 12))
    # uniformly random top-K sets average to 0
    g = torch.Generator().manual_seed(0)
    A = torch.stack([torch.randperm(M, generator=g)[:K] for _ in range(20000)])
    B = torch.stack([torch.randperm(M, generator=g)[:K] for _ in range(20000)])
    assert abs(chance_corrected_overlap(A, B, M).mean().item()) < 0.02
    with pytest.raises(ValueError):
        chance_corrected_overlap(a, a, 2)


def test_audit_row_and_reference_jsd():
    topk = torch.tensor([[[0, 1]], [[1, 2]]])
    w = torch.tensor([[[0.75, 0.25]], [[0.5, 0.5]]])
    row = audit(topk, w, torch.tensor([1, 2]), M=4, reference_weight_dist=weight_distribution(topk, w, 4))
    # weight mass per slot (0.75, 0.75, 0.5, 0) / 2; slot 1 is in the top-2 of both positions
    assert row["largest_slot_mass"] == pytest.approx(0.375) and row["largest_slot_positions"] == pytest.approx(1.0)
    assert row["inactive_cells"] == 1 and row["total_cells"] == 4
    assert row["jsd_mean"] == pytest.approx(0.0, abs=1e-12)
    # one slot chosen everywhere with weight 0.7 (the paper's 60-64% is possible only in these readings: the top-K
    # membership share is at most 1/K)
    topk = torch.tensor([[[0, j]] for j in (1, 2, 3, 1)])
    w = torch.tensor([[[0.7, 0.3]]] * 4)
    row = audit(topk, w, torch.tensor([1, 2, 3, 4]), M=4)
    assert row["largest_slot_mass"] == pytest.approx(0.7) and row["largest_slot_positions"] == pytest.approx(1.0)


def test_stratified_bootstrap_keeps_class_sizes():
    labels = torch.tensor([True] * 5 + [False] * 3)
    seen = []

    def stat(idx):
        seen.append((labels[idx].sum().item(), (~labels[idx]).sum().item()))
        return torch.tensor(0.0)

    lo, hi = stratified_bootstrap(stat, labels, n_boot=20)
    assert set(seen) == {(5, 3)} and lo.item() == hi.item() == 0.0
