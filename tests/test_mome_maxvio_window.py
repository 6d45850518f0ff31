"""--mome-maxvio-window W: the authors' training-window slot MaxVio (reference notes §3.10) over W optimizer steps,
against a per-token Python loop over the routing equations (test_slot_balance.naive_counts)."""

import shutil
from dataclasses import replace

import pytest
import torch

from mome_fixtures import mome_config, random_block
from nanochat import checkpoint as ckpt
from nanochat.memory.mome import MoMEOptions
from nanochat.slot_balance import window_maxvio
from test_slot_balance import naive_counts
from test_train_e2e import stat_records, train

WINDOW_KEYS = ("memory/maxvio_window_mean", "memory/maxvio_window_eligible_mean", "memory/maxvio_window_layers")


def naive_window(per_layer: list[dict], M: int) -> dict:
    """The authors' window rule, site by site: sites with total >= M, mean per layer, then over such layers."""
    means, eligible = [], []
    for counts in per_layer:
        vs = [(max(c) - sum(c) / M) / (sum(c) / M) for c in counts.values() if sum(c) >= M]
        eligible.append(len(vs))
        if vs:
            means.append(sum(vs) / len(vs))
    return {"memory/maxvio_window_mean": sum(means) / len(means),
            "memory/maxvio_window_eligible_mean": sum(eligible) / len(eligible),
            "memory/maxvio_window_layers": len(means)}


def add_counts(total: dict, more: dict) -> None:
    for site, c in more.items():
        total[site] = [a + b for a, b in zip(total.get(site, [0] * len(c)), c)]


@pytest.mark.parametrize("index", ["token", "bigram"])
def test_window_equals_the_naive_count_over_its_steps(tmp_path, index):
    """Two optimizer steps of two micro-batches each (W = 2): the record after step 2 is the MaxVio of the
    selections of all four forwards, over the sites selected at least M times; nothing before, nothing again
    until the next window closes."""
    M = 4
    cfg = replace(mome_config(tmp_path, M, 2, index, maxvio_window=2), memory_layers=(0, 1))
    block = random_block(cfg).double()  # training mode: the forwards count
    g = torch.Generator().manual_seed(3)
    naive = {layer: {} for layer in block.layers}
    for step in range(2):
        for _ in range(2):  # micro-steps
            tokens = torch.randint(0, 24, (2, 8), generator=g)  # some rows reach M selections, some do not
            xn = {layer: torch.randn(2, 8, cfg.n_embd, generator=g, dtype=torch.float64) for layer in block.layers}
            v = torch.randn(2, 8, cfg.n_kv_head, cfg.head_dim, generator=g, dtype=torch.float64)
            ctx = block.prepare(tokens, None)
            for layer in block.layers:
                block.value(layer, xn[layer], v, ctx)
                add_counts(naive[layer], naive_counts(cfg, block, layer, tokens, xn[layer]))
        block.after_optimizer_step()
        stats = block.stats()
        if step == 0:
            assert not set(WINDOW_KEYS) & set(stats)
    want = naive_window([naive[layer] for layer in block.layers], M)
    assert {k: stats[k] for k in WINDOW_KEYS} == pytest.approx(want, rel=1e-12)
    some_below = any(0 < sum(c) < M for counts in naive.values() for c in counts.values())
    assert want["memory/maxvio_window_mean"] > 0 and some_below  # the eligibility rule is exercised
    assert int(block.window_counts.sum()) == 0 and block.window_steps == 0  # the next window starts empty
    block.after_optimizer_step()
    assert not set(WINDOW_KEYS) & set(block.stats())


def test_eligibility_is_total_at_least_m_and_layers_average_equally():
    loads = torch.tensor([[[[3, 1, 0, 0]], [[1, 1, 1, 0]], [[1, 1, 1, 1]]],  # layer 0: MaxVio 2 and 0; 3 < M: out
                          [[[0, 0, 0, 0]], [[2, 0, 0, 0]], [[4, 0, 0, 4]]]],  # layer 1: 2 < M: out; MaxVio 1
                         dtype=torch.int32)  # (L=2, N=3, H=1, M=4)
    assert window_maxvio(loads).tolist() == pytest.approx([(1.0 + 1.0) / 2, 1.5, 2], rel=1e-15)
    none = window_maxvio(torch.ones(2, 3, 1, 4, dtype=torch.int32) * torch.tensor([1, 0, 0, 0], dtype=torch.int32))
    assert none[1:].tolist() == [0.0, 0.0] and none[0].isnan()  # no eligible site: stats() logs no mean


def test_off_by_default_no_buffers_and_the_same_forward(tmp_path):
    cfg = replace(mome_config(tmp_path, 4, 2, "token"), memory_layers=(0, 1))
    on = replace(cfg, memory_options={**cfg.memory_options, "maxvio_window": 3})
    off_block, on_block = random_block(cfg), random_block(on)
    assert not hasattr(off_block, "window_counts") and "window_counts" not in dict(off_block.named_buffers())
    assert off_block.state_dict().keys() == on_block.state_dict().keys()  # the counters are not saved
    tokens = torch.randint(0, 12, (2, 8), generator=torch.Generator().manual_seed(0))
    xn, v = torch.randn(2, 8, cfg.n_embd), torch.randn(2, 8, cfg.n_kv_head, cfg.head_dim)
    outs = [block.value(1, xn, v, block.prepare(tokens, None)) for block in (off_block, on_block)]
    assert torch.equal(*outs) and int(on_block.window_counts.sum()) == 2 * 8 * cfg.n_kv_head * 2  # B*T*H*K


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="--mome-maxvio-window needs K < M"):
        MoMEOptions(slots=3, topk=3, maxvio_window=2)
    with pytest.raises(ValueError, match="--mome-maxvio-window must be an integer >= 0"):
        MoMEOptions(maxvio_window=-1)
    assert train(tmp_path / "ve", "--memory", "ve", "--mome-maxvio-window", "2", "--dry-run") == 2


def test_a_tiny_run_logs_each_window_and_a_resume_logs_the_same(tmp_path):
    """W = 2, a record every step: the window keys appear in the records of steps 2 and 4 only. The step-3
    checkpoint falls inside the second window: it carries step 3's counts, so the resumed run's step-4 window
    is the uninterrupted run's, to the bit."""
    run = tmp_path / "run"
    flags = ["--memory", "mome", "--mome-slots", "4", "--mome-maxvio-window", "2", "--num-iterations", "4",
             "--save-every", "3"]
    assert train(run, *flags) == 0
    full = window_records(run)
    assert list(full) == [2, 4]
    assert full[4][WINDOW_KEYS[0]] >= 0 and full[4][WINDOW_KEYS[1]] > 0 and full[4][WINDOW_KEYS[2]] >= 1
    shutil.rmtree(ckpt.step_dir(run, 4))
    assert ckpt.list_steps(run) == [3]
    assert train(run, *flags, "--resume") == 0
    assert window_records(run) == full


def window_records(run) -> dict:
    """{step: memory/* and moe/* of its train record} for the records that log a window."""
    return {step: rec for step, rec in stat_records(run).items() if WINDOW_KEYS[1] in rec}


def test_a_window_closed_before_a_checkpoint_and_logged_after_it_survives_the_resume(tmp_path):
    """W = 2, a record every 3 steps: the window closed at step 2 is logged at step 3. The step-2 checkpoint is
    written between the two: it carries the closed window's result, so the resumed run's step-3 record logs the
    same window as the uninterrupted run's, to the bit (and the step-6 record the window closed at step 6)."""
    run = tmp_path / "run"
    flags = ["--memory", "mome", "--mome-slots", "4", "--mome-maxvio-window", "2", "--num-iterations", "6",
             "--log-every", "3", "--save-every", "2"]
    assert train(run, *flags) == 0
    full = window_records(run)
    assert list(full) == [3, 6]
    for step in (6, 4):
        shutil.rmtree(ckpt.step_dir(run, step))
    assert ckpt.list_steps(run) == [2]
    assert train(run, *flags, "--resume") == 0
    assert window_records(run) == full
