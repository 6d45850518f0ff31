"""KVCache.update names a write that does not fit the cache: the batch size, kv heads or head dim it was built for,
or a v of another length than k. A batch of 1 used to broadcast silently over every row of the cache."""

import re

import pytest
import torch

from nanochat.kv_cache import KVCache


def cache(dtype=None):
    return KVCache(batch_size=2, n_layer=1, n_kv_head=3, head_dim=4, max_len=8, dtype=dtype)


@pytest.mark.parametrize("dtype", [None, torch.float32], ids=["lazy", "allocated"])
@pytest.mark.parametrize("bad, which", [((1, 3, 2, 4), "k"), ((5, 3, 2, 4), "k"), ((2, 1, 2, 4), "k"),
                                        ((2, 3, 2, 8), "v"), ((2, 3, 2), "v"), ((2, 3, 3, 4), "v")])
def test_a_write_of_another_shape_is_refused_naming_both(dtype, bad, which):
    kv = cache(dtype)
    good = torch.randn(2, 3, 2, 4)
    k, v = (torch.randn(bad), good) if which == "k" else (good, torch.randn(bad))
    expected = "(2, 3, 2, 4)"  # batch, kv heads and head dim of the cache; T of k
    with pytest.raises(ValueError, match=re.escape(f"KV cache layer 0: {which} has shape {tuple(bad)}, expected "
                                                   f"{expected}")):
        kv.update(0, k, v)
    assert kv.pos == 0
    if dtype is None:  # refused before anything was allocated, k included when v is the bad one
        assert kv.k[0] is None and kv.v[0] is None


def test_a_write_that_fits_is_stored():
    kv = cache()
    k, v = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    got_k, got_v = kv.update(0, k, v)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    kv.advance(2)
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    got_k, got_v = kv.update(0, k2, v2)
    assert got_k.shape == (2, 3, 3, 4) and torch.equal(got_k[:, :, 2:], k2) and torch.equal(got_v[:, :, :2], v)
