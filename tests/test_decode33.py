"""Edges of sampling and cached decoding found by the session-33 review of the inference path (engine, KV cache)."""

import pytest
import torch

from nanochat.engine import sample_next


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
