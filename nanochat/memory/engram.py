"""Engram (Cheng et al. 2026), the paper's "canonical Engram adaptation" (appendix; spec appendix_adaptations §3).

Per module (default layers {1, 11} at d24, ``default_layers``), on the block input h (after the resid/x0 mix):

    x'_t    = P[x_t]                                     frozen compression map (persistent buffer, in checkpoints)
    mix_t,n = (x'_t m_0) XOR (x'_{t-1} m_1) XOR ... XOR (x'_{t-n+1} m_{n-1})       n = 2..N, int64, no overflow
    z_t,n,k = mix_t,n mod p_n,k                          K heads per order, distinct primes p
    e_t     = concat_{n,k} E_n,k[z_t,n,k]                d_mem = (N-1) K d_head
    alpha_t = sigmoid(ssqrt(norm(h_t) . norm(W_K e_t) / sqrt(C)))     ssqrt(a) = sign(a) sqrt(max(|a|, 1e-6))
    V~_t    = alpha_t W_V e_t
    Y       = SiLU(CausalDepthwiseConv_{kernel, dilation N}(norm(V~))) + V~,      h <- h + Y

norm is nanochat's parameter-free RMSNorm. Positions before the sequence start read the compressed pad P(BOS).
Canonical (Engram paper and demo, spec §3.1): the compression normaliser, suffix n-grams, the multiplicative-XOR
hash with odd multipliers m = 2r+1 drawn by NumPy's default_rng(seed + 10007 * layer), primes taken ascending from
a search start with one "seen" set over layer -> order -> head, the gate with the signed square root, the
depthwise conv (kernel 4, dilation N, zero init) + SiLU + residual, injection before attention. The paper's
adaptation drops the multi-branch (mHC) fusion: one W_K, one gate, one conv per module (spec §3.2).
RECONSTRUCTED (spec §3.2-3.3): the table layout and sizes -- 2 modules of d_mem = C, 8 heads x 96 per order,
32 primes from 195,131 -- are inferred from the paper's total of 1,389.6M parameters, not stated by it.
Init (spec E6): tables N(0, 1), W_K U(+-sqrt(3/d_mem)), W_V and the conv zero, so the model equals Base at init.

Implementation notes: all modules share one concatenated table (rows of every (module, order, head) at fixed
offsets), so ``prepare`` does the hash and ONE embedding lookup per forward. The multipliers' range divides by
the padded vocab (an upper bound on every compressed id) instead of the demo's |V'|: they are drawn when the model
is built, before the tokenizer is bound, and x' m < 2^63 still holds; they are a persistent buffer, so a NumPy
whose stream differs cannot change a trained model. Without a tokenizer (``--engram-compression identity``) the
pad is the id this repo's tokenizer gives <|bos|> (the first of its 9 special tokens: vocab_size - 9). Decoding
carries in ``state`` the last N-1 compressed ids (= P of the raw tokens, the pad before the start) and, per
module, the last (kernel-1) * N rows of V~ (before the conv's norm).
"""

import math
import re
import unicodedata
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.cli_types import check_int_at_least
from nanochat.tokenizer import SPECIAL_TOKENS

from .base import MemoryBlock
from .ve import record

COMPRESSIONS = ("tokenizer", "identity")
LAYER_SEED_STRIDE = 10007  # the demo's per-layer seed offset
INT64_MAX = 2**63 - 1


def normalize_token(text: str) -> str:
    """The compression key of a decoded token (spec §3.1): NFKC -> NFD -> strip accents -> lowercase ->
    collapse [ \\t\\r\\n]+ to one space -> strip, a pure-space token staying " "."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if unicodedata.category(c) != "Mn").lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    return s if s == " " else s.strip()


def compression_map(pieces: list[bytes]) -> list[int]:
    """Token byte pieces (index = token id) -> compressed id per token, numbered in order of first appearance.

    A piece that decodes with U+FFFD (partial UTF-8) keeps its raw bytes as key (never equal to a text key); a
    token that normalises to "" (e.g. a lone combining accent) keeps its decoded text, so such tokens stay apart."""
    keys: dict[str | bytes, int] = {}
    out = []
    for piece in pieces:
        text = piece.decode("utf-8", errors="replace")
        key = piece if "\ufffd" in text else (normalize_token(text) or text)
        out.append(keys.setdefault(key, len(keys)))
    return out


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for n < 3.3e24, far beyond any table size)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n in bases:
        return True
    if any(n % b == 0 for b in bases):
        return False
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def ascending_primes(start: int, count: int) -> list[int]:
    """The ``count`` smallest primes >= start (distinct and ascending: the demo's global "seen" set)."""
    out, n = [], start
    while len(out) < count:
        if is_prime(n):
            out.append(n)
        n += 1
    return out


def layer_multipliers(seed: int, layer: int, max_order: int, id_bound: int) -> list[int]:
    """The demo's odd multipliers m_j = 2 r_j + 1, r_j ~ U[0, floor(floor(INT64_MAX / id_bound) / 2))."""
    half_bound = max(1, INT64_MAX // id_bound // 2)
    r = np.random.default_rng(seed + LAYER_SEED_STRIDE * layer).integers(0, half_bound, size=max_order, dtype=np.int64)
    return [2 * int(v) + 1 for v in r]


@dataclass
class EngramOptions:
    max_order: int = 3  # N, --engram-max-order: n-grams of order 2..N
    heads: int = 8  # K, --engram-heads: hash heads per order
    dim: int = 0  # d_mem per module, --engram-dim (0 = n_embd)
    first_prime: int = 195131  # --engram-first-prime: search start of the ascending distinct primes
    kernel: int = 4  # --engram-kernel: depthwise conv width (dilation = max_order)
    compression: str = "tokenizer"  # --engram-compression: P from the run's tokenizer, or the identity
    seed: int = 0  # --engram-seed: seeds the hash multipliers (seed + 10007 * layer)

    def __post_init__(self):
        for flag, value, low in (("--engram-max-order", self.max_order, 2), ("--engram-heads", self.heads, 1),
                                 ("--engram-dim", self.dim, 0), ("--engram-first-prime", self.first_prime, 2),
                                 ("--engram-kernel", self.kernel, 1), ("--engram-seed", self.seed, 0)):
            check_int_at_least(flag, value, low)
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"--engram-compression {self.compression!r} is unknown; "
                             f"allowed: {', '.join(COMPRESSIONS)}")

    def memory_dim(self, n_embd: int) -> int:
        """d_mem: --engram-dim, or the model width when it is 0."""
        return self.dim or n_embd


class EngramFusion(nn.Module):
    """One module's key/value projections (d_mem -> C, Muon) and depthwise conv weight (C, 1, kernel: AdamW)."""

    def __init__(self, d_mem: int, n_embd: int, kernel: int):
        super().__init__()
        self.key = nn.Linear(d_mem, n_embd, bias=False)
        self.value = nn.Linear(d_mem, n_embd, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(n_embd, 1, kernel))

    def init_weights(self) -> None:
        bound = math.sqrt(3.0 / self.key.in_features)
        nn.init.uniform_(self.key.weight, -bound, bound)
        nn.init.zeros_(self.value.weight)  # the model equals Base at init
        nn.init.zeros_(self.conv_weight)  # the conv branch starts silent (Engram)


class EngramMemory(MemoryBlock):
    Options = EngramOptions
    uses_layers = True
    table_weight_decay = 0.0  # Engram trains its tables without weight decay

    def __init__(self, config):
        super().__init__(config)
        o = self.opts
        self.vocab_size, self.padded_vocab = config.vocab_size, config.padded_vocab_size
        self.n_embd, self.d_mem = config.n_embd, o.memory_dim(config.n_embd)
        per_head = (o.max_order - 1) * o.heads
        if self.d_mem % per_head:
            raise ValueError(f"--engram-dim {self.d_mem} must be divisible by (--engram-max-order - 1) x "
                             f"--engram-heads = {per_head} (one equal slice per order and head)")
        self.head_dim = self.d_mem // per_head
        self.dilation, self.span = o.max_order, (o.kernel - 1) * o.max_order  # span: V~ rows the conv looks back
        self.layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        n_mod = len(self.layers)
        # table sizes: primes assigned layer -> order -> head, head_sizes[module][order - 2][head] (d24: 195,131 ..
        # 195,493); a function of the options alone, so the config determines them
        flat = ascending_primes(o.first_prime, n_mod * per_head)
        it = iter(flat)
        self.head_sizes = [[[next(it) for _ in range(o.heads)] for _ in range(o.max_order - 1)] for _ in range(n_mod)]
        self.rows = sum(flat)
        self.table = nn.Embedding(self.rows, self.head_dim)
        self.fusions = nn.ModuleList(EngramFusion(self.d_mem, config.n_embd, o.kernel) for _ in self.layers)
        self.register_buffer("compression", torch.empty(self.padded_vocab, dtype=torch.long))  # P, in checkpoints
        self.register_buffer("pad_id", torch.empty((), dtype=torch.long))  # P(BOS), in checkpoints
        self.register_buffer("multipliers", torch.empty(n_mod, o.max_order, dtype=torch.long))
        grid = (n_mod, o.max_order - 1, o.heads)  # head sizes and first rows, rebuilt from the options
        self.register_buffer("primes", torch.empty(grid, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.empty(grid, dtype=torch.long), persistent=False)
        self.compression_ready = o.compression == "identity"  # "tokenizer": bind_tokenizer or a checkpoint sets P
        self.register_load_state_dict_post_hook(EngramMemory._loaded)
        self.capture: dict | None = None

    @staticmethod
    def _loaded(module, incompatible_keys) -> None:
        module.compression_ready = True  # the checkpoint's P (strict loads refuse a state dict without it)

    @classmethod
    def resolved_options(cls, config) -> EngramOptions:
        o = super().resolved_options(config)
        return replace(o, dim=o.memory_dim(config.n_embd))

    @classmethod
    def default_layers(cls, n_layer: int) -> tuple[int, ...]:
        """Two modules, as Engram-27B (layers 2 and 15 of 30): layer 1 and the last of the first half (d24: 1, 11);
        under 6 layers the first two."""
        return (1, n_layer // 2 - 1) if n_layer >= 6 else tuple(range(min(n_layer, 2)))

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.table.weight, mean=0.0, std=1.0)
        for fusion in self.fusions:
            fusion.init_weights()
        self.compression.copy_(torch.arange(self.padded_vocab))
        self.pad_id.fill_(max(self.vocab_size - len(SPECIAL_TOKENS), 0))  # <|bos|>: the first special token
        o = self.opts
        self.multipliers.copy_(torch.tensor([layer_multipliers(o.seed, layer, o.max_order, self.padded_vocab)
                                             for layer in self.layers]))
        sizes = torch.tensor(self.head_sizes)
        self.primes.copy_(sizes)
        self.offsets.copy_((sizes.flatten().cumsum(0) - sizes.flatten()).view_as(sizes))

    @torch.no_grad()
    def bind_tokenizer(self, tokenizer) -> None:
        """Build P from the run's tokenizer (``compression="tokenizer"``) and take P(<|bos|>) as the pad."""
        if tokenizer is None:
            if self.opts.compression == "tokenizer":
                raise ValueError("--engram-compression tokenizer builds the compression map from the run's tokenizer "
                                 "and this run has none (--synthetic-data): pass --engram-compression identity")
            return
        if tokenizer.vocab_size != self.vocab_size:
            raise ValueError(f"--memory engram: the tokenizer has {tokenizer.vocab_size} tokens, the model "
                             f"{self.vocab_size}")
        if self.opts.compression == "tokenizer":
            ids = compression_map([tokenizer.decode_bytes([t]) for t in range(self.vocab_size)])
            unused = range(max(ids) + 1, max(ids) + 1 + self.padded_vocab - self.vocab_size)  # padding ids: apart
            self.compression.copy_(torch.tensor(ids + list(unused)))
        self.pad_id.copy_(self.compression[tokenizer.bos_token_id])
        self.compression_ready = True

    def memory_tables(self) -> list[nn.Parameter]:
        return [self.table.weight]

    def active_table_params(self) -> int:
        """A token reads one head_dim row per (module, order, head): d_mem per module."""
        return len(self.layers) * self.d_mem

    def hash_rows(self, idx: torch.Tensor, state: dict | None) -> torch.Tensor:
        """idx (B, T) -> table rows (B, T, n_mod, N-1, K) int64; carries the last N-1 compressed ids in ``state``."""
        B, T = idx.shape
        N = self.opts.max_order
        x = self.compression[idx]  # (B, T) compressed ids
        prev = state.get("engram_prev") if state is not None else None
        if prev is None:
            prev = self.pad_id.expand(B, N - 1)
        ext = torch.cat([prev, x], dim=1)  # (B, N-1+T): the pad (or the previous chunk) then this chunk
        if state is not None:
            state["engram_prev"] = ext[:, T:].clone()
        back = torch.stack([ext[:, N - 1 - j: N - 1 - j + T] for j in range(N)], dim=-1)  # (B, T, N): x'_{t-j}
        prods = back[:, :, None, :] * self.multipliers  # (B, T, n_mod, N); < 2^63
        mixes, acc = [], prods[..., 0]
        for j in range(1, N):
            acc = torch.bitwise_xor(acc, prods[..., j])
            mixes.append(acc)  # order n = j + 1
        mix = torch.stack(mixes, dim=-1)  # (B, T, n_mod, N-1), >= 0
        return mix[..., None] % self.primes + self.offsets  # (B, T, n_mod, N-1, K)

    def check_ready(self, training: bool = False) -> None:
        if not self.compression_ready:
            raise ValueError("--engram-compression tokenizer: the compression map was never built; a training run "
                             "builds it from its tokenizer (bind_tokenizer), a checkpoint carries it, and a model "
                             "without a tokenizer needs --engram-compression identity")

    def prepare(self, idx, state):
        self.check_ready()
        B, T = idx.shape
        rows = self.hash_rows(idx, state)
        e = self.table(rows.flatten(2))  # (B, T, n_mod*(N-1)*K, d_head): one lookup for every module
        return {"emb": e.view(B, T, len(self.layers), self.d_mem), "state": state}

    def residual(self, layer, x, ctx):
        pos = self.layer_pos.get(layer)
        if pos is None:
            return x
        fusion = self.fusions[pos]
        e = ctx["emb"][:, :, pos]  # (B, T, d_mem)
        k, v = fusion.key(e), fusion.value(e)  # (B, T, C) each
        C = self.n_embd
        a = (F.rms_norm(x, (C,)) * F.rms_norm(k, (C,))).sum(-1, keepdim=True) / math.sqrt(C)  # (B, T, 1)
        alpha = torch.sigmoid(a.sign() * a.abs().clamp_min(1e-6).sqrt())  # (B, T, 1)
        v_gated = alpha * v  # V~ (B, T, C)
        y = F.silu(self.short_conv(pos, v_gated, ctx["state"])) + v_gated
        if self.capture is not None:  # nanochat.analysis: the gate as one "head" of VE/Bigram's per-head gamma
            record(self.capture, layer, gamma=alpha, inject_norm=y.float().norm(dim=-1, keepdim=True))
        return x + y.to(x.dtype)

    def short_conv(self, pos: int, v_gated: torch.Tensor, state: dict | None) -> torch.Tensor:
        """Causal depthwise conv of norm(V~) (B, T, C) -> (B, T, C); the look-back rows come from ``state`` when
        decoding (zeros before the start: norm(0) = 0, the conv's left padding)."""
        B, T, C = v_gated.shape
        key = f"engram_v{pos}"
        past = state.get(key) if state is not None else None
        if past is None:
            past = v_gated.new_zeros(B, self.span, C)
        full = torch.cat([past.to(v_gated.dtype), v_gated], dim=1)  # (B, span+T, C)
        if state is not None:
            state[key] = full[:, full.size(1) - self.span:].detach().clone()
        w = self.fusions[pos].conv_weight
        y = F.conv1d(F.rms_norm(full, (C,)).transpose(1, 2), w.to(full.dtype), groups=C, dilation=self.dilation)
        return y.transpose(1, 2)  # (B, T, C)

    def stats(self) -> dict[str, float]:
        return {"memory/engram/compressed_ids": float(self.compression[: self.vocab_size].unique().numel()),
                "memory/engram/table_rows": float(self.rows)}
