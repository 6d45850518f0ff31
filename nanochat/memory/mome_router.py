"""MoME's causal conv1d router (--mome-router-type conv1d; the reference's --moe-ve-gate-type conv1d, reference
notes §3.5): the router's logits at position t come from its inputs at t-k+1..t (k = --mome-conv-kernel-size)
instead of t alone.

A Conv1d from the router input's width to the logits (hidden mode: C -> H*M on norm(x), reshaped to per-head
logits; value mode: d -> M on each head's value vector, each head's sequence convolved separately, the kernel shared
by the heads as the linear value router is). Causal: the input is left-padded with k-1 zero vectors, so position t
sees only t-k+1..t and the first positions of a sequence see zeros before it. Weight (out, in, k) and bias (out,),
both zero at init (all logits 0, as the linear router). The 3-D kernel and the bias fall to the AdamW
"adam_extra" group by shape (nanochat.optim.shape_routed_groups), as in the reference, and count in the 6N FLOPs
(2*in*out*k per position = 2 x its parameters, like a matmul).

KV-cache decoding: the k-1 router inputs before a forward's first position are carried in the cache's memory
state (zeros at the start), so cached decoding, chunked or token by token, equals the full forward.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalConvRouter(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim, kernel_size))
        self.bias = nn.Parameter(torch.empty(out_dim))

    def forward(self, x: torch.Tensor, state: dict | None = None, key: str = "") -> torch.Tensor:
        """x (N, T, in) -> logits (N, T, out), position t from x[t-k+1 .. t] (zeros before the start).
        ``state``: the KV cache's memory state; its ``key`` entry holds the k-1 inputs before x (absent: zeros)
        and is replaced by the last k-1 inputs of this call."""
        N, T, _ = x.shape
        span = self.kernel_size - 1
        past = state.get(key) if state is not None else None
        if past is None:
            past = x.new_zeros(N, span, x.size(-1))
        full = torch.cat([past.to(x.dtype), x], dim=1)  # (N, k-1+T, in)
        if state is not None:
            state[key] = full[:, full.size(1) - span:].detach().clone()
        y = F.conv1d(full.transpose(1, 2), self.weight.to(x.dtype), self.bias.to(x.dtype))  # (N, out, T)
        return y.transpose(1, 2)  # (N, T, out)

    def extra_repr(self) -> str:
        out_dim, in_dim, k = self.weight.shape
        return f"{in_dim} -> {out_dim}, kernel_size={k}, causal"
