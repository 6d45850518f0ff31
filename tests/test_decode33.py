"""Edges of sampling and cached decoding found by the session-33 review of the inference path (engine, KV cache)."""

import pytest
import torch

from conftest import tiny_config
from nanochat.engine import sample_next
from nanochat.families import build_model
from nanochat.kv_cache import KVCache


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 5e-324])
def test_a_tiny_positive_temperature_samples_the_argmax(temperature):
    """--temperature accepts any finite value >= 0; below ~5e-38 logits / T overflowed fp32 to inf (or, once T
    itself underflows in fp32, 0 / 0), softmax gave nan and torch.multinomial raised. T -> 0 is greedy: every draw
    must be the argmax (a tie at the top is drawn among the tied tokens, as top-k keeps ties)."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0], [2.0, -3.0, 2.5, 2.4999]])
    g = torch.Generator().manual_seed(0)
    for top_k in (None, 2):
        assert sample_next(logits, temperature, top_k, g).tolist() == [1, 2]
    tied = torch.tensor([[3.0, 3.0, -1.0]])
    assert {int(sample_next(tied, temperature, None, g)) for _ in range(40)} == {0, 1}


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1.0])
def test_a_negative_or_non_finite_temperature_is_refused(temperature):
    """As scripts/sample.py refuses them: inf turned the top-k-masked -inf logits into -inf / inf = nan, and nan
    made every probability nan (torch.multinomial's error, a traceback)."""
    with pytest.raises(ValueError, match="--temperature must be >= 0 and finite"):
        sample_next(torch.tensor([[0.0, 1.0, 2.0]]), temperature, 2, torch.Generator().manual_seed(0))


STATEFUL = [("bigram", {}), ("move_input", {"experts": 4, "rank": 8}),
            ("mome", {"index": "bigram", "bigram_factor": 2, "router_type": "conv1d"}),
            ("engram", {"compression": "identity", "first_prime": 101, "heads": 2, "dim": 64})]


@pytest.mark.parametrize("memory, opts", STATEFUL, ids=[m for m, _ in STATEFUL])
@torch.no_grad()
def test_a_bos_only_prefill_then_token_by_token_decode_equals_the_full_forward(memory, opts):
    """What scripts/sample.py does for an empty prompt: a one-token prefill (the bigram hash gives position 0 its
    reserved row, Engram its pad history, the conv router zeros), then every later position decoded alone with the
    previous token carried in the cache's memory state; on a GQA model (4 query heads, 1 KV head) whose S layers'
    window (4) slides. The other decode tests prefill several tokens, with no window or GQA for these blocks."""
    g = torch.Generator().manual_seed(1)
    model = build_model(tiny_config(n_layer=4, n_head=4, n_kv_head=1, n_embd=64, sequence_len=8, window_pattern="SL",
                                    memory=memory, memory_options=opts), seed=0)
    for p in model.parameters():  # zero-initialised tables, gates and projections would hide the memory path
        p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.eval()
    idx = torch.randint(0, 512, (2, 14), generator=g)
    full = model(idx)
    cache = KVCache.for_model(model, batch_size=2, max_len=14)
    steps = [model(idx[:, t:t + 1], kv_cache=cache) for t in range(14)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
