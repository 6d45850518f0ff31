"""Registry of memory blocks: ``--memory NAME`` -> block class. Adding a design = one module + one line.

Also the command-line surface shared by every script that builds a model: ``add_memory_args(parser)`` adds
``--memory``, ``--memory-layers`` and every block flag; ``memory_config_from_args(args)`` turns them into the
JSON-serialisable ``{memory, memory_layers, memory_options}`` that goes into ``GPTConfig(**...)`` and meta.json.
"""

import argparse
import warnings
from pathlib import Path

from .base import MemoryBlock, default_memory_layers
from .bigram import BigramMemory
from .engram import COMPRESSIONS, EngramMemory
from .jtok import JTokMemory, JTokMMemory
from .move_input import MoVEInputMemory
from .mome import MoMEMemory
from .mome_options import GATES, INDEXERS, ROUTER_INPUTS, ROUTER_TYPES, ROUTINGS, BALANCES
from .slot_index import resolve_rows
from nanochat.cli_types import dest_name
from nanochat.download import file_sha256
from .stem import STEMMemory
from .ve import ValueEmbedding

MEMORY_BLOCKS: dict[str, type[MemoryBlock]] = {
    "base": MemoryBlock,
    "ve": ValueEmbedding,
    "bigram": BigramMemory,
    "mome": MoMEMemory,
    "stem": STEMMemory,
    "engram": EngramMemory,
    "jtok": JTokMemory,
    "jtokm": JTokMMemory,
    "move_input": MoVEInputMemory,
}

# (block, flag, option key, argparse kwargs); the argparse default is the block's Options default.
BLOCK_FLAGS = [
    ("bigram", "--bigram-factor", "factor", dict(type=int, default=6, help="Bigram table rows = factor x vocab")),
    ("mome", "--mome-slots", "slots", dict(type=int, default=6, help="M, slots per row actually stored (with "
                                           "--mome-index grouped pass c_grp x the identity-indexed M)")),
    ("mome", "--mome-topk", "topk", dict(type=int, default=2, help="K, active slots per head (K == M: full routing)")),
    ("mome", "--mome-gate", "gate", dict(default="auto", choices=("auto", *GATES),
                                         help="auto = sigmoid-norm for K > 1, softmax for K == 1")),
    ("mome", "--mome-router-input", "router_input", dict(default="hidden", choices=ROUTER_INPUTS)),
    ("mome", "--mome-router-type", "router_type", dict(default="linear", choices=ROUTER_TYPES, help="conv1d: a "
                                                       "causal conv over the router inputs of the last k positions "
                                                       "(the reference's --moe-ve-gate-type)")),
    ("mome", "--mome-conv-kernel-size", "conv_kernel_size", dict(type=int, default=4, help="k of --mome-router-type "
                                                                 "conv1d (positions t-k+1..t)")),
    ("mome", "--mome-index", "index", dict(default="token", choices=INDEXERS)),
    ("mome", "--mome-group-size", "group_size", dict(type=int, default=1, help="c_grp of the slot map (grouped)")),
    ("mome", "--mome-slot-map", "slot_map", dict(default="", help="slot-map JSON (scripts/build_slot_map.py)")),
    ("mome", "--mome-bigram-factor", "bigram_factor", dict(type=int, default=6, help="n: N = n x vocab (bigram)")),
    ("mome", "--mome-rows", "rows", dict(type=int, default=0, help="N, table rows of --mome-index mod/headmod "
                                         "(0: ceil(V / --mome-slot-factor))")),
    # resolved into --mome-rows by memory_config_from_args (the config records N, not f)
    ("mome", "--mome-slot-factor", "slot_factor", dict(type=int, default=1, help="f (mod/headmod without "
                                                       "--mome-rows): N = ceil(V / f), V the tokenizer's vocab; "
                                                       "the reference's --moe-ve-slot-factor")),
    ("mome", "--mome-dedicated-size", "dedicated_size", dict(type=int, default=0, help="D (headmod): tokens "
                                                             "below D keep their own row, 0 < D < N")),
    ("mome", "--mome-routing", "routing", dict(default="context", choices=ROUTINGS)),
    ("mome", "--mome-balance", "balance", dict(default="none", choices=BALANCES)),
    ("mome", "--mome-balance-lr", "balance_lr", dict(type=float, default=0.001, help="step of the bias update")),
    ("mome", "--mome-balance-band", "balance_band", dict(type=float, default=1.4, help="trust-region: n, the band "
                                                         "of load shares is [q_(M-1), q_0], q_r ~ n^-r")),
    ("mome", "--mome-balance-min-visits", "balance_min_visits", dict(type=int, default=0, help="trust-region: rows "
                                                                     "with fewer visits per update keep their bias "
                                                                     "(0 = M)")),
    ("mome", "--mome-shared-expert", "shared_expert", dict(action="store_true", default=False, help="add the "
                                                           "authors' always-on shared expert: one more d-wide row "
                                                           "per n_t, weight 1, added to the routed mix")),
    ("mome", "--mome-per-head-table", "per_head_table", dict(action="store_true", default=False, help="the authors' "
                                                             "per-head tables: each KV head reads its own M slots "
                                                             "(H x the table rows; shared expert H x N rows)")),
    ("mome", "--mome-maxvio-window", "maxvio_window", dict(type=int, default=0, help="W > 0: log the slot MaxVio "
                                                           "of each window of W optimizer steps (per (layer, row, "
                                                           "head) over rows with >= M selections; the authors "
                                                           "count W forwards). Costs L x N x H x M int64 counters "
                                                           "(54 MiB at d12 A2/6, 1296 MiB at bigram n24) and one "
                                                           "all-reduce of them per window; 0 = off")),
    ("engram", "--engram-max-order", "max_order", dict(type=int, default=3, help="N: suffix n-grams of order 2..N")),
    ("engram", "--engram-heads", "heads", dict(type=int, default=8, help="K: hash heads (tables) per order")),
    ("engram", "--engram-dim", "dim", dict(type=int, default=0, help="d_mem per module (0 = n_embd)")),
    ("engram", "--engram-first-prime", "first_prime", dict(type=int, default=195131,
                                                            help="table sizes: the distinct primes >= this")),
    ("engram", "--engram-kernel", "kernel", dict(type=int, default=4, help="causal depthwise conv width")),
    ("engram", "--engram-compression", "compression", dict(default="tokenizer", choices=COMPRESSIONS,
                                                           help="vocabulary compression map P (identity: none)")),
    ("engram", "--engram-seed", "seed", dict(type=int, default=0, help="seed of the hash multipliers")),
    ("jtok", "--jtok-eps", "eps", dict(type=float, default=1e-6, help="eps of Norm(u) = u / (||u||_2 + eps)")),
    ("jtokm", "--jtokm-experts", "experts", dict(type=int, default=4, help="n_e, tables in each layer's pool")),
    ("jtokm", "--jtokm-topk", "topk", dict(type=int, default=2, help="K, tables mixed per token (K >= 2)")),
    ("jtokm", "--jtokm-aux-weight", "aux_weight", dict(type=float, default=1e-4,
                                                         help="lambda of the load-balance loss, per layer")),
    ("jtokm", "--jtokm-eps", "eps", dict(type=float, default=1e-6, help="eps of Norm(u) = u / (||u||_2 + eps)")),
    ("move_input", "--move-experts", "experts", dict(type=int, default=12, help="E, hash-routed experts shared by "
                                                      "all memory layers")),
    ("move_input", "--move-rank", "rank", dict(type=int, default=64, help="r, hidden width of each expert")),
]


def build_memory(config) -> MemoryBlock:
    if config.memory not in MEMORY_BLOCKS:
        raise ValueError(f"--memory {config.memory!r} is unknown; allowed: {', '.join(MEMORY_BLOCKS)}")
    return MEMORY_BLOCKS[config.memory](config)


def add_memory_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("memory block")
    g.add_argument("--memory", default="base", choices=tuple(MEMORY_BLOCKS), help="memory design")
    g.add_argument("--memory-layers", default="", help="comma-separated layer ids (default: alternating layers "
                                                       "ending at the last one, d12: 1,3,...,11)")
    for _, flag, _, kwargs in BLOCK_FLAGS:
        g.add_argument(flag, **kwargs)


def _parse_layers(text: str) -> list[int]:
    if not text.strip():
        return []
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--memory-layers {text!r}: expected comma-separated integers, e.g. 1,3,5") from None


# balancing flags -> the --mome-balance values they steer
BALANCE_FLAGS = {"--mome-balance-lr": ("bias", "trust-region"), "--mome-balance-band": ("trust-region",),
                 "--mome-balance-min-visits": ("trust-region",)}


def _refuse_inert_balance_flags(options: dict) -> None:
    """A balancing flag set without the --mome-balance it steers would change nothing: refuse it. Checked here, not
    in MoMEOptions: a checkpoint that recorded such an inert value must still load."""
    for _, flag, key, kwargs in BLOCK_FLAGS:
        steered = BALANCE_FLAGS.get(flag)
        if steered and options["balance"] not in steered and options[key] != kwargs["default"]:
            raise ValueError(f"{flag} {options[key]} only applies with --mome-balance {' or '.join(steered)} (got "
                             f"--mome-balance {options['balance']}); it would change nothing: drop it")


def memory_config_from_args(args, vocab_size: int | None = None) -> dict:
    """-> {"memory", "memory_layers", "memory_options"}; a flag of another block set to a non-default is an error.

    ``vocab_size`` (the tokenizer's, unpadded) resolves --mome-slot-factor f into the recorded --mome-rows
    N = ceil(V / f) (nanochat.memory.slot_index.resolve_rows); without it mod/headmod need --mome-rows.

    Files (the slot map) must exist, except under ``args.dry_run`` (a plan needs shapes, not contents),
    ``args.init_from`` and ``args.resume`` (the checkpoint carries the map)."""
    memory = args.memory
    if memory not in MEMORY_BLOCKS:
        raise ValueError(f"--memory {memory!r} is unknown; allowed: {', '.join(MEMORY_BLOCKS)}")
    layers = _parse_layers(args.memory_layers)
    if layers and not MEMORY_BLOCKS[memory].uses_layers:
        raise ValueError(f"--memory-layers does not apply to --memory {memory}")
    options = {}
    for block, flag, key, kwargs in BLOCK_FLAGS:
        value = getattr(args, dest_name(flag))
        if block == memory:
            options[key] = value
        elif value != kwargs["default"]:
            raise ValueError(f"{flag} only applies to --memory {block} (got --memory {memory})")
    if memory == "mome":
        _refuse_inert_balance_flags(options)
        given, factor = options["rows"], options.pop("slot_factor")
        options["rows"] = resolve_rows(options["index"], given, factor, vocab_size)
    if memory == "mome" and options["slot_map"]:
        path = Path(options["slot_map"]).resolve()
        options["slot_map"] = str(path)
        if path.is_file():
            options["slot_map_sha256"] = file_sha256(path)
        elif getattr(args, "init_from", None):
            pass  # the source checkpoint carries the map; check_ready refuses a source without one
        elif getattr(args, "resume", None) and not getattr(args, "dry_run", False):
            pass  # the run's checkpoint carries the map; a fresh start (--resume auto, none yet) is refused later
        elif getattr(args, "dry_run", False):  # shapes depend on the group size only (N = V / c rows)
            warnings.warn(f"--mome-slot-map {path} does not exist yet: fine for --dry-run (the table has V / "
                          f"--mome-group-size rows whatever the map), a real run needs the file "
                          f"(scripts/build_slot_map.py) unless it resumes a checkpoint, which carries the map")
        else:
            raise ValueError(f"--mome-slot-map {path}: file does not exist (build one with scripts/build_slot_map.py)")
    try:
        MEMORY_BLOCKS[memory].Options(**options)  # validate now: errors name the flag, before any model exists
    except ValueError as e:
        names_n = "--mome-rows" in str(e)  # e.g. D < N; the other errors do not involve N
        if memory == "mome" and options["rows"] != given and names_n:  # N came from the factor: say how
            raise ValueError(f"{e} (N = ceil(V / --mome-slot-factor f) = ceil({vocab_size} / {factor}) = "
                             f"{options['rows']})") from None
        raise
    return {"memory": memory, "memory_layers": layers, "memory_options": options}


__all__ = ["MEMORY_BLOCKS", "MemoryBlock", "build_memory", "default_memory_layers", "add_memory_args",
           "memory_config_from_args"]
