"""Incremental generation with a KV cache, for every memory block.

The prompt is prefilled in one forward; each new token is then decoded with a single-position forward that
reuses the cache. Memory blocks keep what they need between steps in ``KVCache.memory_state`` (the bigram hash
reads the previous token from there; MoME routes each new token from its own hidden state).
"""

import math

import torch

from nanochat.kv_cache import KVCache


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None):
    """logits (B, V) -> next ids (B,). temperature 0 is greedy."""
    if not 0 <= temperature < math.inf:  # nan fails both: it would reach torch.multinomial as nan probabilities
        raise ValueError(f"--temperature must be >= 0 and finite (got {temperature})")
    if top_k is not None and top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (got {top_k})")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    if top_k is not None and top_k > 0:
        k = min(top_k, logits.size(-1))
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # the max shifted to 0 before dividing: however small the temperature, (l - max) / T stays <= 0 with the top at
    # exactly 0 (T -> 0 is greedy); l / T overflowed fp32 below T ~ 5e-38, and 0 / 0 once T itself underflows
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(torch.where(shifted == 0, 0.0, shifted / temperature), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def iter_samples(model, prompt_ids: list[int], max_tokens: int, num_samples: int = 1, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 0, stop_ids: set[int] | None = None):
    """Yield ``(i, ids)`` for each of ``num_samples`` continuations of ``prompt_ids`` as soon as it is finished: at
    its stop token (its last id), else after ``max_tokens`` (the rest, in index order). A caller can show each one
    while the others are still decoding; ``generate`` collects them.

    Sampling is reproducible for a fixed seed; each sample draws its own tokens from the first step on.
    """
    if not prompt_ids:
        raise ValueError("generate: the prompt must hold at least one token (prepend BOS)")
    model.eval()
    device = model.wte.weight.device
    max_len = len(prompt_ids) + max_tokens
    if max_len > model.rotary_len:
        raise ValueError(f"prompt + max_tokens = {max_len} exceeds the model's position limit {model.rotary_len}")
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache.for_model(model, batch_size=num_samples, max_len=max_len)
    idx = torch.tensor([prompt_ids] * num_samples, dtype=torch.long, device=device)  # (num_samples, T0)
    logits = model(idx, kv_cache=cache)[:, -1]
    out = [[] for _ in range(num_samples)]
    done = [False] * num_samples
    for step in range(max_tokens):
        nxt = sample_next(logits, temperature, top_k, generator)  # (num_samples,); finished rows draw too
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(t)
                if stop_ids and t in stop_ids:
                    done[i] = True
                    yield i, out[i]
        if all(done) or step == max_tokens - 1:
            break  # the last token's logits would never be used
        logits = model(nxt[:, None], kv_cache=cache)[:, -1]
    for i in range(num_samples):
        if not done[i]:
            yield i, out[i]


def generate(model, prompt_ids: list[int], max_tokens: int, num_samples: int = 1, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, stop_ids: set[int] | None = None) -> list[list[int]]:
    """Return ``num_samples`` continuations (token ids, prompt excluded) of ``prompt_ids`` (see ``iter_samples``)."""
    out = [[] for _ in range(num_samples)]
    for i, ids in iter_samples(model, prompt_ids, max_tokens, num_samples, temperature, top_k, seed, stop_ids):
        out[i] = ids
    return out


@torch.no_grad()
def generate_uncached(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding by re-running the full sequence each step (slow; the reference for tests)."""
    model.eval()
    device = model.wte.weight.device
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids], device=device))[:, -1]
        ids.append(int(logits.argmax(dim=-1)))
    return ids[len(prompt_ids):]
