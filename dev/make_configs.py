"""Regenerate configs/<table>/<row>.toml from the paper's tables (run from the repo root).

    python dev/make_configs.py

The generated files are committed; edit this script rather than the files so that every row of a table stays
consistent. Paper numbers: ../shared/spec/paper.tex (Tables "pretrain-12layer", "appendix-memory-scaling",
"engram-mom-compound-scaling", "d24-100b-result", "appendix-context-routing-controls",
"appendix-dense-scaling-controls", "appendix-token-memory-adaptations", "appendix-sparse-moe-interaction"; the
last two as tabulated in ../shared/spec/appendix_adaptations.md §1); seeds and hardware from the reference configs.
Rows whose structure was inferred from a parameter total set ``reconstructed = true`` in [row], which the results
tables print as a marker beside the label.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "configs"

# GPU rows checkpoint periodically, keeping only the latest (plus the final one), so a crash, an OOM, a NCCL
# timeout or a scheduler's kill costs at most this many steps when scripts.run continues the row (--resume auto)
CHECKPOINTS = {"save-every": 500, "keep-last": 1}
# every row pins its vocabulary: base_train otherwise takes the size of whatever tokenizer the directory holds
PAPER_VOCAB = {"vocab-size": 32768}  # the paper's 32k BPE (tokenizer/, the default --tokenizer-dir)
MINI_VOCAB = {"vocab-size": 4096, "tokenizer-dir": "tokenizer/v4096"}  # the CPU rows' tokenizer, kept apart
D12 = {  # the common nanochat d12 recipe (FineWeb-Edu, 3e18 FLOPs, 524,288-token batches)
    "dataset": "fineweb-edu", **PAPER_VOCAB, "depth": 12, "max-seq-len": 2048, "total-batch-size": 524288, "device-batch-size": 32,
    "target-flops": 3e18, "eval-every": -1, "eval-tokens": 20971520, "core-every": -1, "compile": True, **CHECKPOINTS,
}
D24 = {  # the d24 ClimbMix recipe (1,048,576-token batches)
    "dataset": "climbmix", **PAPER_VOCAB, "depth": 24, "max-seq-len": 2048, "total-batch-size": 1048576, "device-batch-size": 16,
    "eval-every": -1, "eval-tokens": 20971520, "core-every": -1, "compile": True, **CHECKPOINTS,
}
MINI = {  # CPU-sized (the speedrun CPU demo's model): embedded corpus, 4 layers x 256 wide, a few hundred steps
    "dataset": "embedded", **MINI_VOCAB, "depth": 4, "head-dim": 64, "max-seq-len": 256, "total-batch-size": 4096,
    "device-batch-size": 16, "num-iterations": 300, "eval-every": 100, "eval-tokens": 65536, "core-every": -1,
    "bundle": "subset", "core-max-per-task": 24, "dtype": "bfloat16", "save-every": 100, "log-every": 10,
}


# The reference's --attention per config (../shared/spec/mome_reference_training.md §4.1-4.2, §7 item 11): the d12
# Base/Bigram/VE/grouped-MoME configs on SDPA, the bigram-indexed MoME and Qwen3 configs on "auto". [paper]
# attention records the kernel a row's numbers (its throughput) came from, only where the spec says which.
SDPA_PAPER = {"attention": "sdpa"}
AUTO = {"attention": "auto"}  # FA3 on a Hopper GPU (when it loads), else SDPA
AUTO_NOTE = ("attention auto as in the reference (FA3 on a Hopper GPU, else SDPA); the paper does not say which GPUs "
             "ran this row (it used H100s and RTX PRO 6000 Blackwells), so [paper] records no attention kernel")


def mome(slots, index="token", group=1, bigram_factor=None, routing=None, slot_map=None):
    m = {"memory": "mome", "mome-slots": slots, "mome-topk": 2, "mome-index": index}
    if index == "grouped":
        m["mome-group-size"] = group
        m["mome-slot-map"] = slot_map or f"runs/slotmaps/k{group}.json"
    if bigram_factor:
        m["mome-bigram-factor"] = bigram_factor
    if routing:
        m["mome-routing"] = routing
    return m


def paper_d12(train, val, core, mem, total, tput=None, train_std=None, val_std=None, core_std=None,
              attention=SDPA_PAPER):
    p = {"train_bpb": train, "val_bpb": val, "core": core, "params_memory_m": mem, "params_total_m": total, **attention}
    if tput:
        p["tok_per_sec_m"] = tput
    for k, v in (("train_bpb_std", train_std), ("val_bpb_std", val_std), ("core_std", core_std)):
        if v is not None:
            p[k] = v
    return p


ROWS = []  # (table, name, label, seeds, nproc, train, paper, notes, reconstructed, train shards, compare_to)
# [row] train_shards: the FineWeb-Edu shards the paper's runs read (base_train warns when fewer are prepared, since
# the run then repeats its data): the reference's nanochat configs pass --training-shards 100 (training spec §4.1),
# its family configs 160 / 520 / 369 (families spec §8, §11.13, §11.16). The paper gives none for ClimbMix.
TRAIN_SHARDS = {"d12": 100, "d12_scaling": 100, "d12_compound": 100}


def add(table, name, label, seeds, nproc, base, memory, paper, notes="", reconstructed=False, shards=None,
        compare_to=None):
    shards = shards or TRAIN_SHARDS.get(table)
    ROWS.append((table, name, label, seeds, nproc, {**base, **memory}, paper, notes, reconstructed, shards, compare_to))


# Table 1 (d12, 3e18 FLOPs, 3 seeds, 4 GPUs)
S3 = [42, 43, 44]
# The paper built its kNN slot maps from "a lightly trained nanochat-d12 base run (~1B tokens, ~1e18 FLOPs)": the
# base row keeps (never prunes) the checkpoint of the first step reaching 1e18 training FLOPs. 887,095,296 FLOPs/token
# x 524,288 tokens/step: step 2151 (1.13B tokens); tests/test_configs.py checks it against the plan.
SLOT_MAP_FLOPS, SLOT_MAP_STEP = "1e18", 2151
SLOT_MAP_SOURCE = f"runs/d12/base/seed42 --step {SLOT_MAP_STEP}"
add("d12", "base", "Base", S3, 4, {**D12, "save-at-flops": SLOT_MAP_FLOPS}, {"memory": "base"},
    paper_d12(0.8783, 0.8785, 0.1447, 0, 135, 1.15, 0.0009, 0.0010, 0.0064),
    f"keeps the checkpoint of step {SLOT_MAP_STEP} (the first to reach {SLOT_MAP_FLOPS} training FLOPs, ~1.13B tokens; "
    "--save-at-flops, meta.json \"keep\": true) for the grouped MoME rows' slot maps, as the paper's \"lightly "
    "trained nanochat-d12 base run (~1B tokens, ~1e18 FLOPs)\"; --dry-run prints the step as \"save at flops\"")
add("d12", "bigram", "Bigram (6V)", S3, 4, D12, {"memory": "bigram", "bigram-factor": 6},
    paper_d12(0.8632, 0.8636, 0.1533, 151, 286, 1.09, 0.0009, 0.0009, 0.0116))
add("d12", "ve", "VEmbedding", S3, 4, D12, {"memory": "ve"}, paper_d12(0.8631, 0.8633, 0.1522, 151, 286, 1.10, 0.0006, 0.0006, 0.0045))
for c, m, tr, va, co, mem, tot, tp, stds in [
    (1, 6, 0.8618, 0.8621, 0.1571, 151, 286, 1.07, (0.0002, 0.0003, 0.0030)),
    (2, 12, 0.8609, 0.8611, 0.1583, 151, 287, 1.07, (0.0003, 0.0003, 0.0020)),
    (4, 24, 0.8608, 0.8610, 0.1554, 151, 287, 1.07, (0.0004, 0.0004, 0.0029)),
    (1, 12, 0.8567, 0.8569, 0.1635, 302, 438, 1.03, (0.0002, 0.0002, 0.0067)),
    (2, 24, 0.8558, 0.8561, 0.1664, 302, 438, 1.03, (0.0003, 0.0003, 0.0059)),
    (4, 48, 0.8563, 0.8565, 0.1515, 302, 439, 1.02, (0.0005, 0.0006, 0.0110)),
]:
    memory = mome(m) if c == 1 else mome(m, index="grouped", group=c)
    note = "" if c == 1 else (f"needs a c_grp={c} slot map, built as the paper's from the d12 base row at ~1e18 FLOPs "
                              f"(d12/base keeps that checkpoint): python -m scripts.build_slot_map --checkpoint "
                              f"{SLOT_MAP_SOURCE} --group-size {c} --output runs/slotmaps/k{c}.json")
    add("d12", f"mome_c{c}_m{m}", f"MoME (c_grp={c}) A2/{m}", S3, 4, D12, memory, paper_d12(tr, va, co, mem, tot, tp, *stds), note)

# Memory-size sweep (d12, 3e18, blocks 3..24; each block = V x 768 = 25.2M params)
SWEEP = {  # blocks: bigram, mome; each (mean, std) of train bpb, val bpb, CORE, wall minutes over the 3 seeds
    3: (((0.8668, 0.0006), (0.8672, 0.0005), (0.1513, 0.0160), (106.72, 0.70)),
        ((0.8667, 0.0005), (0.8669, 0.0005), (0.1476, 0.0035), (109.77, 0.82))),
    6: (((0.8632, 0.0009), (0.8636, 0.0009), (0.1533, 0.0116), (108.80, 0.47)),
        ((0.8618, 0.0002), (0.8621, 0.0003), (0.1571, 0.0030), (111.89, 0.59))),
    9: (((0.8615, 0.0012), (0.8619, 0.0011), (0.1562, 0.0080), (110.55, 0.50)),
        ((0.8589, 0.0003), (0.8591, 0.0003), (0.1627, 0.0063), (113.48, 0.59))),
    12: (((0.8602, 0.0013), (0.8606, 0.0012), (0.1497, 0.0035), (112.49, 0.38)),
         ((0.8567, 0.0002), (0.8569, 0.0002), (0.1635, 0.0067), (115.68, 0.54))),
    15: (((0.8592, 0.0015), (0.8597, 0.0015), (0.1551, 0.0105), (114.35, 0.43)),
         ((0.8558, 0.0005), (0.8561, 0.0005), (0.1599, 0.0068), (117.59, 0.57))),
    18: (((0.8581, 0.0015), (0.8586, 0.0014), (0.1608, 0.0052), (116.34, 0.60)),
         ((0.8550, 0.0003), (0.8552, 0.0003), (0.1602, 0.0027), (119.76, 0.51))),
    21: (((0.8571, 0.0013), (0.8576, 0.0012), (0.1494, 0.0091), (118.28, 0.40)),
         ((0.8541, 0.0004), (0.8544, 0.0004), (0.1584, 0.0003), (121.85, 0.60))),
    24: (((0.8564, 0.0011), (0.8571, 0.0010), (0.1613, 0.0034), (120.17, 0.45)),
         ((0.8530, 0.0003), (0.8533, 0.0003), (0.1586, 0.0025), (123.70, 0.51))),
}


def paper_sweep(stats, mem, attention=None):
    keys = ("train_bpb", "val_bpb", "core", "wall_min")
    return {**{k: mean for k, (mean, _) in zip(keys, stats)}, **{f"{k}_std": std for k, (_, std) in zip(keys, stats)},
            "params_memory_m": mem, **(attention or {})}


# [paper] attention: the sweep rows that are Table 1's runs (the same numbers: d12_bigram.sh, d12_mome_c1_m6.sh,
# d12_mome_c1_m12.sh) ran on SDPA; the spec says nothing about the others
for blocks, (bg, _) in SWEEP.items():  # the paper's order: every Bigram row, then every MoME row
    add("d12_scaling", f"bigram_b{blocks:02d}", f"Bigram {blocks}V", S3, 4, D12, {"memory": "bigram", "bigram-factor": blocks},
        paper_sweep(bg, round(blocks * 25.165824, 1), SDPA_PAPER if blocks == 6 else None))
for blocks, (_, mo) in SWEEP.items():
    add("d12_scaling", f"mome_b{blocks:02d}", f"MoME A2/{blocks}", S3, 4, D12, mome(blocks),
        paper_sweep(mo, round(blocks * 25.165824, 1), SDPA_PAPER if blocks in (6, 12) else None))

# Compound scaling: Bigram-indexed MoME with one table shared by all memory layers (seeds 42, 43 as in the reference)
add("d12_compound", "bigram", "Bigram (6V)", [42, 43, 44], 4, D12, {"memory": "bigram", "bigram-factor": 6},
    {"train_bpb": 0.8632, "val_bpb": 0.8636, "params_memory_m": 151, **SDPA_PAPER})
# the appendix's full table (tab:appendix-compound-scaling): + total params, CORE and stds, and the 8V x A2/9 row
COMPOUND_SEEDS_NOTE = ("seeds 42 and 43 as the reference's results (d12_bigram_mome.json averages these two; the "
                       "paper's caption says three seeds): python -m scripts.run configs/d12_compound/{}.toml "
                       "--seeds 42,43,44 adds the third")
for n, m, mem, total, (tr, tr_s), (va, va_s), (co, co_s) in [
    (6, 6, 151, 286.4, (0.8618, 0.0010), (0.8624, 0.0010), (0.1647, 0.0023)),
    (12, 6, 302, 437.4, (0.8576, 0.0008), (0.8582, 0.0007), (0.1549, 0.0084)),
    (8, 9, 302, 437.5, (0.8579, 0.0010), (0.8585, 0.0010), (0.1551, 0.0088)),
    (6, 12, 302, 437.6, (0.8582, 0.0008), (0.8588, 0.0008), (0.1544, 0.0095)),
    (12, 12, 604, 739.6, (0.8540, 0.0002), (0.8546, 0.0001), (0.1604, 0.0050)),
    (24, 6, 604, 739.4, (0.8541, 0.0011), (0.8547, 0.0012), (0.1590, 0.0096)),
    (6, 24, 604, 739.9, (0.8544, 0.0012), (0.8550, 0.0012), (0.1614, 0.0108)),
]:
    add("d12_compound", f"mome_n{n}_m{m}", f"MoME {n}V x {m}", [42, 43], 4, D12,
        {**mome(m, index="bigram", bigram_factor=n), **AUTO},
        paper_d12(tr, va, co, mem, total, None, tr_s, va_s, co_s, attention={}),
        COMPOUND_SEEDS_NOTE.format(f"mome_n{n}_m{m}") + "; " + AUTO_NOTE)

# d24 on ClimbMix: 100B tokens (100,000 steps of 1,048,576; 8 GPUs) and the 6e19-FLOP controls (seed 42; "the d24
# control reruns use four H100 GPUs"). The step count is ours: the paper says "100B" and neither it nor the spec gives
# steps; 100,000 steps is 104.86B tokens, 95,367 would be 100.00B (the row notes say so)
D24_STEPS_NOTE = ("100,000 steps x 1,048,576 tokens = 104.86B tokens is this repo's reading of the paper's \"100B\" "
                  "(neither the paper nor ../shared/spec gives the step count; 95,367 steps would be 100.00B): "
                  "pass --num-iterations N after -- to change it")
OOD = ("bpb on FineWeb-Edu/enwik9/Shakespeare: python -m scripts.base_eval --run <seed dir> --eval bpb --bpb-corpus "
       "fineweb_edu=PATH --bpb-corpus enwik9=PATH --bpb-corpus shakespeare=PATH on the final step (document-reset "
       "protocol; scripts.results reads these names)")
for name, label, memory, mem, score_tput, vals in [
    ("dense", "Dense", {"memory": "base"}, 0.0, None, (0.6639, 0.7677, 0.9037, 1.4993, 0.3441)),
    ("ve", "VEmbedding", {"memory": "ve"}, 0.60, 64.0, (0.6463, 0.7549, 0.8860, 1.4823, 0.3484)),
    ("mome_a2_m12", "MoME-A2/12", mome(12), 0.61, 58.4, (0.6504, 0.7548, 0.8850, 1.4789, 0.3687)),
]:
    add("d24", name, label + " (100B)", [42], 8, {**D24, "num-iterations": 100000}, memory,
        {"val_bpb": vals[0], "fineweb_edu_bpb": vals[1], "enwik9_bpb": vals[2], "shakespeare_bpb": vals[3], "core": vals[4],
         "params_network_b": 0.78, "params_memory_b": mem,
         **({"score_tok_per_sec_k": score_tput} if score_tput else {})}, D24_STEPS_NOTE + "; " + OOD + (
            "; the paper's 0.61B memory column appears to count the routers (2.7M) with the 604M tables"
            if mem == 0.61 else ""))
# the routing controls' delta columns: the control's value minus hidden-state MoME's ([row] compare_to), as printed.
# The paper names the two controls and gives their totals and "Context-conditioned: No", nothing more (the spec has
# no definition): their layouts are inferred from the totals or chosen here, so they are marked reconstructed
CONTROL_RECON = {
    "ctrl_mome_token_only": "RECONSTRUCTED (the paper gives only the name, \"Context-conditioned: No\" and the "
                            "1,388.8M total): one learned per-token logit table of V x (H*M) = 32768 x 144, zero-init, "
                            "in the memory-table AdamW group and shared by the 12 memory layers, replaces the "
                            "hidden-state router (the total is then exactly 1,388,843,568, the paper's); top-2 and "
                            "sigmoid-norm weights on its logits, as the hidden-state row",
    "ctrl_mome_fixed_random": "RECONSTRUCTED (the paper gives only the name, \"Context-conditioned: No\" and the "
                              "1,384.1M total, VE's: no router): head h of token x reads the K = 2 consecutive slots "
                              "(mod M) from an offset drawn once per (token, head) from a generator seeded at init, "
                              "the same in every memory layer and run, with weights 1/K",
}
for name, label, memory, total, vals, ood, deltas in [
    # hidden-state routing is also the MoME row of the dense-scaling table (FineWeb-Edu, enwik9, Shakespeare bpb)
    ("ctrl_mome_context", "MoME, hidden-state routing", mome(12), 1386.8, (0.6990, 0.2941), (0.8045, 0.9712, 1.5531),
     None),
    ("ctrl_mome_token_only", "MoME, learned token-only routing", mome(12, routing="token-only"), 1388.8,
     (0.7044, 0.2853), None, (0.0054, -0.0088)),
    ("ctrl_mome_fixed_random", "MoME, fixed-random routing", mome(12, routing="fixed-random"), 1384.1,
     (0.7018, 0.2768), None, (0.0028, -0.0173)),
]:
    extra = {"fineweb_edu_bpb": ood[0], "enwik9_bpb": ood[1], "shakespeare_bpb": ood[2]} if ood else {}
    vs_ref = {"val_bpb_vs_ref": deltas[0], "core_vs_ref": deltas[1]} if deltas else {}
    add("d24", name, label + " (6e19)", [42], 4, {**D24, "target-flops": 6e19}, memory,
        {"val_bpb": vals[0], "core": vals[1], **extra, "params_total_m": total, **vs_ref},
        CONTROL_RECON.get(name, OOD if ood else ""), reconstructed=name in CONTROL_RECON,
        compare_to="ctrl_mome_context" if deltas else None)
for name, label, geometry, total, vals in [
    ("ctrl_dense_w1536", "Pure dense d24/w1536", {}, 780, (0.7042, 0.8105, 0.9775, 1.5610, 0.2843)),
    ("ctrl_dense_w1728", "Latency-matched dense d24/w1728", {"model-dim": 1728, "num-heads": 12}, 973,
     (0.6998, 0.8097, 0.9757, 1.5632, 0.2773)),
    ("ctrl_dense_d25_w2048", "Matched-total dense d25/w2048", {"depth": 25, "model-dim": 2048, "num-heads": 16}, 1393,
     (0.7033, 0.8092, 0.9780, 1.5584, 0.2871)),
]:
    add("d24", name, label + " (6e19)", [42], 4, {**D24, "target-flops": 6e19, **geometry}, {"memory": "base"},
        {"val_bpb": vals[0], "fineweb_edu_bpb": vals[1], "enwik9_bpb": vals[2], "shakespeare_bpb": vals[3], "core": vals[4],
         "params_total_m": total, "params_memory_m": 0}, OOD)

# CPU-sized versions of the d12 Table 1 rows: 2 memory layers (1, 3) of 4 heads x 64, so the VE-matched budget is
# 2 x V x 256 = a 2V bigram table = MoME M = 4 (A2/4); A2/8 doubles it like the paper's 302M rows.
for name, label, memory in [
    ("base", "Base (mini)", {"memory": "base"}), ("bigram", "Bigram 2V (mini)", {"memory": "bigram", "bigram-factor": 2}),
    ("ve", "VEmbedding (mini)", {"memory": "ve"}), ("mome_c1_m4", "MoME A2/4 (mini)", mome(4)),
    ("mome_c1_m8", "MoME A2/8 (mini)", mome(8)),
]:
    add("mini", name, label, [42], 1, MINI, memory, {}, "CPU demo row; no paper numbers")


# Iso-token table "Llama/MobileLLM and Qwen3 backbone families" (paper tab:mobilenet125-summary and its 22-task
# appendix version; seed 42). Recipes from the reference configs (families spec §5-§7): fixed horizons, warmup (Qwen3
# only) + flat + linear warmdown over the last 40%, per-family memory-table AdamW, STEM tables trained like wte.
FAMILY = {"dataset": "fineweb-edu", **PAPER_VOCAB, "max-seq-len": 2048, "total-batch-size": 524288, "eval-tokens": 2097152,
          "core-every": -1, "compile": True, **CHECKPOINTS}
TASKS = ["hellaswag_zeroshot", "jeopardy", "arc_easy", "arc_challenge", "copa", "commonsense_qa", "piqa", "openbook_qa",
         "lambada_openai", "hellaswag", "winograd", "winogrande", "agi_eval_lsat_ar", "squad", "coqa", "boolq",
         "bigbench_qa_wikidata", "bigbench_dyck_languages", "bigbench_cs_algorithms", "bigbench_operators",
         "bigbench_repeat_copy_logic", "bigbench_language_identification"]
STEM_OPT = {"memory": "stem", "memory-lr": 0.3, "memory-beta1": 0.8, "memory-beta2": 0.95, "memory-wd": 0.0}
MOBILE_TABLES = {"memory-lr": 0.1, "memory-beta1": 0.8, "memory-beta2": 0.95, "memory-wd": 0.001}
QWEN_TABLES = {"memory-lr": 0.2, "memory-beta1": 0.8, "memory-beta2": 0.995, "memory-wd": 0.001}


def family_mome(slots, topk, router):
    return {"memory": "mome", "mome-slots": slots, "mome-topk": topk, "mome-gate": "softmax" if topk == 1 else "sigmoid-norm",
            "mome-router-input": router}


WARMDOWN = "the paper text says cosine decay or warmdown, the configs use the linear warmdown"  # families spec §11.3
DISCREPANCIES = {
    "mobilellm-125m": "tied wte trains at --embedding-lr (0.3 x s_d) as in the reference; the paper trained 5B tokens on "
                      "the first 160 shards (one pass); " + WARMDOWN,
    "mobilellm-350m": "untied as in the reference (real MobileLLM-350M ties); the paper text says launcher-default wd for "
                      "the memory tables but the reference configs pass 0.001; 520 shards (one pass); " + WARMDOWN,
    "qwen3-0.6b": "tied wte trains at --unembedding-lr (0.004 x s_d) as in the reference; RoPE base 1e4 (not 1e6); 369 "
                  "shards for 20B tokens (about 1.28 passes); the paper says 8 GPUs but only STEM used 8 (the others "
                  "4); " + WARMDOWN + "; " + AUTO_NOTE,
}
# the reference's MobileLLM model ignores its attention flag: SDPA always (families spec §7, §11.9); Qwen3 ran on auto
FAMILY_ATTENTION = {"mobilellm-125m": ({}, SDPA_PAPER), "mobilellm-350m": ({}, SDPA_PAPER), "qwen3-0.6b": (AUTO, {})}
# (size, row, label, memory, nproc, device batch, eval every, Mem (M, full-table precision), wall, bb-avg,
#  train bpb, val bpb, CORE, 22 accuracies in TASKS order)
FAMILY_ROWS = [
    ("mobilellm-125m", "base", "Base", {}, 4, 64, 1907, 0, 1.0, 20.13, 0.8904, 0.8852, 0.1382,
     [34.11, 0.76, 52.82, 27.56, 58.00, 31.61, 63.82, 33.40, 27.58, 33.27, 60.81, 53.04, 23.91, 4.81, 10.12, 55.14, 31.48, 6.20, 43.11, 11.90, 3.12, 24.96]),
    ("mobilellm-125m", "stem", "STEM", STEM_OPT, 4, 32, 1907, 755.0, 1.0, 20.13, 0.8683, 0.8633, 0.1483,
     [35.81, 2.36, 55.72, 29.35, 65.00, 27.19, 65.13, 34.20, 28.68, 35.47, 58.61, 52.88, 23.91, 6.14, 12.31, 54.01, 37.23, 8.40, 38.33, 10.95, 0.00, 25.88]),
    ("mobilellm-125m", "ve", "VEmbedding", {"memory": "ve", **MOBILE_TABLES}, 4, 32, 1907, 94.4, 1.03, 22.21, 0.8671, 0.8620, 0.1530,
     [36.28, 0.90, 56.82, 28.50, 64.00, 22.11, 66.43, 31.20, 29.54, 36.23, 57.51, 52.09, 25.65, 13.61, 13.52, 53.67, 40.29, 12.60, 43.03, 12.38, 0.00, 24.97]),
    ("mobilellm-125m", "mome_a1_3", "MoME-A1/3", {**family_mome(3, 1, "value"), **MOBILE_TABLES}, 4, 32, 1907, 94.4, 1.07, 23.31,
     0.8673, 0.8623, 0.1587,
     [36.15, 0.85, 56.44, 27.30, 63.00, 29.48, 66.00, 34.00, 29.38, 35.59, 62.64, 52.49, 26.09, 8.96, 14.17, 50.49, 41.36, 10.60, 39.92, 16.19, 6.25, 25.52]),
    ("mobilellm-125m", "mome_a2_6", "MoME-A2/6", {**family_mome(6, 2, "value"), **MOBILE_TABLES}, 4, 32, 1907, 188.7, 1.07, 21.98,
     0.8613, 0.8560, 0.1686,
     [36.59, 3.83, 57.24, 27.65, 66.00, 30.71, 65.18, 32.00, 30.72, 36.19, 60.44, 51.93, 25.65, 14.31, 14.73, 57.86, 39.13, 8.40, 39.77, 15.71, 3.12, 25.72]),
    ("mobilellm-350m", "base", "Base", {}, 4, 16, 1907, 0, 1.0, 16.68, 0.7807, 0.7750, 0.1988,
     [48.00, 13.79, 64.23, 34.04, 65.00, 19.74, 70.13, 37.20, 39.41, 47.87, 65.20, 54.14, 27.83, 26.35, 21.48, 55.66, 53.54, 0.00, 0.00, 17.14, 3.12, 26.30]),
    ("mobilellm-350m", "stem", "STEM", STEM_OPT, 4, 8, 7629, 1342.2, 1.09, 25.94, 0.7645, 0.7697, 0.2179,
     [47.65, 15.45, 64.52, 35.41, 66.00, 22.44, 69.37, 36.80, 38.19, 47.64, 62.64, 54.54, 23.91, 28.98, 23.19, 50.52, 54.24, 8.20, 43.03, 15.71, 9.38, 25.07]),
    ("mobilellm-350m", "ve", "VEmbedding", {"memory": "ve", **MOBILE_TABLES}, 4, 16, 7629, 167.8, 1.04, 23.87, 0.7710, 0.7651, 0.2214,
     [49.35, 17.48, 66.29, 36.26, 67.00, 20.72, 70.62, 37.00, 39.94, 49.60, 67.40, 56.35, 21.30, 31.43, 25.23, 47.06, 51.66, 9.70, 34.24, 21.90, 0.00, 25.70]),
    ("mobilellm-350m", "mome_a2_5", "MoME-A2/5", {**family_mome(5, 2, "value"), **MOBILE_TABLES}, 4, 16, 7629, 167.8, 1.04, 24.70,
     0.7704, 0.7647, 0.2202,
     [49.11, 16.34, 65.03, 36.60, 68.00, 21.95, 70.73, 35.80, 41.51, 49.20, 66.67, 56.04, 23.04, 30.57, 24.14, 44.65, 53.64, 8.40, 41.97, 18.57, 0.00, 25.64]),
    ("mobilellm-350m", "mome_a2_10", "MoME-A2/10", {**family_mome(10, 2, "value"), **MOBILE_TABLES}, 4, 16, 7629, 335.5, 1.08, 21.15,
     0.7675, 0.7610, 0.2286,
     [49.79, 16.67, 65.28, 36.77, 70.00, 20.31, 71.60, 36.00, 42.05, 49.50, 68.50, 56.75, 23.04, 30.61, 23.60, 55.44, 54.54, 8.50, 18.26, 20.00, 0.00, 25.62]),
    ("qwen3-0.6b", "base", "Base", {}, 4, 8, 7629, 0, 1.0, 25.72, 0.7577, 0.7594, 0.2491,
     [50.12, 18.19, 65.99, 35.32, 72.00, 22.36, 70.78, 37.60, 43.16, 50.58, 67.03, 55.96, 24.35, 28.05, 24.60, 59.88, 54.93, 16.70, 40.98, 16.19, 0.00, 25.50]),
    ("qwen3-0.6b", "stem", "STEM", STEM_OPT, 8, 8, 7629, 1409.3, 1.07, 26.01, 0.7484, 0.7564, 0.2556,
     [50.81, 22.34, 67.97, 36.52, 69.00, 23.10, 71.98, 39.00, 42.03, 51.01, 71.43, 56.59, 24.78, 29.78, 25.96, 56.39, 56.58, 14.10, 36.89, 19.52, 3.12, 25.87]),
    ("qwen3-0.6b", "ve", "VEmbedding", {"memory": "ve", **QWEN_TABLES}, 4, 8, 7629, 469.8, 1.06, 26.82, 0.7374, 0.7427, 0.2530,
     [52.66, 23.29, 66.50, 38.05, 71.00, 22.28, 71.00, 39.00, 42.98, 53.07, 69.23, 57.14, 24.35, 35.87, 28.18, 47.55, 54.43, 13.20, 45.45, 22.38, 0.00, 25.48]),
    ("qwen3-0.6b", "mome_a2_8", "MoME-A2/8", {**family_mome(8, 2, "hidden"), **QWEN_TABLES}, 4, 8, 7629, 469.8, 1.06, 26.19,
     0.7381, 0.7461, 0.2737,
     [52.66, 22.82, 67.09, 38.31, 68.00, 28.99, 71.76, 39.60, 43.45, 53.39, 69.96, 56.04, 26.09, 35.62, 28.50, 63.39, 53.89, 9.90, 44.17, 23.81, 0.00, 25.35]),
]
HORIZON = {"mobilellm-125m": (9536, 0.0), "mobilellm-350m": (38146, 0.0), "qwen3-0.6b": (38146, 0.01)}
FAMILY_SHARDS = {"mobilellm-125m": 160, "mobilellm-350m": 520, "qwen3-0.6b": 369}
for size, name, label, memory, nproc, dbs, eval_every, mem, wall, bb, tr, va, core, accs in FAMILY_ROWS:
    steps, warmup = HORIZON[size]
    attention, paper_attention = FAMILY_ATTENTION[size]
    train = {**FAMILY, "model-type": size, "num-iterations": steps, "warmup-ratio": warmup, "device-batch-size": dbs,
             "eval-every": eval_every, "memory": "base", **memory, **attention}
    paper = {"train_bpb": tr, "val_bpb": va, "core": core, "params_memory_m": mem, "wall_ratio": wall, "bb_avg": bb,
             **{f"acc_{task}": acc for task, acc in zip(TASKS, accs)}, **paper_attention}
    notes = DISCREPANCIES[size]
    if mem == 94.4:
        notes += "; the summary table prints 95M memory, the exact count (and the paper's full table) is 94.4M"
    prefix = {"mobilellm-125m": "m125", "mobilellm-350m": "m350", "qwen3-0.6b": "qwen3"}[size]
    add("families", f"{prefix}_{name}", f"{size} {label}", [42], nproc, train, {}, paper, notes,
        shards=FAMILY_SHARDS[size])

# CPU-sized versions of the family rows (embedded corpus, 4 layers x 256, GQA 4/2 heads; Qwen3 heads of 96 so that
# its query width 384 != C): memory on layers 1 and 3; MoME M = H_kv = 2 is iso-parameter with VE.
MINI_FAMILY = {**{k: v for k, v in MINI.items() if k not in ("depth", "head-dim")}, "depth": 4, "model-dim": 256,
               "num-heads": 4, "num-kv-heads": 2}
for fam, geometry, tables, router in [("mobilellm", {"head-dim": 64}, MOBILE_TABLES, "value"),
                                      ("qwen3", {"head-dim": 96, "warmup-ratio": 0.01}, QWEN_TABLES, "hidden")]:
    for name, label, memory in [("base", "Base", {}), ("stem", "STEM", STEM_OPT), ("ve", "VEmbedding", {"memory": "ve", **tables}),
                                ("mome_a2_2", "MoME-A2/2", {**family_mome(2, 2, router), **tables})]:
        add("families_mini", f"{fam}_{name}", f"{fam} {label} (mini)", [42], 1,
            {**MINI_FAMILY, "model-type": fam, **geometry}, {"memory": "base", **memory}, {}, "CPU demo row; no paper numbers")
# Appendix baselines (spec appendix_adaptations.md): "Token-indexed memory comparisons on d24/w1536/h12" (~6e19 FLOPs,
# seed 42, 4 GPUs) and "Sparse-MoE interaction" (8 GPUs, FA3 throughput); issue 20.
SPEC = "../shared/spec/appendix_adaptations.md"
D24_6E19 = {**D24, "target-flops": 6e19}
ENGRAM = {"memory": "engram", "memory-layers": "1,11", "engram-compression": "tokenizer"}
JTOKM = {"memory": "jtokm", "memory-layers": "7,15,23", "jtokm-experts": 4, "jtokm-topk": 2}
MOE = {"mlp": "moe", "moe-experts": 6, "moe-topk": 2, "moe-shared": 1}
# JTok's and JTok-M's optimizer group for s is the spec's choice (the paper names none)
JTOK_SCALE = ("the C-wide scale vector s of each memory layer trains in the per-layer scalar AdamW group (x0_lambdas: "
              "lr 0.5 x batch scale, betas (0.96, 0.95), as the spec's J5 says): the first setting to check if the "
              "row underperforms")
RECON = {
    "engram": f"RECONSTRUCTED table layout ({SPEC} §3.2-3.3): the paper gives only the 1,389.6M total; 2 modules at "
              "layers 1 and 11 (Engram-27B's placement rescaled) with d_mem = C, 8 heads x 2 orders, 32 consecutive "
              "primes from 195,131; the compression map is built from the run's tokenizer",
    "jtokm": f"RECONSTRUCTED ({SPEC} §4.3): the 1,384.1M total forces 12 V x C tables; taken as n_e = 4 tables, top-2, "
             "at layers 7, 15, 23 with a full-width router and the Switch aux loss (weight 1e-4)",
    "move_input": f"RECONSTRUCTED ({SPEC} §5): MoVE has no public equations; per-layer V x C base tables on the odd "
                  "layers, bigram mean pooling, 12 hash-routed rank-64 experts shared by all layers, per-head gate, "
                  "inferred from the 1,386.7M total",
}
for name, label, memory, total, vals, notes in [
    ("bigram_12v", "Bigram (12V x C)", {"memory": "bigram", "bigram-factor": 12}, 1384.1, (0.6943, 0.2871),
     "one hashed-bigram table of 12V x C shared by the 12 odd layers"),
    ("engram", "Canonical Engram adaptation", ENGRAM, 1389.6, (0.7029, 0.2698), RECON["engram"]),
    ("jtok", "JTok adaptation", {"memory": "jtok"}, 1384.1, (0.6974, 0.2764),
     f"structure forced by the total ({SPEC} §4.2): a V x C table and scale s per odd layer, modulating the MLP "
     "output; " + JTOK_SCALE),
    ("jtokm", "JTok-M adaptation", JTOKM, 1384.1, (0.7003, 0.2756), RECON["jtokm"] + "; " + JTOK_SCALE),
    ("move_input", "MoVE-Input adaptation", {"memory": "move_input", "move-experts": 12, "move-rank": 64}, 1386.7,
     (0.7016, 0.2744), RECON["move_input"]),
    ("mome_a2_m12", "MoME A2/12", mome(12), 1386.8, (0.6990, 0.2941), "the same run as d24/ctrl_mome_context"),
    ("dense", "(ref.) pure dense d24", {"memory": "base"}, 780, (0.7042, 0.2843),
     "the dense-scaling table's row (the same run as d24/ctrl_dense_w1536)"),
]:
    add("d24_token_memory", name, label, [42], 4, D24_6E19, memory,
        {"val_bpb": vals[0], "core": vals[1], "params_total_m": total}, notes, reconstructed=name in RECON)
FA3 = ("train tok/s as the paper measured it: 8xH100, native FA3, the same global batch (attention auto runs FA3 "
       "on Hopper GPUs when flash_attn_interface or the kernels package is installed, see docs/training.md; results mark a "
       "tok/s measured on another kernel); params_active_m = parameters one token uses (full embeddings, routers, "
       "dense/shared parts, the selected experts and memory slots)")
for name, label, train, stored, active, tps, vals in [
    ("mome_a2_m12", "MoME (odd layers, A2/12)", mome(12), 1386.8, 782.8, 796258, (0.6990, 0.2941)),
    ("moe", "MoE-FFN E6/K2/24 (+1 shared)", {"memory": "base", **MOE}, 1384.3, 780.4, 653033, (0.6903, 0.2886)),
    ("moe_mome", "MoE-FFN E6/K2/24 + MoME", {**MOE, **mome(12)}, 1991.0, 783.0, 611249, (0.6913, 0.2986)),
]:
    add("d24_sparse_moe", name, label, [42], 8, D24_6E19, {**train, **AUTO},
        {"params_total_m": stored, "params_active_m": active, "tok_per_sec": tps, "val_bpb": vals[0], "core": vals[1],
         "attention": "fa3"},
        FA3 + (f"; MoE as a backbone FFN option ({SPEC} §6)" if "mlp" in train else ""))
# CPU-sized rows of the new designs on the MINI recipe (4 layers x 256, V = 4096): memory budgets near the mini VE
# row's 2 x V x 256 = 2.1M (Engram: 32 primes from 4096, 16 wide = 2.1M), except JTok-M (one layer of 4 tables).
for name, label, train in [
    ("engram", "Engram (mini)", {"memory": "engram", "engram-compression": "tokenizer", "engram-first-prime": 4096}),
    ("jtok", "JTok (mini)", {"memory": "jtok"}),
    ("jtokm", "JTok-M (mini)", {"memory": "jtokm", "memory-layers": "3", "jtokm-experts": 4, "jtokm-topk": 2}),
    ("move_input", "MoVE-Input (mini)", {"memory": "move_input"}),
    ("moe", "MoE-FFN E6/K2 +1 shared (mini)", {"memory": "base", **MOE}),
    ("moe_mome", "MoE-FFN + MoME A2/4 (mini)", {**MOE, **mome(4)}),
]:
    recon = name in RECON
    add("appendix_mini", name, label, [42], 1, MINI, train, {},
        "CPU demo row; no paper numbers" + (f"; RECONSTRUCTED design ({SPEC})" if recon else ""), reconstructed=recon)


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float) and v >= 1e6:
        return f"{v:.0e}".replace("e+", "e")
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def render(table, name, label, seeds, nproc, train, paper, notes, reconstructed=False, shards=None, compare_to=None,
           order=0) -> str:
    lines = [f"# {table}/{name}: {label}. Generated by dev/make_configs.py; paper numbers from ../shared/spec/paper.tex.",
             "", "[row]", f"table = {toml_value(table)}", f"name = {toml_value(name)}", f"label = {toml_value(label)}",
             f"order = {order}", f"seeds = {toml_value(seeds)}", f"nproc_per_node = {nproc}"]
    if notes:
        lines.append(f"notes = {toml_value(notes)}")
    if reconstructed:
        lines.append("reconstructed = true")
    if shards:
        lines.append(f"train_shards = {shards}")
    if compare_to:
        lines.append(f"compare_to = {toml_value(compare_to)}")
    lines += ["", "[train]"] + [f"{k} = {toml_value(v)}" for k, v in train.items()]
    if paper:
        lines += ["", "[paper]"] + [f"{k} = {toml_value(v)}" for k, v in paper.items()]
    return "\n".join(lines) + "\n"


def rendered() -> dict[str, str]:
    """"<table>/<row>.toml" -> the file's text, for every row (tests/test_faith34.py compares them with configs/)."""
    seen: dict[str, int] = {}  # rows per table so far: each row's place (results list the paper's order)
    out = {}
    for row in ROWS:
        order = seen[row[0]] = seen.get(row[0], -1) + 1
        out[f"{row[0]}/{row[1]}.toml"] = render(*row, order=order)
    return out


def main():
    files = rendered()
    for name, text in files.items():
        path = ROOT / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    print(f"wrote {len(files)} configs under {ROOT}")


if __name__ == "__main__":
    main()
