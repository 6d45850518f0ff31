"""The logged counters of the MoE FFN (per-expert loads), JTok-M (per-expert loads) and the gate tracker (forwards
per memory layer) stay exact past 2^24 within one log interval (fp32 stops adding 1 there: an MoE expert of d24's
sparse run gets 2^20 x K / E assignments per step). The counts are forced near the bound, then one more forward,
a sum over two thread ranks, or a checkpoint's fp32 counts must land exactly."""

import pytest
import torch

from _thread_ranks import BUILD_LOCK, run_ranks
from conftest import tiny_config
from nanochat.gpt import build_model
from nanochat.memory.ve import GammaTracker
from nanochat.moe import MoEFFN
from nanochat.train_loop import module_stats, restore_stats_buffers, summed_stats_buffers

BIG = 2**30  # fp32 spacing there is 128: a forward's few assignments vanish


def _moe_layer() -> MoEFFN:
    layer = MoEFFN(tiny_config(n_embd=64, mlp="moe"), 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.init_weights(3 ** 0.5 / 8)
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.size(1) ** 0.5)
    return layer


def _moe_forward(layer: MoEFFN, seed: int = 0) -> None:
    layer(torch.randn(2, 30, 64, generator=torch.Generator().manual_seed(seed)))


def test_moe_load_counts_past_2_24_are_exact_and_logged_in_float64():
    layer = _moe_layer().train()
    _moe_forward(layer)
    delta = layer.load_counts.to(torch.int64).clone()
    assert delta.sum() == 2 * 30 * layer.K and (delta > 0).sum() > 1
    with torch.no_grad():
        layer.load_counts.fill_(BIG)
    _moe_forward(layer)
    want = BIG + delta
    assert torch.equal(layer.load_counts.to(torch.int64), want)
    stats = layer.stats()
    load = want.double()
    frac = load / load.sum()
    for e in range(layer.E):
        assert stats[f"moe/load/layer0/expert{e}"] == pytest.approx(float(frac[e]), rel=1e-12)
    maxvio = float(load.max() * layer.E / load.sum() - 1)
    assert maxvio > 0 and stats["moe/maxvio/layer0"] == pytest.approx(maxvio, rel=1e-9)


def _moe_two_ranks(rank: int) -> dict:
    with BUILD_LOCK:
        layer = _moe_layer()
    with torch.no_grad():
        layer.load_counts.zero_()
        layer.load_counts[0] = 2**24 + 1  # each rank: 2^24 + 1 on expert 0, 1 on expert 1
        layer.load_counts[1] = 1
    saved = summed_stats_buffers(layer)["load_counts"]
    return {"saved": saved, "stats": module_stats(layer)}


def test_moe_load_counts_summed_over_ranks_past_2_24_are_exact():
    total = 2 * (2**24 + 1) + 2
    for r in run_ranks(2, lambda rank, world: _moe_two_ranks(rank)):
        assert r["saved"][:2].tolist() == [2 * (2**24 + 1), 2] and r["saved"][2:].sum() == 0
        assert r["stats"]["moe/load/layer0/expert1"] == pytest.approx(2 / total, rel=1e-12)


def test_old_fp32_counters_load_into_the_integer_buffers():
    layer = _moe_layer()
    old = torch.arange(layer.E, dtype=torch.float32) * 1000.0 + 2**23  # a checkpoint from before: fp32 counts
    restore_stats_buffers(layer, {"load_counts": old}, rank=0, step=0)
    assert layer.load_counts.dtype == torch.int64 and torch.equal(layer.load_counts, old.to(torch.int64))
    tracker = GammaTracker(2)
    restore_stats_buffers(tracker, {"count": torch.tensor([3.0, 5.0]), "gamma_sum": torch.tensor([1.5, 2.5])},
                          rank=0, step=0)
    assert tracker.count.tolist() == [3, 5] and tracker.gamma_sum.tolist() == [1.5, 2.5]


def test_jtokm_load_counts_past_2_24_are_exact():
    model = build_model(tiny_config(memory="jtokm", memory_options={"experts": 4}, n_layer=2), seed=0)
    model.train()
    idx = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    model(idx, idx)
    mem = model.memory
    delta = mem.load_counts.to(torch.int64).clone()
    assert delta.sum() == len(mem.layers) * 2 * 12 * mem.K
    with torch.no_grad():
        mem.load_counts.fill_(BIG)
    model(idx, idx)
    want = BIG + delta
    assert torch.equal(mem.load_counts.to(torch.int64), want)
    stats = mem.stats()
    for pos, layer in enumerate(mem.layers):
        load = want[pos].double()
        mean = load.sum() / mem.n_experts
        assert stats[f"memory/maxvio/layer{layer}"] == pytest.approx(float((load.max() - mean) / mean), rel=1e-9)


def test_gamma_tracker_count_past_2_24_is_exact():
    tracker = GammaTracker(2)
    tracker.count[0] = 2**24
    tracker.add(0, torch.full((3,), 0.5))
    tracker.add(1, torch.full((3,), 0.25))
    assert tracker.count.tolist() == [2**24 + 1, 1]
    assert tracker.pop((3, 7)) == {"memory/gamma_mean/layer3": pytest.approx(0.5 / (2**24 + 1)),
                                   "memory/gamma_mean/layer7": 0.25}
