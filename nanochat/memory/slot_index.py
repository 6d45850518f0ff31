"""MoME's arithmetic row indexers ``mod`` and ``headmod`` (the authors' slot mappings, reference notes §3.4).

With N table rows (the reference's slot vocabulary S) and D = --mome-dedicated-size:

    mod:      n_t = x_t mod N
    headmod:  n_t = x_t                          for x_t < D   (BPE ids are roughly frequency-ranked, so the D
              n_t = D + ((x_t - D) mod (N - D))  otherwise      most frequent tokens keep a row of their own)

N is --mome-rows, or else ceil(V / f) with f = --mome-slot-factor (default 1) and V the tokenizer's unpadded vocab
(the reference's "S = the explicit size, or ceil(V/f)", model notes §3.2); ``resolve_rows`` turns the flags into the
N that the model config records, so a checkpoint never needs the factor again.

Both depend on the current token only, so KV-cache decoding needs no state. Elementwise int64 tensor ops (no
host sync, no Python loop): the same code runs on the CPU, on CUDA and under torch.compile.
"""

import torch

from nanochat.cli_types import check_int_at_least

ARITHMETIC_INDEXERS = ("mod", "headmod")


def check_arithmetic_options(index: str, rows: int, dedicated: int) -> None:
    """The flags of these indexers, refused where they do not apply (errors name the flag)."""
    if index in ARITHMETIC_INDEXERS and rows < 1:
        raise ValueError(f"--mome-index {index} needs N >= 1 table rows (the reference's slot vocabulary S): "
                         f"--mome-rows N, or --mome-slot-factor f for N = ceil(V / f) (got {rows})")
    if index not in ARITHMETIC_INDEXERS and rows != 0:
        raise ValueError(f"--mome-rows only applies to --mome-index mod or headmod (got --mome-index {index})")
    if index == "headmod" and not 0 < dedicated < rows:
        raise ValueError(f"--mome-dedicated-size {dedicated} must satisfy 0 < D < --mome-rows {rows} for "
                         "--mome-index headmod (tokens below D keep their own row, the rest share N - D rows)")
    if index != "headmod" and dedicated != 0:
        raise ValueError(f"--mome-dedicated-size only applies to --mome-index headmod (got --mome-index {index})")


def resolve_rows(index: str, rows: int, factor: int, vocab_size: int | None) -> int:
    """N of the flags: --mome-rows N as given, else ceil(V / --mome-slot-factor f) for mod/headmod (V = vocab_size,
    the tokenizer's, unpadded); the factor is refused where it does not apply (it must be 1 there)."""
    check_int_at_least("--mome-slot-factor", factor)
    if index not in ARITHMETIC_INDEXERS:
        if factor != 1:
            hint = " (grouped sizes its rows with --mome-group-size c: N = V / c)" if index == "grouped" else ""
            raise ValueError(f"--mome-slot-factor only applies to --mome-index mod or headmod (got --mome-index "
                             f"{index}){hint}")
        return rows
    if rows:
        if factor != 1:  # the reference takes the explicit size and ignores f: refused here rather than ignored
            raise ValueError(f"--mome-rows {rows} and --mome-slot-factor {factor} both set N (the reference uses "
                             "the explicit size and ignores the factor); pass one of them")
        return rows
    if vocab_size is None:
        raise ValueError(f"--mome-index {index} without --mome-rows: N = ceil(V / --mome-slot-factor {factor}) needs "
                         "the vocab size, which is not known here; pass --mome-rows N")
    return -(-vocab_size // factor)


def check_rows_fit_vocab(index: str, rows: int, padded_vocab: int) -> None:
    """N <= padded V, the reference's module check (S <= V in token mode): more rows than token ids would never
    all be read."""
    if rows > padded_vocab:
        raise ValueError(f"--mome-rows {rows} exceeds the (padded) vocab size {padded_vocab} for --mome-index {index}")


def arithmetic_rows(idx: torch.Tensor, index: str, rows: int, dedicated: int) -> torch.Tensor:
    """Token ids (B, T) -> row ids (B, T) int64 in [0, rows) by ``mod`` or ``headmod``."""
    x = idx.long()
    if index == "mod":
        return x % rows
    if index == "headmod":
        return torch.where(x < dedicated, x, dedicated + (x - dedicated) % (rows - dedicated))
    raise ValueError(f"--mome-index {index!r} is not an arithmetic indexer; allowed: {', '.join(ARITHMETIC_INDEXERS)}")
