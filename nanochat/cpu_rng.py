"""torch's CPU generator replayed for many seeds at once (numpy, vectorised over the seeds).

``torch.Generator().manual_seed(s)`` is a std::mt19937 seeded with the low 32 bits of s, and ``torch.randint``
of a range below 2**32 on the CPU draws one 32-bit output per element, in order: ``low + out % (high - low)``.
Drawing the first outputs of N such generators one generator at a time costs ~40 us of Python and dispatch per
generator (25 s for the 655k synthetic eval rows of a 32-token context at the default --eval-tokens); here the
seeding recurrence and the twist run once per state word over all N seeds. Checked equal to torch in
tests/test_train_e2e.py (a torch that changed its generator would also change every seeded run).
"""

import numpy as np
import torch

_N, _M = 624, 397
_CHUNK = 16384  # seeds per pass: the (624, chunk) uint32 state is 40 MB


def _twist(mt: np.ndarray, words: int) -> np.ndarray:
    """The first ``words`` words of the regenerated (624, n) states (all 624 unless no later output needs them).
    Word i mixes the old words i, i + 1 and i + 397, which for i >= 227 is the new word i - 227: three blocks."""
    new = np.empty_like(mt)
    for lo, hi, far in ((0, _N - _M, lambda: mt[_M:]), (_N - _M, 2 * (_N - _M), lambda: new[:_N - _M]),
                        (2 * (_N - _M), _N - 1, lambda: new[_N - _M:_M - 1])):
        hi = min(hi, words)
        if hi > lo:
            y = (mt[lo:hi] & 0x80000000) | (mt[lo + 1:hi + 1] & 0x7FFFFFFF)
            new[lo:hi] = far()[:hi - lo] ^ (y >> 1) ^ ((y & 1) * np.uint32(0x9908B0DF))
    if words == _N:  # the last word wraps around to the new word 0
        y = (mt[_N - 1] & 0x80000000) | (new[0] & 0x7FFFFFFF)
        new[_N - 1] = new[_M - 1] ^ (y >> 1) ^ ((y & 1) * np.uint32(0x9908B0DF))
    return new


def _temper(y: np.ndarray) -> np.ndarray:
    y = y ^ (y >> 11)
    y = y ^ ((y << 7) & 0x9D2C5680)
    y = y ^ ((y << 15) & 0xEFC60000)
    return y ^ (y >> 18)


def _outputs_chunk(seeds: np.ndarray, count: int) -> np.ndarray:
    mt = np.empty((_N, len(seeds)), dtype=np.uint32)
    mt[0] = seeds
    for i in range(1, min(_N, count + _M)):  # the seeding recurrence, as far as the first outputs reach
        prev = mt[i - 1]
        mt[i] = np.uint32(1812433253) * (prev ^ (prev >> 30)) + np.uint32(i)  # mod 2**32
    out = np.empty((len(seeds), count), dtype=np.int64)
    for start in range(0, count, _N):
        n = min(_N, count - start)
        mt = _twist(mt, n)
        out[:, start:start + n] = _temper(mt[:n]).T
    return out


def first_outputs(seeds: torch.Tensor, count: int) -> torch.Tensor:
    """(N, count) int64 in [0, 2**32): the first ``count`` 32-bit outputs of ``torch.Generator().manual_seed(s)``
    for each of the N int64 ``seeds`` (any sign: torch keeps the low 32 bits)."""
    low = (seeds.numpy().astype(np.int64) & 0xFFFFFFFF).astype(np.uint32)
    out = np.empty((len(low), count), dtype=np.int64)
    for i in range(0, len(low), _CHUNK):
        out[i:i + _CHUNK] = _outputs_chunk(low[i:i + _CHUNK], count)
    return torch.from_numpy(out)
