"""The authors' checkpoint format <-> ours: model config, parameter names, and their files on disk.

Their checkpoint directory (reference spec: training §1.8) holds ``model_<step:06d>.pt`` (state_dict of the
uncompiled model, keys possibly prefixed ``_orig_mod.``, some tensors bf16) and ``meta_<step:06d>.json`` with
``model_type`` and ``model_config`` (their GPTConfig kwargs). ``../shared/spec/reference_checkpoint_names.md``
gives the verified one-to-one name mapping used here; every parameter keeps its shape, so converting is a rename
plus an exact upcast to fp32.

A design field we cannot express exactly or whose parameter layout is unverified (a conv1d router: ours has one,
but their names and kernel layout are unknown; a shared expert without routed slots; a moving balancing bias;
...) is refused by its field name; nothing is approximated. The ``table`` slot mapping
(the paper's d12 grouped rows) is our grouped index; its slot-map JSON lives outside their checkpoint
(nanochat.reference_slot_map). Their ``mod``/``headmod`` mappings are our indexers of the same names; their
shared expert and per-head tables are ours too, under parameter names the spec's table does not give (inferred).
Fields that only steer training-time machinery their checkpoints do not carry (the router-bias buffer is not
saved and is never used in eval) are accepted only at values where that machinery is inert.
"""

import json
import re
from dataclasses import asdict
from pathlib import Path

import torch

from nanochat.families import meta_device
from nanochat.gpt import GPT, GPTConfig
from nanochat.memory import MEMORY_BLOCKS, default_memory_layers
from nanochat.memory.mome import MoMEOptions
from nanochat.memory.slot_index import ARITHMETIC_INDEXERS

COMPILE_PREFIX = "_orig_mod."
ROTARY_KEYS = ("cos", "sin")  # their rotary tables; recomputed by our model, never stored
# their MoME layers' balance bookkeeping (load and MaxVio metrics; the selection bias, read by training forwards
# only): no effect on what an imported model computes; the spec calls router_bias non-persistent and does not say
# for the metric buffers, so a checkpoint may carry them
BOOKKEEPING_BUFFERS = ("router_bias", "maxvio_counts", "last_load", "last_maxvio")
MODEL_TYPES = ("gpt", "bigram_engram_gpt")
META_FILE_RE = re.compile(r"^meta_(\d+)\.json$")
SLOT_MAP_KEY = "memory.slot_map"  # our grouped index's map: a buffer in our state dict, a JSON file beside theirs
# The always-on shared expert's table (their "1_K_E"). The spec (reference_checkpoint_names.md) names only the
# routed tables; these names are INFERRED from them (their module builds the shared table beside
# `routed_embedding`, and the network-shared pair at the container level, §3.1): not verified on a real checkpoint.
# An import whose names differ fails naming the missing and unknown keys.
SHARED_EXPERT_LAYER = "embed_value_moe.layers.{pos}.shared_embedding.weight"
SHARED_EXPERT_NETWORK = "embed_value_moe.network_shared_shared_embedding.weight"
# Per-head tables (their moe_ve_per_head_table): the spec (model notes §3.3) gives the layout, routed row
# (slot*H + h)*E + e of S*H*E rows and shared expert (S*H, d), which is ours ((n*H + h)*M + a; n*H + h), so the
# tables convert by the same rename. That they keep the names above with the larger shape is INFERRED (the name
# table does not mention per-head tables: their module builds the same embeddings with H times the rows).

# Their conv1d router (moe_ve_gate_type conv1d): ours has it (--mome-router-type conv1d), but the spec gives neither
# its parameter names nor its kernel layout (which input position each tap reads, the order of the H*E outputs), and
# a 3-D kernel under the linear router's names would load without error and compute something else if either
# differs. So it is refused both ways until a real checkpoint or their code settles them.
CONV_ROUTER_UNVERIFIED = ("their conv1d router's parameter names and kernel layout are not in the verified name "
                          "table (reference_checkpoint_names.md): refused rather than imported or exported under "
                          "guessed names (ours trains it with --mome-router-type conv1d)")


def _dropped(key: str) -> bool:
    """Their keys that carry nothing our model computes with: rotary tables and MoME balance bookkeeping."""
    return key in ROTARY_KEYS or (key.startswith("embed_value_moe.") and key.rsplit(".", 1)[-1] in BOOKKEEPING_BUFFERS)

# Their GPTConfig fields with their defaults (reference spec: model §1.1). A field missing from a meta file takes
# this default, as their own loader would; a field not listed here is refused, except stem_* (read only by their
# other model types, which are refused by model_type).
REFERENCE_DEFAULTS = {
    "sequence_len": 2048, "vocab_size": 32768, "n_layer": 12, "n_head": 6, "n_kv_head": 6, "n_embd": 768,
    "head_dim": 0, "weight_tying": False, "window_pattern": "SSSL", "value_embeds_layers": [],
    "dense_ve_enabled": False, "moe_ve_enabled": False, "moe_ve_per_head_table": False,
    "moe_ve_network_shared_table": False, "moe_ve_setting": "1_0_0", "moe_ve_gate_nl": "sigmoid",
    "moe_ve_gate_type": "linear", "moe_ve_conv_kernel_size": 4, "moe_ve_router_input": "value",
    "moe_ve_balance_lr": 0.001, "moe_balance_mode": "bias", "moe_ve_bias_scope": "slot",
    "moe_ve_bias_update": "deepseek_moe", "moe_ve_bias_min_visits": 0, "moe_ve_bias_powerlaw_n": 1.4,
    "moe_ve_maxvio_window": 0, "moe_ve_slot_mapping": "none", "moe_ve_slot_index_mode": "token",
    "moe_ve_bigram_slot_factor": 1, "moe_ve_slot_vocab_size": 0, "moe_ve_slot_dedicated_size": 0,
    "moe_ve_slot_map_path": "", "bigram_engram_enabled": False, "bigram_engram_layers": [],
    "bigram_engram_vocab_factor": 6, "bigram_engram_gate_channels": 32, "bigram_engram_init_lambda": 0.1,
}
BIAS_UPDATES = ("none", "deepseek_moe", "trust_region")  # their --moe-ve-bias-update choices
GATE_NLS = ("sigmoid", "sigmoid-norm", "softmax", "softmax-norm")  # same forward AND backward as ours
GATE_CHANNELS = 32


class ReferenceFormatError(ValueError):
    """Their files cannot be converted exactly; the message names the field, key or file."""


class SeveralCheckpointFolders(ReferenceFormatError):
    """``find_meta`` found meta files in more than one folder (``folders``); the caller says how to pick one."""

    def __init__(self, message: str, folders: list[Path]):
        super().__init__(message)
        self.folders = folders


# -- model config -------------------------------------------------------------------------------------------
def _refuse(field, value, why):
    raise ReferenceFormatError(f"model_config {field}={value!r}: {why}")


def _is_int(value) -> bool:
    return type(value) is int  # JSON true/false are bools, 4.0 a float: neither builds their model


def _is_number(value) -> bool:
    return type(value) in (int, float)


def _window_pattern(pattern) -> str:
    """Their window_pattern as ours (--window-pattern): the same L/S letters, tiled the same way with the last layer
    forced to L, and the same windows (L: the context, S: sequence_len // 2); their code upper-cases it."""
    if not isinstance(pattern, str) or not pattern or set(pattern.upper()) - {"S", "L"}:
        _refuse("window_pattern", pattern, "expected a non-empty string of L/S")
    return pattern.upper()


def parse_moe_setting(setting: str) -> tuple[int, int, int]:
    """'σ_K_E' -> (shared expert on/off, K, E); '' means (1, 0, 0) as in their parser."""
    if not isinstance(setting, str):
        _refuse("moe_ve_setting", setting, "expected 'shared_active_experts', e.g. '0_2_12'")
    if setting == "":
        return 1, 0, 0
    try:
        shared, k, e = (int(t) for t in setting.split("_"))
    except ValueError:
        _refuse("moe_ve_setting", setting, "expected 'shared_active_experts', e.g. '0_2_12'")
    return shared, k, e


def _layers(cfg: dict, field: str) -> list[int]:
    layers = cfg[field]
    if not isinstance(layers, list) or not all(type(i) is int for i in layers):
        _refuse(field, layers, "expected a list of layer ids")
    if layers != sorted(set(layers)):  # memory positions follow this order; only the increasing one is verified
        _refuse(field, layers, "expected strictly increasing layer ids")
    if any(not 0 <= i < cfg["n_layer"] for i in layers):
        _refuse(field, layers, f"layer ids must lie in [0, {cfg['n_layer'] - 1}] (n_layer {cfg['n_layer']})")
    # the default layout is stored as () (ours: "default"), so that export -> import gives back the same config
    return [] if layers == list(default_memory_layers(cfg["n_layer"])) else layers


def _table_options(cfg: dict, experts: int, slot_map: tuple[str, str] | None) -> dict:
    """Our grouped-index options for their ``table`` slot mapping (reference notes §3.4: slot = map[token]).

    Their GPTConfig has no slot-factor field: base_train resolves S (= ceil(V/f)) into moe_ve_slot_vocab_size, and
    the routed table has S*E rows (§3.2-3.3). Ours has exactly V/c rows of c tokens each, so the import is exact
    when S divides V (c = V/S); a world-size-padded S (rows no token reads) is refused, not cut off.
    ``slot_map`` = (path, sha256) of the JSON, which their checkpoint does not carry."""
    vocab = cfg["vocab_size"]
    slots = cfg["moe_ve_slot_vocab_size"] or GPTConfig(vocab_size=vocab).padded_vocab_size  # 0 means V (§1.1)
    if not (isinstance(slots, int) and 0 < slots <= vocab and vocab % slots == 0):
        _refuse("moe_ve_slot_vocab_size", cfg["moe_ve_slot_vocab_size"], f"with moe_ve_slot_mapping 'table' the "
                f"slot count S must divide vocab_size {vocab} (ours groups exactly c = V/S tokens per slot; a "
                "world-size-padded S is not supported)")
    group = vocab // slots
    if experts % group:
        _refuse("moe_ve_setting", cfg["moe_ve_setting"], f"E={experts} is not a multiple of the group size c = "
                f"vocab_size/moe_ve_slot_vocab_size = {group} (ours needs M = c x the identity-indexed M, as "
                "every paper row has)")
    if slot_map is None:
        _refuse("moe_ve_slot_mapping", "table", "needs the slot-map JSON, which is not in the checkpoint "
                "(import_reference --slot-map FILE)")
    return {"index": "grouped", "group_size": group, "slot_map": slot_map[0], "slot_map_sha256": slot_map[1]}


def _arithmetic_options(cfg: dict) -> dict:
    """Our mod/headmod index options for their mapping of the same name (reference notes §3.4: slot = tok mod S;
    headmod: tok below D, else D + ((tok - D) mod (S - D))). Their meta holds the S their base_train resolved
    (the explicit size or ceil(V/f), padded for the world size; 0 = the padded vocab, §1.1/§3.1): the module maps
    with that S and the routed table has S*E rows, so ours takes it as --mome-rows and is exact for any S, padded
    or not. The factor itself stays in the meta's user_config (the CLI args), which their loader does not read."""
    mapping = cfg["moe_ve_slot_mapping"]
    padded = GPTConfig(vocab_size=cfg["vocab_size"]).padded_vocab_size
    slots = cfg["moe_ve_slot_vocab_size"] or padded
    if not (isinstance(slots, int) and 0 < slots <= padded):
        _refuse("moe_ve_slot_vocab_size", cfg["moe_ve_slot_vocab_size"], f"with moe_ve_slot_mapping {mapping!r} "
                f"the slot count S must be an integer in 1..{padded} (the padded vocab size; their module check)")
    dedicated = cfg["moe_ve_slot_dedicated_size"]
    if mapping == "headmod" and not (isinstance(dedicated, int) and 0 < dedicated < slots):
        _refuse("moe_ve_slot_dedicated_size", dedicated, f"headmod needs 0 < D < S = {slots}")
    return {"index": mapping, "rows": slots, "dedicated_size": dedicated if mapping == "headmod" else 0}


def _mome_options(cfg: dict, slot_map: tuple[str, str] | None = None) -> dict:
    shared, k, e = parse_moe_setting(cfg["moe_ve_setting"])
    if shared not in (0, 1):
        _refuse("moe_ve_setting", cfg["moe_ve_setting"], "the shared-expert field is 0 or 1")
    if shared and k == 0:
        _refuse("moe_ve_setting", cfg["moe_ve_setting"], "a shared expert without routed slots (K = 0) is not "
                "supported; ours needs 1 <= K <= E (then the first field 1 imports as --mome-shared-expert)")
    if not 1 <= k <= e:
        _refuse("moe_ve_setting", cfg["moe_ve_setting"], "need 1 <= K <= E")
    if cfg["moe_ve_gate_nl"] not in GATE_NLS:
        _refuse("moe_ve_gate_nl", cfg["moe_ve_gate_nl"], f"supported: {', '.join(GATE_NLS)} "
                "(softmax-norm-detach has a different gradient)")
    if cfg["moe_ve_gate_type"] == "conv1d":
        _refuse("moe_ve_gate_type", "conv1d", CONV_ROUTER_UNVERIFIED)
    if cfg["moe_ve_gate_type"] != "linear":
        _refuse("moe_ve_gate_type", cfg["moe_ve_gate_type"], "expected linear or conv1d")
    if cfg["moe_ve_router_input"] not in ("hidden", "value"):
        _refuse("moe_ve_router_input", cfg["moe_ve_router_input"], "expected hidden or value")
    if not isinstance(cfg["moe_ve_per_head_table"], bool):
        _refuse("moe_ve_per_head_table", cfg["moe_ve_per_head_table"], "expected true or false")
    if cfg["moe_ve_slot_mapping"] not in ("none", "table", *ARITHMETIC_INDEXERS):
        _refuse("moe_ve_slot_mapping", cfg["moe_ve_slot_mapping"], "expected none, mod, headmod or table")
    if cfg["moe_ve_slot_mapping"] != "none" and cfg["moe_ve_slot_index_mode"] != "token":
        _refuse("moe_ve_slot_mapping", cfg["moe_ve_slot_mapping"], f"with moe_ve_slot_index_mode "
                f"{cfg['moe_ve_slot_index_mode']!r}: their trainer maps only the token index through a slot mapping")
    if cfg["moe_ve_slot_dedicated_size"] and cfg["moe_ve_slot_mapping"] != "headmod":
        _refuse("moe_ve_slot_dedicated_size", cfg["moe_ve_slot_dedicated_size"], "headmod only; must be 0")
    if cfg["moe_balance_mode"] != "bias":
        _refuse("moe_balance_mode", cfg["moe_balance_mode"], "only 'bias' exists in their trainer")
    if not _is_number(cfg["moe_ve_balance_lr"]):
        _refuse("moe_ve_balance_lr", cfg["moe_ve_balance_lr"], "expected a number")
    if cfg["moe_ve_bias_update"] not in BIAS_UPDATES:
        _refuse("moe_ve_bias_update", cfg["moe_ve_bias_update"], f"expected one of {', '.join(BIAS_UPDATES)}")
    index = cfg["moe_ve_slot_index_mode"]
    if index not in ("token", "bigram"):
        _refuse("moe_ve_slot_index_mode", index, "expected token or bigram")
    if index == "bigram" and not (isinstance(cfg["moe_ve_bigram_slot_factor"], int)
                                  and cfg["moe_ve_bigram_slot_factor"] >= 1):
        _refuse("moe_ve_bigram_slot_factor", cfg["moe_ve_bigram_slot_factor"], "must be an integer >= 1")
    shared_table = bool(cfg["moe_ve_network_shared_table"])
    if shared_table != (index == "bigram"):
        _refuse("moe_ve_network_shared_table", shared_table, f"with moe_ve_slot_index_mode {index}: ours has "
                "per-layer tables for the token index and one network-shared table for the bigram index")
    options = {"slots": e, "topk": k, "gate": cfg["moe_ve_gate_nl"], "router_input": cfg["moe_ve_router_input"],
               "index": index, "shared_expert": bool(shared), "per_head_table": cfg["moe_ve_per_head_table"]}
    if cfg["moe_ve_slot_mapping"] == "table":
        options.update(_table_options(cfg, e, slot_map))
    if cfg["moe_ve_slot_mapping"] in ARITHMETIC_INDEXERS:
        options.update(_arithmetic_options(cfg))
    if MoMEOptions(**{**options, "gate": "auto"}).gate_mode == options["gate"]:
        options["gate"] = "auto"  # the paper's rule picks the same gate; keeps export -> import exact
    rows = cfg["vocab_size"] * cfg["moe_ve_bigram_slot_factor"] if index == "bigram" else None
    if index == "bigram":
        options["bigram_factor"] = cfg["moe_ve_bigram_slot_factor"]
    options = asdict(MoMEOptions(**options))  # every option spelled out, as base_train records them
    slot_vocab = cfg["moe_ve_slot_vocab_size"]
    if options["index"] in ("grouped", *ARITHMETIC_INDEXERS):
        return options  # S checked by _table_options / _arithmetic_options
    if slot_vocab and slot_vocab != (rows or GPTConfig(vocab_size=cfg["vocab_size"]).padded_vocab_size):
        _refuse("moe_ve_slot_vocab_size", slot_vocab, "differs from the slot count of the index (world-size "
                "padding of S is not supported)")
    return options


def moving_bias_note(model_config: dict) -> str:
    """What an import of a MoME trained with their moving router bias (bias update on, balance lr > 0: their CLI's
    default, no paper run) should say: the bias is non-persistent and added only in training forwards (spec model
    §3.6), so their evaluation routes without it, as the imported model (--mome-balance none) does; the weights came
    from training with it. "" otherwise."""
    cfg = {**REFERENCE_DEFAULTS, **model_config}
    if not cfg["moe_ve_enabled"] or cfg["moe_ve_bias_update"] == "none" or not cfg["moe_ve_balance_lr"] > 0:
        return ""
    return (f"note: trained with their moving router bias (moe_ve_bias_update {cfg['moe_ve_bias_update']!r}, "
            f"moe_ve_balance_lr {cfg['moe_ve_balance_lr']}); the bias is not in their checkpoint and their evaluation "
            "routes without it, as this import does (--mome-balance none): evaluations are exact. Training on from it "
            "(--init-from) starts without a bias, as their own resume does; pass --mome-balance bias to move one "
            "(ours updates once per optimizer step, theirs once per micro-batch forward)")


def config_from_reference(model_type: str, model_config: dict, slot_map: tuple[str, str] | None = None) -> GPTConfig:
    """Our GPTConfig for their (model_type, model_config); refuses anything not exactly representable.
    ``slot_map``: (path, sha256) of the slot-map JSON of a ``table``-mapped MoME (see _table_options)."""
    if model_type not in MODEL_TYPES:
        raise ReferenceFormatError(f"model_type {model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})")
    if "moe_ve_slot_factor" in model_config:  # their CLI flag (the meta's user_config), not a GPTConfig field
        _refuse("moe_ve_slot_factor", model_config["moe_ve_slot_factor"], "not a field of their GPTConfig (their "
                "loader would reject it): their base_train resolves --moe-ve-slot-factor f into "
                "moe_ve_slot_vocab_size = ceil(V / f), which is what is imported (ours: --mome-slot-factor)")
    unknown = sorted(k for k in model_config if k not in REFERENCE_DEFAULTS and not k.startswith("stem_"))
    if unknown:
        raise ReferenceFormatError(f"model_config has unknown field(s) {unknown}; cannot tell whether they change "
                                   "the model")
    # stem_* fields configure the STEM FFN of their other model types; their nanochat GPT never reads them
    cfg = {**REFERENCE_DEFAULTS, **model_config}
    if model_type == "bigram_engram_gpt":
        cfg["bigram_engram_enabled"] = True  # their BigramEngramGPT forces it
    designs = [f for f in ("dense_ve_enabled", "moe_ve_enabled", "bigram_engram_enabled") if cfg[f]]
    if len(designs) > 1:
        raise ReferenceFormatError(f"model_config enables {designs}; ours has one memory design per model")
    base = {k: cfg[k] for k in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")}
    for field, value in base.items():  # a wrong type would fail later as a TypeError traceback, naming nothing
        if not _is_int(value) or value < 1:
            _refuse(field, value, "expected an integer >= 1")
    base["window_pattern"] = _window_pattern(cfg["window_pattern"])
    if not designs:
        return GPTConfig(**base)
    if designs[0] == "dense_ve_enabled":
        return GPTConfig(**base, memory="ve", memory_layers=_layers(cfg, "value_embeds_layers"))
    if designs[0] == "bigram_engram_enabled":
        if not _is_int(cfg["bigram_engram_vocab_factor"]) or cfg["bigram_engram_vocab_factor"] < 1:
            _refuse("bigram_engram_vocab_factor", cfg["bigram_engram_vocab_factor"], "expected an integer >= 1")
        if cfg["bigram_engram_gate_channels"] != GATE_CHANNELS:
            _refuse("bigram_engram_gate_channels", cfg["bigram_engram_gate_channels"], f"ours reads {GATE_CHANNELS}")
        return GPTConfig(**base, memory="bigram", memory_layers=_layers(cfg, "bigram_engram_layers"),
                         memory_options={"factor": cfg["bigram_engram_vocab_factor"]})
    return GPTConfig(**base, memory="mome", memory_layers=_layers(cfg, "value_embeds_layers"),
                     memory_options=_mome_options(cfg, slot_map))


def reference_from_config(config: GPTConfig) -> tuple[str, dict]:
    """(model_type, model_config) in their format for our config; refuses designs their code lacks."""
    family = getattr(config, "family", "nanochat")
    if family != "nanochat":  # their family models are separate scripts with no checkpoint format of this kind
        raise ReferenceFormatError(f"--model-type {family} has no counterpart in the authors' gpt / "
                                   "bigram_engram_gpt checkpoint format (nanochat backbone only)")
    if config.mlp != "dense":
        raise ReferenceFormatError(f"--mlp {config.mlp} has no counterpart in the authors' code (dense MLP only)")
    cfg = dict(REFERENCE_DEFAULTS, moe_ve_balance_lr=0.0, moe_ve_bias_update="none",
               **{k: getattr(config, k) for k in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head",
                                                  "n_embd", "window_pattern")})
    layers = list(MEMORY_BLOCKS[config.memory].layers_of(config))
    model_type = "gpt"
    if config.memory == "ve":
        cfg.update(dense_ve_enabled=True, value_embeds_layers=layers)
    elif config.memory == "bigram":
        model_type = "bigram_engram_gpt"
        cfg.update(bigram_engram_enabled=True, bigram_engram_layers=layers,
                   bigram_engram_vocab_factor=config.memory_options.get("factor", 6))
    elif config.memory == "mome":
        o = MoMEOptions(**config.memory_options)
        if o.router_type != "linear":
            raise ReferenceFormatError(f"--mome-router-type {o.router_type}: {CONV_ROUTER_UNVERIFIED}")
        for name, value, ok in (("--mome-routing", o.routing, "context"), ("--mome-balance", o.balance, "none")):
            if value != ok:
                raise ReferenceFormatError(f"{name} {value} has no counterpart in the authors' code (needs {ok})")
        if o.index == "grouped":  # moe_ve_slot_map_path: set by the exporter, which writes their JSON
            cfg.update(moe_ve_slot_mapping="table", moe_ve_slot_vocab_size=config.vocab_size // o.group_size)
        if o.index in ARITHMETIC_INDEXERS:  # their S is our N; D is 0 for mod, as their default
            cfg.update(moe_ve_slot_mapping=o.index, moe_ve_slot_vocab_size=o.rows,
                       moe_ve_slot_dedicated_size=o.dedicated_size)
        cfg.update(moe_ve_enabled=True, value_embeds_layers=layers,
                   moe_ve_setting=f"{int(o.shared_expert)}_{o.topk}_{o.slots}",
                   moe_ve_gate_nl=o.gate_mode, moe_ve_router_input=o.router_input,
                   moe_ve_slot_index_mode="bigram" if o.index == "bigram" else "token",
                   moe_ve_network_shared_table=o.index == "bigram", moe_ve_per_head_table=o.per_head_table,
                   moe_ve_bigram_slot_factor=o.bigram_factor if o.index == "bigram" else 1)
        if o.index == "bigram":  # their base_train resolves S = n*V into this field (0 would mean the vocab size)
            cfg.update(moe_ve_slot_vocab_size=o.bigram_factor * config.vocab_size)
    elif config.memory != "base":
        raise ReferenceFormatError(f"--memory {config.memory} has no counterpart in the authors' code")
    return model_type, cfg


# -- parameter names ----------------------------------------------------------------------------------------
def name_map(config: GPTConfig) -> dict[str, str]:
    """ours -> theirs for every entry of our state dict (reference_checkpoint_names.md)."""
    m = {"wte.weight": "transformer.wte.weight", "lm_head.weight": "lm_head.weight",
         "resid_lambdas": "resid_lambdas", "x0_lambdas": "x0_lambdas"}
    for i in range(config.n_layer):
        for part in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            m[f"blocks.{i}.{part}.weight"] = f"transformer.h.{i}.{part}.weight"
    layers = MEMORY_BLOCKS[config.memory].layers_of(config)  # () for base
    for pos, layer in enumerate(layers):
        if config.memory == "ve":
            m[f"memory.tables.{pos}.weight"] = f"embed_value_dense.layers.{layer}.weight"
            m[f"memory.gates.{pos}.proj.weight"] = f"transformer.h.{layer}.attn.ve_gate.weight"
        elif config.memory == "bigram":
            m[f"memory.gates.{pos}.proj.weight"] = f"bigram_engram_gates.{layer}.weight"
        elif config.memory == "mome":
            if config.memory_options.get("index", "token") != "bigram":
                m[f"memory.tables.{pos}.weight"] = f"embed_value_moe.layers.{pos}.routed_embedding.weight"
                if config.memory_options.get("shared_expert"):
                    m[f"memory.shared_experts.{pos}.weight"] = SHARED_EXPERT_LAYER.format(pos=pos)
            m[f"memory.routers.{pos}.weight"] = f"embed_value_moe.layers.{pos}.router.weight"
            m[f"memory.routers.{pos}.bias"] = f"embed_value_moe.layers.{pos}.router.bias"
            m[f"memory.gates.{pos}.proj.weight"] = f"transformer.h.{layer}.attn.ve_gate.weight"
    if config.memory == "bigram":
        m["memory.table.weight"] = "bigram_engram_embedding.embedding.weight"
        m["memory.lambdas"] = "bigram_lambdas"
    if config.memory == "mome" and config.memory_options.get("index") == "bigram":
        m["memory.table.weight"] = "embed_value_moe.network_shared_routed_embedding.weight"
        if config.memory_options.get("shared_expert"):
            m["memory.shared_expert.weight"] = SHARED_EXPERT_NETWORK
    return m


def expected_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Our state-dict shapes for ``config``, computed on the meta device (no memory is allocated)."""
    with meta_device():
        model = GPT(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def state_from_reference(state: dict, config: GPTConfig, buffers: dict | None = None) -> tuple[dict, dict]:
    """Their state dict -> ours (fp32). Returns (state, report of dropped keys and upcast dtypes). ``buffers``:
    entries of ours that their checkpoint keeps outside its state dict (SLOT_MAP_KEY, from the slot-map JSON)."""
    stripped = {}
    for k, v in state.items():
        key = k[len(COMPILE_PREFIX):] if k.startswith(COMPILE_PREFIX) else k
        if key in stripped:
            raise ReferenceFormatError(f"state dict key {key!r} appears with and without the {COMPILE_PREFIX} prefix")
        stripped[key] = v
    dropped = sorted(k for k in stripped if _dropped(k))
    theirs_to_ours = {t: o for o, t in name_map(config).items()}
    unknown = sorted(k for k in stripped if k not in theirs_to_ours and not _dropped(k))
    if unknown:
        raise ReferenceFormatError(f"unknown state dict key(s) for this model_config: {unknown[:5]}"
                                   f"{' ...' if len(unknown) > 5 else ''}")
    missing = sorted(t for t in theirs_to_ours if t not in stripped)
    if missing:
        raise ReferenceFormatError(f"state dict lacks key(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    shapes = expected_shapes(config)
    out, upcast = {}, {}
    for theirs, ours in theirs_to_ours.items():
        t = stripped[theirs]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ReferenceFormatError(f"state dict key {theirs!r}: expected a floating-point tensor")
        if tuple(t.shape) != shapes[ours]:
            raise ReferenceFormatError(f"state dict key {theirs!r} has shape {tuple(t.shape)}, the model_config "
                                       f"needs {shapes[ours]} (for our {ours})")
        if t.dtype != torch.float32:
            upcast[str(t.dtype)] = upcast.get(str(t.dtype), 0) + 1
        out[ours] = t.to(torch.float32)  # bf16/fp16 -> fp32 is exact; float64 only when its values are fp32's
        if t.dtype == torch.float64 and not torch.equal(out[ours].double(), t):
            raise ReferenceFormatError(f"state dict key {theirs!r} is float64 and fp32 cannot hold its values "
                                       "exactly: refused rather than rounded (their code saves fp32 and bf16)")
    for key, t in (buffers or {}).items():
        if key not in shapes or tuple(t.shape) != shapes[key]:
            raise ReferenceFormatError(f"{key} of shape {tuple(t.shape)} does not fit this model_config "
                                       f"(needs {shapes.get(key)})")
        out[key] = t
    if set(out) != set(shapes):  # a persistent entry of ours the spec has no name for
        raise ReferenceFormatError(f"our model also needs {sorted(set(shapes) - set(out))}, absent from their format")
    return out, {"dropped_keys": dropped, "upcast_tensors": upcast,
                 "compiled_prefix": any(k.startswith(COMPILE_PREFIX) for k in state)}


def state_to_reference(state: dict, config: GPTConfig) -> dict:
    """Our state dict -> theirs (fp32, no prefix, no rotary tables). A grouped model's map (SLOT_MAP_KEY) is not
    in their state dict: the exporter writes it as their slot-map JSON (nanochat.reference_slot_map)."""
    names = name_map(config)
    extra = sorted(set(state) - set(names) - {SLOT_MAP_KEY})
    if extra:
        raise ReferenceFormatError(f"state dict entries {extra} have no counterpart in the authors' format")
    return {names[k]: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items() if k in names}


# -- files --------------------------------------------------------------------------------------------------
def find_meta(root, step: int | None = None) -> tuple[Path, int]:
    """(meta_<step>.json, step) under ``root``, searched recursively (default: the largest step)."""
    root = Path(root)
    metas = {}
    for p in sorted(root.rglob("meta_*.json")):
        m = META_FILE_RE.match(p.name)
        if m:
            metas.setdefault(p.parent, {})[int(m.group(1))] = p
    if not metas:
        raise FileNotFoundError(f"{root}: no meta_<step>.json found (expected the authors' checkpoint files)")
    if len(metas) > 1:
        raise SeveralCheckpointFolders(f"{root}: checkpoints in several directories {sorted(map(str, metas))}; "
                                       "pass the one you want", sorted(metas))
    steps = next(iter(metas.values()))
    step = max(steps) if step is None else step
    if step not in steps:
        raise FileNotFoundError(f"{root}: no meta_{step:06d}.json (steps found: {sorted(steps)})")
    return steps[step], step


def find_checkpoint(root, step: int | None = None) -> tuple[Path, Path, int]:
    """(model_<step>.pt, meta_<step>.json, step): the weights sit beside their meta file."""
    meta, step = find_meta(root, step)
    model = meta.parent / f"model_{step:06d}.pt"
    if not model.is_file():
        raise FileNotFoundError(f"{model} is missing (the weights for {meta.name})")
    return model, meta, step


def find_tokenizer(root) -> tuple[Path, Path | None]:
    """(tokenizer.pkl, token_bytes.pt beside it or None) under ``root``, searched recursively."""
    found = sorted(Path(root).rglob("tokenizer.pkl"))
    if not found:
        raise FileNotFoundError(f"{root}: no tokenizer.pkl found; pass --tokenizer PATH (their "
                                "artifacts/tokenizer/tokenizer.pkl)")
    if len(found) > 1:
        raise ReferenceFormatError(f"{root}: several tokenizer.pkl files {list(map(str, found))}; pass --tokenizer")
    tb = found[0].parent / "token_bytes.pt"
    return found[0], tb if tb.is_file() else None


def read_meta(path) -> dict:
    try:
        meta = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ReferenceFormatError(f"{path}: not valid JSON ({e})") from None
    for key in ("model_type", "model_config"):
        if key not in meta:
            raise ReferenceFormatError(f"{path}: lacks '{key}' (not an authors' checkpoint meta file?)")
    if not isinstance(meta["model_config"], dict):
        raise ReferenceFormatError(f"{path}: 'model_config' must be an object")
    return meta
