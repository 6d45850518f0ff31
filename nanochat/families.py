"""Backbone families: ``--model-type NAME`` -> config class, model class, geometry rules, optimizer groups.

| family | model file | per layer |
|---|---|---|
| ``nanochat`` | ``gpt.py`` | the paper's nanochat GPT (param-free norms, relu^2 MLP 4C, resid/x0 lambdas, softcap) |
| ``mobilellm`` | ``llama.py`` | Llama/MobileLLM: learnable RMSNorm 1e-5, GQA, interleaved RoPE, SwiGLU int(8C/3)->256 |
| ``qwen3`` | ``qwen3.py`` | Qwen3: explicit head_dim, per-head QK-norm before half-split RoPE, RMSNorm 1e-6, SwiGLU 3C |

Named sizes are flag presets, applied before a ``--config`` file and the command line (which override them):
``mobilellm-125m`` (30 x 576, 9/3 heads of 64, tied), ``mobilellm-350m`` (32 x 960, 15/5 heads, untied),
``qwen3-0.6b`` (28 x 1024, 16/8 heads of 128, tied); so are each family's recipe defaults (``FAMILY_RECIPES``,
``TABLE_RECIPES``: warmup, memory-table AdamW). Every model class is built on the meta device and
initialised by ``init_weights()``; it exposes ``config``, ``memory``, ``wte``, ``rotary_len``, ``max_seq_len``,
``num_params()``, ``estimate_flops()``, ``param_groups(oc)`` and ``forward(idx, targets=None, kv_cache=None,
loss_reduction)``. Adding a family = one model file + one ``FAMILIES`` line (+ a ``NAMED_SIZES`` line per size);
its config class's ``family`` must be the registry key (checked at import). docs/extending.md has the details.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

from nanochat.cli_types import flag_name
from nanochat.gpt import GPT, GPTConfig
from nanochat.llama import Llama, LlamaConfig, llama_ffn_hidden
from nanochat.memory import MEMORY_BLOCKS
from nanochat.memory.base import MemoryBlock
from nanochat.moe import FFN_FIELDS
from nanochat.optim import OptimConfig
from nanochat.qwen3 import Qwen3, Qwen3Config, qwen3_ffn_hidden


@dataclass(frozen=True)
class Family:
    config_cls: type
    model_cls: type
    ffn_rule: Callable[[int], int] | None  # F from C; None = no --ffn-dim / --tie-embeddings / --num-kv-heads
    head_dim_from_width: bool  # d = C/H (the --head-dim flag only picks H) or d = --head-dim (Qwen3)


FAMILIES: dict[str, Family] = {
    "nanochat": Family(GPTConfig, GPT, None, True),
    "mobilellm": Family(LlamaConfig, Llama, llama_ffn_hidden, True),
    "qwen3": Family(Qwen3Config, Qwen3, qwen3_ffn_hidden, False),
}

NAMED_SIZES: dict[str, tuple[str, dict]] = {  # geometry of the paper's families table (families spec §1)
    "mobilellm-125m": ("mobilellm", {"depth": 30, "model-dim": 576, "num-heads": 9, "num-kv-heads": 3, "head-dim": 64,
                                     "tie-embeddings": True}),
    "mobilellm-350m": ("mobilellm", {"depth": 32, "model-dim": 960, "num-heads": 15, "num-kv-heads": 5, "head-dim": 64,
                                     "tie-embeddings": False}),
    "qwen3-0.6b": ("qwen3", {"depth": 28, "model-dim": 1024, "num-heads": 16, "num-kv-heads": 8, "head-dim": 128,
                             "tie-embeddings": True}),
}


def model_types() -> tuple[str, ...]:
    """The ``--model-type`` values: every registered family, then the named sizes. Read when a parser is built, so a
    family registered at run time (a test, a notebook) is a choice like one added to ``FAMILIES`` in this file."""
    return (*FAMILIES, *NAMED_SIZES)


# The reference recipe's defaults per family (families spec §4-§7), also presets that flags override: Qwen3 warms
# up over 1% of the steps; MobileLLM's VE/MoME tables use AdamW lr 0.1 with betas (0.8, 0.95) (Qwen3 keeps the
# nanochat 0.2 / (0.8, 0.995)); STEM tables train like the embedding (lr 0.3, betas (0.8, 0.95), no decay).
# MoME's router input is not a preset, although every MobileLLM row of the paper routes from the values: it is a
# row setting (configs/families set --mome-router-input value), and a preset would refuse --mome-routing token-only.
FAMILY_RECIPES = {"qwen3": {"warmup-ratio": 0.01}}
TABLE_RECIPES = {("mobilellm", "ve"): {"memory-lr": 0.1, "memory-beta2": 0.95},
                 ("mobilellm", "mome"): {"memory-lr": 0.1, "memory-beta2": 0.95},
                 ("mobilellm", "stem"): {"memory-lr": 0.3, "memory-beta2": 0.95, "memory-wd": 0.0},
                 ("qwen3", "stem"): {"memory-lr": 0.3, "memory-beta2": 0.95, "memory-wd": 0.0}}


def family_name(model_type: str) -> str:
    if model_type in NAMED_SIZES:
        return NAMED_SIZES[model_type][0]
    if model_type not in FAMILIES:
        raise ValueError(f"--model-type {model_type!r} is unknown; allowed: {', '.join(model_types())}")
    return model_type


def _presets(model_type: str, memory: str) -> list[tuple[str, dict]]:
    """(label, {flag: value}) of each preset a model type brings, in the order they apply."""
    family = family_name(model_type)
    return [(f"--model-type {model_type}", NAMED_SIZES.get(model_type, ("", {}))[1]),
            (f"{family} recipe", FAMILY_RECIPES.get(family, {})),
            (f"{family} tables of --memory {memory}", TABLE_RECIPES.get((family, memory), {}))]


def _flag_tokens(key: str, value) -> list[str]:
    return [f"--{key}" if value else f"--no-{key}"] if isinstance(value, bool) else [f"--{key}", str(value)]


def preset_tokens(model_type: str, memory: str = "base") -> list[str]:
    """Command-line tokens of the defaults a model type brings: a named size's geometry and the family's recipe
    (for this memory block). Unknown model types give none (argparse reports them)."""
    if model_type not in model_types():
        return []
    return [token for _, preset in _presets(model_type, memory) for key, value in preset.items()
            for token in _flag_tokens(key, value)]


def preset_lines(args) -> list[str]:
    """What ``preset_tokens`` applied to this run, for base_train's start and --dry-run: each preset's flags (a value
    that a --config file or the command line replaced says so), and a line when the family has table presets for
    other designs but none for --memory (its tables then train at the flags' memory AdamW, not a family preset)."""
    lines = []
    for label, preset in _presets(args.model_type, args.memory):
        if preset:
            lines.append(f"{'presets':>26}: {label}: " + ", ".join(_preset_flag(args, k, v) for k, v in preset.items()))
    family = family_name(args.model_type)
    others = [memory for fam, memory in TABLE_RECIPES if fam == family and memory != args.memory]
    if others and (family, args.memory) not in TABLE_RECIPES and _has_tables(args.memory):
        lines.append(f"{'presets':>26}: no table preset for --memory {args.memory} on {family} (it has presets for "
                     f"--memory {', '.join(others)}); its memory AdamW is the flags' (--memory-lr, --memory-beta2, "
                     "--memory-wd)")
    return lines


def _has_tables(memory: str) -> bool:
    """Whether the design declares memory tables (a block class that keeps MemoryBlock's empty list has none, e.g.
    base: no memory AdamW for a table preset to set)."""
    block = MEMORY_BLOCKS.get(memory)
    return block is not None and block.memory_tables is not MemoryBlock.memory_tables


def _preset_flag(args, key: str, value) -> str:
    shown = " ".join(_flag_tokens(key, value))
    given = getattr(args, key.replace("-", "_"))
    return shown if given == value else f"{shown} (overridden: {given})"


def check_families() -> None:
    """Each family's config class names its registry key (``config_cls.family``: what meta.json records and
    ``family_of`` dispatches on); a subclass that forgot to override it would build, save and reload as its parent."""
    for name, fam in FAMILIES.items():
        _check_family(name, fam)


def _check_family(name: str, fam: Family) -> None:
    if fam.config_cls.family != name:
        raise ValueError(f"families.FAMILIES[{name!r}]: {fam.config_cls.__name__}.family is "
                         f"{fam.config_cls.family!r}; set it to {name!r} (the registry key)")


def _registered(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model config names an unknown family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(config) -> Family:
    family = _registered(config.family)
    registered = next((key for key, fam in FAMILIES.items() if fam.config_cls is type(config)), config.family)
    _check_family(registered, FAMILIES[registered])
    return family


def config_from_args(args, vocab_size: int, memory: dict):
    """The model config of the parsed base_train flags (``memory`` = ``memory_config_from_args(args, vocab_size)``)."""
    name = family_name(args.model_type)
    fam = FAMILIES[name]
    common = dict(sequence_len=args.max_seq_len, vocab_size=vocab_size, **memory)
    ffn = {key: getattr(args, key) for key in FFN_FIELDS}  # --mlp, --moe-*: the nanochat GPT's FFN
    if fam.ffn_rule is None:
        common.update(ffn, window_pattern=args.window_pattern)
    else:
        if set(args.window_pattern) != {"L"}:
            raise ValueError(f"--window-pattern {args.window_pattern}: --model-type {name} attends to the full causal "
                             "context in every layer (as the reference's, which ignores window_pattern); sliding "
                             "windows are a --model-type nanochat option (allowed here: L)")
        defaults = {f.name: f.default for f in fields(GPTConfig)}
        changed = [flag_name(k) for k, v in ffn.items() if v != defaults[k]]
        if changed:
            raise ValueError(f"{', '.join(changed)}: the MoE FFN is a --model-type nanochat option (relu^2 experts); "
                             f"--model-type {name} has a SwiGLU FFN")
    if fam.ffn_rule is None:
        for flag, value in (("--num-kv-heads", args.num_kv_heads), ("--ffn-dim", args.ffn_dim),
                            ("--tie-embeddings", args.tie_embeddings)):
            if value not in (-1, None):
                raise ValueError(f"{flag} does not apply to --model-type {name} (MHA, 4C relu^2 MLP, untied head)")
        if args.model_dim == -1:
            return fam.config_cls.from_depth(args.depth, args.aspect_ratio, args.head_dim, **common)
        heads = args.num_heads if args.num_heads != -1 else args.model_dim // args.head_dim
        return fam.config_cls(n_layer=args.depth, n_head=heads, n_kv_head=heads, n_embd=args.model_dim, **common)
    width = args.model_dim if args.model_dim != -1 else math.ceil(args.depth * args.aspect_ratio / args.head_dim) * args.head_dim
    heads = args.num_heads if args.num_heads != -1 else width // args.head_dim
    if fam.head_dim_from_width:
        if width % heads:
            raise ValueError(f"--model-type {name}: --model-dim {width} is not divisible by --num-heads {heads}")
        head_dim = width // heads
    else:
        head_dim = args.head_dim
    kv_heads = args.num_kv_heads if args.num_kv_heads != -1 else heads
    if heads % kv_heads:
        raise ValueError(f"--num-heads {heads} is not divisible by --num-kv-heads {kv_heads}")
    return fam.config_cls(n_layer=args.depth, n_embd=width, n_head=heads, n_kv_head=kv_heads, head_dim=head_dim,
                          ffn_hidden=args.ffn_dim if args.ffn_dim != -1 else fam.ffn_rule(width),
                          tie_embeddings=True if args.tie_embeddings is None else args.tie_embeddings, **common)


def config_from_dict(d: dict):
    """Inverse of ``config.to_dict()`` (checkpoint meta.json); a dict without "family" is a nanochat GPT."""
    cls = _registered(d.get("family", GPTConfig.family)).config_cls
    if "family" not in {f.name for f in fields(cls)}:  # a class constant (the GPT configs), not a field
        d = {k: v for k, v in d.items() if k != "family"}
    return cls(**d)


# torch's random inits of nn.Linear (kaiming_uniform_, then uniform_ for a bias) and nn.Embedding (normal_)
_RANDOM_INITS = (torch.nn.init.normal_, torch.Tensor.normal_, torch.nn.init.kaiming_uniform_, torch.nn.init.uniform_,
                 torch.Tensor.uniform_)


class _NoRandomInitOnMeta(torch.overrides.TorchFunctionMode):
    """torch's random inits on a meta tensor are no-ops here: a meta tensor holds no values (init_weights sets every
    one after to_empty), and on meta they run torch's Python references: normal_'s wrapper imports torch._dynamo
    (~2.5 s of CPU in a process that never compiles: a dry run, an eval), and nn.Linear's kaiming_uniform_ took ~5
    of the 18 s of a --plan check of every config row."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_INITS:
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def meta_device():
    with torch.device("meta"), _NoRandomInitOnMeta():
        yield


def build_model(config, device: str | torch.device = "cpu", seed: int | None = None):
    """Build on the meta device, materialise on ``device`` and initialise (optionally seeded)."""
    with meta_device():
        model = family_of(config).model_cls(config)
    model.to_empty(device=device)
    if seed is not None:
        torch.manual_seed(seed)
    model.init_weights()
    return model


def model_summary(config) -> dict[str, int]:
    """params_total / params_memory / params_backbone / flops_per_token, computed on the meta device."""
    with meta_device():
        model = family_of(config).model_cls(config)
    return {**model.num_params(), "flops_per_token": model.estimate_flops()}


def param_groups(model, oc: OptimConfig) -> list[dict]:
    """The optimizer groups of ``model`` (every model class has ``param_groups(oc)``; nanochat's GPT:
    optim.build_param_groups)."""
    return model.param_groups(oc)


def optimizer_fields_without_effect(config, oc: OptimConfig, names) -> list[str]:
    """The fields among ``names`` that no optimizer group of ``config``'s model reads (e.g. ``memory_lr`` without
    memory tables, ``scalar_lr`` on a family whose memory block has no scalars, ``embedding_lr`` with a tied
    head): the groups' hyperparameters come out the same for another value. Built on the meta device."""
    with meta_device():
        model = family_of(config).model_cls(config)

    def hyperparameters(o: OptimConfig) -> list[dict]:
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": len(g["params"])}
                for g in param_groups(model, o)]

    def another_value(v) -> float:  # always differs from v by 0.5, and keeps a beta in [0, 1]
        v = v or 0.0
        return v - 0.5 if v >= 0.5 else v + 0.5

    used = hyperparameters(oc)
    return [name for name in names if hyperparameters(replace(oc, **{name: another_value(getattr(oc, name))})) == used]


check_families()  # at import: a mis-registered family fails before any run starts
