"""The Qwen3-style backbone family (paper: Qwen3 0.6B; reference families spec §3).

The pre-norm SwiGLU transformer of ``nanochat/llama.py`` with Qwen3's choices:
- head_dim is explicit and independent of C/H (0.6B: C = 1024, 16 query heads x 128 = 2048, 8 KV heads);
- learnable per-head RMSNorm on q and k (over head_dim) **before** RoPE; v is not normed;
- RoPE base 1e4 (the reference's choice for 2k context, not Qwen3's 1e6) in the half-split (rotate_half)
  layout, rotation by +angle: y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin (nanochat's GPT rotates by -angle);
- every RMSNorm has eps 1e-6; FFN width F = 3C; embeddings tied;
- init: every matrix and embedding N(0, 0.02) (untruncated, no depth scaling), norm gains 1; VE/MoME tables
  U(+-0.02), STEM tables N(0, 0.02); gates and routers zero (the memory block's own init);
- the tied wte trains at --unembedding-lr (x (C/768)^-0.5), not --embedding-lr as MobileLLM's does.

Numerics differ from the reference in one documented way: cos/sin stay fp32 (the reference stores them in bf16).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from nanochat.llama import Attention, Llama, LlamaConfig, RMSNorm

QK_NORM_EPS = 1e-6
INIT_STD = 0.02


def qwen3_ffn_hidden(n_embd: int) -> int:
    return 3 * n_embd


@dataclass
class Qwen3Config(LlamaConfig):
    family: str = "qwen3"
    n_layer: int = 28
    n_head: int = 16
    n_kv_head: int = 8
    n_embd: int = 1024
    head_dim: int = 128
    ffn_hidden: int = 3072
    tie_embeddings: bool = True

    @property
    def memory_table_bound(self) -> float:
        return INIT_STD

    def init_token_table(self, weight: torch.Tensor) -> None:
        nn.init.normal_(weight, mean=0.0, std=INIT_STD)


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotate_half RoPE on x (B, T, H, d), +angle, in fp32; cos/sin (1, T, 1, d/2)."""
    xf = x.float()
    half = x.size(-1) // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Qwen3Attention(Attention):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(config.head_dim, QK_NORM_EPS)
        self.k_norm = RMSNorm(config.head_dim, QK_NORM_EPS)

    def rope(self, q, k, cos, sin):
        q, k = self.q_norm(q), self.k_norm(k)  # per-head QK-norm, before RoPE (Qwen3 order)
        return rope_half_split(q, cos, sin), rope_half_split(k, cos, sin)


class Qwen3(Llama):
    attention_cls = Qwen3Attention
    norm_eps = 1e-6
    tied_embedding_lr = "unembedding"  # the reference routes Qwen3's tied matrix to the unembedding LR on purpose

    def init_backbone(self) -> None:
        own = {id(m) for m in self.memory.modules()}  # the memory block initialises its own modules
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and id(module) not in own:
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
