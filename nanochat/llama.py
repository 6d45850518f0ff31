"""The Llama/MobileLLM backbone family (paper: MobileLLM 125M and 350M; reference families spec §2), and the
pre-norm SwiGLU transformer that the Qwen3 family (``nanochat/qwen3.py``) specialises.

Per layer:  h <- h + Attn(RMSNorm(h));  h <- h + FFN(RMSNorm(h)),  FFN(x) = W_down(silu(W_gate x) ⊙ W_up x).
- learnable RMSNorm (gain init 1, eps 1e-5, computed in fp32), also the final norm; no embedding norm, no
  resid/x0 lambdas, no softcap, no biases, no dropout;
- GQA attention, H query and H_kv key/value heads of an explicit head_dim d (MobileLLM: d = C/H); RoPE base 1e4
  in the Llama interleaved layout (channels 2j, 2j+1 rotate as a pair by +angle, in fp32); full causal window;
- FFN width F = int(8C/3) rounded up to a multiple of 256 (125M: 1536, 350M: 2560);
- wte is the output head when ``tie_embeddings`` (125M), else a separate lm_head (350M);
- init: truncated normals (+-3 sigma) of std C^-0.5 for wte/lm_head/q/k/v/o/gate/up, F^-0.5 for W_down; no depth
  scaling. VE/MoME tables U(+-C^-0.5); STEM tables like wte.

Memory hooks: as in ``nanochat.memory.base``; VE/MoME act on the KV-head values before the GQA expansion, gates
read the attention norm's output, and a block that owns a layer's FFN up-projection (STEM) replaces W_up there.

``__init__`` runs on the meta device; ``init_weights()`` sets every value (``nanochat.families.build_model``).
"""

import math
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.gpt import GPT, VOCAB_PAD_MULTIPLE, causal_attention, lm_loss, rotary_tables
from nanochat.memory import build_memory
from nanochat.optim import OptimConfig, adamw_group, finalize_groups, memory_table_group, shape_routed_groups

FFN_MULTIPLE_OF = 256


def llama_ffn_hidden(n_embd: int, multiple_of: int = FFN_MULTIPLE_OF) -> int:
    """int(8C/3) rounded up to a multiple of ``multiple_of`` (the reference's compute_stem_hidden_dim)."""
    return math.ceil(int(8 * n_embd / 3) / multiple_of) * multiple_of


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


@dataclass
class LlamaConfig:
    training_fields: ClassVar[tuple[str, ...]] = ()  # as GPTConfig's: none in these families
    family: str = "mobilellm"  # nanochat.families registry key, recorded in meta.json
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 30
    n_head: int = 9
    n_kv_head: int = 3
    n_embd: int = 576
    head_dim: int = 64
    ffn_hidden: int = 1536
    tie_embeddings: bool = True
    memory: str = "base"
    memory_layers: tuple[int, ...] = ()
    memory_options: dict = field(default_factory=dict)

    def __post_init__(self):
        self.memory_layers = tuple(self.memory_layers)
        # build_model dispatches on this field, the init rules (memory_table_bound, init_token_table) come from the
        # class: a mismatch would build one family with the other's init (and reload as the other's config)
        own = type(self).__dataclass_fields__["family"].default
        if self.family != own:
            raise ValueError(f"{type(self).__name__}(family={self.family!r}): this config class builds the {own!r} "
                             f"family; use the config class registered for {self.family!r} "
                             f"(nanochat.families.FAMILIES[{self.family!r}].config_cls)")
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "head_dim", "ffn_hidden", "sequence_len",
                     "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self.family}: {name} must be >= 1 (got {getattr(self, name)})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"{self.family}: n_head {self.n_head} is not divisible by n_kv_head {self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"{self.family}: head_dim {self.head_dim} must be even (RoPE rotates channel pairs)")

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    @property
    def attention_windows(self) -> tuple[None, ...]:
        """The full causal context in every layer: these families have no --window-pattern (the reference's
        MobileLLM/Qwen3 models ignore window_pattern, families spec §1)."""
        return (None,) * self.n_layer

    @property
    def memory_table_bound(self) -> float:
        return self.n_embd**-0.5  # the reference passes C^-0.5 as the VE/MoME half-width

    def init_token_table(self, weight: torch.Tensor) -> None:
        """How this family initialises a token-indexed table (wte, untied lm_head, STEM tables)."""
        trunc_normal_(weight, self.n_embd**-0.5)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory_layers"] = list(self.memory_layers)
        return d


class RMSNorm(nn.Module):
    """Learnable RMSNorm, computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.size(-1),), self.weight.float(), self.eps).to(x.dtype)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama/Meta-Lingua RoPE on x (B, T, H, d): pair (2j, 2j+1) rotated by +angle_j; cos/sin (1, T, 1, d/2)."""
    xf = x.float()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    y = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (B, T, H, d/2, 2)
    return y.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """GQA attention: C -> H*d queries, C -> H_kv*d keys/values, H*d -> C output; no biases."""

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        C, d = config.n_embd, config.head_dim
        self.c_q = nn.Linear(C, self.n_head * d, bias=False)
        self.c_k = nn.Linear(C, self.n_kv_head * d, bias=False)
        self.c_v = nn.Linear(C, self.n_kv_head * d, bias=False)
        self.c_proj = nn.Linear(self.n_head * d, C, bias=False)

    def rope(self, q, k, cos, sin):
        return rope_interleaved(q, cos, sin), rope_interleaved(k, cos, sin)

    def forward(self, xn, cos_sin, memory, mem_ctx, kv_cache):
        B, T, _ = xn.shape
        q = self.c_q(xn).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(xn).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(xn).view(B, T, self.n_kv_head, self.head_dim)
        v = memory.value(self.layer_idx, xn, v, mem_ctx)  # memory joins the KV-head values before GQA expansion
        q, k = self.rope(q, k, *cos_sin)
        y = causal_attention(q, k, v, kv_cache, self.layer_idx)  # (B, T, H, d)
        return self.c_proj(y.reshape(B, T, self.n_head * self.head_dim))


class SwiGLU(nn.Module):
    """W_down(silu(W_gate x) ⊙ u), u = W_up x, or the memory block's u on a layer it owns (STEM)."""

    def __init__(self, config: LlamaConfig, layer_idx: int, has_up: bool):
        super().__init__()
        self.layer_idx = layer_idx
        C, hidden = config.n_embd, config.ffn_hidden
        self.c_gate = nn.Linear(C, hidden, bias=False)
        self.c_up = nn.Linear(C, hidden, bias=False) if has_up else None
        self.c_proj = nn.Linear(hidden, C, bias=False)

    def forward(self, xn, memory, mem_ctx):
        up = self.c_up(xn) if self.c_up is not None else memory.ffn_up(self.layer_idx, xn, mem_ctx)
        return self.c_proj(F.silu(self.c_gate(xn)) * up)


class Block(nn.Module):
    def __init__(self, model, config: LlamaConfig, layer_idx: int, memory):
        super().__init__()
        self.norm_attn = RMSNorm(config.n_embd, model.norm_eps)
        self.attn = model.attention_cls(config, layer_idx)
        self.norm_mlp = RMSNorm(config.n_embd, model.norm_eps)
        self.mlp = SwiGLU(config, layer_idx, has_up=not memory.owns_ffn_up(layer_idx))

    def forward(self, x, cos_sin, memory, mem_ctx, kv_cache):
        h = x
        x = x + self.attn(self.norm_attn(x), cos_sin, memory, mem_ctx, kv_cache)
        return x + memory.mlp_out(self.mlp.layer_idx, h, self.mlp(self.norm_mlp(x), memory, mem_ctx), mem_ctx)


class Llama(nn.Module):
    """The MobileLLM family. Subclasses (Qwen3) change the class attributes and ``init_backbone``."""

    attention_cls = Attention
    norm_eps = 1e-5
    tied_embedding_lr = "embedding"  # a tied wte trains at --embedding-lr here (at --unembedding-lr in Qwen3)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        V, C = config.padded_vocab_size, config.n_embd
        self.wte = nn.Embedding(V, C)
        self.memory = build_memory(config)  # before the blocks: it decides which layers keep their W_up
        self.blocks = nn.ModuleList([Block(self, config, i, self.memory) for i in range(config.n_layer)])
        self.norm_f = RMSNorm(C, self.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(C, V, bias=False)
        self.rotary_len = config.sequence_len * 10  # headroom for long CORE prompts and generation
        half = config.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(1, self.rotary_len, 1, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(1, self.rotary_len, 1, half), persistent=False)

    max_seq_len = GPT.max_seq_len

    @torch.no_grad()
    def init_weights(self) -> None:
        self.init_backbone()
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        self.memory.init_weights()
        cos, sin = rotary_tables(self.rotary_len, self.config.head_dim, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def init_backbone(self) -> None:
        """Truncated normals (+-3 sigma): std C^-0.5 everywhere except the FFN down-projection, F^-0.5."""
        cfg = self.config
        std = cfg.n_embd**-0.5
        cfg.init_token_table(self.wte.weight)
        if self.lm_head is not None:
            cfg.init_token_table(self.lm_head.weight)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.attn.c_proj, block.mlp.c_gate,
                        block.mlp.c_up):
                if lin is not None:
                    trunc_normal_(lin.weight, std)
            trunc_normal_(block.mlp.c_proj.weight, cfg.ffn_hidden**-0.5)

    # -- accounting (the same rules as the nanochat GPT) ------------------------------------------------------
    memory_table_params = GPT.memory_table_params
    num_params = GPT.num_params

    def scalar_params(self) -> list[nn.Parameter]:
        return list(self.memory.scalar_params())

    def estimate_flops(self) -> int:
        """FLOPs per token: nanochat's rule (6 x params minus wte, memory tables and scalars, + 12*H*d*T attention
        per layer) plus the output head's 6 V C when it is the tied wte. The reference estimator omits the tied
        head (families spec §9, §11.7): ``reference = estimate_flops() - 6 V C`` for tied models."""
        return GPT.estimate_flops(self) + (6 * self.wte.weight.numel() if self.lm_head is None else 0)

    def param_groups(self, oc: OptimConfig) -> list[dict]:
        """AdamW: wte (tied: at the family's tied_embedding_lr), lm_head, memory tables, memory scalars, and every
        non-matrix (norm gains, router biases) at matrix_lr; Muon: every other matrix. AdamW LRs x (C/768)^-0.5."""
        cfg = self.config
        width_scale = (cfg.n_embd / 768) ** -0.5
        tied_unembedding = self.lm_head is None and self.tied_embedding_lr == "unembedding"
        wte_lr = oc.unembedding_lr if tied_unembedding else oc.embedding_lr
        groups = [adamw_group("wte", [self.wte.weight], wte_lr * width_scale, oc)]
        if self.lm_head is not None:
            groups.append(adamw_group("lm_head", [self.lm_head.weight], oc.unembedding_lr * width_scale, oc))
        groups += memory_table_group(self.memory, oc, width_scale)
        if self.memory.scalar_params():  # e.g. Bigram's lambdas: nanochat's x0 group settings
            groups.append(adamw_group("scalars", self.memory.scalar_params(), oc.scalar_lr, oc, betas=(0.96, 0.95)))
        assigned = {id(p) for g in groups for p in g["params"]}
        groups += shape_routed_groups([p for p in self.parameters() if id(p) not in assigned], oc,
                                      oc.matrix_lr * width_scale, oc.weight_decay * (12 / cfg.n_layer) ** 2)
        return finalize_groups(self, groups)

    # -- forward ------------------------------------------------------------------------------------------
    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean", return_aux=False):
        B, T = idx.shape
        pos = kv_cache.pos if kv_cache is not None else 0
        if pos + T > self.rotary_len:
            raise ValueError(f"sequence of {pos + T} tokens exceeds the rotary cache ({self.rotary_len})")
        cos_sin = self.rope_cos[:, pos : pos + T], self.rope_sin[:, pos : pos + T]
        mem_ctx = self.memory.prepare(idx, kv_cache.memory_state if kv_cache is not None else None)
        x = self.wte(idx)
        for i, block in enumerate(self.blocks):
            x = self.memory.residual(i, x, mem_ctx)
            x = block(x, cos_sin, self.memory, mem_ctx, kv_cache)
        x = self.norm_f(x)
        if kv_cache is not None:
            kv_cache.advance(T)
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, head)[..., : self.config.vocab_size].float()
        if targets is None:
            return logits
        return lm_loss(logits, targets, loss_reduction, self.memory, mem_ctx, return_aux)
