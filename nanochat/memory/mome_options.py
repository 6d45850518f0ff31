"""MoME's options (the --mome-* flags) and their validation: every flag error is raised here, before any allocation.

Split from nanochat.memory.mome (the block itself); ``from nanochat.memory.mome import MoMEOptions`` keeps working.
"""

import math
from dataclasses import dataclass

from nanochat.cli_types import check_int_at_least

from .slot_index import ARITHMETIC_INDEXERS, check_arithmetic_options

GATES = ("sigmoid-norm", "softmax", "sigmoid", "softmax-norm")
INDEXERS = ("token", "grouped", "bigram", *ARITHMETIC_INDEXERS)
ROUTER_INPUTS = ("hidden", "value")
ROUTER_TYPES = ("linear", "conv1d")
ROUTINGS = ("context", "token-only", "fixed-random")
BALANCES = ("none", "bias", "trust-region")


def _choice(flag, value, allowed):
    if value not in allowed:
        raise ValueError(f"{flag} {value!r} is unknown; allowed: {', '.join(allowed)}")


def finite_number_at_least(flag: str, value, minimum: float, strict: bool = False) -> None:
    """A finite int or float (not a bool: a config file's true) >= ``minimum`` (> with ``strict``): an inf step makes
    the bias NaN where it meets a 0 (inf * 0), an inf eps switches a memory off, a nan weight a NaN loss."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (value > minimum if strict else value >= minimum):
        raise ValueError(f"{flag} must be a finite number {'>' if strict else '>='} {minimum} (got {value!r})")


@dataclass
class MoMEOptions:
    slots: int = 6  # M, --mome-slots
    topk: int = 2  # K, --mome-topk
    gate: str = "auto"  # auto = sigmoid-norm for K > 1, softmax for K == 1 (paper)
    router_input: str = "hidden"
    router_type: str = "linear"  # the reference's --moe-ve-gate-type: linear, or a causal conv1d over k positions
    conv_kernel_size: int = 4  # k of the conv1d router (the reference's --moe-ve-conv-kernel-size)
    index: str = "token"
    group_size: int = 1  # c_grp, grouped indexer only
    slot_map: str = ""  # grouped indexer only
    slot_map_sha256: str = ""  # content hash recorded at configuration time (checked on load)
    bigram_factor: int = 6  # n, bigram indexer only (N = n*V)
    rows: int = 0  # N, mod/headmod indexers only (required there; the CLI resolves --mome-slot-factor f into it)
    dedicated_size: int = 0  # D, headmod indexer only: tokens below D keep their own row
    routing: str = "context"
    balance: str = "none"
    balance_lr: float = 0.001
    balance_band: float = 1.4  # n, base of the trust region's power-law band (trust-region only)
    balance_min_visits: int = 0  # rows with fewer visits per update keep their bias; 0 = M (trust-region only)
    shared_expert: bool = False  # sigma of the authors' "sigma_K_E": an always-on d-wide row of n_t, weight 1
    per_head_table: bool = False  # the authors' moe_ve_per_head_table: each KV head its own N x M slots (x H rows)
    maxvio_window: int = 0  # W optimizer steps of the training-window slot MaxVio (0 = off; logging only)

    def __post_init__(self):
        check_int_at_least("--mome-slots", self.slots)
        check_int_at_least("--mome-topk", self.topk)
        if self.topk > self.slots:
            raise ValueError(f"--mome-topk {self.topk} exceeds --mome-slots {self.slots} (need K <= M)")
        if self.gate != "auto":
            _choice("--mome-gate", self.gate, GATES)
        _choice("--mome-router-input", self.router_input, ROUTER_INPUTS)
        _choice("--mome-index", self.index, INDEXERS)
        _choice("--mome-routing", self.routing, ROUTINGS)
        _choice("--mome-balance", self.balance, BALANCES)
        check_int_at_least("--mome-group-size", self.group_size)
        check_int_at_least("--mome-bigram-factor", self.bigram_factor)
        check_int_at_least("--mome-rows", self.rows, 0)
        check_int_at_least("--mome-dedicated-size", self.dedicated_size, 0)
        check_arithmetic_options(self.index, self.rows, self.dedicated_size)
        if self.index == "grouped":
            if self.slots % self.group_size:
                raise ValueError(f"--mome-slots {self.slots} must be a multiple of --mome-group-size "
                                 f"{self.group_size} (M = c_grp x the identity-indexed M)")
            if not self.slot_map:
                raise ValueError("--mome-index grouped needs --mome-slot-map FILE (see scripts/build_slot_map.py)")
        else:
            for flag, value, default in (("--mome-group-size", self.group_size, 1), ("--mome-slot-map", self.slot_map, "")):
                if value != default:
                    raise ValueError(f"{flag} only applies to --mome-index grouped (got --mome-index {self.index})")
        if self.index != "bigram" and self.bigram_factor != 6:
            raise ValueError(f"--mome-bigram-factor only applies to --mome-index bigram (got {self.index})")
        if self.routing != "context" and self.router_input != "hidden":
            raise ValueError(f"--mome-router-input only applies to --mome-routing context (got {self.routing})")
        _choice("--mome-router-type", self.router_type, ROUTER_TYPES)
        check_int_at_least("--mome-conv-kernel-size", self.conv_kernel_size)
        if self.router_type != "conv1d" and self.conv_kernel_size != 4:
            raise ValueError(f"--mome-conv-kernel-size only applies to --mome-router-type conv1d (got "
                             f"--mome-router-type {self.router_type})")
        if self.router_type != "linear" and self.routing != "context":
            # token-only routing looks its logits up per token and fixed-random has no router: nothing to convolve
            raise ValueError(f"--mome-router-type {self.router_type} only applies to --mome-routing context (got "
                             f"{self.routing}: token-only reads a per-token logit table, fixed-random has no router)")
        if self.balance != "none" and (self.routing == "fixed-random" or self.topk == self.slots):
            raise ValueError(f"--mome-balance {self.balance} needs a learned top-K selection (not fixed-random, "
                             "K < M)")
        finite_number_at_least("--mome-balance-lr", self.balance_lr, 0)  # inf: inf * 0 makes unmoved biases NaN
        # n < 1 would invert the band; n = 1 is M equal shares
        finite_number_at_least("--mome-balance-band", self.balance_band, 1)
        check_int_at_least("--mome-balance-min-visits", self.balance_min_visits, 0)
        check_int_at_least("--mome-maxvio-window", self.maxvio_window, 0)
        if self.maxvio_window and self.topk == self.slots:  # every slot is read: MaxVio is 0 by construction
            raise ValueError(f"--mome-maxvio-window needs K < M (got --mome-topk {self.topk} == --mome-slots "
                             f"{self.slots}: full routing reads every slot, so its MaxVio is always 0)")
        if not isinstance(self.shared_expert, bool):
            raise ValueError(f"--mome-shared-expert is a switch: true or false (got {self.shared_expert!r})")
        if self.shared_expert and self.routing != "context":
            # the spec defines the shared expert for the learned router only; the appendix's routing controls are
            # defined without it (fixed-random's parameter count is VE's by construction)
            raise ValueError(f"--mome-shared-expert only applies to --mome-routing context (got {self.routing})")
        if not isinstance(self.per_head_table, bool):
            raise ValueError(f"--mome-per-head-table is a switch: true or false (got {self.per_head_table!r})")
        if self.per_head_table and self.routing != "context":
            # the appendix's routing controls are defined on the shared table only (fixed-random's parameter count
            # is VE's by construction); the reference's per_head_table is an option of its learned router
            raise ValueError(f"--mome-per-head-table only applies to --mome-routing context (got {self.routing})")

    @property
    def gate_mode(self) -> str:
        if self.gate != "auto":
            return self.gate
        return "softmax" if self.topk == 1 else "sigmoid-norm"
