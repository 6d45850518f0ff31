"""How far two bf16-autocast forwards of one model may land apart (other GEMM shapes round differently), and the
greedy-decoding check built on it: cached tokens are the uncached argmax up to that bound, not equal to it. Exact
token equality is not a property of bf16: these tiny models' top-1/top-2 logit gaps reach 0 (exact ties), below the
~1e-4 the cached and uncached forwards differ by, and which way a near-tie falls depends on the CPU's kernels."""

import torch


@torch.no_grad()
def bf16_logits_and_bound(model, idx, kv_cache=None):
    """Logits of one forward (under the caller's autocast) and the per-logit bound on how far another bf16 path may
    land: each path's final hidden state x is a bf16 rounding (2^-8 relative) of a value carrying upstream
    roundings, so to first order |d logit_v| <= 4 * 2^-8 * sum_k |W_vk| |x_k| for two paths (measured <= 1.24 *
    2^-8 on ATen's AVX-512, AVX2 and default paths). The logits are ~0.01 (lm_head std 1e-3): a bound relative to
    the logits would be meaningless, one on sum |W||x| is not."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].float()))
    try:
        logits = model(idx, kv_cache=kv_cache)
    finally:
        hook.remove()
    weight = model.lm_head.weight.float()[: logits.shape[-1]]
    return logits, 4 * 2 ** -8 * (seen[0].abs() @ weight.abs().T)


def assert_greedy_within_bf16_bound(model, prompt: list[int], cached: list[int]):
    """Every token of cached greedy decoding is the argmax of the uncached forward over the same tokens (teacher
    forcing) up to the bf16 bound: cached picks c = argmax of logits within b of ref, so ref.max - ref[c] <=
    b[argmax] + b[c]. Call under the autocast the decoding ran in."""
    ref, bound = bf16_logits_and_bound(model, torch.tensor([prompt + cached]))
    ref, bound = ref[0, len(prompt) - 1:-1], bound[0, len(prompt) - 1:-1]
    chosen = torch.tensor(cached)[:, None]
    shortfall = ref.max(-1).values - ref.gather(1, chosen)[:, 0]
    slack = bound.gather(1, ref.argmax(-1, keepdim=True))[:, 0] + bound.gather(1, chosen)[:, 0]
    assert (shortfall <= slack).all(), (cached, shortfall, slack)
    assert (ref.max(-1).values - ref.min(-1).values).min() > 10 * slack.max()  # the check tells tokens apart
