"""Synthetic checkpoints in the authors' format, written from ``../shared/spec/reference_checkpoint_names.md``.

The names below are spelled out from the spec's tables (NOT taken from nanochat.reference_format), so these files
are an independent oracle for the importer and the exporter. Like the authors' CUDA checkpoints, the state dict
carries the ``_orig_mod.`` prefix and stores wte, memory tables and routers as bf16; the source model's values of
those tensors are rounded to bf16 first, so an exact import must give back the source model bit for bit.
The ``table``-mapped MoME (their d12 grouped rows) reads a slot-map JSON in their format (reference notes §3.11),
written here from the spec's keys; their checkpoint does not hold the map.
"""

import json
import pickle
from pathlib import Path

import torch

from conftest import tiny_config
from nanochat.reference_format import REFERENCE_DEFAULTS
from scripts import import_reference
from test_analysis import make_tokenizer

STEP = 5
COMMON = dict(sequence_len=64, n_layer=4, n_head=2, n_kv_head=2, n_embd=64)
INERT_BALANCE = {"moe_ve_balance_lr": 0.0, "moe_ve_bias_update": "none"}  # every paper run
# design -> (their model_type, their model_config fields, our memory, our memory_layers, our memory_options)
DESIGNS = {
    "base": ("gpt", {}, "base", (), {}),
    "ve": ("gpt", {"dense_ve_enabled": True, "value_embeds_layers": [1, 3]}, "ve", (), {}),
    "ve_layers": ("gpt", {"dense_ve_enabled": True, "value_embeds_layers": [0, 1]}, "ve", (0, 1), {}),
    "bigram": ("bigram_engram_gpt", {"bigram_engram_vocab_factor": 2}, "bigram", (), {"factor": 2}),
    "mome_token": ("gpt", {"moe_ve_enabled": True, "value_embeds_layers": [1, 3], "moe_ve_setting": "0_2_6",
                           "moe_ve_gate_nl": "sigmoid-norm", "moe_ve_router_input": "hidden", **INERT_BALANCE},
                   "mome", (), {"slots": 6, "topk": 2}),
    "mome_bigram": ("gpt", {"moe_ve_enabled": True, "value_embeds_layers": [1, 3], "moe_ve_setting": "0_2_4",
                            "moe_ve_gate_nl": "sigmoid-norm", "moe_ve_router_input": "hidden",
                            "moe_ve_slot_index_mode": "bigram", "moe_ve_bigram_slot_factor": 2,
                            "moe_ve_network_shared_table": True, **INERT_BALANCE},
                    "mome", (), {"slots": 4, "topk": 2, "index": "bigram", "bigram_factor": 2}),
    "mome_value": ("gpt", {"moe_ve_enabled": True, "value_embeds_layers": [0, 2], "moe_ve_setting": "0_1_4",
                           "moe_ve_gate_nl": "softmax", "moe_ve_router_input": "value", **INERT_BALANCE},
                   "mome", (0, 2), {"slots": 4, "topk": 1, "router_input": "value"}),
    "mome_full": ("gpt", {"moe_ve_enabled": True, "value_embeds_layers": [1, 3], "moe_ve_setting": "0_3_3",
                          "moe_ve_gate_nl": "sigmoid", "moe_ve_router_input": "hidden", **INERT_BALANCE},
                  "mome", (), {"slots": 3, "topk": 3, "gate": "sigmoid"}),
    # their table slot mapping = our grouped index; the slot map's path and hash are filled in by source_model
    "mome_table": ("gpt", {"moe_ve_enabled": True, "value_embeds_layers": [1, 3], "moe_ve_setting": "0_2_4",
                           "moe_ve_gate_nl": "sigmoid-norm", "moe_ve_router_input": "hidden",
                           "moe_ve_slot_mapping": "table", **INERT_BALANCE},
                   "mome", (), {"slots": 4, "topk": 2, "index": "grouped", "group_size": 2}),
    # their mod/headmod mappings = our indexers of the same names; S is what their base_train resolved (here not
    # a divisor of the 439-token vocab, so rows hold unequal token counts)
    "mome_mod": ("gpt", {"moe_ve_enabled": True, "value_embeds_layers": [1, 3], "moe_ve_setting": "0_2_4",
                         "moe_ve_gate_nl": "sigmoid-norm", "moe_ve_router_input": "hidden",
                         "moe_ve_slot_mapping": "mod", "moe_ve_slot_vocab_size": 100, **INERT_BALANCE},
                 "mome", (), {"slots": 4, "topk": 2, "index": "mod", "rows": 100}),
    # their --moe-ve-slot-factor 4 (mod, no explicit size) on the 439-token vocab: their base_train writes the
    # resolved S = ceil(439 / 4) = 110 into model_config, the flags into user_config (USER_CONFIG below)
    "mome_mod_factor": ("gpt", {"moe_ve_enabled": True, "value_embeds_layers": [1, 3], "moe_ve_setting": "0_2_4",
                                "moe_ve_gate_nl": "sigmoid-norm", "moe_ve_router_input": "hidden",
                                "moe_ve_slot_mapping": "mod", "moe_ve_slot_vocab_size": 110, **INERT_BALANCE},
                        "mome", (), {"slots": 4, "topk": 2, "index": "mod", "rows": 110}),
    "mome_headmod": ("gpt", {"moe_ve_enabled": True, "value_embeds_layers": [1, 3], "moe_ve_setting": "0_2_4",
                             "moe_ve_gate_nl": "sigmoid-norm", "moe_ve_router_input": "hidden",
                             "moe_ve_slot_mapping": "headmod", "moe_ve_slot_vocab_size": 120,
                             "moe_ve_slot_dedicated_size": 30, **INERT_BALANCE},
                     "mome", (), {"slots": 4, "topk": 2, "index": "headmod", "rows": 120, "dedicated_size": 30}),
    # their always-on shared expert ("1_K_E"): per layer, and network-shared beside the bigram-indexed table
    "mome_shared": ("gpt", {"moe_ve_enabled": True, "value_embeds_layers": [1, 3], "moe_ve_setting": "1_2_6",
                            "moe_ve_gate_nl": "sigmoid-norm", "moe_ve_router_input": "hidden", **INERT_BALANCE},
                    "mome", (), {"slots": 6, "topk": 2, "shared_expert": True}),
    "mome_bigram_shared": ("gpt", {"moe_ve_enabled": True, "value_embeds_layers": [1, 3], "moe_ve_setting": "1_2_4",
                                   "moe_ve_gate_nl": "sigmoid-norm", "moe_ve_router_input": "hidden",
                                   "moe_ve_slot_index_mode": "bigram", "moe_ve_bigram_slot_factor": 2,
                                   "moe_ve_network_shared_table": True, **INERT_BALANCE},
                           "mome", (), {"slots": 4, "topk": 2, "index": "bigram", "bigram_factor": 2,
                                        "shared_expert": True}),
    # their per-head tables (moe_ve_per_head_table): the same names with H times the rows (S*H*E routed, S*H
    # shared; the layout is the spec's, §3.3; the names' staying the same is inferred)
    "mome_per_head": ("gpt", {"moe_ve_enabled": True, "value_embeds_layers": [1, 3], "moe_ve_setting": "1_2_6",
                              "moe_ve_gate_nl": "sigmoid-norm", "moe_ve_router_input": "hidden",
                              "moe_ve_per_head_table": True, **INERT_BALANCE},
                      "mome", (), {"slots": 6, "topk": 2, "shared_expert": True, "per_head_table": True}),
    "mome_bigram_per_head": ("gpt", {"moe_ve_enabled": True, "value_embeds_layers": [1, 3], "moe_ve_setting": "0_2_4",
                                     "moe_ve_gate_nl": "sigmoid-norm", "moe_ve_router_input": "hidden",
                                     "moe_ve_slot_index_mode": "bigram", "moe_ve_bigram_slot_factor": 2,
                                     "moe_ve_network_shared_table": True, "moe_ve_per_head_table": True,
                                     **INERT_BALANCE},
                             "mome", (), {"slots": 4, "topk": 2, "index": "bigram", "bigram_factor": 2,
                                          "per_head_table": True}),
}
# their meta's user_config (the CLI args) beyond the common ones, per design; their loader does not read it
USER_CONFIG = {"mome_mod_factor": {"moe_ve_slot_mapping": "mod", "moe_ve_slot_factor": 4, "moe_ve_slot_vocab_size": 0}}
# what their CUDA init casts to bf16 (the whole embed_value_moe module: shared experts too)
BF16_PREFIXES = ("wte.", "memory.table", "memory.routers.", "memory.shared_expert")


def their_slot_map_json(tok, rows) -> dict:
    """A slot map in the authors' nanochat_slot_map_v1 layout (reference notes §3.11) for the given rows."""
    def text(i):
        return tok.decode_bytes([i]).decode("utf-8", errors="replace")

    return {"format": "nanochat_slot_map_v1", "mapping": "table", "vocab_size": tok.vocab_size,
            "slot_vocab_size": len(rows), "slot_factor": len(rows[0]),
            "tokenizer": {"vocab_size": tok.vocab_size, "bos_token_id": tok.bos_token_id},
            "slot_size_histogram": {str(len(rows[0])): len(rows)}, "stats": {}, "metadata": {},
            "slots": [{"slot_id": i, "token_ids": r, "token_texts": [text(t) for t in r],
                       "token_texts_visible": [text(t) for t in r], "sample_counts": [0] * len(r),
                       "sample_count_sum": 0, "sample_share_sum": 0.0} for i, r in enumerate(rows)]}


def shuffled_rows(vocab_size: int, group_size: int, seed: int = 0) -> list[list[int]]:
    """A partition of the vocabulary into slots of group_size unrelated token ids (slot ids unlike token order)."""
    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    return perm.view(-1, group_size).tolist()


def write_their_slot_map(tok, path: Path, group_size: int) -> str:
    """Their JSON for a shuffled partition; returns its sha256."""
    from nanochat.download import file_sha256

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(their_slot_map_json(tok, shuffled_rows(tok.vocab_size, group_size))))
    return file_sha256(path)


def pairable_tokenizer(out_dir):
    """make_tokenizer's BPE plus one merge ('  '): 440 tokens, which slots of 2 or 4 tokens partition."""
    from nanochat.tokenizer import Tokenizer

    ranks = dict(make_tokenizer(out_dir).mergeable_ranks)
    ranks[b"  "] = len(ranks)
    tok = Tokenizer(ranks)
    tok.save(out_dir)
    return tok


def source_model(tok, design: str, seed: int = 0, slot_map: Path | None = None):
    """A tiny model of ours with every zero-init weight perturbed and the bf16-stored tensors bf16-rounded. A
    grouped design writes its slot map (their format) to ``slot_map``."""
    from nanochat.gpt import build_model

    _, _, memory, layers, options = DESIGNS[design]
    if options.get("index") == "grouped":
        digest = write_their_slot_map(tok, slot_map, options["group_size"])
        options = {**options, "slot_map": str(slot_map), "slot_map_sha256": digest}
    cfg = tiny_config(vocab_size=tok.vocab_size, memory=memory, memory_layers=layers, memory_options=options, **COMMON)
    model = build_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "memory" in name or "c_proj" in name or "lambdas" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            if name.startswith(BF16_PREFIXES):
                p.copy_(p.bfloat16().float())
    return model.eval()


def their_state_dict(model, design: str, bf16: bool = True, prefix: str = "_orig_mod.") -> dict:
    sd = model.state_dict()
    low = (lambda t: t.bfloat16()) if bf16 else (lambda t: t.clone())
    out = {"transformer.wte.weight": low(sd["wte.weight"]), "lm_head.weight": sd["lm_head.weight"],
           "resid_lambdas": sd["resid_lambdas"], "x0_lambdas": sd["x0_lambdas"]}
    for i in range(model.config.n_layer):
        for part in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            out[f"transformer.h.{i}.{part}.weight"] = sd[f"blocks.{i}.{part}.weight"]
    memory = DESIGNS[design][2]
    bigram_index = memory == "mome" and model.memory.opts.index == "bigram"
    # the shared expert's names are not in the spec's tables: inferred from the routed table's (`routed_embedding`
    # -> `shared_embedding`, `network_shared_routed_embedding` -> `network_shared_shared_embedding`), unverified
    shared_expert = memory == "mome" and model.memory.opts.shared_expert
    for pos, layer in enumerate(model.memory.layers):
        gate = sd[f"memory.gates.{pos}.proj.weight"]
        if memory == "ve":  # tables keyed by the LAYER id
            out[f"embed_value_dense.layers.{layer}.weight"] = low(sd[f"memory.tables.{pos}.weight"])
            out[f"transformer.h.{layer}.attn.ve_gate.weight"] = gate
        elif memory == "bigram":
            out[f"bigram_engram_gates.{layer}.weight"] = gate
        else:  # MoME: per-layer modules keyed by POSITION, gates by layer
            if not bigram_index:
                out[f"embed_value_moe.layers.{pos}.routed_embedding.weight"] = low(sd[f"memory.tables.{pos}.weight"])
            if shared_expert and not bigram_index:
                out[f"embed_value_moe.layers.{pos}.shared_embedding.weight"] = \
                    low(sd[f"memory.shared_experts.{pos}.weight"])
            out[f"embed_value_moe.layers.{pos}.router.weight"] = low(sd[f"memory.routers.{pos}.weight"])
            out[f"embed_value_moe.layers.{pos}.router.bias"] = low(sd[f"memory.routers.{pos}.bias"])
            out[f"transformer.h.{layer}.attn.ve_gate.weight"] = gate
    if memory == "bigram":
        out["bigram_engram_embedding.embedding.weight"] = low(sd["memory.table.weight"])
        out["bigram_lambdas"] = sd["memory.lambdas"]
    if bigram_index:
        out["embed_value_moe.network_shared_routed_embedding.weight"] = low(sd["memory.table.weight"])
    if bigram_index and shared_expert:
        out["embed_value_moe.network_shared_shared_embedding.weight"] = low(sd["memory.shared_expert.weight"])
    return {prefix + k: v for k, v in out.items()}


def their_model_config(model, design: str) -> dict:
    cfg = model.config
    fields = {k: getattr(cfg, k) for k in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")}
    # head_dim is ignored by their GPT; stem_* fields belong to their other model types
    out = {**REFERENCE_DEFAULTS, **fields, "window_pattern": "L", "head_dim": 128, "stem_multiple_of": 256,
           **DESIGNS[design][1]}
    if out["moe_ve_slot_index_mode"] == "bigram":  # their base_train writes the resolved S = n * V
        out["moe_ve_slot_vocab_size"] = out["moe_ve_bigram_slot_factor"] * cfg.vocab_size
    if out["moe_ve_slot_mapping"] == "table":  # ... and S = ceil(V / c) for the table; the map's path as given
        options = cfg.memory_options
        out.update(moe_ve_slot_vocab_size=-(-cfg.vocab_size // options["group_size"]),
                   moe_ve_slot_map_path=options["slot_map"])
    return out


def write_their_tokenizer(tok, directory: Path, protocol=pickle.DEFAULT_PROTOCOL) -> None:
    """What their tok_train writes: a pickled tiktoken Encoding named 'rustbpe' + token_bytes of decoded strings."""
    import tiktoken

    directory.mkdir(parents=True, exist_ok=True)
    enc = tiktoken.Encoding(name="rustbpe", pat_str=tok.pattern, mergeable_ranks=tok.mergeable_ranks,
                            special_tokens=tok.special_tokens)
    (directory / "tokenizer.pkl").write_bytes(pickle.dumps(enc, protocol=protocol))
    specials = set(tok.special_tokens.values())
    tb = [0 if i in specials else len(enc.decode([i]).encode("utf-8")) for i in range(tok.vocab_size)]
    torch.save(torch.tensor(tb, dtype=torch.int32), directory / "token_bytes.pt")


def write_their_checkpoint(ckpt_dir: Path, model, design: str, step: int = STEP, **state_kw) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.save(their_state_dict(model, design, **state_kw), ckpt_dir / f"model_{step:06d}.pt")
    meta = {"step": step, "val_bpb": 1.25, "model_type": DESIGNS[design][0],
            "model_config": their_model_config(model, design), "user_config": {"depth": 4, "seed": 42, **USER_CONFIG.get(design, {})},
            "device_batch_size": 8, "max_seq_len": 64, "dataloader_state_dict": {"pq_idx": 0, "rg_idx": 2, "epoch": 1},
            "stop_reason": "flops", "loop_state": {"min_val_bpb": 1.25, "smooth_train_loss": 3.0}}
    (ckpt_dir / f"meta_{step:06d}.json").write_text(json.dumps(meta, indent=2))


def make_their_files(tmp_path: Path, design: str, seed: int = 0):
    """Their base-dir layout under tmp_path/theirs: base_checkpoints/d4/{model,meta}_000005.*,
    tokenizer/{tokenizer.pkl, token_bytes.pt}, and slotmaps/tiny_k2.json for a grouped design. Returns (that
    directory, source model, our tokenizer)."""
    root = tmp_path / "theirs"
    grouped = DESIGNS[design][4].get("index") == "grouped"
    tok = (pairable_tokenizer if grouped else make_tokenizer)(tmp_path / "our_tok")
    model = source_model(tok, design, seed, root / "slotmaps" / "tiny_k2.json" if grouped else None)
    write_their_checkpoint(root / "base_checkpoints" / "d4", model, design)
    write_their_tokenizer(tok, root / "tokenizer")
    return root, model, tok


def our_base_run(tmp_path: Path) -> Path:
    """A run of ours (tmp_path/ours, checkpoint step 12) of make_their_files' Base model: what export_reference
    exports."""
    from nanochat.checkpoint import save_checkpoint

    _, source, _ = make_their_files(tmp_path, "base")
    run = tmp_path / "ours"
    save_checkpoint(run, 12, source, {"tokenizer_dir": str(tmp_path / "our_tok")})
    return run


# -- driving the importer in the import/export tests --------------------------------------------------------
def run_import(src, run_dir, *extra) -> int:
    return import_reference.main([str(src), "--run-dir", str(run_dir), *extra])


def imported_climbmix_run(tmp: Path) -> Path:
    """tmp/run: a MoME run imported with --dataset climbmix (its meta records "dataset", no "data_dir")."""
    src, _, _ = make_their_files(tmp, "mome_token")
    assert run_import(src, tmp / "run", "--dataset", "climbmix") == 0
    return tmp / "run"


def logits(model, seed=0):
    idx = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(idx)


def _edit_meta(src, **fields):
    path = src / "base_checkpoints" / "d4" / f"meta_{STEP:06d}.json"
    meta = json.loads(path.read_text())
    meta["model_config"].update(fields)
    path.write_text(json.dumps(meta))
