"""Trainer setup that touches the outside world: tokenizer, data loaders, fixed val rows, the CORE bundle, the
attention kernel, MoME's kernels, the run dir; and --dry-run (the plan alone).

Kept apart from scripts/base_train.py so the loop reads top to bottom. --dry-run needs no data and does not
resolve --attention or --mome-kernels: of this it only reads an existing tokenizer (``existing_tokenizer``: its
size, and for --init-from its fingerprint) and, where data is prepared, the train split's manifest and first
documents (``data_passes_lines``: the passes over it, and the paper's shard count).
"""

import json
import shlex
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from nanochat import checkpoint as ckpt
from nanochat import init_from, run_control
from nanochat.common import (every_rank_ok, get_dist_info, print0, rank0_decides, raised_on_every_rank,
                             resolve_dtype)
from nanochat.families import NAMED_SIZES, model_summary
from nanochat.gpt import attention_dtype, resolve_attention, set_attention_backend
from nanochat.jsonfile import write_text_atomic
from nanochat.memory import mome_mix, mome_triton
from nanochat.memory.mome_triton import MAX_TILE, resolve_kernels
from nanochat.plan import build_plan
from nanochat.row_config import REPO
from nanochat.run_dir import ensure_writable, run_contents
from nanochat.train_args import model_config
from nanochat.train_loop import SyntheticLoader, gather_objects, synthetic_eval_rows

SYNTHETIC_VOCAB = 32768
DRY_RUN_VOCAB = 32768  # the paper's tokenizer: what --dry-run assumes when there is none yet and no --vocab-size


@dataclass
class RunData:
    loader: object
    val_rows: torch.Tensor | None  # built after the cheap checks (load_eval_rows)
    token_bytes: torch.Tensor
    tokenizer: object | None
    vocab_size: int
    source: str
    bundle: Path | None = None  # resolved (find_bundle): config.json "data" "bundle", read from any directory
    train_rows: torch.Tensor | None = None  # fixed rows of the train split for the final "train bpb"
    tokenizer_dir: str | None = None  # resolved absolute paths, recorded in checkpoint meta for eval/analysis
    data_dir: str | None = None
    tokenizer_sha256: str | None = None  # content fingerprints, checked on --resume (paths may move)
    data_sha256: str | None = None
    # the dataset the manifest of data_dir records: what was trained on (with --data-dir, --dataset is only a label)
    dataset: str | None = None
    # the train split's tokens as the plan estimates them (report_data_passes, rank 0): metrics.jsonl's data_passes
    # is the tokens trained over it, so that it ends where the dry run's "data passes" said it would
    train_split_tokens: int | None = None

    def describe(self) -> dict:
        return {"source": self.source, "data_dir": self.data_dir, "dataset": self.dataset,
                "vocab_size": self.vocab_size, "val_rows": len(self.val_rows),
                "bundle": str(self.bundle) if self.bundle else None}


def _same_on_every_rank(flag: str, requested: str, name: str, fix: str) -> None:
    """Every rank resolved ``flag requested`` alike (device kind, packages), unless one node differs: then every rank
    stops, naming what each got and ``fix``, rather than train with mixed kernels. Collective."""
    names = gather_objects(name)
    if len(set(names)) > 1:
        raise raised_on_every_rank(ValueError(f"{flag} {requested} resolved to {names} on ranks 0..{len(names) - 1}: "
                                              f"{fix}"))  # from the gathered names: printed once (print_error)


def setup_attention(requested: str, device, dtype: str = "auto") -> str:
    """Resolve --attention once, before the model is built and compiled, and install it for ``causal_attention``;
    returns the resolved name. Every rank resolves alike (device kind and packages), but a kernels-hub download can
    fail on one node only: ranks that disagree stop the run rather than train with mixed kernels. ``dtype`` (--dtype):
    a FlashAttention kernel under float32 says that its attention is bf16."""
    backend = every_rank_ok(lambda: resolve_attention(requested, device))
    _same_on_every_rank("--attention", requested, backend.name,
                        "install the same attention packages on every node, or pass --attention sdpa, fa2 or fa3")
    set_attention_backend(backend)
    print0(f"attention: {backend.name}" + (f" ({backend.reason})" if backend.reason else ""))
    dtype = resolve_dtype(torch.device(device).type, dtype)
    if (computed := attention_dtype(backend.name, dtype)) != dtype:
        print0(f"attention: {backend.name} computes in {computed} under --dtype {dtype} "
               "(FlashAttention takes 16-bit inputs only); pass --attention sdpa for float32 attention")
    return backend.name


def install_mome_kernels(requested: str, device, stack: ExitStack, shared_table: str = "off") -> tuple[str, str]:
    """Resolve --mome-kernels once, before the model is built and compiled (a later change would only make dynamo
    recompile), and install it (nanochat.memory.mome_mix.set_kernels) with --mome-shared-table-kernel
    (``shared_table``, "off" or "on": mome_mix.set_shared_table_kernel) until ``stack`` closes; returns the resolved
    name and a note for the log: why it differs from the request, and what the shared table's setting does ("" if
    there is nothing to say). Harmless for other memories. Every rank resolves alike (device kind, triton import),
    but a node without triton would not: ranks that disagree stop the run rather than train with mixed kernels."""
    name, reason = every_rank_ok(lambda: resolve_kernels(requested, device))
    _same_on_every_rank("--mome-kernels", requested, name, "install triton on every node, or pass --mome-kernels torch")
    reason = "; ".join(r for r in (reason, shared_table_note(shared_table, name, device)) if r)
    # a caller in the same process (the tests, a notebook) gets the module's globals back as they were
    keys = {key for settings in mome_mix.KERNEL_SETTINGS.values() for key in settings} | {"SHARED_TABLE_KERNEL"}
    stack.callback(vars(mome_mix).update, {key: getattr(mome_mix, key) for key in keys})
    mome_mix.set_kernels(name)
    mome_mix.set_shared_table_kernel(shared_table == "on")
    return name, reason


def shared_table_note(shared_table: str, kernels: str, device) -> str:
    """What --mome-shared-table-kernel on does with the resolved --mome-kernels on this device, for the log ("" for
    off). The kernels off on CUDA (auto without triton) is an error: the flag asked for them; off on a device the
    kernels never run on (the CPU) it has no effect, as --mome-kernels fused there, and is said to."""
    if shared_table == "off":
        return ""
    if shared_table != "on":
        raise ValueError(f"--mome-shared-table-kernel must be off or on (got {shared_table!r})")
    if kernels != "torch":
        return "the shared table too: --mome-shared-table-kernel on"
    device = torch.device(device)
    if device.type in mome_triton.KERNEL_DEVICES:
        raise raised_on_every_rank(ValueError(  # the kernels' name was agreed on every rank: printed once
            f"--mome-shared-table-kernel on: the MoME kernels resolved to torch ops on {device.type} (triton cannot "
            "be imported), so the shared table cannot take them; install triton, or pass --mome-shared-table-kernel "
            "off"))
    return f"--mome-shared-table-kernel on: no effect either, this run is on {device.type}"


def report_mome_kernels(model, kernels: tuple[str, str]) -> str:
    """The kernel path the built model's layers take (model_kernel_path: what a run records), after logging how
    the setting resolved (``kernels``, install_mome_kernels' result) for a model with MoME's layers only: the
    resolution says nothing about a model without them. Training and evaluation both install before the model is
    built and log after. With the kernels installed and mome_mix.SHARED_TABLE_KERNEL on, a model whose layers
    still take torch ops (a shape or dtype mome_triton.applies refuses) is an error: the flag asked for them."""
    path = model_kernel_path(model)
    name, reason = kernels
    if mome_mix.shared_table_kernel() and name != "torch" and path == "torch":
        raise raised_on_every_rank(ValueError(  # one model and one setting on every rank: printed once
            "--mome-shared-table-kernel on: the model's shared table does not take the MoME Triton kernels "
            "(nanochat.memory.mome_triton.applies: an fp32 table, heads and head size rounded up to powers of 2 "
            f"within {MAX_TILE} values, at most 64 slots); pass --mome-shared-table-kernel off"))
    if path != "none":
        print0(f"mome kernels: {name}" + (f" ({reason})" if reason else ""))
    return path


def model_kernel_path(model) -> str:
    """The MoME kernel path the built model's memory layers take (``MoMEMemory.kernel_path``), "none" for
    memories without MoME's kernels: what config.json and summary.json record as ``mome_kernels``."""
    path = getattr(getattr(model, "memory", None), "kernel_path", None)
    return path() if path is not None else "none"


def tokenizer_dir(args) -> Path:
    """--tokenizer-dir, else the default tokenizer directory (NANOCHAT_TOKENIZER_DIR or tokenizer/)."""
    from nanochat.tokenizer import default_tokenizer_dir

    return Path(args.tokenizer_dir) if args.tokenizer_dir else default_tokenizer_dir()


def existing_tokenizer(args):
    """The tokenizer a run of these flags would train with, if it exists already (--dry-run needs none yet);
    None with --synthetic-data."""
    from nanochat.tokenizer import HEADER_FILE, get_tokenizer

    tok_dir = tokenizer_dir(args)
    return None if args.synthetic_data or not (tok_dir / HEADER_FILE).is_file() else get_tokenizer(tok_dir)


def _data_dir(args) -> Path:
    from nanochat.dataset import default_data_dir

    return Path(args.data_dir) if args.data_dir else default_data_dir(args.dataset)


def check_run_dataset(args, data_dir: Path, manifest: dict) -> None:
    """Without --data-dir the run reads --dataset's default directory: refuse another dataset's data there
    (dataset.check_default_dir_dataset). With --data-dir the directory is the user's choice (docs/extending.md
    trains on a --data-dir of the embedded corpus with the default --dataset): it is read whatever it holds."""
    from nanochat.dataset import DataError, check_default_dir_dataset

    if args.data_dir:
        return
    try:
        check_default_dir_dataset(data_dir, args.dataset, manifest)
    except DataError as e:  # a flag-level error before any training, as --data-dir's are
        raise ValueError(str(e)) from None


def load_run_data(args, rank: int, world: int, device, loaded=None) -> RunData:
    """Tokenizer (vocab checked against --vocab-size), the per-rank train loader and the fingerprints --resume
    checks; the fixed eval rows (the expensive part) come later, from ``load_eval_rows``. ``loaded``: the tokenizer
    already read from this run's tokenizer directory (``existing_tokenizer``), else it is read here."""
    if args.synthetic_data:
        vocab = args.vocab_size or SYNTHETIC_VOCAB
        loader = SyntheticLoader(vocab, args.device_batch_size, args.max_seq_len, rank, world, args.data_seed, device)
        # every token counts as one "byte": the reported bpb is bits per token
        return RunData(loader, None, torch.ones(vocab, dtype=torch.long), None, vocab, "synthetic")
    from nanochat.dataloader import PackedDataLoader
    from nanochat.dataset import DataError, load_manifest, manifest_fingerprint
    from nanochat.tokenizer import HEADER_FILE, get_tokenizer

    tok_dir = tokenizer_dir(args)
    data_dir = _data_dir(args)

    def open_local():  # per-rank files: every rank must have them before the collective row building
        if loaded is None and not (tok_dir / HEADER_FILE).is_file():  # the hint trains one on this run's data
            raise ValueError(f"no tokenizer in {tok_dir} (missing {HEADER_FILE}); train one with "
                             f"`{tok_train_command(args, tok_dir)}`, or pass --tokenizer-dir DIR of an existing one")
        tokenizer = loaded if loaded is not None else get_tokenizer(tok_dir)
        check_pinned_vocab(args, tokenizer)  # the --dry-run's check: a hint with this run's tok_train command
        # the tokenizer's raw bytes, as base_eval counts them (numerics.eval_token_bytes), not token_bytes.pt: a
        # hand-copied file of another convention would make a run's train-time and base_eval bpb differ
        token_bytes = tokenizer.token_bytes()
        try:
            manifest = load_manifest(data_dir)
        except DataError as e:
            raise ValueError(f"--data-dir {data_dir}: {e}") from e
        check_run_dataset(args, data_dir, manifest)  # here: a rank whose copy differs stops every rank
        try:
            return tokenizer, token_bytes, manifest, PackedDataLoader(data_dir, "train", args.device_batch_size, args.max_seq_len, tokenizer,
                                               rank=rank, world_size=world, seed=args.data_seed, device=device)
        except DataError as e:
            raise ValueError(f"--data-dir {data_dir}: {e}") from e

    tokenizer, token_bytes, manifest, loader = every_rank_ok(open_local)
    # resolved, as in meta.json: a report or eval read from another directory names the same data
    data_dir, tok_dir = data_dir.resolve(), tok_dir.resolve()
    return RunData(loader, None, token_bytes, tokenizer, tokenizer.vocab_size, f"{data_dir} (tokenizer {tok_dir})",
                   tokenizer_dir=str(tok_dir), data_dir=str(data_dir),
                   tokenizer_sha256=tokenizer.fingerprint(), data_sha256=manifest_fingerprint(manifest),
                   dataset=manifest["dataset"])


def load_eval_rows(args, data: RunData, rank: int, world: int) -> None:
    """The fixed val rows (and train rows for --final-train-bpb) of --eval-tokens tokens, into ``data``."""
    if args.synthetic_data:
        data.val_rows = synthetic_eval_rows(data.vocab_size, args.max_seq_len, args.eval_tokens, args.data_seed)
        return  # no train rows: the synthetic stream has no separate train split (its "train bpb" would be val's)
    from nanochat.dataloader import build_eval_rows, eval_rows_order
    from nanochat.dataset import DataError

    data_dir = _data_dir(args)
    # the paper's "train bpb", on data the run has trained on (the reference: the first training files, which its
    # loader reads first): the same budget from the documents this run's loader reads first (epoch 0 of
    # --data-seed), not the split's first ones in manifest order, which the permuted stream may never reach. The
    # rows of each split follow eval_rows_order, as their entry in the final evaluation's fingerprint does

    def rows(split: str):
        return build_eval_rows(data_dir, split, data.tokenizer, args.max_seq_len, args.eval_tokens, rank=rank,
                               world_size=world, first_read_seed=eval_rows_order(split, args.data_seed)[0])

    try:
        data.val_rows = rows("val")
        data.train_rows = rows("train") if args.final_train_bpb else None
    except DataError as e:  # surfaced as a flag-level error (--data-dir / --eval-tokens) before any training
        raise ValueError(f"--data-dir {data_dir}: {e}") from e


PASSES_SAMPLE_DOCS = 1024  # documents tokenized to estimate the train split's tokens (~1M tokens of FineWeb-Edu)


def data_passes_lines(args, total_tokens: int, tokenizer) -> list[str]:
    """``data_passes_plan``'s lines."""
    return data_passes_plan(args, total_tokens, tokenizer)[0]


def data_passes_plan(args, total_tokens: int, tokenizer) -> tuple[list[str], int | None]:
    """(lines, the train split's estimated tokens or None): the passes over the prepared train split that a run of
    ``total_tokens`` makes (estimated), and a warning when the row config's paper run read another number of
    shards of that dataset (``[row] train_shards``): the run then repeats its data more or less often than the
    paper's, which changes its numbers. Printed by --dry-run and when a run starts. A warning, not a refusal: smoke
    and local runs reuse the rows on a few shards, and the passes made are in metrics.jsonl (data_passes: the tokens
    trained over this estimate) beside the results."""
    from nanochat.dataset import DataError, load_manifest

    if args.synthetic_data:
        return [], None
    data_dir, paper = _data_dir(args), args.paper_shards
    try:
        manifest = load_manifest(data_dir)
    except DataError:
        hint = f" (the paper's: {prepare_command(args, *paper)})" if paper else ""
        return [f"{'data passes':>26}: unknown: no prepared data in {data_dir} yet{hint}"], None
    try:
        check_run_dataset(args, data_dir, manifest)
    except ValueError as e:  # a plan, not the run: it says so
        return [f"{'data passes':>26}: unknown: the run will refuse it: {e}"], None
    prepared = len(manifest["train"])
    split_tokens, line = _estimated_split(data_dir, total_tokens, tokenizer, f"{prepared} shards in {data_dir}")
    passes = None if split_tokens is None else total_tokens / max(split_tokens, 1)
    lines = [f"{'data passes':>26}: {line}"]
    if paper and paper[1] == manifest["dataset"] and paper[0] != prepared:
        shards, dataset = paper
        theirs = f"~{passes:.2f} passes where the paper's {shards} give ~{passes * prepared / shards:.2f}" \
            if passes is not None else f"{shards / prepared:.2f} x the paper's passes"
        lines.append(f"warning: the paper trained this row on {shards} {dataset} train shards and {data_dir} holds "
                     f"{prepared}: the run makes {theirs}, which changes its results; to follow the paper: "
                     f"{prepare_command(args, shards, dataset)}")
    return lines, split_tokens


def tok_train_command(args, output_dir) -> str:
    """The tok_train command that trains this run's tokenizer: on its data (tok_train's own default dataset may be
    another: a mini row's is the embedded corpus) and at its --vocab-size where one is given."""
    vocab = f" --vocab-size {args.vocab_size}" if args.vocab_size is not None else ""
    return (f"python -m scripts.tok_train{vocab} --data-dir {shlex.quote(str(_data_dir(args)))} "
            f"--output-dir {shlex.quote(str(output_dir))}")


def prepare_command(args, shards: int, dataset: str) -> str:
    """The prepare_data command that gives the run's data directory the paper's ``shards``: with the run's
    --data-dir, since without it prepare_data fills the default directory, which this run does not read."""
    command = f"python -m scripts.prepare_data --dataset {dataset} --num-shards {shards}"
    return command + (f" --data-dir {shlex.quote(str(args.data_dir))}" if args.data_dir else "")


def _estimated_split(data_dir: Path, total_tokens: int, tokenizer, shards: str) -> tuple[int | None, str]:
    """(the split's tokens estimated on its first documents or None, what to print: the passes of
    ``total_tokens``); ``shards`` says what the split is ("8 shards in DIR")."""
    from nanochat.dataloader import estimate_split_tokens
    from nanochat.dataset import DataError

    if tokenizer is None:
        return None, f"unknown until the tokenizer exists (the prepared train split: {shards})"
    try:
        split_tokens, sampled = estimate_split_tokens(data_dir, "train", tokenizer, PASSES_SAMPLE_DOCS)
    except DataError as e:  # the run's loader refuses the file; a plan only loses its estimate
        return None, f"unknown: {e} (the prepared train split: {shards})"
    passes = total_tokens / max(split_tokens, 1)
    return split_tokens, (f"~{passes:.2f} over the prepared train split: {shards}, ~{split_tokens:,} tokens "
                          f"(estimated from its first {sampled:,} documents)")


def report_data_passes(args, plan: dict, data: RunData, rank: int) -> None:
    """``data_passes_lines`` when a run starts (rank 0: it reads a sample of the data), and the estimate of the
    split's tokens they come from into ``data.train_split_tokens``. Every session of a run (a resume too) makes the
    same estimate: the same first documents of the same data (its fingerprint is checked), the same tokenizer."""
    if rank == 0:
        lines, data.train_split_tokens = data_passes_plan(args, plan["total_tokens"], data.tokenizer)
        for line in lines:
            print0(line.strip())


def resolve_bundle(args) -> Path | None:
    """The CORE bundle, resolved before training so a bad --bundle fails early.

    An explicit --bundle must work (error otherwise). Without it, the evaluator's search order is tried and a
    failure (e.g. no internet for the download) disables CORE with a loud message: CORE is "when available".
    Decided on rank 0 for every rank (CORE is collective; only rank 0 reads the bundle, see evaluate_core).
    """
    if not (args.final_core or args.core_every > 0 or args.eval_every_flops) or args.synthetic_data:
        return None
    return rank0_decides(lambda: _find_bundle_here(args))


def _find_bundle_here(args) -> Path | None:
    from nanochat.eval_bundle import find_bundle

    if args.bundle:
        try:
            return find_bundle(args.bundle)
        except (FileNotFoundError, RuntimeError, OSError) as e:
            raise ValueError(f"--bundle {args.bundle}: {e}") from e
    try:
        return find_bundle(None)
    except Exception as e:  # noqa: BLE001 - any download/parse failure means "no bundle available"
        print0(f"warning: no CORE eval bundle available ({type(e).__name__}: {e}); CORE will be skipped. "
               "Pass --bundle DIR or --bundle subset to evaluate CORE, or --no-final-core to silence this.")
        return None


def run_split_bpb(model, data: RunData, args, rank: int, world: int, device, autocast_ctx, split: str = "val") -> float:
    from nanochat.dataloader import iter_eval_batches
    from nanochat.loss_eval import evaluate_bpb

    rows = data.val_rows if split == "val" else data.train_rows
    batches = iter_eval_batches(rows, args.eval_batch_size or args.device_batch_size, rank, world, device)
    was_training = model.training
    model.eval()
    try:
        return evaluate_bpb(model, batches, data.token_bytes.to(device), autocast_ctx)
    finally:
        model.train(was_training)


def run_core(model, data: RunData, args, device, autocast_ctx, finished=None) -> dict:
    """``finished``: see nanochat.core_eval.evaluate_core (the final evaluation keeps each task's counts)."""
    from nanochat.core_eval import evaluate_core

    return evaluate_core(model, data.tokenizer, data.bundle, max_per_task=args.core_max_per_task,
                         batch_size=args.eval_batch_size or args.device_batch_size, device=device,
                         autocast_ctx=autocast_ctx, progress=True, finished=finished)


# -- the run dir, and --dry-run's plan ----------------------------------------------------------------------
def resolve_run_dir(args) -> Path:
    if args.run_name is None:
        # d<depth> is the nanochat family's own name (the paper's d12, d20); every other family, a registered GPT
        # variant too, leads with its --model-type, so two families' runs of one depth never share runs/<name>
        size = f"d{args.depth}" if args.model_type == "nanochat" else (
            args.model_type if args.model_type in NAMED_SIZES else f"{args.model_type}-d{args.depth}")
        args.run_name = f"{size}{'-moe' if args.mlp == 'moe' else ''}-{args.memory}"
    return Path(args.run_dir) if args.run_dir else REPO / "runs" / args.run_name


def write_json(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def dry_run_vocab(args, tokenizer) -> tuple[int, str, bool]:
    """(vocab size, where it comes from, whether it is only assumed) for --dry-run: the vocab of the run's model is
    --vocab-size, else its tokenizer's (``tokenizer``: the one the run would load, if it exists), else with
    --synthetic-data that stream's default. With none of them (a plan made before the tokenizer is trained) the
    paper's is assumed, and said: FLOPs/token, hence the steps of --target-flops and the FLOP targets, depend on it."""
    if args.vocab_size is not None:
        return args.vocab_size, "--vocab-size", False
    if args.synthetic_data:
        return SYNTHETIC_VOCAB, "the --synthetic-data default", False
    if tokenizer is not None:
        return tokenizer.vocab_size, f"the tokenizer in {tokenizer_dir(args)}", False
    assumed = (f"ASSUMED (no tokenizer in {tokenizer_dir(args)} yet): the run uses its tokenizer's; pass --vocab-size N "
               "or --tokenizer-dir DIR for the plan and FLOP-target steps of the real one")
    return DRY_RUN_VOCAB, assumed, True


def dry_run(args, tokenizer=None) -> None:
    """Build on the meta device, print the plan, write plan.json; the last stdout line is the plan as JSON.
    ``tokenizer``: the one preflight read, if it did."""
    world = get_dist_info().world_size
    if tokenizer is None:  # the run's vocab, and for --init-from the fingerprint (None: synthetic or none yet)
        tokenizer = existing_tokenizer(args)
    check_pinned_vocab(args, tokenizer)
    vocab, vocab_source, assumed = dry_run_vocab(args, tokenizer)
    config = model_config(args, vocab)
    plan = build_plan(args, model_summary(config), world)
    try:
        flop_lines = run_control.check_flop_flags(args, plan)
    except ValueError as e:
        raise ValueError(f"{e} (vocab size {vocab:,} {vocab_source})" if assumed else str(e)) from None
    run_dir = resolve_run_dir(args)
    resuming = args.resume and ckpt.list_steps(run_dir)  # a resume never reads an --init-from source
    checks_source = args.init_from and not resuming
    source_line = None
    if args.init_from and resuming:
        source_line = f"{'init from':>26}: {args.init_from} not read: --resume continues this run's checkpoints"
    elif checks_source:
        source_line = init_from.check_for_dry_run(args, run_dir, tokenizer, lambda vocab: model_config(args, vocab))
    existing_run = run_contents(run_dir) if run_dir.is_dir() else []
    if get_dist_info().rank == 0 and not existing_run:
        ensure_writable(run_dir, "--run-dir")
        write_json(run_dir / "plan.json", {**plan, "model_config": config.to_dict()})
    print0(f"{'vocab size':>26}: {vocab:,} ({vocab_source})" if not assumed else
           f"{'vocab size':>26}: {vocab:,} {vocab_source}")
    for key, value in plan.items():
        print0(f"{key:>26}: {value:,}" if isinstance(value, int) else f"{key:>26}: {value}")
    if existing_run:  # its plan.json is the run's own (written when it started)
        print0(f"{'plan not written':>26}: {run_dir} holds a run ({', '.join(existing_run)})")
    else:
        print0(f"{'plan written to':>26}: {run_dir / 'plan.json'}")
    for line in [source_line, *flop_lines, *data_passes_lines(args, plan["total_tokens"], tokenizer)]:
        if line:
            print0(line)
    print0(json.dumps(plan))


def check_pinned_vocab(args, tokenizer) -> None:
    """When --vocab-size is given (every config row pins it) and the tokenizer directory holds one (``tokenizer``),
    their sizes must agree: at the start, and in --dry-run (which needs no tokenizer) caught before a speedrun
    downloads anything. The error gives the tok_train command of this run's data and size."""
    if args.vocab_size is None or tokenizer is None:
        return
    if tokenizer.vocab_size != args.vocab_size:
        raise ValueError(f"--tokenizer-dir {tokenizer_dir(args)} holds a tokenizer of vocab size "
                         f"{tokenizer.vocab_size}, but this run needs --vocab-size {args.vocab_size}: train one "
                         f"with `{tok_train_command(args, 'DIR')}` and pass --tokenizer-dir DIR")
