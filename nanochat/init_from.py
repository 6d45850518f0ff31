"""``base_train --init-from RUN_DIR[:STEP]``: start a run from another run's weights (fine-tuning, continued
pretraining, or the authors' released model after ``scripts.import_reference``).

Only the weights come from the source checkpoint, loaded strictly into the model this run built from its own flags;
the optimizer state, step counter, LR schedule, data order (this run's seeds) and routing statistics start fresh.
Buffers that are part of the model (a grouped MoME slot map, Engram's compression map, balancing biases) come with
the weights, so a slot-map file that is no longer on disk is not needed. Before any weight is read the source is
checked: its model config must equal this run's field for field as the model resolves it (``auto``/0 defaults
as the values they stand for), except the context length and the training-time settings stored in the model
config (``training_settings``: this run's are used), and its tokenizer (the fingerprint its checkpoint records,
or for a run imported before session 33 the tokenizer inside its run dir) must be this run's. These checks run
before the eval rows and the model are built (``checked_source``); the weights are loaded after
(``start_from_source``). Every rank hashes the model.pt it loads, through the handle it loads from, and the ranks
must agree.

The source (resolved run dir, step, sha256 of its model.pt) is recorded in config.json, every checkpoint's meta
and summary.json (``init_from``). A resume takes the weights from the run's own checkpoint and never reads the
source again, but refuses an --init-from that names another source than the recorded one.
"""

import dataclasses
import os
from contextlib import ExitStack
from pathlib import Path

from nanochat import checkpoint as ckpt
from nanochat.common import every_rank_ok, print0, rank0_decides
from nanochat.families import config_from_dict
from nanochat.memory import MEMORY_BLOCKS
from nanochat.memory.base import parse_options
from nanochat.moe import moe_hidden_size

FLAG = "--init-from"
SLOT_MAP_SHA = "memory_options.slot_map_sha256"


def parse_spec(spec: str) -> tuple[Path, str]:
    """'RUN_DIR[:STEP]' -> (run dir, 'latest' or the step number as text, unpadded). A directory whose own name
    ends in ':digits' is that directory (its steps: 'DIR:STEP')."""
    head, sep, tail = spec.rpartition(":")
    if sep and (tail.isdigit() or tail == "latest") and not Path(spec).is_dir():
        return Path(head), str(int(tail)) if tail.isdigit() else tail
    return Path(spec), "latest"


def resolve_source(spec: str, own_run_dir: Path) -> tuple[Path, int, dict]:
    """The source checkpoint of ``spec`` -> (run dir, step, meta); clear errors for a missing directory, a file,
    a directory without checkpoints, a missing step (listing the available ones), a step without weights, or this
    run's own directory (which --overwrite would delete)."""
    run_dir, step_spec = parse_spec(spec)
    if run_dir.resolve() == Path(own_run_dir).resolve():
        raise ValueError(f"{FLAG} {spec}: that is this run's own --run-dir; continue that run with --resume, or "
                         "write the new run to another --run-dir")
    if run_dir.is_file():
        raise ValueError(f"{FLAG} {spec}: {run_dir} is a file, not a run directory (pass the directory that holds "
                         "checkpoints/step_NNNNNN/, e.g. runs/NAME or runs/NAME:STEP)")
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{FLAG} {spec}: no such run directory {run_dir} ({FLAG} RUN_DIR[:STEP], STEP a "
                                "step number or 'latest')")
    steps = ckpt.list_steps(run_dir)
    if not steps:
        raise FileNotFoundError(f"{FLAG} {spec}: {run_dir} holds no checkpoint (no {ckpt.CKPT_DIR}/step_NNNNNN/"
                                "meta.json): not a run directory of base_train or scripts.import_reference")
    step = steps[-1] if step_spec == "latest" else int(step_spec)
    if step not in steps:
        raise FileNotFoundError(f"{FLAG} {spec}: no checkpoint step_{step:06d} in {run_dir / ckpt.CKPT_DIR} "
                                f"(available steps: {steps})")
    meta = ckpt.load_meta(run_dir, step)
    if not (ckpt.step_dir(run_dir, step) / "model.pt").is_file():
        raise FileNotFoundError(f"{FLAG} {spec}: checkpoint {ckpt.step_dir(run_dir, step)} has no model.pt")
    return run_dir.resolve(), step, meta


def _flat(config, options, layers) -> dict:
    fields = {"family": config.family, **dataclasses.asdict(config), "memory_layers": list(layers)}
    options = dataclasses.asdict(options)
    fields.pop("memory_options"), options.pop("slot_map", None)
    return {**fields, **{f"memory_options.{k}": v for k, v in options.items()}}


def _comparable(model_config: dict) -> dict:
    """A model config as flat fields that compare equal when the architectures are equal: each field holds the value
    the model is built with (``auto``/0 defaults resolved by the functions the model uses, memory layers sorted),
    the slot map's path dropped (the weights carry the map)."""
    return _written_and_resolved(model_config)[1]


def _written_and_resolved(model_config: dict) -> tuple[dict, dict]:
    config = config_from_dict(model_config)
    block = MEMORY_BLOCKS[config.memory]
    written = _flat(config, parse_options(block.Options, dict(config.memory_options), config.memory),
                    config.memory_layers)
    resolved = _flat(config, block.resolved_options(config), block.layers_of(config))
    # the MoE FFN's fields (moe.FFN_FIELDS) are the GPT config's, whichever family subclasses it: asked of the config,
    # not of the family's name, so a registered GPT variant compares its expert width as resolved too
    if getattr(config, "mlp", "dense") == "moe":
        resolved["moe_hidden"] = moe_hidden_size(config.n_embd, config.moe_shared, config.moe_topk, config.moe_hidden)
    return written, resolved


def _defaults(model_config: dict) -> dict:
    """The flat fields' dataclass defaults (the model config's and its memory block's options'): the sentinels
    (auto, 0, []) that stand for a derived value, among others."""
    config = config_from_dict(model_config)

    def value(f):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        return list(default) if isinstance(default, tuple) else default  # as _flat lists memory_layers

    def of(cls, prefix=""):
        return {prefix + f.name: value(f) for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    return {**of(type(config)), **of(MEMORY_BLOCKS[config.memory].Options, "memory_options.")}


def _differing_fields(source: dict, ours: dict, theirs: str) -> dict[str, str]:
    """{field: 'field source-value (source) vs our-value (this run)'} for each model-config field whose resolved
    value differs; a side whose value was written otherwise says from what: the default that stands for it ('from the
    default auto': the field was not given, or given as its default) or what was given ('given as [3, 1]')."""
    (wa, a), (wb, b) = _written_and_resolved(source), _written_and_resolved(ours)
    da, db = _defaults(source), _defaults(ours)
    if a["family"] != b["family"]:
        return {"family": f"family {a['family']!r} ({theirs}) vs {b['family']!r} (this run)"}
    if not (a.get(SLOT_MAP_SHA) and b.get(SLOT_MAP_SHA)):  # a map file not on disk here: the checkpoint's is used
        a.pop(SLOT_MAP_SHA, None), b.pop(SLOT_MAP_SHA, None)

    def side(value, written, default, who: str) -> str:
        if written == value:
            return f"{value!r} ({who})"
        return f"{value!r} ({who}, {'from the default' if written == default else 'given as'} {written!r})"

    return {k: f"{k} {side(a.get(k), wa.get(k), da.get(k), theirs)} vs "
               f"{side(b.get(k), wb.get(k), db.get(k), 'this run')}"
            for k in [*a, *(k for k in b if k not in a)] if a.get(k) != b.get(k)}


def config_differences(source: dict, ours: dict, theirs: str = "source") -> list[str]:
    """'field source-value (source) vs our-value (this run)' for each model-config field whose resolved value differs
    (``theirs`` names the checkpoint's side). Every field counts, training-time settings too: what a --resume of
    the checkpoint compares (an --init-from source: compare_with_source)."""
    return list(_differing_fields(source, ours, theirs).values())


def training_settings(config) -> tuple[str, ...]:
    """The model-config fields (flat names, as config_differences reports them) that steer training only: no forward
    depends on them (e.g. the balancing-bias step, an auxiliary loss weight), so the weights mean the same under
    another value. A run from a source may change them; a resume may not (it continues one trajectory)."""
    block = MEMORY_BLOCKS[config.memory]
    return (*config.training_fields, *(f"memory_options.{k}" for k in block.training_options))


def compare_with_source(source: dict, config) -> tuple[list[str], list[str]]:
    """(differences that refuse the source, training-time settings this run changes) between the source's model
    config and this run's. The context length may differ too (no weight depends on it: RoPE tables are rebuilt)."""
    diffs, training = _differing_fields(source, config.to_dict(), "source"), training_settings(config)
    return ([d for k, d in diffs.items() if k != "sequence_len" and k not in training],
            [d for k, d in diffs.items() if k in training])


def source_tokenizer_sha256(meta: dict, tokenizer=None) -> str | None:
    """The tokenizer fingerprint a checkpoint records; a run imported before session 33 records none but keeps
    its tokenizer in its run dir (meta tokenizer_dir), which is fingerprinted instead. None: no tokenizer
    (synthetic data). ``tokenizer``: this run's; when it was read from that same directory it is not read again."""
    from nanochat.tokenizer import HEADER_FILE, get_tokenizer

    if meta.get("tokenizer_sha256"):
        return meta["tokenizer_sha256"]
    tok_dir = meta.get("tokenizer_dir")
    if tok_dir and (Path(tok_dir) / HEADER_FILE).is_file():
        same = tokenizer is not None and tokenizer.directory == Path(tok_dir).resolve()
        return (tokenizer if same else get_tokenizer(tok_dir)).fingerprint()
    return None


def check_source(run_dir: Path, step: int, meta: dict, config, tokenizer, synthetic: bool) -> str:
    """Refuse a source whose tokenizer or model config differs from this run's (a synthetic-data run has no
    tokenizer, and neither may its source). ``tokenizer`` None on a run with data: a --dry-run before the tokenizer
    exists, which cannot compare fingerprints yet (the returned note says so)."""
    from nanochat.tokenizer import check_vocab_matches

    where = f"{FLAG} source {ckpt.step_dir(run_dir, step)}"
    trained = source_tokenizer_sha256(meta, tokenizer)
    note = "architecture and tokenizer match"
    if synthetic:
        if trained is not None:
            raise ValueError(f"{where} was trained with the tokenizer in {meta.get('tokenizer_dir')} but this run "
                             "has none (--synthetic-data): train on data with that tokenizer (--tokenizer-dir)")
    elif trained is None:
        raise ValueError(f"{where} records no tokenizer (trained on --synthetic-data, or its tokenizer directory "
                         f"{meta.get('tokenizer_dir')} is gone), so its token ids cannot be checked against "
                         "--tokenizer-dir")
    elif tokenizer is None:
        note = "architecture matches; tokenizer not checked (none in --tokenizer-dir yet)"
    else:
        check_vocab_matches(tokenizer, meta["model_config"].get("vocab_size"), where,
                            {**meta, "tokenizer_sha256": trained})
    diffs, training = compare_with_source(meta["model_config"], config)
    if diffs:
        raise ValueError(f"{where}: its model differs from the one this run's flags build: {'; '.join(diffs)} "
                         "(pass the source's architecture flags: its config.json or meta.json model_config)")
    trained_len = meta["model_config"].get("sequence_len")
    if trained_len != config.sequence_len:  # a fine-tune may train at another context length: said, not refused
        note += f"; context {config.sequence_len} tokens, the source trained at {trained_len}"
        if "S" in config.window_pattern and isinstance(trained_len, int):  # S windows are sequence_len // 2
            note += (f" (the S layers' sliding window: {config.sequence_len // 2} tokens, trained with "
                     f"{trained_len // 2})")
    if training:
        note += f"; training settings of this run, not the source's: {'; '.join(training)}"
    return note


def describe(record: dict) -> str:
    return f"{record['run_dir']} step {record['step']}"


def data_seed(args: dict) -> int:
    return args["seed"] if args.get("data_seed") is None else args["data_seed"]


def same_data_order_note(meta: dict, args, data_sha256: str | None) -> str:
    """Continued pretraining on the source's own data with its data seed reads the source's documents again, first
    and in the same order (the order depends only on the seed, the world size and the files): say so."""
    source_args = ckpt.recorded_run_args(meta)
    if data_sha256 is None or meta.get("data_sha256") != data_sha256 or "seed" not in source_args \
            or data_seed(source_args) != data_seed(vars(args)):
        return ""
    return (f"; NOTE: same data and data seed ({data_seed(vars(args))}) as the source, so this run reads the "
            "source's training documents first, in the source's order: pass another --data-seed to start elsewhere")


def _size_and_mtime(f) -> tuple[int, int]:
    st = os.fstat(f.fileno())
    return st.st_size, st.st_mtime_ns


def same_file_on_every_rank(path: Path, f) -> str:
    """The sha256 of ``path`` (open as ``f`` on this rank) as every rank reads it; the same error on every rank if
    they read different bytes (a node whose copy of the source differs: each rank loads the file itself).
    Collective. Every rank hashes the whole file (the 5.5 GB d24 model.pt: seconds, the ranks of a node in
    parallel)."""
    from nanochat.download import stream_sha256
    from nanochat.train_loop import gather_objects

    def from_start() -> str:
        f.seek(0)
        return stream_sha256(f)

    seen = gather_objects((str(path), every_rank_ok(from_start)))
    ranks = {}
    for rank, (_, sha) in enumerate(seen):
        ranks.setdefault(sha, []).append(rank)
    if len(ranks) > 1:  # every rank holds the same list, so every rank raises the same message
        read = "; ".join(f"{'rank' if len(r) == 1 else 'ranks'} {', '.join(map(str, r))} read "
                         f"{'sha256 ' if i == 0 else ''}{sha[:12]}" for i, (sha, r) in enumerate(ranks.items()))
        raise ValueError(f"{FLAG} source {seen[0][0]}: the ranks read different files under this path ({read}): "
                         "every node must hold the same copy of the source checkpoint (copy it again, or use a "
                         "shared filesystem)")
    return seen[0][1]


def load_hashed_weights(model, run_dir, step: int, device) -> str:
    """Load the checkpoint's model.pt into ``model`` on every rank; returns its sha256, the same on every rank.
    Collective. Hashed and loaded through one open file, so the bytes hashed are the bytes loaded: a checkpoint
    saved again meanwhile is renamed into place (nanochat.checkpoint) and the open file keeps reading the one it
    opened; a file rewritten in place (copied over) changes its size or modification time and is refused. The hash
    is a read of its own (torch.load reads the zip archive out of order): the file is read twice, never held twice."""
    path = ckpt.step_dir(run_dir, step) / "model.pt"
    with ExitStack() as stack:
        def open_it():
            f = stack.enter_context(ckpt.open_model_file(run_dir, step))
            return f, _size_and_mtime(f)

        f, opened = every_rank_ok(open_it)
        sha = same_file_on_every_rank(path, f)

        def load():
            ckpt.load_model_weights(model, run_dir, step, map_location=device, file=f)
            if _size_and_mtime(f) != opened:
                raise ValueError(f"{FLAG} source {path} changed while it was read (its size or modification time "
                                 "differs from when it was opened: written in place, e.g. copied over): start again "
                                 "once nothing writes to it")

        every_rank_ok(load)
    return sha


def checked_source(args, run_dir: Path, config, tokenizer, data_sha256: str | None) -> dict:
    """The --init-from source, checked on rank 0 for every rank (collective) before the expensive set-up, so that a
    wrong source fails in seconds, as a wrong --resume does: the record ``start_from_source`` loads from.
    ``data_sha256``: this run's prepared data (None: synthetic), to tell whether the source read it in this order."""

    def decide() -> dict:
        source, step, meta = resolve_source(args.init_from, run_dir)
        note = check_source(source, step, meta, config, tokenizer, args.synthetic_data)
        note += same_data_order_note(meta, args, data_sha256)
        return {"spec": args.init_from, "run_dir": str(source), "step": step, "reason": meta.get("reason"),
                "note": note}

    return rank0_decides(decide)


def start_from_source(model, checked: dict, device) -> dict:
    """Load the weights of the source ``checked_source`` accepted into ``model`` on every rank, once every rank has
    read the same model.pt (a rank that cannot, or read another file, stops them all). Collective. Returns the
    record for config.json, checkpoints and summary.json."""
    record = {k: v for k, v in checked.items() if k != "note"}  # the note is printed: config.json has both configs
    record["model_sha256"] = load_hashed_weights(model, record["run_dir"], record["step"], device)
    print0(f"{FLAG}: weights of {describe(record)} (model.pt sha256 {record['model_sha256'][:12]}; "
           f"{checked['note']}); optimizer, LR schedule, step count and data order start fresh")
    return record


def check_for_dry_run(args, run_dir: Path, tokenizer, build_config) -> str:
    """--dry-run: resolve and check the source without loading its weights; ``build_config(vocab)`` is this run's
    model config. The vocab is the pinned one, else the existing tokenizer's, else the source's (unknown yet)."""
    source, step, meta = resolve_source(args.init_from, run_dir)
    vocab = args.vocab_size or (tokenizer.vocab_size if tokenizer is not None else None)
    if vocab is None and args.synthetic_data:
        from nanochat.train_setup import SYNTHETIC_VOCAB

        vocab = SYNTHETIC_VOCAB
    config = build_config(vocab or meta["model_config"]["vocab_size"])
    note = check_source(source, step, meta, config, tokenizer, args.synthetic_data)
    return f"{'init from':>26}: {source} step {step} ({note})"


def resume_differences(recorded: dict | None, spec: str | None) -> list[str]:
    """On --resume: the source given now must be the one the run started from (the step may be left out)."""
    if recorded is None and spec is None:
        return []
    if recorded is None:
        return [f"{FLAG} {spec}: the checkpoint's run did not start from another run's weights (no {FLAG})"]
    if spec is None:
        return [f"{FLAG}: the checkpoint's run started from {describe(recorded)}; pass {FLAG} {recorded['spec']}"]
    if spec == recorded["spec"]:  # the command that started the run (its source may have moved on since)
        return []
    run_dir, step = parse_spec(spec)
    if str(run_dir.resolve()) != recorded["run_dir"] or step not in ("latest", str(recorded["step"])):
        return [f"{FLAG} {spec}: the checkpoint's run started from {describe(recorded)} ({FLAG} {recorded['spec']})"]
    return []
