"""MoME's selection counters stay exact past 2^31 (the window and eval-load counts, per (layer, row, head, slot))
and past 2^24 (the logged per-(head, slot) loads): a cell of a frequent token's row can pass 2^31 - 1 within one
--mome-maxvio-window at d24's 2^20 tokens per step (W >= 2048 in the worst case, all tokens on one row), a summed
window or checkpoint of several ranks sooner, and the logged loads pass 2^24 within one log interval. The counts
are forced near those bounds, then one more forward (or the sum over two thread ranks) must land exactly."""

from dataclasses import replace

import pytest
import torch

from _thread_ranks import BUILD_LOCK, run_ranks
from mome_fixtures import mome_config, random_block
from nanochat.slot_balance import window_maxvio
from nanochat.train_loop import summed_stats_buffers

INT32_MAX = 2**31 - 1


def _block(tmp_path, **extra):
    cfg = replace(mome_config(tmp_path, 4, 2, "token", **extra), memory_layers=(0, 1))
    return cfg, random_block(cfg)


def _forward(cfg, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 6, (2, 8), generator=g)  # few tokens: several selections per cell
    xn = torch.randn(2, 8, cfg.n_embd, generator=g)
    v = torch.randn(2, 8, cfg.n_kv_head, cfg.head_dim, generator=g)
    ctx = block.prepare(tokens, None)
    for layer in block.layers:
        block.value(layer, xn, v, ctx)


def test_window_counts_past_int32_are_exact_and_give_the_right_maxvio(tmp_path):
    cfg, block = _block(tmp_path, maxvio_window=2)
    _forward(cfg, block)  # training mode: counts one forward's selections
    delta = block.window_counts.to(torch.int64).clone()
    assert delta.max() > 1  # a cell gets several selections in one forward
    block.window_counts.zero_()
    block.window_counts[delta > 0] = INT32_MAX  # a window that has already counted 2^31 - 1 on those cells
    _forward(cfg, block)
    want = torch.where(delta > 0, INT32_MAX + delta, 0)
    assert torch.equal(block.window_counts.to(torch.int64), want)  # int32 wraps to negative counts
    block.after_optimizer_step()
    block.after_optimizer_step()  # W = 2: the window closes
    assert block.window_result.tolist() == [1.0, *window_maxvio(want).tolist()]
    assert block.window_result[1] > 0


def _two_rank_window(rank: int, tmp_path) -> dict:
    """Each rank counted 1.5 x 2^30 selections of slot 0 and 2^29 of slot 1 on every site: 3 x 2^30 and 2^30
    over the two ranks (MaxVio (3 - 1) / 1 = 2 with M = 4); the checkpoint's sum and the closed window's."""
    with BUILD_LOCK:
        _, block = _block(tmp_path, maxvio_window=2)
    block.window_counts.zero_()
    block.window_counts[..., 0] = 3 * 2**29
    block.window_counts[..., 1] = 2**29
    saved = summed_stats_buffers(block)["window_counts"]
    block.close_window()
    block.close_window()
    return {"saved": saved, "result": block.window_result.tolist(), "counts": block.window_counts.clone()}


def test_window_summed_over_ranks_past_int32_is_exact(tmp_path):
    results = run_ranks(2, lambda rank, world: _two_rank_window(rank, tmp_path))
    for r in results:
        assert torch.all(r["saved"][..., 0].to(torch.int64) == 3 * 2**30)  # the checkpoint's sum over the ranks
        assert torch.all(r["saved"][..., 1].to(torch.int64) == 2**30) and r["saved"][..., 2:].sum() == 0
        sites = r["counts"][0].numel() // 4  # N x H sites per layer, every one eligible
        assert r["result"] == [1.0, 2.0, sites, 2.0]  # int32 sums wrap: 3 x 2^30 reads as -2^30
        assert int(r["counts"].abs().sum()) == 0  # the next window starts empty


def test_eval_loads_past_int32_are_exact(tmp_path):
    cfg, block = _block(tmp_path)
    block.eval()
    block.start_eval_loads()
    _forward(cfg, block)
    delta = block.eval_loads.to(torch.int64).clone()
    assert delta.max() > 1
    block.eval_loads.zero_()
    block.eval_loads[delta > 0] = INT32_MAX  # an evaluation that has already counted 2^31 - 1 on those cells
    _forward(cfg, block)
    loads = block.pop_eval_loads()
    assert torch.equal(loads.to(torch.int64), torch.where(delta > 0, INT32_MAX + delta, 0))


def test_logged_loads_past_2_24_are_exact(tmp_path):
    """The logged per-(head, slot) loads of a log interval: one more forward's few selections on counts of 2^30
    (fp32 drops every addition below 64 there) must land exactly, and the logged MaxVio is theirs."""
    cfg, block = _block(tmp_path)
    _forward(cfg, block)
    delta = block.load_counts.to(torch.int64).clone()
    assert delta.max() > 0
    block.load_counts.zero_()
    block.load_counts[0, 0, 0] = 2**30  # layer 0, head 0, slot 0
    block.load_counts[1] = 2**30  # layer 1: every (head, slot)
    base = block.load_counts.to(torch.int64).clone()
    _forward(cfg, block)
    want = base + delta
    assert torch.equal(block.load_counts.to(torch.int64), want)
    stats = block.stats()
    load = want.sum(dim=1).double()  # (L, M) loads summed over heads
    mean = load.sum(dim=-1) / 4
    for pos, layer in enumerate(block.layers):
        assert stats[f"memory/maxvio/layer{layer}"] == pytest.approx(float((load[pos].max() - mean[pos]) / mean[pos]),
                                                                     rel=1e-12)
    assert stats["memory/maxvio/layer1"] != 0  # the layer-1 loads of 2^30 each differ by the forward's counts alone
