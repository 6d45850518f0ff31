"""The GPT backbone of the paper's nanochat family, with one extension point for memory blocks.

Architecture (paper appendix / reference spec §1): param-free RMSNorm everywhere, untied wte/lm_head, RoPE
(base 10000, half-split) then QK-norm, causal attention (full context, or a sliding window of half the context in
the layers ``window_pattern`` marks S; the last layer always full), relu^2 MLP of width 4C, no biases, per-layer
``x <- resid_lambdas[i] * x + x0_lambdas[i] * x0`` with x0 the normed token embedding, logit softcap 15.
The memory block (``nanochat.memory``) may add to the residual stream, the attention values and/or the FFN
increment (JTok/JTok-M).
``mlp="moe"`` replaces every layer's MLP by a sparse MoE FFN (``nanochat.moe``), whatever the memory block.

``GPT.__init__`` is meant to run on the meta device: every real value is set in ``init_weights()``.
"""

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.cli_types import flag_name
from nanochat.memory import build_memory
from nanochat.moe import MoEFFN, ReluSquaredMLP, check_mlp_config, inactive_expert_params
from nanochat.optim import OptimConfig, build_param_groups

ROPE_BASE = 10000.0
LOGIT_SOFTCAP = 15.0
VOCAB_PAD_MULTIPLE = 64
WINDOW_LETTERS = {"L": "the full causal context", "S": "a sliding window of sequence_len // 2 tokens"}


def check_window_pattern(pattern) -> str:
    """--window-pattern: a non-empty string of L and S (reference spec §1.1), returned as given."""
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(WINDOW_LETTERS):
        allowed = "; ".join(f"{k} = {v}" for k, v in WINDOW_LETTERS.items())
        raise ValueError(f"--window-pattern {pattern!r}: expected a non-empty string of the letters L and S "
                         f"({allowed}), tiled over the layers with the last layer always L, e.g. L (the default) "
                         "or SSSL")
    return pattern


def shortest_period(pattern: str) -> str:
    """The shortest string whose repetition is ``pattern`` ("SLSL" -> "SL", "SSSL" -> "SSSL")."""
    n = len(pattern)
    return next(pattern[:k] for k in range(1, n + 1) if n % k == 0 and pattern[:k] * (n // k) == pattern)


@dataclass
class GPTConfig:
    # nanochat.families registry key; not a field, so nanochat's meta.json stays as it was (a subclass registered as
    # another family overrides it, and to_dict records it)
    family: ClassVar[str] = "nanochat"
    # fields that steer training only (no forward depends on them): --init-from may change them, --resume may not
    training_fields: ClassVar[tuple[str, ...]] = ("moe_balance_lr",)  # the step of the selection-bias update
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    window_pattern: str = "L"  # L/S per layer, tiled, last layer L (attention_windows); "L" = full context everywhere
    memory: str = "base"  # a key of nanochat.memory.MEMORY_BLOCKS
    memory_layers: tuple[int, ...] = ()  # empty = alternating layers ending at the last one
    memory_options: dict = field(default_factory=dict)  # block-specific, validated by the block
    mlp: str = "dense"  # "dense" (relu^2 4C) or "moe" (nanochat.moe; the moe_* fields below)
    moe_experts: int = 6  # E routed experts per layer
    moe_topk: int = 2  # K routed experts per token
    moe_shared: int = 1  # always-on shared experts per layer
    moe_hidden: int = 0  # expert width; 0 = 4C/(shared+topk) rounded to x64 (2048 at C=1536)
    moe_balance_lr: float = 1e-3  # loss-free balancing step of the selection bias per optimizer step

    def __post_init__(self):
        self.memory_layers = tuple(self.memory_layers)
        check_mlp_config(self)
        if self.mlp == "dense":
            changed = [f.name for f in fields(self) if f.name.startswith("moe_") and getattr(self, f.name) != f.default]
            if changed:
                flags = ", ".join(flag_name(n) for n in changed)
                raise ValueError(f"{flags}: only for --mlp moe (got --mlp dense)")
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "sequence_len", "vocab_size"):
            if getattr(self, name) < 1:  # the CLI checks its flags; this covers configs built in Python
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} is not divisible by n_kv_head {self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"head size n_embd / n_head = {self.head_dim} must be even (RoPE rotates pairs)")
        # a repetition tiles as its shortest period ("LL" is "L", "SLSL" is "SL"): the same model compares (resume,
        # --init-from, eval reuse) and saves alike
        self.window_pattern = shortest_period(check_window_pattern(self.window_pattern))

    @classmethod
    def from_depth(cls, depth: int, aspect_ratio: int = 64, head_dim: int = 128, **kwargs) -> "GPTConfig":
        """The paper's single dial: width = depth*aspect_ratio rounded up to a multiple of head_dim."""
        if depth < 1:
            raise ValueError(f"--depth must be >= 1 (got {depth})")
        n_embd = math.ceil(depth * aspect_ratio / head_dim) * head_dim
        n_head = n_embd // head_dim
        return cls(n_layer=depth, n_embd=n_embd, n_head=n_head, n_kv_head=n_head, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    @property
    def attention_windows(self) -> tuple[int | None, ...]:
        """Per-layer window_left: the pattern tiled over the layers, the last layer forced to L (reference §1.1).
        L -> None (the full causal context, at any length), S -> sequence_len // 2 (a query sees itself and the
        window_left tokens before it; reference §Attention: S is half the context)."""
        letters = [self.window_pattern[i % len(self.window_pattern)] for i in range(self.n_layer)]
        letters[-1] = "L"
        return tuple(None if c == "L" else self.sequence_len // 2 for c in letters)

    @property
    def memory_table_bound(self) -> float:
        """Half-width of the U(-s, s) init of VE/MoME tables: the backbone's matrix init, std 1/sqrt(C)."""
        return math.sqrt(3.0 / self.n_embd)

    def to_dict(self) -> dict:
        """JSON-ready fields; a dense model leaves out the FFN fields, and an all-L model (stored as "L") its window_pattern, so
        their meta.json is the one it was before those existed (and checkpoints written before them still resume:
        the configs compare equal)."""
        d = asdict(self)
        d["memory_layers"] = list(self.memory_layers)
        if self.mlp == "dense":
            d = {k: v for k, v in d.items() if k != "mlp" and not k.startswith("moe_")}
        if self.window_pattern == "L":
            del d["window_pattern"]
        if self.family != GPTConfig.family:  # a GPT-variant family (nanochat.families.config_from_dict reads it)
            d["family"] = self.family
        return d


def norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE on x of shape (B, T, H, d); cos/sin are (1, T, 1, d/2).

    The tables are cast to x's dtype: under bf16 autocast q/k come out of their Linear in bf16, and fp32 tables
    would promote them (and the attention inputs) to fp32."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    return torch.cat([y1, y2], dim=-1)


def rotary_tables(length: int, head_dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin for positions 0..length-1, each (1, length, 1, head_dim/2), fp32."""
    inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)  # (length, d/2)
    return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]


ATTENTION_BACKENDS = ("sdpa", "fa2", "fa3", "auto")  # --attention
FA3_HUB_KERNEL = "varunneal/flash-attention-3"  # FA3 on the Hugging Face kernels hub (nanochat and the authors load it)
ATTENTION_INSTALL = {
    "fa2": "pip install flash-attn --no-build-isolation (FlashAttention-2)",
    "fa3": "FlashAttention-3 (Hopper): build flash_attn_interface from the hopper/ directory of "
           "github.com/Dao-AILab/flash-attention, or pip install kernels (fetches " + FA3_HUB_KERNEL + " from the "
           "Hugging Face hub on first use)",
}
ATTENTION_GPU = {"fa2": "an Ampere or newer GPU (compute capability >= 8.0)",
                 "fa3": "a Hopper GPU (compute capability 9.x)"}


@dataclass(frozen=True)
class AttentionBackend:
    """The resolved --attention: what ``causal_attention`` runs for forwards without a KV cache on CUDA."""
    name: str = "sdpa"  # sdpa, fa2 or fa3 (never auto): recorded in config.json and summary.json
    func: Callable | None = None  # flash_attn_func(q, k, v, causal=True) of fa2/fa3; None = SDPA
    device_type: str = "cuda"  # the flash kernels run on this device type only; other tensors take SDPA
    reason: str = ""  # why auto chose what it chose (printed at startup)


# Set once at startup (set_attention_backend), before the model is built and compiled (a compiled graph keeps the
# kernel it traced), the same on every rank. SDPA until then: evaluation scripts, tests, notebooks.
_ATTENTION = AttentionBackend()


def attention_dtype(name: str, dtype: str) -> str:
    """The dtype the resolved kernel ``name`` computes attention in under the run's autocast ``dtype``: FlashAttention
    takes 16-bit inputs only (``causal_attention`` casts fp32 to bf16), SDPA the run's own."""
    return "bfloat16" if name in ("fa2", "fa3") else dtype


def set_attention_backend(backend: AttentionBackend) -> None:
    global _ATTENTION
    _ATTENTION = backend


def _load_fa2() -> Callable:
    from flash_attn import flash_attn_func  # type: ignore

    return flash_attn_func


def _load_fa3() -> Callable:
    """FlashAttention-3's flash_attn_func: a local flash_attn_interface build first, else the kernels hub's build."""
    try:
        from flash_attn_interface import flash_attn_func  # type: ignore

        return flash_attn_func
    except ImportError as e:
        local = e
    try:
        from kernels import get_kernel  # type: ignore
    except ImportError as e:
        raise ImportError(f"no flash_attn_interface module ({local}) and no kernels package ({e})") from e
    return get_kernel(FA3_HUB_KERNEL).flash_attn_interface.flash_attn_func


def resolve_attention(requested: str, device, capability: tuple[int, int] | None = None) -> AttentionBackend:
    """--attention -> the backend of this process. Depends only on the device kind and the installed packages, so
    every rank of a run resolves alike. ``capability`` is the CUDA compute capability (default: the device's).

    auto = FA3 on a Hopper GPU (compute capability 9.x) when FA3 loads, else SDPA (the reason is returned). An
    explicit fa2/fa3 that cannot run here is an error naming --attention, never a silent SDPA."""
    allowed = ", ".join(ATTENTION_BACKENDS)
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention must be one of {allowed} (got {requested!r})")
    device = torch.device(device)
    if requested == "sdpa":
        return AttentionBackend()
    if device.type != "cuda":
        if requested == "auto":
            return AttentionBackend(reason=f"--attention auto: FA3 needs CUDA, this run is on {device.type}")
        raise ValueError(f"--attention {requested}: FlashAttention runs on CUDA GPUs only, this run is on "
                         f"{device.type}; use --attention sdpa or auto (allowed: {allowed})")
    major, minor = capability if capability is not None else torch.cuda.get_device_capability(device)
    want = "fa3" if requested == "auto" else requested
    if not (major == 9 if want == "fa3" else major >= 8):
        if requested == "auto":
            return AttentionBackend(reason=f"--attention auto: FA3 needs {ATTENTION_GPU['fa3']}, this GPU is "
                                           f"{major}.{minor}")
        raise ValueError(f"--attention {requested} needs {ATTENTION_GPU[want]}, this GPU is {major}.{minor}; "
                         f"use another of {allowed}")
    try:
        func = _load_fa2() if want == "fa2" else _load_fa3()
    except Exception as e:  # noqa: BLE001 - import errors, or the kernels hub's download/build errors
        if requested == "auto":
            return AttentionBackend(reason=f"--attention auto: FA3 could not be loaded ({e}); to use it: "
                                           f"{ATTENTION_INSTALL['fa3']}")
        raise ValueError(f"--attention {requested}: cannot load it ({e}); install {ATTENTION_INSTALL[want]}, "
                         f"or use another of {allowed}") from e
    return AttentionBackend(want, func, reason="--attention auto: a Hopper GPU and FA3" if requested == "auto" else "")


def attention_mask(pos: int, T: int, T_k: int, window: int | None, device) -> torch.Tensor:
    """(T, T_k) boolean mask of queries at positions pos..pos+T-1 over keys 0..T_k-1: key col is visible to query row
    iff 0 <= row - col <= window (no upper bound for window None, the full causal context)."""
    dist = (torch.arange(T, device=device)[:, None] + pos) - torch.arange(T_k, device=device)
    return dist >= 0 if window is None else (dist >= 0) & (dist <= window)


def causal_attention(q, k, v, kv_cache=None, layer_idx: int = 0, window: int | None = None) -> torch.Tensor:
    """Causal attention of q (B, T, H, d) over k, v (B, T, H_kv, d) -> (B, T, H, d), shared by every family.

    GQA: KV head j serves query heads j*H/H_kv ... (j+1)*H/H_kv - 1. The --attention backend (FlashAttention-2/3)
    for forwards without a KV cache on its device, else SDPA; with a KV cache the new k/v are appended first (in
    SDPA's autocast dtype under autocast) and the T new queries attend to the whole prefix, or on a windowed layer
    to the cached keys within their window only. ``window`` (window_left) limits each query to itself and the
    ``window`` keys before it (flash: window_size=(window, 0)); None, or a window reaching every key, is the plain
    causal path."""
    T = q.size(1)
    flash = _ATTENTION
    if flash.func is not None and kv_cache is None and q.device.type == flash.device_type:
        # FlashAttention takes 16-bit inputs only (QK-norm may have produced fp32 q/k); GQA is native
        dt = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        q, k, v_in = q.to(dt), k.to(dt), v.to(dt)
        if window is None or window >= T:
            y = flash.func(q, k, v_in, causal=True)
        else:
            y = flash.func(q, k, v_in, causal=True, window_size=(window, 0))
        y = y[0] if isinstance(y, tuple) else y  # some FA3 builds return (out, softmax_lse)
        return y.to(v.dtype)  # (B, T, H, d)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, d)
    gqa = q.size(1) != k.size(1)
    if kv_cache is None:
        if window is None or window >= T:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            mask = attention_mask(0, T, T, window, q.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    else:
        if torch.is_autocast_enabled(q.device.type):
            # SDPA is on autocast's lower-precision list (CPU and CUDA): it would cast q, k, v to the autocast dtype
            # anyway. Casting the new k/v before caching gives SDPA the same inputs and keeps the cache in that
            # dtype, instead of re-casting the whole fp32 prefix each step (under CUDA autocast QK-norm's rms_norm
            # returns fp32 k). float64 is left alone, as autocast leaves it.
            dt = torch.get_autocast_dtype(q.device.type)
            q, k, v = (t.to(dt) if t.dtype != torch.float64 else t for t in (q, k, v))
        k, v = kv_cache.update(layer_idx, k, v)  # views (B, kv_heads, pos+T, d) of the cache's storage
        pos = k.size(2) - T  # position of the first new query
        start = 0
        if window is not None:
            # keys before pos - window are outside every new query's window (they were masked out): leave them out
            start = max(0, pos - window)
            k, v = k[:, :, start:], v[:, :, start:]  # (B, kv_heads, pos+T-start, d)
        T_k = k.size(2)
        if window is not None and window >= T_k - 1:
            window = None  # every remaining key is within the window: row - col <= T_k - 1
        if T == 1 and window is None:
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        else:
            mask = attention_mask(pos - start, T, T_k, window, q.device)  # key col here is key start+col
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return y.transpose(1, 2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        # None = the full causal context; nanochat.numerics' reference mode sets L layers to sequence_len
        self.window = config.attention_windows[layer_idx]
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        C = config.n_embd
        self.c_q = nn.Linear(C, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(C, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(C, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(C, C, bias=False)

    def forward(self, xn, cos_sin, memory, mem_ctx, kv_cache):
        B, T, C = xn.shape
        q = self.c_q(xn).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(xn).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(xn).view(B, T, self.n_kv_head, self.head_dim)
        v = memory.value(self.layer_idx, xn, v, mem_ctx)  # memory injection into the value stream
        cos, sin = cos_sin
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = norm(q), norm(k)  # QK-norm after RoPE
        y = causal_attention(q, k, v, kv_cache, self.layer_idx, self.window)
        return self.c_proj(y.reshape(B, T, C))


class MLP(ReluSquaredMLP):
    def __init__(self, config: GPTConfig):
        super().__init__(config.n_embd, 4 * config.n_embd)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MoEFFN(config, layer_idx) if config.mlp == "moe" else MLP(config)

    def forward(self, x, cos_sin, memory, mem_ctx, kv_cache):
        h = x
        x = x + self.attn(norm(x), cos_sin, memory, mem_ctx, kv_cache)
        return x + memory.mlp_out(self.attn.layer_idx, h, self.mlp(norm(x)), mem_ctx)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        V, C = config.padded_vocab_size, config.n_embd
        self.wte = nn.Embedding(V, C)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.lm_head = nn.Linear(C, V, bias=False)
        self.resid_lambdas = nn.Parameter(torch.empty(config.n_layer))
        self.x0_lambdas = nn.Parameter(torch.empty(config.n_layer))
        self.memory = build_memory(config)
        owned = [i for i in range(config.n_layer) if self.memory.owns_ffn_up(i)]
        if owned:  # the relu^2 MLP has no separate up-projection to hand over
            raise ValueError(f"--memory {config.memory} replaces FFN up-projections (layers {owned}); the nanochat "
                             "backbone's relu^2 MLP has none: use a SwiGLU family (--model-type mobilellm|qwen3)")
        self.rotary_len = config.sequence_len * 10  # headroom for long CORE prompts and generation
        self.register_buffer("rope_cos", torch.empty(1, self.rotary_len, 1, config.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(1, self.rotary_len, 1, config.head_dim // 2), persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.config.sequence_len

    @torch.no_grad()
    def init_weights(self) -> None:
        C = self.config.n_embd
        s = math.sqrt(3.0) / math.sqrt(C)  # uniform bound with std 1/sqrt(C)
        nn.init.normal_(self.wte.weight, mean=0.0, std=1.0)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
                nn.init.uniform_(lin.weight, -s, s)
            block.mlp.init_weights(s)  # c_fc (every expert's, the router) uniform, c_proj zero
            nn.init.zeros_(block.attn.c_proj.weight)
        self.resid_lambdas.fill_(1.0)
        self.x0_lambdas.fill_(0.1)
        self.memory.init_weights()
        self.rope_cos.copy_(self._rotary()[0])
        self.rope_sin.copy_(self._rotary()[1])

    def _rotary(self):
        return rotary_tables(self.rotary_len, self.config.head_dim, self.rope_cos.device)

    def param_groups(self, oc: OptimConfig) -> list[dict]:
        """The optimizer groups (``nanochat.families.param_groups`` asks every model class for its own)."""
        return build_param_groups(self, oc)

    # -- accounting ---------------------------------------------------------------------------------------
    def memory_table_params(self) -> list[nn.Parameter]:
        return self.memory.memory_tables()

    def scalar_params(self) -> list[nn.Parameter]:
        return [self.resid_lambdas, self.x0_lambdas, *self.memory.scalar_params()]

    def num_params(self) -> dict[str, int]:
        """Stored counts (total = backbone + memory tables) and ``params_active``, the parameters one token uses
        (the appendix's "active/token": full embeddings, routers, dense and shared parameters, the K selected
        experts, and the memory table entries it reads, ``MemoryBlock.active_table_params``)."""
        total = sum(p.numel() for p in self.parameters())
        memory = sum(p.numel() for p in self.memory_table_params())
        inactive = inactive_expert_params(self) + memory - self.memory.active_table_params()
        return {"params_total": total, "params_memory": memory, "params_backbone": total - memory,
                "params_active": total - inactive}

    def estimate_flops(self) -> int:
        """FLOPs per token: 6 x (params minus wte, memory tables, scalars, unselected MoE experts) + attention
        12*H*d*min(window, T) per layer (reference §1.8; an L layer's window is T). MoE layers count their ACTIVE
        experts: stored ones would stop a FLOP target early."""
        excluded = {id(p) for p in [self.wte.weight, *self.memory_table_params(), *self.scalar_params()]}
        n = sum(p.numel() for p in self.parameters() if id(p) not in excluded) - inactive_expert_params(self)
        cfg = self.config
        T = cfg.sequence_len
        attn = sum(12 * cfg.n_head * cfg.head_dim * (T if w is None else min(w, T)) for w in cfg.attention_windows)
        return 6 * n + attn

    # -- forward ------------------------------------------------------------------------------------------
    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean", return_aux=False):
        """-> logits (B, T, V) without targets; else the LM loss, or (LM loss, auxiliary loss) with
        ``return_aux`` (the memory block's, a 0-dim zero when it has none; the trainer adds it before backward)."""
        B, T = idx.shape
        pos = kv_cache.pos if kv_cache is not None else 0
        if pos + T > self.rotary_len:
            raise ValueError(f"sequence of {pos + T} tokens exceeds the rotary cache ({self.rotary_len})")
        cos_sin = self.rope_cos[:, pos : pos + T], self.rope_sin[:, pos : pos + T]
        mem_ctx = self.memory.prepare(idx, kv_cache.memory_state if kv_cache is not None else None)
        x = norm(self.wte(idx))
        x0 = x
        for i, block in enumerate(self.blocks):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            x = self.memory.residual(i, x, mem_ctx)
            x = block(x, cos_sin, self.memory, mem_ctx, kv_cache)
        x = norm(x)
        if kv_cache is not None:
            kv_cache.advance(T)
        logits = self.lm_head(x)[..., : self.config.vocab_size].float()
        if torch.is_grad_enabled():
            logits = LOGIT_SOFTCAP * torch.tanh(logits / LOGIT_SOFTCAP)
        else:  # evaluation (CORE, bpb, sampling): in place, the same values without two more (B, T, V) float32
            # temporaries (the peak of a CORE batch); training cannot: autograd keeps tanh's output
            logits = logits.contiguous()  # a padded float32 head gives a strided slice: copied, as the other form did
            logits.div_(LOGIT_SOFTCAP).tanh_().mul_(LOGIT_SOFTCAP)
        if targets is None:
            return logits
        return lm_loss(logits, targets, loss_reduction, self.memory, mem_ctx, return_aux)


def lm_loss(logits, targets, loss_reduction: str, memory, mem_ctx, return_aux: bool):
    """Cross-entropy over (B, T, V) logits (targets -1 ignored), plus the memory block's auxiliary loss on request;
    shared by every family's forward."""
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                           reduction=loss_reduction)
    if not return_aux:
        return loss
    aux = memory.aux_loss(mem_ctx)
    return loss, (aux.float() if aux is not None else torch.zeros((), device=loss.device))


def build_model(config: GPTConfig, device: str | torch.device = "cpu", seed: int | None = None) -> GPT:
    """Build on the meta device, materialise on ``device`` and initialise (optionally seeded); any family."""
    from nanochat.families import build_model as build  # deferred: the families registry imports this module

    return build(config, device, seed)


def model_summary(config: GPTConfig) -> dict[str, int]:
    """params_total / params_memory / params_backbone / flops_per_token, computed on the meta device."""
    from nanochat.families import model_summary as summary

    return summary(config)
