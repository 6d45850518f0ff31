"""MoME's cross-rank counters on W thread ranks (tests/_thread_ranks.py): the selection bias and the training
MaxVio window of W ranks, each on its own rows, equal one process's over all the rows."""
import torch

from _thread_ranks import BUILD_LOCK, run_ranks
from conftest import tiny_config
from nanochat.gpt import build_model
from nanochat.slot_balance import window_maxvio
from nanochat.train_loop import after_optimizer_step, module_stats

OPTS = {"slots": 6, "topk": 2, "balance": "bias", "balance_lr": 2.0 ** -6, "maxvio_window": 2}
STEPS, MICRO, ROWS = 2, 2, 2  # optimizer steps (one window of W = 2), micro-steps, rows per rank and micro-step


def _model():
    with BUILD_LOCK:  # one global RNG for every thread
        model = build_model(tiny_config(n_embd=64, memory="mome", memory_options=OPTS), seed=0)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # routing that depends on the context
            for name, p in model.named_parameters():
                if "router" in name or "c_proj" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "router" in name else 0.2))
    return model


def _rows(step: int, micro: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a micro-step: its slice of the global rows (few distinct tokens: rows revisited)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    rows = torch.randint(0, 8, (ROWS * world, 16), generator=g)
    return rows[rank * ROWS : (rank + 1) * ROWS]


def _train(rank: int, world: int, per_rank: int = 1) -> dict:
    model = _model()
    mem = model.memory
    for step in range(STEPS):
        for micro in range(MICRO):
            for r in range(rank * per_rank, (rank + 1) * per_rank):  # one process: every rank's rows in turn
                model(_rows(step, micro, r, world * per_rank))
        if step == STEPS - 1:
            window = mem.window_counts.clone()  # this rank's counts of the window, before it closes
        after_optimizer_step(model)
    return {"bias": mem.router_bias.clone(), "window": window, "stats": module_stats(model)}


def test_bias_and_window_of_two_ranks_equal_one_process_over_all_rows():
    one = _train(0, 1, per_rank=2)
    two = run_ranks(2, _train)
    for r in two:
        assert torch.equal(r["bias"], one["bias"])  # identical on every rank, and the update of the global counts
        assert r["stats"] == one["stats"]
    assert (one["bias"] != 0).any()
    summed = two[0]["window"] + two[1]["window"]
    assert torch.equal(summed, one["window"]) and not torch.equal(two[0]["window"], one["window"])
    want = window_maxvio(one["window"]).tolist()
    assert one["stats"]["memory/maxvio_window_mean"] == want[0] and want[2] > 0
