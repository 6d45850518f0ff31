"""The bigram hash shared by the Bigram baseline and MoME's bigram row indexer (modded-nanogpt style).

    h_t = ((36313 * tok_t) XOR (27191 * tok_{t-1})) mod (rows - 1)        for t >= 1
    h_0 = rows - 1                                                          (reserved row for sequence starts)

During KV-cache decoding the first position of a chunk has a real predecessor (the last token of the previous
chunk); ``prev`` then supplies it and position 0 is hashed like any other position. All arithmetic is int64,
so the products never overflow for any vocabulary that fits in memory.
"""

import torch

HASH_CUR, HASH_PREV = 36313, 27191


def bigram_hash(idx: torch.Tensor, rows: int, prev: torch.Tensor | None = None) -> torch.Tensor:
    """idx (B, T) token ids -> (B, T) int64 row ids in [0, rows-1]; ``prev`` (B,) is the token before idx[:, 0]."""
    if rows < 2:
        raise ValueError(f"bigram hash needs at least 2 rows (got {rows})")
    cur = idx.long()
    m = rows - 1
    first = prev.long().view(-1, 1) if prev is not None else torch.zeros_like(cur[:, :1])
    before = torch.cat([first, cur[:, :-1]], dim=1)  # (B, T): the token preceding each position
    h = torch.bitwise_xor(HASH_CUR * cur, HASH_PREV * before) % m
    if prev is None:
        # position 0 has no predecessor: it gets the reserved last row
        is_start = torch.arange(cur.size(1), device=cur.device) == 0
        h = torch.where(is_start, m, h)
    return h


def prepare_bigram_rows(idx: torch.Tensor, rows: int, state: dict | None) -> torch.Tensor:
    """Hash idx and carry the previous token across KV-cache decode steps through ``state["prev_token"]``."""
    prev = state.get("prev_token") if state is not None else None
    h = bigram_hash(idx, rows, prev)
    if state is not None:
        state["prev_token"] = idx[:, -1].detach().clone()
    return h
