"""The memory-block extension point.

A memory block is one ``nn.Module`` owned by the model (``model.memory``), whatever the backbone family
(``nanochat.families``). The model calls it at up to six places:

    ctx = memory.prepare(idx, state)            once per forward, before layer 0 (e.g. hash indices once)
    x   = memory.residual(layer, x, ctx)        every layer, before the block (nanochat: after the resid/x0 mix)
    v   = memory.value(layer, xn, v, ctx)       every layer, inside attention, before RoPE/SDPA
    u   = memory.ffn_up(layer, xn, ctx)         SwiGLU families only, on the layers where owns_ffn_up(layer):
                                                the block provides the FFN's up-projection output (STEM)
    dm  = memory.mlp_out(layer, h, dm, ctx)     every layer, on the FFN's output increment before it joins the
                                                residual; h is the block input (JTok multiplies, JTok-M adds)
    aux = memory.aux_loss(ctx)                  once per training forward, after the last layer: an auxiliary
                                                loss (e.g. JTok-M's load balance) the trainer adds to the LM loss

``idx`` is (B, T) token ids, ``x`` the (B, T, C) residual stream, ``xn`` the normed attention (or FFN) input and
``v`` the (B, T, H_kv, d) value heads before the GQA expansion. A block returns its inputs unchanged on layers it
does not touch. ``owns_ffn_up`` is asked once, when the backbone is built: the backbone then builds no
up-projection on those layers (the block's parameters replace it). Backbones without a gated FFN (nanochat's
relu^2 MLP) refuse blocks that own one.
``state`` is a dict carried by the KV cache across decode steps (None in training), e.g. the previous token
for bigram hashing.

A block also declares which of its parameters are memory tables (excluded from FLOPs, own AdamW group) and
which are scalars (x0-like AdamW group, excluded from FLOPs), and how many table parameters one token reads
(``active_table_params``: the memory part of the "active/token" count). Everything else it owns is routed by
shape: 2-D matrices to Muon, the rest to AdamW. See ``nanochat.optim.build_param_groups``.

Optional attributes, which callers look up with ``hasattr`` (a block without one opts out of that feature):
``capture`` (None; the analyses set a dict and the forward fills it through ``nanochat.memory.ve.record``, at
least ``gamma`` and ``inject_norm``, plus ``slots``/``weights`` for routing), ``route`` (marks a routing design
for scripts/analyze_routing.py and wic_probe.py, which also read ``H`` and ``M``), ``STATS_BUFFERS`` (names of
counters summed over the ranks before ``stats()`` and kept in checkpoints, on the block or any submodule),
``start_eval_loads``/``pop_eval_loads`` (slot selections counted during the final evaluation) and
``reference_gating`` (set by ``--numerics reference``). docs/extending.md describes each, and the registry lines.
"""

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn as nn


def default_memory_layers(n_layer: int) -> tuple[int, ...]:
    """Alternating layers ending at the last one (d12: 1,3,...,11; d24: 1,3,...,23)."""
    return tuple(i for i in range(n_layer) if i % 2 == (n_layer - 1) % 2)


def parse_options(options_cls, options: dict, memory: str):
    """Build a block's options dataclass from the config dict; unknown keys are an error."""
    known = {f.name for f in fields(options_cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"--memory {memory}: unknown option(s) {unknown}; allowed: {sorted(known)}")
    return options_cls(**options)


@dataclass
class NoOptions:
    pass


class MemoryBlock(nn.Module):
    """Base class and the no-memory block ("base")."""

    Options = NoOptions
    uses_layers = False  # whether --memory-layers applies
    table_weight_decay = 0.0  # default AdamW weight decay of this block's tables (overridable by --memory-wd)
    # options that steer training only (no forward depends on them): --init-from may change them, --resume may not
    training_options: tuple[str, ...] = ()

    def __init__(self, config):
        super().__init__()
        self.n_layer = config.n_layer
        self.opts = parse_options(self.Options, dict(config.memory_options), config.memory)
        self.layers: tuple[int, ...] = self.layers_of(config)

    @classmethod
    def default_layers(cls, n_layer: int) -> tuple[int, ...]:
        """The layers a block uses when --memory-layers is not given (a block may override this)."""
        return default_memory_layers(n_layer)

    @classmethod
    def layers_of(cls, config) -> tuple[int, ...]:
        """The layers this block uses under ``config``, ascending: --memory-layers in any order, else the default;
        () for a block without layers."""
        if not cls.uses_layers:
            return ()
        layers = tuple(config.memory_layers) if config.memory_layers else cls.default_layers(config.n_layer)
        bad = [i for i in layers if not 0 <= i < config.n_layer]
        if bad or not layers or len(set(layers)) != len(layers):
            raise ValueError(
                f"--memory-layers {','.join(map(str, layers))}: need distinct layer ids in [0, {config.n_layer - 1}]"
            )
        return tuple(sorted(layers))

    @classmethod
    def resolved_options(cls, config):
        """The options as the block builds and runs with them under ``config``: an option whose default stands for
        a derived value (``auto``, 0) holds that value. Two configs whose resolved options and layers are equal
        build the same block (what nanochat.init_from compares); a block with such an option overrides this."""
        return parse_options(cls.Options, dict(config.memory_options), config.memory)

    # -- parameters -------------------------------------------------------------------------------------
    def init_weights(self) -> None:
        """Set every parameter and buffer (the module was built on the meta device)."""

    def bind_tokenizer(self, tokenizer) -> None:
        """The trainer passes the run's tokenizer (None with --synthetic-data) right after ``init_weights``, e.g. for
        Engram's compression map; what it builds must be in the state dict, since a resume, eval or sampling
        gets it from the checkpoint (a resume loads the checkpoint after this call)."""

    def check_ready(self, training: bool = False) -> None:
        """Raise ValueError (naming the flag) if something the forward needs was neither built nor loaded from a
        checkpoint, e.g. a grouped MoME slot map whose file is missing. ``training``: the trainer asks before the
        first step, and then a file given by a flag must also agree with what a checkpoint supplied (evaluation
        uses the checkpoint's, whatever the file says now)."""

    def memory_tables(self) -> list[nn.Parameter]:
        return []

    def scalar_params(self) -> list[nn.Parameter]:
        return []

    def active_table_params(self) -> int:
        """Table parameters one token reads (the "active/token" count of ``GPT.num_params``; FLOPs never count
        tables). Default: one row of each table (VE, Bigram, STEM, JTok); a block that reads several rows of a
        table, or parts of a row, overrides it."""
        return sum(p.shape[-1] for p in self.memory_tables())

    # -- forward hooks ----------------------------------------------------------------------------------
    def prepare(self, idx: torch.Tensor, state: dict | None) -> Any:
        return None

    def residual(self, layer: int, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        return x

    def value(self, layer: int, xn: torch.Tensor, v: torch.Tensor, ctx: Any) -> torch.Tensor:
        return v

    def owns_ffn_up(self, layer: int) -> bool:
        """Whether this block replaces the FFN up-projection of ``layer`` (asked when the backbone is built)."""
        return False

    def ffn_up(self, layer: int, xn: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The (B, T, d_ffn) up-projection output on a layer this block owns; called only there."""
        raise NotImplementedError(f"{type(self).__name__} owns no FFN up-projection (layer {layer})")

    def mlp_out(self, layer: int, h: torch.Tensor, delta: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The FFN increment ``delta`` (B, T, C) of ``layer`` before ``x + delta``; ``h`` is the block input."""
        return delta

    def aux_loss(self, ctx: Any) -> torch.Tensor | None:
        """An auxiliary training loss built during this forward (None: the block has none)."""
        return None

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Called by the trainer once per optimizer step (e.g. MoME's loss-free balancing bias update)."""

    # -- logging ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Scalar statistics for metrics.jsonl (may sync with the device; called at log steps only)."""
        return {}
