"""Command line of ``scripts/base_train.py``: argparse flags, ``--config FILE.toml`` defaults, validation, and the
model and optimizer configs the flags describe (``model_config``, ``optim_config``).

Config files are flat TOML tables whose keys are flag names (``matrix-lr`` or ``matrix_lr``); a row config
(``configs/<table>/<row>.toml`` with [row]/[train]/[paper] tables) contributes its [train] table. They are turned
into command-line tokens placed *before* the real ones, so argparse applies the same type/choice checks to both
and later (command-line) values win. An error of a value from the file names the file: unknown keys, a wrong TOML
type, a bad choice (an on/off flag also takes true/false), or a check the parse makes.
"""

import argparse
import difflib
import functools
import math
import os
import re
import sys
from dataclasses import fields
from pathlib import Path

from nanochat.cli_types import (SEED_MAX, NodeParser, count_or_all, count_or_all_or_zero, device_choice, flag_name,
                                seed_int, unresumable_seeds)
from nanochat.common import DTYPES
from nanochat.dataset import check_dataset_name
from nanochat.families import (FAMILIES, model_types, config_from_args, family_name,
                               optimizer_fields_without_effect, preset_tokens)
from nanochat.gpt import ATTENTION_BACKENDS, GPTConfig, check_window_pattern
from nanochat.memory import add_memory_args, memory_config_from_args
from nanochat.memory.mome_mix import MOME_KERNELS
from nanochat.moe import MLP_KINDS
from nanochat.optim import OptimConfig
from nanochat.row_config import check_row_config, paper_train_shards, read_config
from nanochat.run_control import parse_flop_list
from nanochat.schedules import ScheduleConfig

WANDB_MODES = ("off", "offline", "online")
SHARED_TABLE_KERNEL_CHOICES = ("off", "on")  # --mome-shared-table-kernel
DEVICE_TYPES = ("auto", "cuda", "cpu", "mps")
LEGACY_ATTENTION_ENV = "NANOCHAT_ATTN"  # replaced by --attention


def _group_run(p):
    g = p.add_argument_group("run control")
    g.add_argument("--config", type=str, default=None, help="TOML file of flag defaults; command-line flags override it")
    g.add_argument("--run-name", type=str, default=None, help="run name (default d<depth>[-moe]-<memory>; other families <model-type>-d<depth>[-moe]-<memory>, named sizes <size>-<memory>)")
    g.add_argument("--run-dir", type=str, default=None, help="output directory (default runs/<run-name>)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="latest|auto|STEP",
                   help="resume from a checkpoint in the run dir: 'latest' (error if none), 'auto' (latest if any, "
                        "else start fresh), or a step number")
    g.add_argument("--resume-override-lr", action="store_true",
                   help="allow --resume with other learning rates (--embedding-lr, --unembedding-lr, --matrix-lr, "
                        "--scalar-lr, --memory-lr) than the checkpoint's run, e.g. lower ones after a non-finite "
                        "loss; the change is recorded in config.json (lr_overrides) and metrics.jsonl")
    g.add_argument("--init-from", type=str, default=None, metavar="RUN_DIR[:STEP]",
                   help="start from the weights of another run's checkpoint (STEP: a step number or 'latest', the "
                        "default), e.g. to fine-tune or continue pretraining, also the authors' model after "
                        "scripts.import_reference; its architecture (model config compared as built: auto/0 "
                        "defaults resolved; the context length and training-time settings such as "
                        "--mome-balance-lr may differ) and tokenizer must equal this run's (checked before "
                        "training, and by --dry-run). Optimizer, LR schedule, step count and data order start "
                        "fresh; the source (dir, step, model.pt sha256) is recorded in config.json and summary.json. "
                        "A --resume continues from the run's own checkpoint and needs the same --init-from")
    g.add_argument("--overwrite", action="store_true",
                   help="start afresh in a run dir that already holds a run, deleting that run (its checkpoints, "
                        "metrics, config, summary, evals); without it such a fresh start is refused")
    g.add_argument("--resume-new-world-size", action="store_true",
                   help="allow --resume with another number of processes than the checkpoint's run: model and "
                        "optimizer continue exactly, the data order is re-partitioned (not an exact resume)")
    g.add_argument("--dry-run", action="store_true", help="print the plan (params, FLOPs, steps) and exit; no data needed")
    g.add_argument("--device-type", choices=DEVICE_TYPES, default="auto", help="device (auto: cuda > mps > cpu)")
    g.add_argument("--dtype", choices=DTYPES, default="auto", help="autocast dtype (auto: bf16 on CUDA, fp32 elsewhere)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on for CUDA, off elsewhere; --no-compile disables)")
    g.add_argument("--attention", choices=ATTENTION_BACKENDS, default="sdpa",
                   help="attention kernel on CUDA for forwards without a KV cache (training, bpb, CORE): PyTorch "
                        "SDPA, FlashAttention-2 (flash_attn package), FlashAttention-3 (flash_attn_interface, or the "
                        "kernels hub), or auto = fa3 on a Hopper GPU when it loads, else sdpa; the resolved one is in "
                        "config.json and summary.json")
    g.add_argument("--mome-kernels", choices=MOME_KERNELS, default="auto",
                   help="MoME's Triton kernels on CUDA (per-layer fp32 tables; nanochat/memory/mome_triton.py): fused "
                        "= the row mix and the value injection in one kernel pair, row = the row mix only (injection "
                        "in torch), torch = no kernels (torch ops; compiled with --compile), e.g. to compare paths or "
                        "to take the kernels' fp32 atomics (their sums in a free order) out of the table gradients; "
                        "auto = fused where triton imports, else torch. fused/row without triton on CUDA is an "
                        "error; on a CPU the kernels never run and fused/row have no effect. No effect without "
                        "--memory mome. What the model's layers take (fused, row, torch: a shared expert, per-head or "
                        "bigram-indexed tables keep some kernels off; the last take them with "
                        "--mome-shared-table-kernel on) is in config.json and summary.json")
    g.add_argument("--mome-shared-table-kernel", choices=SHARED_TABLE_KERNEL_CHOICES, default="off",
                   help="on: the MoME Triton kernels of --mome-kernels (fused or row) serve the shared "
                        "bigram-indexed table too, on its rows gathered once per forward "
                        "(nanochat.memory.mome_mix.SHARED_TABLE_KERNEL); off keeps that table on torch ops. Needs "
                        "--memory mome --mome-index bigram without --mome-per-head-table, and kernels (not "
                        "--mome-kernels torch); on a CPU the kernels never run and it has no effect (said in the "
                        "log). A resume may change it, as --mome-kernels; the path the layers took is config.json's "
                        "and summary.json's mome_kernels")
    g.add_argument("--seed", type=seed_int, default=42, help="model init (and default data order) seed")
    g.add_argument("--data-seed", type=seed_int, default=None, help="data order seed (default: --seed)")
    g.add_argument("--wandb", choices=WANDB_MODES, default="off", help="Weights & Biases logging mode")
    g.add_argument("--wandb-project", type=str, default="mome-nanochat", help="W&B project")
    g.add_argument("--max-wall-time-seconds", type=float, default=-1,
                   help="stop once this many seconds have passed since this process started (set-up, compile and "
                        "evals count): at the next step boundary every rank stops at the same step, saves a "
                        "checkpoint and runs the final evaluation; summary.json says stop_reason wall_time_limit. "
                        "A --resume gets the budget afresh (it is this process's clock, not the run's total wall "
                        "time), so a requeued job continues with the same flag. At least one step trains per "
                        "process. -1 = no limit")


def _group_model(p):
    g = p.add_argument_group("model")
    g.add_argument("--model-type", choices=model_types(), default="nanochat",
                   help="backbone family (a key of nanochat.families.FAMILIES) or a named size; its geometry and the "
                        "family's recipe (warmup, memory-table AdamW) are defaults that a config file and the command "
                        "line override (nanochat/families.py)")
    g.add_argument("--depth", type=int, default=12, help="number of layers (the single size dial)")
    g.add_argument("--aspect-ratio", type=int, default=64, help="width = depth x aspect-ratio, rounded up to head-dim")
    g.add_argument("--head-dim", type=int, default=128, help="attention head size")
    g.add_argument("--model-dim", type=int, default=-1,
                   help="explicit width (-1 = depth x aspect-ratio rounded up to head-dim); for the dense scaling controls")
    g.add_argument("--num-heads", type=int, default=-1,
                   help="explicit number of heads (-1 = model-dim / head-dim); head size becomes model-dim / num-heads")
    g.add_argument("--num-kv-heads", type=int, default=-1, help="KV heads for GQA (-1 = num-heads; mobilellm/qwen3)")
    g.add_argument("--ffn-dim", type=int, default=-1,
                   help="SwiGLU hidden size (-1 = the family's rule: mobilellm int(8C/3) up to x256, qwen3 3C)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="use wte as the output head (default: tied for mobilellm/qwen3; nanochat is always untied)")
    g.add_argument("--max-seq-len", type=int, default=2048, help="context length (tokens)")
    g.add_argument("--window-pattern", type=str, default="L",
                   help="attention window per layer (--model-type nanochat), tiled over the layers, the last layer "
                        "always L: L = the full causal context, S = a sliding window of max-seq-len // 2 tokens "
                        "(e.g. SSSL; the reference's paper runs all use L)")
    ffn = {f.name: f.default for f in fields(GPTConfig)}
    g.add_argument("--mlp", choices=MLP_KINDS, default=ffn["mlp"],
                   help="FFN of every layer (--model-type nanochat): the dense relu^2 4C MLP, or a sparse MoE FFN "
                        "(nanochat/moe.py: sigmoid top-K routing, loss-free balancing, dropless), any --memory")
    g.add_argument("--moe-experts", type=int, default=ffn["moe_experts"], help="E, routed experts per layer")
    g.add_argument("--moe-topk", type=int, default=ffn["moe_topk"], help="K, routed experts per token (>= 2)")
    g.add_argument("--moe-shared", type=int, default=ffn["moe_shared"], help="always-on shared experts per layer")
    g.add_argument("--moe-hidden", type=int, default=ffn["moe_hidden"],
                   help="expert hidden width (0 = 4C / (shared + topk) rounded to a multiple of 64: 2048 at d24)")
    g.add_argument("--moe-balance-lr", type=float, default=ffn["moe_balance_lr"],
                   help="loss-free balancing: selection-bias step per optimizer step (0 = no balancing)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size; must match the tokenizer (default: the tokenizer's, 32768 with "
                        "--synthetic-data; --dry-run with no tokenizer yet assumes 32768 and says so)")


def _group_optim(p):
    g = p.add_argument_group("optimizer")
    g.add_argument("--embedding-lr", type=float, default=0.3, help="AdamW LR of wte")
    g.add_argument("--unembedding-lr", type=float, default=0.004, help="AdamW LR of lm_head")
    g.add_argument("--matrix-lr", type=float, default=0.02, help="Muon LR of 2-D matrices")
    g.add_argument("--scalar-lr", type=float, default=0.5, help="AdamW LR of x0 lambdas (resid lambdas get 0.01x)")
    g.add_argument("--adam-beta1", type=float, default=0.8, help="AdamW beta1")
    g.add_argument("--adam-beta2", type=float, default=0.95, help="AdamW beta2")
    g.add_argument("--weight-decay", type=float, default=0.2,
                   help="Muon weight decay at depth 12 (scaled by (12/depth)^2, decayed linearly to 0)")
    g.add_argument("--memory-lr", type=float, default=0.2,
                   help="AdamW LR of memory tables (--model-type mobilellm presets 0.1, STEM on any family 0.3)")
    g.add_argument("--memory-beta1", type=float, default=0.8, help="AdamW beta1 of memory tables")
    g.add_argument("--memory-beta2", type=float, default=0.995,
                   help="AdamW beta2 of memory tables (--model-type mobilellm and STEM preset 0.95)")
    g.add_argument("--memory-wd", type=float, default=None, help="weight decay of memory tables (default: the block's)")


def _group_schedule(p):
    g = p.add_argument_group("horizon and schedules")
    g.add_argument("--total-batch-size", type=int, default=524288, help="tokens per optimizer step, all ranks")
    g.add_argument("--device-batch-size", type=int, default=32, help="rows per micro-batch per rank")
    g.add_argument("--num-iterations", type=int, default=None, help="optimizer steps (wins over the next two)")
    g.add_argument("--target-flops", type=float, default=None, help="FLOP budget: steps = round(F / (flops/token x batch))")
    g.add_argument("--target-param-data-ratio", type=float, default=8.0,
                   help="fallback horizon: tokens = ratio x stored backbone params (an MoE FFN counts every "
                        "expert; the paper's MoE rows use --target-flops)")
    g.add_argument("--warmup-ratio", type=float, default=0.0, help="fraction of steps with linear LR warmup")
    g.add_argument("--warmdown-ratio", type=float, default=0.4, help="fraction of steps with linear LR decay at the end")
    g.add_argument("--final-lr-frac", type=float, default=0.0, help="LR multiplier at the end of warmdown")
    g.add_argument("--muon-momentum-start", type=float, default=0.85, help="Muon momentum at step 0")
    g.add_argument("--muon-momentum-end", type=float, default=0.95, help="Muon momentum after the ramp")
    g.add_argument("--muon-momentum-ramp", type=int, default=300, help="steps of the linear momentum ramp")


def _group_eval(p, core_cap=count_or_all):
    g = p.add_argument_group("evaluation, checkpoints, logging")
    g.add_argument("--eval-every", type=int, default=250, help="val bpb every N steps, at step 0 and at the end (-1 = only at the end)")
    g.add_argument("--eval-tokens", type=int, default=20971520, help="val tokens per bpb evaluation (fixed rows)")
    g.add_argument("--eval-batch-size", type=int, default=None, help="rows per eval batch (default --device-batch-size)")
    g.add_argument("--core-every", type=int, default=-1, help="CORE every N steps (-1 = only at the end)")
    g.add_argument("--eval-every-flops", type=str, default="", metavar="INTERVAL|F1,F2,...",
                   help="val bpb and CORE (with a bundle) together at training-FLOP counts (step x total batch x "
                        "FLOPs/token): one number is an interval (every INTERVAL FLOPs), a comma list the targets "
                        "(e.g. 1e18,2_000_000_000_000_000_000); each at the first step reaching it, several reached "
                        "by one step evaluate once. Replaces --eval-every and --core-every (refused together with "
                        "a positive one); a target beyond the run's FLOPs (with --target-flops F: beyond F) is an error")
    g.add_argument("--sample-every", type=int, default=-1,
                   help="rank 0 greedily completes 7 fixed prompts (16 tokens) every N steps and at the end, printed "
                        "and logged to metrics.jsonl (kind sample). Off (-1) by default, unlike the reference's "
                        "2000: existing runs and configs keep their output and time")
    g.add_argument("--final-core", action=argparse.BooleanOptionalAction, default=True,
                   help="run CORE after training when an eval bundle is available")
    g.add_argument("--final-train-bpb", action=argparse.BooleanOptionalAction, default=True,
                   help="also report bpb on fixed rows of the train split at the end (the paper's train bpb)")
    g.add_argument("--core-max-per-task", type=core_cap, default=-1,
                   help="cap on examples per CORE task (-1 = all; 0 is refused, except by a --resume of a run an "
                        "older version recorded with 0, which meant all)")
    g.add_argument("--bundle", type=str, default=None, help="CORE eval bundle dir (default: first one found)")
    g.add_argument("--save-every", type=int, default=-1, help="checkpoint every N steps (the last step is always saved)")
    g.add_argument("--save-at-flops", type=str, default="", metavar="F1,F2,...",
                   help="also checkpoint at the first step whose training FLOPs (step x total batch x FLOPs/token) "
                        "reach each count (comma list, _ separators allowed, e.g. 1e18,2e18); these checkpoints are "
                        "kept (never pruned by --keep-last); a count beyond the run's FLOPs (with --target-flops F: "
                        "beyond F) is an error")
    g.add_argument("--keep-last", type=int, default=3,
                   help="keep the last K checkpoints (0 = keep all), and every --save-at-flops one")
    g.add_argument("--log-every", type=int, default=1, help="console line + metrics.jsonl record every N steps")


def _group_data(p):
    g = p.add_argument_group("data")
    g.add_argument("--dataset", type=check_dataset_name, default="fineweb-edu", help="which prepared dataset "
                   "--data-dir defaults to: fineweb-edu, climbmix, embedded, local or hf:ORG/NAME[:CONFIG] "
                   "(python -m scripts.prepare_data --dataset ...)")
    g.add_argument("--data-dir", type=str, default=None, help="prepared data dir (default: the --dataset cache dir)")
    g.add_argument("--tokenizer-dir", type=str, default=None, help="tokenizer dir (default: nanochat.tokenizer default)")
    g.add_argument("--synthetic-data", action="store_true",
                   help="train on a seeded random-walk token stream (x_t = x_{t-1} + 1..3 mod V) instead of data "
                   "(tests/benchmarks; bpb is bits/token)")


def build_parser(resuming: bool = False) -> argparse.ArgumentParser:
    """``resuming`` (--resume given): --core-max-per-task also takes 0, for a run an older version recorded with it
    (nanochat.train_resume reads it as -1, the same "all", and refuses it for any other run)."""
    # allow_abbrev=False: the pre-parser of --config/--model-type/--memory takes full names only, so an accepted
    # prefix (--conf FILE) would silently skip the config file
    p = NodeParser(prog="python -m scripts.base_train", description="Pretrain a GPT with a memory block.",
                   formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    core_cap = count_or_all_or_zero if resuming else count_or_all
    for add in (_group_run, _group_model, _group_optim, _group_schedule,
                functools.partial(_group_eval, core_cap=core_cap), _group_data):
        add(p)
    add_memory_args(p)
    return p


# flags whose value is a comma list: a TOML list in a config file is joined with commas for them alone (any other
# flag takes one value: [10] for --eval-every read as 10, silently)
COMMA_LIST_FLAGS = ("save_at_flops", "eval_every_flops", "memory_layers")
ON_OFF = {"on", "off"}  # a flag with these choices takes TOML's true/false in a config file too
RESUME_VALUES = "'latest', 'auto' or a step number"
# what a config key of a string flag takes, where "a string" would not say (resume = true reads as no value of it)
TAKES = {"resume": RESUME_VALUES}


def config_tokens(parser: argparse.ArgumentParser, path: str) -> tuple[list[str], tuple[int, str] | None]:
    """Turn a flat TOML file into command-line tokens. Each value is checked here as argparse would check it on the
    command line (type, choices), so an error names the file and the key; unknown keys, one flag under two
    spellings and a file that sets nothing are errors too. Also returns a row config's ``paper_train_shards``
    (None for a flat file)."""
    file = Path(path)
    data, paper = read_config(file, f"--config {path}"), None
    if any(isinstance(v, dict) for v in data.values()):  # a reproduction row config: [row], [train], [paper]
        row = check_row_config(data, file, runner=False)  # the runner's checks, so they cannot drift
        data, paper = row.get("train", {}), paper_train_shards(row)
    if not data:  # e.g. a file emptied by accident: the run would silently take every default
        raise ValueError(f"--config {path}: the file sets no key (drop --config, or fill it in)")
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    tokens, keys = [], {}
    for key, value in data.items():
        dest = key.replace("-", "_")
        if dest == "config":
            raise ValueError(f"--config {path}: key {key!r} cannot be set in a config file (one --config per run)")
        if dest not in actions or dest == "help":
            close = difflib.get_close_matches(dest, [d for d in actions if d not in ("config", "help")], n=1)
            spelled = [c.replace("_", "-") if "-" in key else c for c in close]  # in the file's own spelling
            hint = f"; did you mean {spelled[0]!r}?" if close else ""
            raise ValueError(f"--config {path}: unknown key {key!r} (not a base_train flag{hint})")
        flag = next(s for s in actions[dest].option_strings if s.startswith("--") and not s.startswith("--no-"))
        if dest in keys:  # TOML sees matrix_lr and matrix-lr as two keys; argparse would take the later one
            raise ValueError(f"--config {path}: keys {keys[dest]!r} and {key!r} both set {flag}; keep one")
        keys[dest] = key
        tokens += _key_tokens(f"--config {path}: key {key!r}", actions[dest], flag, value)
    return tokens, paper


def _key_tokens(where: str, action: argparse.Action, flag: str, value) -> list[str]:
    """The command-line tokens of one config key's TOML ``value``; ``where`` names the file and key in errors."""
    if isinstance(value, dict):
        raise ValueError(f"{where} is a table; config files are flat key = value lists")
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
        if not isinstance(value, bool):  # a string "false" would read as true
            raise ValueError(f"{where} must be true or false (a TOML boolean, unquoted), got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []
    if isinstance(value, list):
        if action.dest not in COMMA_LIST_FLAGS:
            raise ValueError(f"{where} takes one value, not a list (got {value!r})")
        return [flag, ",".join(str(v) for v in value)]
    if isinstance(value, bool) and ON_OFF == set(action.choices or ()):
        value = "on" if value else "off"
    _check_key_value(where, action, value)
    return [flag, str(value)]


def _check_key_value(where: str, action: argparse.Action, value) -> None:
    """``value`` against its flag's choices and int/float type, as argparse checks the command line's (whose error
    names the flag alone: a value from a file must name the file). A ``type=`` of ours is left to the parse (its
    error gets the file's name there, from with_config_source): what it takes can depend on the whole command
    (--core-max-per-task 0 and a seed above SEED_MAX are a --resume's matter)."""
    choices = list(action.choices or ())
    wanted = {int: "an integer", float: "a number"}.get(action.type, TAKES.get(action.dest, "a string"))
    if choices:
        wanted = "one of " + ", ".join(map(repr, choices)) + (" (or true, false)" if ON_OFF == set(choices) else "")
    if isinstance(value, bool) or (choices and str(value) not in choices):  # a stray true would read as "True"
        raise ValueError(f"{where} must be {wanted} (got {value!r})")
    if action.type in (int, float):
        try:
            action.type(str(value))
        except ValueError:
            raise ValueError(f"{where} must be {wanted} (got {value!r})") from None


class TrainArgs(argparse.Namespace):
    """base_train's parsed flags (``vars()``: what config.json records, a --resume compares and speedrun checks a
    finished run with), and in a slot, outside ``vars()``, what the --config file says that is no flag:
    ``paper_shards``, the row's ``paper_train_shards`` (None without one), from the parse that gave the flags."""

    __slots__ = ("paper_shards",)


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = NodeParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", action="append", default=None)  # a list: a second file is refused, not dropped
    pre.add_argument("--model-type", default="nanochat")
    pre.add_argument("--memory", default="base")
    pre.add_argument("--resume", nargs="?", const="latest", default=None)
    pre.add_argument("--seed", default=None)
    pre.add_argument("--data-seed", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config and len(known.config) > 1:
        parser.error(f"--config given {len(known.config)} times ({', '.join(known.config)}): one config file per run; "
                     "put the keys of the others on the command line")
    known.config = known.config[0] if known.config else None
    tokens, paper = [], None
    if known.config:
        try:
            tokens, paper = config_tokens(parser, known.config)
        except (ValueError, FileNotFoundError) as e:
            parser.error(str(e))
    chosen = pre.parse_known_args(tokens + argv)[0]  # the command line's model type and memory win over the file's
    if chosen.resume is not None:
        refuse_unresumable_seeds(parser, chosen)
        parser = build_parser(resuming=True)
    parser.explain = functools.partial(with_config_source, config=known.config, tokens=tokens, argv=argv)
    args = parser.parse_args(preset_tokens(chosen.model_type, chosen.memory) + tokens + argv, TrainArgs())
    args.paper_shards = paper
    if args.device_type != "auto" and not args.dry_run:  # a plan builds nothing: a GPU row is planned anywhere
        try:
            # compute_init's own check exits 1, after the tokenizer is read; a missing device's hint lists auto too
            device_choice(*DEVICE_TYPES, per_rank=True)(args.device_type)
        except argparse.ArgumentTypeError as e:
            parser.error(f"argument --device-type: {e}")
    try:
        validate_args(args)
        check_eval_cadences(args, given_flags(tokens + argv))
    except ValueError as e:
        parser.error(str(e))
    return args


def with_config_source(message: str, config: str | None, tokens: list[str], argv: list[str]) -> str:
    """``message`` (a parse error: argparse's, or a check of the parsed flags), naming the --config file for each
    flag in it that the file set and the command line did not: the flag's name alone sends the user looking for it
    on the command line."""
    named = dict.fromkeys(re.findall(r"--[a-z][a-z0-9-]*", message))
    from_file = [flag for flag in named if flag in given_flags(tokens) and flag not in given_flags(argv)]
    return f"{message} ({', '.join(from_file)} from --config {config})" if from_file else message


def refuse_unresumable_seeds(parser, chosen: argparse.Namespace) -> None:
    """A requeue's command (an older version's seed above SEED_MAX in it) stops where seed_int would, saying
    that the run cannot be resumed rather than only the range; out-of-range values of other kinds are seed_int's."""
    seeds = []
    for flag, text in (("--seed", chosen.seed), ("--data-seed", chosen.data_seed)):
        try:
            if text is not None and int(text) > SEED_MAX:
                seeds.append((flag, int(text)))
        except ValueError:
            pass
    if seeds:
        parser.error(unresumable_seeds(seeds))


def given_flags(tokens: list[str]) -> set[str]:
    """The long flags named in command-line tokens (a config file's included): ``--flag value`` or ``--flag=value``."""
    return {t.split("=", 1)[0] for t in tokens if t.startswith("--")}


def check_eval_cadences(args, given: set[str]) -> None:
    """--eval-every-flops replaces the step cadences: a positive --eval-every or --core-every given with it (on
    the command line or in a --config file) is a contradiction. Their defaults, and -1, are simply replaced."""
    if not args.eval_every_flops:
        return
    for name in ("eval_every", "core_every"):
        flag = flag_name(name)
        if flag in given and getattr(args, name) > 0:
            raise ValueError(f"--eval-every-flops {args.eval_every_flops} replaces {flag} (evaluating at FLOP "
                             f"counts instead of every N steps), but {flag} {getattr(args, name)} is given too: "
                             f"drop one (or pass {flag} -1)")


@functools.cache
def _default_parser() -> argparse.ArgumentParser:
    return build_parser()


def flag_default(dest: str):
    """The parser's default of a flag (``dest`` spelling): the checks below tell a flag the user set from one left
    alone. The parser is built once, not once per check."""
    return _default_parser().get_default(dest)


def validate_args(args: argparse.Namespace) -> None:
    """Checks that need no model, data or devices: bad values fail before any work is done."""
    if LEGACY_ATTENTION_ENV in os.environ:  # its old users must not silently lose their flash setting
        raise ValueError(f"{LEGACY_ATTENTION_ENV} is set ({os.environ[LEGACY_ATTENTION_ENV]!r}) but no longer read: "
                         f"choose the attention kernel with --attention {{{','.join(ATTENTION_BACKENDS)}}} (or "
                         f"attention = \"...\" in a --config file; {LEGACY_ATTENTION_ENV}=flash was --attention fa2) "
                         f"and unset {LEGACY_ATTENTION_ENV}")
    check_window_pattern(args.window_pattern)
    positive = ["depth", "aspect_ratio", "head_dim", "max_seq_len", "total_batch_size", "device_batch_size",
                "eval_tokens"]
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"{flag_name(name)} must be >= 1 (got {getattr(args, name)})")
    if args.num_iterations is not None and args.num_iterations < 1:
        raise ValueError(f"--num-iterations must be >= 1 (got {args.num_iterations})")
    check_geometry(args)
    for name in ("target_flops", "target_param_data_ratio"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            raise ValueError(f"{flag_name(name)} must be > 0 (got {v})")
    if args.vocab_size is not None and args.vocab_size < 2:
        raise ValueError(f"--vocab-size must be >= 2 (got {args.vocab_size})")
    rates = ("embedding_lr", "unembedding_lr", "matrix_lr", "scalar_lr", "memory_lr", "weight_decay", "memory_wd")
    for name in rates:
        v = getattr(args, name)
        if v is not None and v < 0:
            raise ValueError(f"{flag_name(name)} must be >= 0 (got {v})")
    # and finite: float() reads nan and inf; round(inf) in the horizon was a traceback, a NaN LR or decay trained
    # NaN weights for a step, an inf LR was called a flag no optimizer group uses
    for name in ("target_flops", "target_param_data_ratio", *rates):
        v = getattr(args, name)
        if v is not None and not math.isfinite(v):
            raise ValueError(f"{flag_name(name)} must be a finite number (got {v})")
    for name in ("adam_beta1", "adam_beta2", "memory_beta1", "memory_beta2", "muon_momentum_start", "muon_momentum_end"):
        if not 0 <= getattr(args, name) < 1:
            raise ValueError(f"{flag_name(name)} must be in [0, 1) (got {getattr(args, name)})")
    # the schedule's own checks, with a stand-in horizon: the real one needs the model (FLOP target)
    ScheduleConfig(1, args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac, args.muon_momentum_start,
                   args.muon_momentum_end, args.muon_momentum_ramp)
    if args.keep_last < 0:
        raise ValueError(f"--keep-last must be >= 0 (got {args.keep_last})")
    if args.log_every < 1:
        raise ValueError(f"--log-every must be >= 1 (got {args.log_every})")
    for name in ("eval_every", "core_every", "save_every", "sample_every"):
        v = getattr(args, name)
        if v == 0 or v < -1:
            raise ValueError(f"{flag_name(name)} must be a positive step count or -1 (got {v})")
    if args.max_wall_time_seconds != -1 and not (args.max_wall_time_seconds > 0 and
                                                 math.isfinite(args.max_wall_time_seconds)):
        raise ValueError(f"--max-wall-time-seconds must be a positive number of seconds or -1 (got "
                         f"{args.max_wall_time_seconds})")
    for name in ("save_at_flops", "eval_every_flops"):  # syntax here; against the run's FLOPs with the plan
        if getattr(args, name):
            parse_flop_list(getattr(args, name), flag_name(name))
    if args.resume is not None and args.resume not in ("latest", "auto") and not args.resume.isdigit():
        raise ValueError(f"--resume must be {RESUME_VALUES} (got {args.resume!r})")
    if args.overwrite and args.resume is not None:
        raise ValueError("--overwrite (delete the run in --run-dir and start afresh) contradicts --resume; pass one")
    if args.resume_override_lr and args.resume is None:
        raise ValueError("--resume-override-lr only applies with --resume")
    if args.resume_new_world_size and args.resume is None:
        raise ValueError("--resume-new-world-size only applies with --resume (a fresh run partitions its data "
                         "for the world size it starts with)")
    if args.init_from is not None and not args.init_from.strip():
        raise ValueError("--init-from needs a run directory (RUN_DIR[:STEP])")
    if args.eval_batch_size is not None and args.eval_batch_size < 1:
        raise ValueError(f"--eval-batch-size must be >= 1 (got {args.eval_batch_size})")
    if args.mome_shared_table_kernel == "on":
        check_shared_table_kernel(args.memory, args.mome_index, args.mome_per_head_table, args.mome_kernels)
    if args.run_name is not None and ("/" in args.run_name or args.run_name in ("", ".", "..")):
        raise ValueError(f"--run-name must be a plain name without '/' (got {args.run_name!r}); use --run-dir for paths")


def check_geometry(args: argparse.Namespace) -> None:
    """The width flags against each other: --model-dim, --num-heads, --head-dim, --num-kv-heads, --ffn-dim and
    --aspect-ratio (one way to give each size, and heads that split the width evenly)."""
    if args.model_dim != -1 and args.model_dim < 1:
        raise ValueError(f"--model-dim must be >= 1 or -1 (got {args.model_dim})")
    for name in ("num_kv_heads", "ffn_dim"):
        if getattr(args, name) != -1 and getattr(args, name) < 1:
            raise ValueError(f"{flag_name(name)} must be >= 1 or -1 (got {getattr(args, name)})")
    if args.num_heads != -1:
        if args.num_heads < 1:
            raise ValueError(f"--num-heads must be >= 1 or -1 (got {args.num_heads})")
        if args.model_dim == -1:
            raise ValueError("--num-heads needs an explicit --model-dim")
        # d = C/H (--num-heads picks H), or d = --head-dim (Qwen3): the family registry's rule
        split = FAMILIES[family_name(args.model_type)].head_dim_from_width
        if split and (args.model_dim % args.num_heads or (args.model_dim // args.num_heads) % 2):
            raise ValueError(f"--model-dim {args.model_dim} must split into --num-heads {args.num_heads} heads of even size")
        size = args.model_dim // args.num_heads
        if split and args.head_dim not in (size, flag_default("head_dim")):
            raise ValueError(f"--head-dim {args.head_dim} has no effect with --num-heads: the head size is --model-dim "
                             f"{args.model_dim} / --num-heads {args.num_heads} = {size}; drop --head-dim or change "
                             "--num-heads")
    elif args.model_dim != -1 and args.model_dim % args.head_dim:
        raise ValueError(f"--model-dim {args.model_dim} is not a multiple of --head-dim {args.head_dim}; pass --num-heads")
    if args.model_dim != -1 and args.aspect_ratio != flag_default("aspect_ratio"):
        raise ValueError(f"--aspect-ratio {args.aspect_ratio} has no effect with --model-dim {args.model_dim} (the width "
                         "is --depth x --aspect-ratio only without it); drop one of them")


def check_shared_table_kernel(memory: str, index: str, per_head: bool, kernels: str) -> None:
    """--mome-shared-table-kernel on where it can change nothing is refused (base_train's flags, base_eval's flag
    against the checkpoint's model): only MoME's bigram-indexed table is shared, per-head tables keep every kernel
    off (MoMEMemory._kernel_row_mix), and --mome-kernels torch turns the kernels off for every table."""
    flag = "--mome-shared-table-kernel on"
    if memory != "mome" or index != "bigram":
        got = f"--memory {memory}" + (f" --mome-index {index}" if memory == "mome" else "")
        raise ValueError(f"{flag}: only --memory mome --mome-index bigram has a shared table (got {got}); drop the "
                         "flag or pass --mome-shared-table-kernel off")
    if per_head:
        raise ValueError(f"{flag}: per-head tables (--mome-per-head-table) never take the MoME Triton kernels; drop "
                         "one of them")
    if kernels == "torch":
        raise ValueError(f"{flag}: it puts the shared table through the MoME Triton kernels, which --mome-kernels "
                         "torch turns off: pass --mome-kernels auto, fused or row, or --mome-shared-table-kernel off")


def model_config(args, vocab_size: int):
    """The model config of the flags: --model-type picks the family (nanochat.families), the rest its geometry.
    An optimizer flag that this model would not use is an error here (so --dry-run reports it too)."""
    config = config_from_args(args, vocab_size, memory_config_from_args(args, vocab_size))
    changed = [name for name in OPTIM_FLAGS if getattr(args, name) != flag_default(name)]
    unused = optimizer_fields_without_effect(config, optim_config(args), changed)
    if unused:
        flags = ", ".join(f"{flag_name(name)} {getattr(args, name)}" for name in unused)
        raise ValueError(f"{flags}: no optimizer group of this model uses it (--model-type {args.model_type}, "
                         f"--memory {args.memory}); drop the flag")
    return config


OPTIM_FLAGS = ("embedding_lr", "unembedding_lr", "matrix_lr", "scalar_lr", "adam_beta1", "adam_beta2", "weight_decay",
               "memory_lr", "memory_beta1", "memory_beta2", "memory_wd")


def optim_config(args, lr_scale: float = 1.0) -> OptimConfig:
    return OptimConfig(lr_scale=lr_scale, **{name: getattr(args, name) for name in OPTIM_FLAGS})
