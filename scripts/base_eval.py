"""Evaluate a checkpoint: CORE and/or bits per byte (train/val splits and out-of-domain corpora).

    python -m scripts.base_eval --run runs/X [--step S] [--eval core,bpb] [--bundle run|DIR|subset]
        [--max-per-task run|N] [--device-batch-size B] [--splits train,val] [--eval-tokens N]
        [--bpb-corpus NAME=PATH ...]
    torchrun --standalone --nproc_per_node=N -m scripts.base_eval --run-dir runs/X ...
    (under torchrun spell it --run-dir: torchrun's parser takes "--run" for an abbreviation of its --run-path)

Results go to <run>/eval/step_NNNNNN/: core.json, core.csv, core.md and bpb.json (for MoME also the slot balance of
each split's routing, "mome_slot_balance": MaxVio and absolute load deviation; the output directory is checked
writable before anything is evaluated). The tokenizer and data directory come from the checkpoint's meta.json
("tokenizer_dir", "data_dir") unless --tokenizer-dir/--data-dir are given; a run trained with --synthetic-data is
refused (no tokenizer made its token ids). CORE counts only the tasks whose data files exist and says so in its
label (e.g. CORE-21/22).

The autocast dtype, the attention kernel and MoME's kernels default to the ones the run trained (and evaluated)
with, from the checkpoint's config, so the CORE and bpb printed here equal the ones at the end of training; all three
are written into core.json/bpb.json (MoME's as the path the model's layers took, "none" without MoME), and the dtype
is printed beside every number, since bf16 and fp32 results differ in the last digits. CORE's bundle and examples
per task follow the run likewise (--bundle run, --max-per-task run: its --bundle, else the bundle its search found,
and its --core-max-per-task; a run that records none gets the search order and every example), printed with the
other resolved settings. The train split's rows are the
documents the run's recorded --data-seed reads first (the split's first documents for a checkpoint that records none,
e.g. an imported one), named in bpb.json "train_bpb_rows" as in summary.json: a run finished before 2026-11-27
measured its final train bpb on the split's first documents in manifest order (its summary.json has no
"train_bpb_rows"), so its train bpb here is on other rows and differs.

Everything the bpb evaluation reads is read before CORE runs: the data's manifest, the rows of every split (a split
too small for --eval-tokens is refused naming the flag, the split, what it holds and what was asked), and every
--bpb-corpus; so a problem of the bpb part stops the evaluation in seconds, not once CORE has run (the rows are
scored after CORE: the same rows and numbers as when they were built there).

Nothing finished is lost: every CORE task and bpb split/corpus is kept in <out>/core.partial.json and
<out>/bpb.partial.json as soon as it is done, and running the same command again after Ctrl-C, SIGTERM (a Slurm
time limit) or a crash continues from there; results computed under other settings are recomputed, never mixed
(nanochat/eval_resume.py). --fresh starts over.
"""

import argparse
import functools
import json
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from nanochat.checkpoint import (check_not_synthetic, existing_step, load_model, recorded_run_args, recorded_value,
                                 require_files, step_dir)
from nanochat.cli_types import NodeParser, checkpoint_step, device_type_name, positive_int, recorded_args
from nanochat.eval_bundle import add_core_flags
from nanochat.common import (DTYPES, autocast_context, compute_cleanup, compute_init, every_rank_ok, print0,
                             print_error, raised_like, raised_on_every_rank, rank0_decides, resolve_dtype)
from nanochat.eval_resume import (FinishedResults, Interrupted, ResultWriteError, eval_settings, interrupts_raise,
                                  write_on_rank0, write_report_on_rank0)
from nanochat.gpt import ATTENTION_BACKENDS, AttentionBackend
from nanochat.jsonfile import write_text_atomic
from nanochat.lost_output import keep_running_without_output
from nanochat.memory.mome_mix import MOME_KERNELS
from nanochat.numerics import NUMERICS, apply_numerics, eval_token_bytes
from nanochat.run_dir import RunDirLock, ensure_writable
from nanochat.slot_balance import describe, with_slot_balance
from nanochat.terminal import replace_unencodable_output
from nanochat.train_args import SHARED_TABLE_KERNEL_CHOICES, check_shared_table_kernel

PAPER_EVAL_TOKENS = 20_971_520
# MoME's kernel paths (MoMEMemory.kernel_path), each also the --mome-kernels setting that takes it; most capable first
KERNEL_PATHS = ("fused", "row", "torch")


def parse_args(argv=None):
    ap = NodeParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # --run-dir exists because torchrun's own parser rejects "--run" as an ambiguous prefix of its --run-path.
    ap.add_argument("--run", "--run-dir", dest="run", required=True,
                    help="run directory holding checkpoints/step_NNNNNN/ (use --run-dir under torchrun)")
    ap.add_argument("--step", type=checkpoint_step, default=None, help="checkpoint step (default: the last one)")
    ap.add_argument("--eval", default="core,bpb", help="comma list of: core, bpb")
    add_core_flags(ap)
    ap.add_argument("--device-batch-size", type=positive_int, default=16, help="rows per forward pass (CORE and bpb)")
    ap.add_argument("--splits", default="train,val",
                    help="dataset splits for bpb (comma list; '' for none; one named twice is scored once)")
    ap.add_argument("--eval-tokens", type=positive_int_or_run, default="run",
                    help="tokens per bpb split/corpus (fixed rows: independent of world size and batch size); run "
                    "= the --eval-tokens the checkpoint's run evaluated with (runs that record none, e.g. imported "
                    f"ones, get {PAPER_EVAL_TOKENS:,}), so its final train and val bpb are scored on the same rows")
    ap.add_argument("--bpb-corpus", action="append", default=[], metavar="NAME=PATH",
                    help="out-of-domain text (.txt = one document, .jsonl = one 'text' per line), scored with "
                    "the document-reset protocol; repeatable")
    ap.add_argument("--tokenizer-dir", default=None, help="override meta['tokenizer_dir']")
    ap.add_argument("--data-dir", default=None, help="override meta['data_dir']")
    ap.add_argument("--device-type", type=device_type_name, default=None, help="cuda|cpu|mps (default: autodetect)")
    ap.add_argument("--dtype", default="run", choices=("run", *DTYPES),
                    help="autocast dtype: run = the dtype the checkpoint's run trained with (auto: bf16 on CUDA, "
                    "fp32 elsewhere)")
    ap.add_argument("--numerics", default="ours", choices=NUMERICS,
                    help="reference = the authors' eval numerics (bf16 RoPE tables except MobileLLM's, MoME top-K on "
                    "router scores in the autocast dtype, their token_bytes, CORE prompts longer than the context "
                    "uncropped up to the rotary table (10x) with each nanochat L layer seeing the last sequence_len "
                    "keys, their scoring of a multiple-choice option whose scored region is empty: it wins when it is "
                    "the first option) to compare with numbers their code prints; ours crops such prompts from the "
                    "left to sequence_len and never picks an option with an empty region")
    ap.add_argument("--attention", default="run", choices=("run", *ATTENTION_BACKENDS),
                    help="attention kernel on CUDA (as base_train's --attention): run = the kernel the checkpoint's "
                    f"run trained with (its config.json 'attention'; runs that record none, e.g. imported ones, get "
                    f"the code's default, {AttentionBackend().name}); the CPU runs sdpa only")
    ap.add_argument("--mome-kernels", default="run", choices=("run", *MOME_KERNELS),
                    help="MoME's Triton kernels on CUDA (as base_train's --mome-kernels): run = the setting that "
                    "takes the kernel path the checkpoint's run recorded (its config.json 'mome_kernels'; where its "
                    "layers differed, the most capable one named, fused > row > torch; runs that record none, e.g. "
                    "imported ones, get auto); the CPU runs the torch ops only")
    ap.add_argument("--mome-shared-table-kernel", default="run", choices=("run", *SHARED_TABLE_KERNEL_CHOICES),
                    help="the MoME kernels for the shared bigram-indexed table too (as base_train's flag): run = on "
                    "where the checkpoint's model has that table and its recorded mome_kernels is a kernel path "
                    "(it took them: with the flag off that table records torch), unless --mome-kernels torch")
    ap.add_argument("--out-dir", default=None, help="default: <run>/eval/step_NNNNNN")
    ap.add_argument("--fresh", action="store_true", help="ignore the results an earlier, interrupted run of this "
                    "evaluation finished (<out-dir>/*.partial.json) and compute everything")
    ap.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = ap.parse_args(argv)
    args.evals = [e for e in args.eval.split(",") if e]
    bad = sorted(set(args.evals) - {"core", "bpb"})
    if bad:
        ap.error(f"--eval: unknown evaluation(s) {bad}; choose from core, bpb")
    # once each, in the order given: "train,train" would build (and hold, 168 MB a rank at 20,971,520 tokens) the
    # same rows twice and score them twice, the second time "reused from an earlier run"; the report is the same
    args.split_names = list(dict.fromkeys(s for s in args.splits.split(",") if s))
    bad = sorted(set(args.split_names) - {"train", "val"})
    if bad:  # now, not once CORE has run
        ap.error(f"--splits: unknown split(s) {bad}; choose from train, val")
    args.corpora = {}
    for spec in args.bpb_corpus:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            ap.error(f"--bpb-corpus expects NAME=PATH, got {spec!r}")
        if not Path(path).is_file():  # now, not after CORE and the split bpbs have run
            ap.error(f"--bpb-corpus {spec}: file {path} does not exist")
        if name in args.corpora:  # one NAME, one line of bpb.json: a second would silently replace the first
            ap.error(f"--bpb-corpus {spec}: the name {name} is given twice (also {name}={args.corpora[name]}); "
                     "give each corpus its own NAME")
        args.corpora[name] = Path(path)
    return args


def positive_int_or_run(text: str) -> int | str:
    if text == "run":
        return "run"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:  # positive_int's message would leave out "run"
        raise argparse.ArgumentTypeError(f"must be 'run' or an integer >= 1 (got {text!r})") from None


def eval_tokens_of(flag: int | str, meta: dict, run_dir: Path | None = None) -> tuple[int, str]:
    """(tokens per bpb split, where it came from): --eval-tokens, else the run's own, else the paper's budget. The
    run's: a mini row's 65,536 are its final evaluation's rows, where 20,971,520 would ask more of the embedded corpus
    than it holds. The run dir's config.json first: every session rewrites it, and a final evaluation resumed with
    another --eval-tokens saves no new checkpoint, so the checkpoint's copy can be the older budget."""
    if flag != "run":
        return flag, "--eval-tokens"
    recorded, where = recorded_value(meta, run_dir, lambda config: recorded_args(config).get("eval_tokens") or None)
    if recorded:
        return int(recorded), f"the run's --eval-tokens ({where})"
    return PAPER_EVAL_TOKENS, "default (the checkpoint does not record --eval-tokens)"


def eval_dtype(flag: str, meta: dict, device_type: str) -> tuple[str, str]:
    """(dtype, where it came from): --dtype, else the run's training dtype (config 'dtype'; older checkpoints:
    their --dtype flag resolved for the device they trained on), else this device's default."""
    if flag != "run":
        return resolve_dtype(device_type, flag), "--dtype"
    config = meta.get("config") or {}
    if config.get("dtype"):
        return config["dtype"], "the run's training dtype"
    trained = recorded_run_args(meta).get("dtype")
    if trained and config.get("device"):
        return resolve_dtype(str(config["device"]).split(":")[0], trained), "the run's training dtype"
    return resolve_dtype(device_type, "auto"), "default for this device (the checkpoint does not record one)"


def eval_attention(flag: str, meta: dict) -> tuple[str, str]:
    """(requested kernel, where it came from): --attention, else the kernel the run trained with (config
    'attention'), else the code's default (runs that record none: imported ones, runs older than --attention)."""
    if flag != "run":
        return flag, "--attention"
    recorded = (meta.get("config") or {}).get("attention")
    if recorded:
        return recorded, "the run's kernel"
    return AttentionBackend().name, "the code's default (the checkpoint does not record a kernel)"


def setup_eval_attention(flag: str, meta: dict, device, dtype: str = "auto") -> tuple[str, str]:
    """Resolve and install the kernel with training's own checks and errors (setup_attention); returns (its name,
    where the request came from)."""
    from nanochat.train_setup import setup_attention

    requested, source = eval_attention(flag, meta)
    try:
        return setup_attention(requested, device, dtype), source
    except ValueError as e:
        if flag != "run":
            raise
        raise raised_like(e, ValueError(f"--attention run: the run trained with {requested}, which cannot run here "
                                        f"({e}); pass --attention {AttentionBackend().name} to evaluate with another "
                                        "kernel")) from e


def eval_mome_kernels(flag: str, meta: dict) -> tuple[str, str]:
    """(requested --mome-kernels setting, where it came from): the flag, else the setting that takes the path the run
    recorded (config 'mome_kernels'), else auto (no MoME: "none"; no record: imported runs, runs older than
    --mome-kernels)."""
    if flag != "run":
        return flag, "--mome-kernels"
    recorded = (meta.get("config") or {}).get("mome_kernels")
    if not recorded or recorded == "none":
        return "auto", "the code's default (the checkpoint records no MoME kernels)"
    parts = recorded.split("+")
    if not set(parts) <= set(KERNEL_PATHS):
        raise ValueError(f"--mome-kernels run: the checkpoint records mome_kernels {recorded!r}, not a kernel path of "
                         f"{', '.join(KERNEL_PATHS)}; pass --mome-kernels {', '.join(MOME_KERNELS[:-1])} or "
                         f"{MOME_KERNELS[-1]}")
    # layers that took different paths ("+"-joined) ran under the setting of the most capable one: only it takes
    # each layer down the same path again (the others were kept off it by their own options, as they are here)
    return min(parts, key=KERNEL_PATHS.index), f"the run's kernels, {recorded}"


def eval_shared_table_kernel(flag: str, kernels: str, meta: dict) -> str:
    """--mome-shared-table-kernel against the checkpoint's model and the --mome-kernels setting (``kernels``: the
    request for an explicit on, the resolved name for run): an explicit on is refused as in training where it can
    change nothing; run is on where the run's shared table took the kernels and they run here. No record (imported
    runs, runs older than the flag): its torch or none."""
    model = meta.get("model_config") or {}
    options = model.get("memory_options") or {}
    shape = (model.get("memory"), options.get("index"), bool(options.get("per_head_table")))
    if flag == "on":
        check_shared_table_kernel(*shape, kernels)
    if flag != "run":
        return flag
    recorded = set(((meta.get("config") or {}).get("mome_kernels") or "none").split("+"))
    took = shape == ("mome", "bigram", False) and bool(recorded & {"fused", "row"})
    return "on" if took and kernels != "torch" else "off"


def _resolves_to(requested: str, device) -> str:
    """The kernels --mome-kernels ``requested`` resolves to here, or ``requested`` where it cannot: the refusal is
    install_mome_kernels', raised by every rank together (a rank raising here alone would skip its collective)."""
    from nanochat.memory.mome_triton import resolve_kernels

    try:
        return resolve_kernels(requested, device)[0]
    except ValueError:
        return requested


def setup_eval_mome_kernels(flag: str, meta: dict, device, stack: ExitStack,
                            shared_table: str = "run") -> tuple[str, str, str]:
    """Resolve and install MoME's kernels with training's own checks and errors (install_mome_kernels), the shared
    table's too (``shared_table``: --mome-shared-table-kernel, eval_shared_table_kernel), until ``stack`` closes;
    returns (the resolved setting, why it differs from the request or "", where the request came from)."""
    from nanochat.train_setup import install_mome_kernels

    requested, source = eval_mome_kernels(flag, meta)
    try:
        # run follows the kernels that resolve here (auto on a GPU without triton: torch ops, so off); an explicit
        # on is checked against the request, as in training
        resolved = _resolves_to(requested, device) if shared_table == "run" else requested
        shared = eval_shared_table_kernel(shared_table, resolved, meta)
        return *install_mome_kernels(requested, device, stack, shared), source
    except ValueError as e:
        if flag != "run":
            raise
        raise raised_like(e, ValueError(f"--mome-kernels run: the run trained with {requested} kernels, which cannot "
                                        f"run here ({e}); pass --mome-kernels torch or auto to evaluate with other "
                                        "kernels")) from e


@dataclass
class BpbItem:
    """A split or corpus of the bpb evaluation: the fingerprint of its inputs (rank 0's) and ``rows()``, its rows
    built once (cached; a split's build is collective: every rank calls it alike)."""
    kind: str  # split | corpus
    name: str
    key: dict
    rows: Callable

    @property
    def item(self) -> str:  # its name in bpb.partial.json
        return f"{self.kind} {self.name}"


@dataclass
class BpbPlan:
    out: dict  # bpb.json's fields but the numbers (its "splits" and "corpora" empty): eval_tokens, seq_len, data_dir
    items: list[BpbItem]
    token_bytes: torch.Tensor


def prepare_bpb(tokenizer, args, meta, seq_len: int, rank: int, world: int, device,
                finished: FinishedResults) -> BpbPlan:
    """Everything of the bpb evaluation before its first forward, run before CORE (minutes to hours on a GPU), so
    that a --eval-tokens the data cannot fill, a missing split or manifest, or a corpus with nothing to score stops
    base_eval before it, not after: the token budget, the data, and the rows of every split and corpus an earlier
    run has not finished. The rows are held until scored (a split of 20,971,520 tokens: 168 MB on every rank, as
    training holds its own final-evaluation rows)."""
    from nanochat.dataloader import eval_rows_order
    from nanochat.dataset import check_run_data, load_manifest, manifest_fingerprint, run_data_dir
    from nanochat.download import file_sha256

    # rank 0's record for every rank: a node's own copy of config.json can record another budget, and ranks that
    # build different numbers of rows fall out of step in the collectives
    eval_tokens, tokens_source = rank0_decides(lambda: eval_tokens_of(args.eval_tokens, meta, Path(args.run)))
    plan = BpbPlan({"eval_tokens": eval_tokens, "seq_len": seq_len, "splits": {}, "corpora": {}}, [],
                   eval_token_bytes(tokenizer, args.numerics).to(device))
    if args.split_names:
        found = run_data_dir(args.data_dir, meta)
        data_dir = found.path
        print0(f"bpb data: {data_dir} ({found.source}); {eval_tokens:,} tokens per split ({tokens_source})")

        def checked_manifest():
            manifest = load_manifest(data_dir, found.dataset)
            check_run_data(found, manifest)
            return manifest

        plan.out["data_dir"] = str(data_dir)
        # build_eval_rows is collective: fail together, before it
        # "result": what an item holds; older code kept a bare bpb (its items are scored again, even where the code
        # version cannot tell the codes apart: outside a git checkout)
        data = {"data_sha256": manifest_fingerprint(every_rank_ok(checked_manifest)),
                "eval_tokens": eval_tokens, "result": "bpb, mome_slot_balance"}
        data_seed = recorded_run_args(meta).get("data_seed")  # the run's train bpb rows
        for split in args.split_names:
            first_read, rows_key = eval_rows_order(split, data_seed)
            plan.items.append(BpbItem("split", split, {**data, **rows_key}, functools.cache(functools.partial(
                split_rows, data_dir, split, tokenizer, seq_len, (eval_tokens, tokens_source), rank, world,
                first_read))))
    for name, path in args.corpora.items():
        key = rank0_decides(lambda: {"file_sha256": file_sha256(path), "eval_tokens": eval_tokens})
        plan.items.append(BpbItem("corpus", name, key, functools.cache(functools.partial(
            corpus_rows, tokenizer, path, seq_len, eval_tokens))))
    for item in plan.items:  # not built for nothing: get_or_run's own test, decided on rank 0 for every rank
        if not rank0_decides(lambda: finished.would_reuse(item.item, item.key)):
            item.rows()
    return plan


def split_rows(data_dir, split: str, tokenizer, seq_len: int, budget: tuple[int, str], rank: int, world: int,
               first_read: int | None):
    """The split's bpb rows (build_eval_rows); a split too small for the budget is refused naming --eval-tokens and
    where the budget came from. Every rank packs the same rows, so every rank refuses together (printed once)."""
    from nanochat.dataloader import EvalRowsTooFew, build_eval_rows
    from nanochat.dataset import DataError

    eval_tokens, source = budget
    try:
        return build_eval_rows(data_dir, split, tokenizer, seq_len, eval_tokens, rank=rank, world_size=world,
                               first_read_seed=first_read)
    except EvalRowsTooFew as e:  # a file's error (tokenizing ranks share it) goes on as it is
        flag = f"--eval-tokens {eval_tokens:,}" if source == "--eval-tokens" else \
            f"--eval-tokens run = {eval_tokens:,}, {source}"
        raise raised_on_every_rank(DataError(f"{flag}: {e}")) from e


def corpus_rows(tokenizer, path: Path, seq_len: int, eval_tokens: int):
    """(inputs, targets) of a --bpb-corpus file (bpb_rows_from_text), read by every rank: one that fails stops all.
    A plain-text file (one document) is read and tokenized only as far as the rows need."""
    from nanochat.loss_eval import bpb_rows_from_text, corpus_documents

    return every_rank_ok(lambda: bpb_rows_from_text(tokenizer, corpus_documents(path), seq_len,
                                                    max_tokens=eval_tokens))


def run_bpb(model, plan: BpbPlan, args, rank, world, device, autocast_ctx, finished: FinishedResults) -> dict:
    """Score the rows of ``plan`` (prepare_bpb); bpb.json's fields."""
    from nanochat.dataloader import iter_eval_batches
    from nanochat.loss_eval import evaluate_bpb, iter_row_batches
    from nanochat.report import train_rows_description

    B, token_bytes = args.device_batch_size, plan.token_bytes
    out = {**plan.out, "splits": {}, "corpora": {}}  # new dicts, in plan.out's places (bpb.json's key order)
    for item in plan.items:
        name = item.name
        if item.kind == "split":
            def score_split():  # bpb, and for MoME the slot balance of the same forwards (nanochat.slot_balance)
                bpb, balance = with_slot_balance(model, lambda: evaluate_bpb(
                    model, iter_eval_batches(item.rows(), B, rank, world, device), token_bytes, autocast_ctx))
                return {"bpb": bpb, "mome_slot_balance": balance}

            scored = finished.get_or_run(item.item, lambda: item.key, score_split)
            out["splits"][name] = scored["bpb"]
            if name == "train":  # as summary.json's: which documents this train bpb read (the key's "rows")
                out["train_bpb_rows"] = train_rows_description(item.key)
            print0(f"{name} bpb: {scored['bpb']:.6f}")
            if scored["mome_slot_balance"]:
                balance = out.setdefault("mome_slot_balance", {})[name] = scored["mome_slot_balance"]
                print0(f"{name} {describe(balance)}")
        else:
            def score_corpus():
                x, y = item.rows()
                return evaluate_bpb(model, iter_row_batches(x, y, B, rank, world, device), token_bytes, autocast_ctx)

            bpb = finished.get_or_run(item.item, lambda: item.key, score_corpus)
            out["corpora"][name] = {"bpb": bpb, "path": str(args.corpora[name]), "protocol": "document-reset"}
            print0(f"{name} bpb (document-reset): {bpb:.6f}")
    if finished.reused:
        print0(finished.reuse_note("bpb results", len(out["splits"]) + len(out["corpora"])))
    return out


def load_chosen_checkpoint(run: Path, step: int, device):
    require_files(run, step, ("meta.json", "model.pt"))  # a clear error on a node that cannot see rank 0's choice
    return load_model(run, step, device)


def main(argv=None) -> int:
    """Exit 2 with one error line for a bad run dir, checkpoint, tokenizer, data or bundle; 128 + the signal number
    with one line after Ctrl-C or SIGTERM (what finished is kept); one that comes once the last report is written
    (under torchrun: in that write's step) changes nothing, exit 0."""
    from nanochat.dataset import DataError
    from nanochat.download import DownloadError  # the CORE bundle, offline without --bundle
    from nanochat.launcher_watch import watch_launcher

    keep_running_without_output()  # a dead reader of the output (a killed `| tee`) does not end the evaluation
    watch_launcher()  # under torchrun: a SIGKILLed launcher stops this rank as a SIGTERM would
    try:
        args = parse_args(argv)
        with interrupts_raise():
            return evaluate(args)
    except (FileNotFoundError, ValueError, KeyError, DataError, DownloadError, ResultWriteError) as e:
        print_error(e)  # once under torchrun when every rank raised it together
        compute_cleanup()
        return 2
    except Interrupted as e:  # during the setup (evaluate handles the evaluation itself), on every rank alike
        print0(f"base_eval: interrupted ({e}) before anything was evaluated", file=sys.stderr)
        compute_cleanup()  # gloo's threads joined now: left to the exit, a rank sometimes died of SIGABRT
        return 128 + e.signum


def evaluate(args) -> int:
    info, device = compute_init(args.device_type)
    rank = info.rank
    run = Path(args.run)
    # rank 0 picks the step; every rank must then load it (under torchrun all ranks take the same branches)
    step = rank0_decides(lambda: existing_step(run, args.step))
    out_dir = Path(args.out_dir) if args.out_dir else run / "eval" / f"step_{step:06d}"
    rank0_decides(lambda: ensure_writable(out_dir, "--out-dir"))  # rank 0 writes the results: fail now, not after
    # one evaluation per output directory at a time: two would overwrite each other's partial results and reports
    lock = RunDirLock(out_dir) if rank == 0 else None
    try:  # a signal on any rank can end the acquiring step once rank 0 holds the lock (release: a no-op if not held)
        rank0_decides(lambda: lock.acquire("--out-dir") and None)
        with ExitStack() as stack:  # MoME's kernel globals back as they were for a caller in this process (tests)
            return evaluate_into(args, info, device, run, step, out_dir, stack)
    finally:
        if lock is not None:
            lock.release(remove_file=True)


def check_flags_against(args, meta: dict, device_type: str) -> None:
    """The checks of the flags against the checkpoint that enter no collective (the set-up repeats them), run first,
    in every_rank_ok: a refusal each rank raised on its own was printed by every rank. The set-up's own checks
    (setup_attention, install_mome_kernels) are collectives that raise on every rank together."""
    eval_dtype(args.dtype, meta, device_type)
    requested, _ = eval_mome_kernels(args.mome_kernels, meta)
    if args.mome_shared_table_kernel == "on":  # an explicit on is checked against the request (run: no refusal)
        eval_shared_table_kernel("on", requested, meta)


def evaluate_into(args, info, device, run: Path, step: int, out_dir: Path, stack: ExitStack) -> int:
    from nanochat.analysis import run_tokenizer_dir
    from nanochat.eval_bundle import find_bundle, run_core_inputs
    from nanochat.tokenizer import check_vocab_matches, get_tokenizer
    from nanochat.train_setup import report_mome_kernels

    rank, world = (info.rank, info.world_size)
    model, meta = every_rank_ok(lambda: load_chosen_checkpoint(run, step, device))
    model.eval()
    # the flags against the checkpoint: refused alike on every rank, so print_error prints it once
    every_rank_ok(lambda: check_not_synthetic(meta, f"{run} step {step}", "CORE and bpb score text in the run's own "
                                              "tokenizer (CORE the bundle's prompts, bpb the data's splits and "
                                              "--bpb-corpus files)", "evaluate"))
    every_rank_ok(lambda: check_flags_against(args, meta, device.type))
    numerics = apply_numerics(model, args.numerics)
    dtype, dtype_source = eval_dtype(args.dtype, meta, device.type)
    attention, attention_source = setup_eval_attention(args.attention, meta, device, dtype)
    # read at each forward (nothing here is compiled), so after the model is built; what its layers then take is the
    # record, not the setting (a shared expert, per-head tables, the CPU keep kernels off)
    *kernels, mome_kernels_source = setup_eval_mome_kernels(args.mome_kernels, meta, device, stack,
                                                             args.mome_shared_table_kernel)
    mome_kernels = report_mome_kernels(model, kernels)
    autocast_ctx = autocast_context(device.type, dtype)
    tok_dir, source = run_tokenizer_dir(args.tokenizer_dir, meta)  # printed below: never silent
    # rank 0's reading of the run's records and the bundle's files, for every rank (only rank 0 reads the bundle)
    core = rank0_decides(lambda: run_core_inputs(args.bundle, args.max_per_task, meta, run)) \
        if "core" in args.evals else None
    print0(f"checkpoint {run} step {step}; tokenizer {tok_dir} ({source}); "
           + (f"{core.describe()}; " if core else "") + f"world size {world}; numerics {args.numerics}; "
           f"dtype {dtype} ({dtype_source}); attention {attention} ({attention_source}); "
           f"mome kernels {mome_kernels} ({mome_kernels_source})")
    tokenizer = every_rank_ok(lambda: get_tokenizer(tok_dir))
    every_rank_ok(lambda: check_vocab_matches(tokenizer, meta["model_config"]["vocab_size"], f"{run} step {step}",
                                              meta))
    header = {"run": str(run), "step": step, "tokenizer_dir": str(tok_dir), "dtype": dtype, "attention": attention,
              "mome_kernels": mome_kernels, **numerics}
    # everything besides an item's own inputs that can change a number, down to its last digits: the batch size and
    # the world size decide which rows share a forward (CORE pads them to a common length, which moves float32
    # logits in the last bits) and the order of the bpb sums
    @functools.cache  # once on rank 0, for the core and the bpb results alike (git, tokenizer hash)
    def settings():
        return eval_settings(step_dir(run, step) / "model.pt", run, step, device,
                             tokenizer_sha256=tokenizer.fingerprint(), dtype=dtype, numerics=numerics,
                             attention=attention, mome_kernels=mome_kernels,
                             device_batch_size=args.device_batch_size, world_size=world)

    stores = {name: FinishedResults.open(out_dir, name, settings, args.fresh) for name in args.evals}
    try:
        # what CORE and bpb read, checked (and the bpb rows built) before CORE runs: a problem of either stops
        # base_eval now, not minutes to hours later
        bundle = rank0_decides(lambda: find_bundle(core.bundle)) if core else None
        if "bpb" in args.evals:
            plan = prepare_bpb(tokenizer, args, meta, model.max_seq_len, rank, world, device, stores["bpb"])
        if "core" in args.evals:
            run_core_eval(model, tokenizer, args, bundle, core.max_per_task, device, autocast_ctx, out_dir, header,
                          stores["core"], last="bpb" not in args.evals)
        if "bpb" in args.evals:
            res = run_bpb(model, plan, args, rank, world, device, autocast_ctx, stores["bpb"])
            write_report_on_rank0(out_dir / "bpb.json", lambda: write_text_atomic(
                out_dir / "bpb.json", json.dumps({**header, **res}, indent=2) + "\n"))
    except Interrupted as e:  # on every rank at the same batch (nanochat.eval_resume.stop_voted)
        print0(f"base_eval: interrupted ({e}); {kept_note(stores, out_dir)}", file=sys.stderr)
        compute_cleanup()  # every rank is here: its gloo threads are joined now, not at exit (see compute_cleanup)
        return 128 + e.signum
    except Exception as e:  # e.g. another rank was stopped and a collective failed here: the error follows
        if any(store.items for store in stores.values()):
            print0(f"base_eval: failed ({type(e).__name__}); {kept_note(stores, out_dir)}", file=sys.stderr)
        raise
    for store in stores.values():
        store.discard()
    print0(f"results in {out_dir}")
    compute_cleanup()
    return 0


def kept_note(stores: dict, out_dir: Path) -> str:
    kept = ", ".join(f"{len(store.items)} {name}" for name, store in stores.items())
    return f"finished results ({kept}) are kept in {out_dir}: run the same command again to continue"


def run_core_eval(model, tokenizer, args, bundle: Path, max_per_task: int, device, autocast_ctx, out_dir: Path,
                  header: dict, finished: FinishedResults, last: bool) -> None:
    """``bundle``: rank 0's (find_bundle; only rank 0 reads it, see evaluate_core); ``max_per_task``: the resolved
    per-task cap (run_core_inputs). ``last``: its report is the evaluation's last write (see write_report_on_rank0)."""
    from nanochat.core_eval import evaluate_core, write_core_report

    res = evaluate_core(model, tokenizer, bundle, max_per_task, args.device_batch_size, device,
                        autocast_ctx, progress=not args.no_progress, finished=finished)
    if finished.reused:
        print0(finished.reuse_note("CORE tasks", len(res["tasks"])))
    (write_report_on_rank0 if last else write_on_rank0)(f"the CORE report (core.json, core.csv, core.md) in {out_dir}",
                                                        lambda: write_core_report(res, out_dir, header))
    print0(f"{res['label']} [{header['dtype']}]: {res['core']:.6f}" + (f" (missing: {', '.join(res['missing'])})"
                                                                 if res["missing"] else ""))


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
