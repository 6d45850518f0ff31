"""Crash-safe checkpoints: ``<run_dir>/checkpoints/step_<NNNNNN>/{model.pt, state.pt, meta.json}``.

A checkpoint directory is first written as ``.tmp-step_<N>`` (every file fsynced), then renamed into place
in one ``os.replace``; a crash mid-save therefore never touches the latest good checkpoint. Pruning is crash-safe
the same way: an old checkpoint is renamed to ``.prune-step_<N>`` before it is deleted, so a kill mid-deletion
never leaves a half-deleted ``step_<N>``; ``sweep_leftovers`` (run at the start of a run) removes what such a
kill leaves behind. ``meta.json`` holds
the model config (enough to rebuild the model), the step and anything the trainer adds. ``state.pt`` holds
the optimizer state, loop state, dataloader state and RNG states (trainer-defined dict).
"""

import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from nanochat.cli_types import recorded_args
from nanochat.families import build_model, config_from_dict
from nanochat.jsonfile import fsync_dir, read_json_object

CKPT_DIR = "checkpoints"
TMP_PREFIX, OLD_PREFIX, PRUNE_PREFIX = ".tmp-", ".old-", ".prune-"
SUPERSEDED_PREFIX = "superseded-"  # checkpoints of a continuation abandoned by resuming from an earlier step
_STEP_RE = re.compile(r"^step_(\d{6,})$")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (e.g. a full disk): ``save_checkpoint``'s file-system errors. base_train
    raises it on every rank together (rank 0 writes, through rank0_decides)."""


def _write_file(path: Path, write_fn) -> None:
    with open(path, "wb") as f:
        write_fn(f)
        f.flush()
        os.fsync(f.fileno())


def step_dir(run_dir, step: int) -> Path:
    return Path(run_dir) / CKPT_DIR / f"step_{step:06d}"


def list_steps(run_dir) -> list[int]:
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and (p / "meta.json").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def find_last_step(run_dir) -> int:
    steps = list_steps(run_dir)
    if not steps:
        raise FileNotFoundError(f"no checkpoint found under {Path(run_dir) / CKPT_DIR} (is --run the right directory?)")
    return steps[-1]


def existing_step(run_dir, step: int | None) -> int:
    """``step``, or the last one when None; a step without a checkpoint is an error listing the available ones."""
    if step is None:
        return find_last_step(run_dir)
    if step not in list_steps(run_dir):
        raise FileNotFoundError(f"checkpoint {step_dir(run_dir, step)} does not exist "
                                f"(available steps: {list_steps(run_dir) or 'none'})")
    return step


def save_checkpoint(run_dir, step: int, model, meta: dict, state: dict | None = None, keep_last: int = 0) -> Path:
    """Atomically write a checkpoint (call on rank 0 only). ``keep_last > 0`` prunes older ones. A write or rename
    that fails (e.g. a full disk) raises CheckpointWriteError after removing the unfinished copy, so that the space
    it took is free again for summary.json; a prune that fails only warns (the checkpoint is whole by then)."""
    root = Path(run_dir) / CKPT_DIR
    final = step_dir(run_dir, step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    try:
        _write_checkpoint(root, final, tmp, step, model, meta, state)
    except (OSError, RuntimeError) as e:  # torch.save reports its file's OSError (ENOSPC) as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        cause = _os_cause(e)
        if cause is None:  # not the file system (e.g. a CUDA error while copying to the CPU): a bug to see whole
            raise
        raise CheckpointWriteError(f"could not write checkpoint step {step} in {root}: {cause}") from e
    if keep_last > 0:
        try:
            prune_checkpoints(run_dir, keep_last)
        except OSError as e:
            print(f"warning: checkpoint step {step} is saved, but older ones could not be pruned ({e})",
                  file=sys.stderr)
    return final


def _os_cause(error: BaseException) -> OSError | None:
    """``error`` if an OSError, else the OSError behind it (e.g. ENOSPC behind torch.save's RuntimeError), else None."""
    cause = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    return cause


def _write_checkpoint(root: Path, final: Path, tmp: Path, step: int, model, meta: dict, state: dict | None) -> None:
    """The files into ``tmp``, fsynced, then renamed to ``final`` (a checkpoint of the same step moved aside)."""
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model_state = {k.removeprefix("_orig_mod."): v for k, v in model.state_dict().items()}
    _write_file(tmp / "model.pt", lambda f: torch.save(model_state, f))
    if state is not None:
        _write_file(tmp / "state.pt", lambda f: torch.save(state, f))
    full_meta = {"step": step, "model_config": model.config.to_dict(), **meta}
    _write_file(tmp / "meta.json", lambda f: f.write(json.dumps(full_meta, indent=2).encode()))
    fsync_dir(tmp)
    if final.exists():  # re-saving the same step: move the old one aside first
        old = root / f"{OLD_PREFIX}{final.name}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(root)


def is_kept(run_dir, step: int) -> bool:
    """Whether checkpoint ``step`` was saved to be kept for good (meta ``"keep": true``, e.g. --save-at-flops)."""
    try:
        return json.loads((step_dir(run_dir, step) / "meta.json").read_text(encoding="utf-8")).get("keep") is True
    except (OSError, ValueError):
        return False


def prune_checkpoints(run_dir, keep_last: int) -> list[int]:
    """Delete all but the last ``keep_last`` checkpoints, except those saved to be kept (``is_kept``): each is
    renamed away (atomic) before it is deleted."""
    root = Path(run_dir) / CKPT_DIR
    old = [s for s in list_steps(run_dir)[:-keep_last] if not is_kept(run_dir, s)]
    for s in old:
        trash = root / f"{PRUNE_PREFIX}{step_dir(run_dir, s).name}"
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(step_dir(run_dir, s), trash)
    fsync_dir(root)
    for s in old:
        shutil.rmtree(root / f"{PRUNE_PREFIX}{step_dir(run_dir, s).name}", ignore_errors=True)
    return old


def set_aside_later(run_dir, step: int) -> tuple[list[int], Path | None]:
    """Resuming from an earlier step abandons the checkpoints after it: move them (kept, never listed again)
    into ``checkpoints/superseded-<time>-after-step_N/``, so that pruning, ``--resume latest/auto`` and
    evaluation of the "last" checkpoint follow the new continuation, not the abandoned one. -> (steps, folder)."""
    later = [s for s in list_steps(run_dir) if s > step]
    if not later:
        return [], None
    root = Path(run_dir) / CKPT_DIR
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    name = f"{SUPERSEDED_PREFIX}{stamp}-after-{step_dir(run_dir, step).name}"
    dest, n = root / name, 1
    while dest.exists():  # a second rewind within the same second
        dest, n = root / f"{name}-{n}", n + 1
    dest.mkdir()
    for s in sorted(later, reverse=True):  # the latest first: a kill midway leaves the fewest later steps listed
        os.replace(step_dir(run_dir, s), dest / step_dir(run_dir, s).name)
    fsync_dir(dest)
    fsync_dir(root)
    return later, dest


def sweep_leftovers(run_dir) -> list[str]:
    """Remove what a kill during a save or a prune leaves in ``checkpoints/`` and return the names: unfinished
    ``.tmp-`` writes, ``.prune-`` directories, ``step_N`` directories without meta.json (half deleted by older
    versions). A ``.old-step_N`` whose ``step_N`` is missing (kill while re-saving a step) is put back instead."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    swept = []
    for p in sorted(root.iterdir()):
        if not p.is_dir():
            continue
        if p.name.startswith(OLD_PREFIX):
            final = root / p.name[len(OLD_PREFIX):]
            if _STEP_RE.match(final.name) and not final.exists() and (p / "meta.json").is_file():
                os.replace(p, final)
                swept.append(f"{p.name} (restored as {final.name})")
                continue
        if p.name.startswith((TMP_PREFIX, PRUNE_PREFIX, OLD_PREFIX)) or (
                _STEP_RE.match(p.name) and not (p / "meta.json").is_file()):
            shutil.rmtree(p, ignore_errors=True)
            swept.append(p.name)
    if swept:
        fsync_dir(root)
    return swept


def _float_tensors(obj, prefix: str = ""):
    if torch.is_tensor(obj):
        if obj.is_floating_point():
            yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _float_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _float_tensors(v, f"{prefix}.{i}" if prefix else str(i))


def nonfinite_tensors(state) -> list[str]:
    """Dotted names of the floating-point tensors in ``state`` (nested dicts/lists) holding NaN or inf.
    Per device one reduction per tensor and one host sync in all."""
    items = list(_float_tensors(state))
    by_device: dict = {}
    for name, t in items:
        by_device.setdefault(t.device, []).append((name, torch.isfinite(t).all()))
    bad = []
    for pairs in by_device.values():
        flags = torch.stack([ok for _, ok in pairs]).tolist()
        bad += [name for (name, _), ok in zip(pairs, flags) if not ok]
    return bad


def load_meta(run_dir, step: int | None = None) -> dict:
    path = step_dir(run_dir, existing_step(run_dir, step)) / "meta.json"  # a listed step has its meta.json
    meta = read_json_object(path, ValueError, "corrupt checkpoint metadata: use another step or re-run")
    if not isinstance(meta.get("model_config"), dict):
        raise ValueError(f"corrupt checkpoint metadata {path}: no 'model_config' object")
    for key in ("tokenizer_dir", "data_dir"):  # a relative path names a directory inside the run (it moves along)
        if isinstance(meta.get(key), str) and meta[key] and not Path(meta[key]).is_absolute():
            meta[key] = str(Path(run_dir).resolve() / meta[key])
    return meta


def _torch_load(path: Path, map_location, mmap: bool = False, file=None):
    """``file``: ``path`` already open, read again from its start through that handle, not by name (whatever was
    renamed over the path since it was opened). torch.load opens a path as a file object too, so both read alike;
    mmap needs the name (it maps the path), so it cannot be combined with ``file``."""
    if file is None and not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} is missing")
    try:
        if file is not None:
            file.seek(0)
        return torch.load(path if file is None else file, map_location=map_location, weights_only=False, mmap=mmap)
    except Exception as e:  # truncated or foreign file
        raise ValueError(f"corrupt checkpoint file {path}: {type(e).__name__}: {e}") from e


def load_state(run_dir, step: int, map_location="cpu") -> dict:
    """``state.pt``, memory-mapped: every rank of a resume reads it, and each pages in only the rows of the
    optimizer state it copies into its shard, not the whole (multi-GB at d24) state. The tensors are views of the
    file: copy what is kept (``MuonAdamW.load_state_dict`` does). A checkpoint pruned later (--keep-last) is
    unlinked, never rewritten, so a view still held reads the old bytes; it only pins the file's disk space."""
    return _torch_load(step_dir(run_dir, step) / "state.pt", map_location, mmap=True)


def config_from_meta(meta: dict):
    """The model config recorded in meta.json (any family, nanochat.families)."""
    return config_from_dict(meta["model_config"])


def recorded_config(meta: dict) -> dict:
    """meta.json's "config" (base_train's resolved run config: args, plan, world size, LR and world-size changes);
    {} where it records none (an imported checkpoint, or "config": null), read as a checkpoint older than them."""
    return meta.get("config") or {}


def recorded_run_args(meta: dict) -> dict:
    """The training flags meta.json records (base_train's resolved args, "config" -> "args"); {} where it records
    none (an imported checkpoint, or "args": null), so a reader's .get(flag) is None for a flag not recorded."""
    return recorded_args(recorded_config(meta))


def check_not_synthetic(meta: dict, where: str, why: str, instead: str) -> None:
    """Refuse a checkpoint trained with --synthetic-data (its step's recorded flags say so) for work on text: its
    token ids are a seeded random walk no tokenizer produced, so no --tokenizer-dir makes text mean anything to it.
    ``why``: what reads text in the run's tokenizer; ``instead``: the verb of what to do with a real-data run. The
    one wording of base_eval and the analyses."""
    if recorded_run_args(meta).get("synthetic_data"):
        raise ValueError(f"{where} was trained with --synthetic-data (random token ids of no tokenizer): {why}, so "
                         f"{instead} a run trained on real data; this run's val bpb on the synthetic stream is in its "
                         "summary.json")


def recorded_value(meta: dict, run_dir, pick):
    """(``pick(config)``, "its config.json" | "its checkpoint") from the first of the run's resolved configs that
    records it (``pick`` returns None for "not recorded"): the run dir's config.json first (every session rewrites
    it, and a final evaluation resumed with other flags saves no new checkpoint, so the checkpoint's copy can be the
    older one), then the checkpoint's meta.json "config". (None, None) where neither does (an imported checkpoint, a
    run older than the flag). A missing, torn or foreign config.json is passed over for the checkpoint's."""
    records = []
    if run_dir is not None:
        try:
            records.append((read_json_object(Path(run_dir) / "config.json", ValueError), "its config.json"))
        except (OSError, ValueError):
            pass
    records.append((recorded_config(meta), "its checkpoint"))
    for config, where in records:
        try:
            value = pick(config)
        except (AttributeError, TypeError):  # not base_train's layout ("args" not an object): not a record of it
            value = None
        if value is not None:
            return value, where
    return None, None


def load_model(run_dir, step: int | None = None, device="cpu"):
    """Rebuild the model of a checkpoint and load its weights. Returns (model, meta)."""
    meta = load_meta(run_dir, step)
    model = build_model(config_from_meta(meta), device=device)
    state = _torch_load(step_dir(run_dir, meta["step"]) / "model.pt", device)
    model.load_state_dict(state, strict=True)
    return model, meta


# -- training state (trainer) ---------------------------------------------------------------------------------
TRAIN_STATE_KEYS = ("optimizer", "loop", "dataloader", "rng", "world_size")


def rng_state() -> dict:
    """Every RNG the training step could touch on this rank (python, torch CPU, all CUDA devices)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # one state per GPU the saving process saw; this one may see fewer (--resume-new-world-size onto a smaller
        # node, another CUDA_VISIBLE_DEVICES layout): restore those it has a device for (torch's
        # set_rng_state_all would index past torch.cuda.default_generators); the rest keep their seed
        torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])


def resolve_resume_step(run_dir, spec: str | None) -> int | None:
    """Map --resume (None | 'latest' | 'auto' | 'STEP') to a checkpoint step; None = start fresh.

    'latest' and an explicit step are errors when the checkpoint is missing; only 'auto' may start fresh.
    """
    if spec is None:
        return None
    steps = list_steps(run_dir)
    if spec == "auto":
        return steps[-1] if steps else None
    if spec == "latest":
        if not steps:
            raise FileNotFoundError(
                f"--resume: no checkpoint under {Path(run_dir) / CKPT_DIR}; use --resume auto to start fresh when none exists"
            )
        return steps[-1]
    step = int(spec)
    if step not in steps:
        raise FileNotFoundError(f"--resume {step}: no checkpoint step_{step:06d} in {Path(run_dir) / CKPT_DIR} "
                                f"(available steps: {steps or 'none'})")
    return step


def require_files(run_dir, step: int, names=("meta.json", "model.pt", "state.pt")) -> None:
    """Raise naming what is missing when this process cannot see checkpoint ``step`` (e.g. the step was chosen
    on rank 0 and this node has no shared filesystem with it)."""
    d = step_dir(run_dir, step)
    missing = [n for n in names if not (d / n).is_file()]
    if missing == ["state.pt"] and load_meta(run_dir, step).get("reason") == "imported":
        raise ValueError(f"checkpoint step {step} of {run_dir} was imported (weights only: no optimizer or "
                         "data-loader state), so it cannot be resumed; evaluate, sample or export it, or start a "
                         "new run from its weights with --init-from")
    if missing:
        raise FileNotFoundError(f"checkpoint {d} (chosen on rank 0) lacks {', '.join(missing)} here: every rank "
                                "must see the same run dir (a shared filesystem, or a copy of it on every node)")


def load_training_state(run_dir, step: int) -> dict:
    """Load and check ``state.pt`` of a trainer checkpoint; a missing key means a foreign or partial file.

    Always onto the CPU: the dataloader and RNG states must stay there (``torch.set_rng_state`` takes a CPU
    ByteTensor), and ``MuonAdamW.load_state_dict`` moves the optimizer state to each parameter's device."""
    state = load_state(run_dir, step, "cpu")
    missing = [k for k in TRAIN_STATE_KEYS if k not in state] if isinstance(state, dict) else list(TRAIN_STATE_KEYS)
    if missing:
        raise ValueError(f"checkpoint {step_dir(run_dir, step)} is not a resumable training checkpoint "
                         f"(state.pt lacks {missing})")
    return state


def open_model_file(run_dir, step: int):
    """model.pt of a checkpoint, opened for reading (``load_model_weights(..., file=)``)."""
    path = step_dir(run_dir, step) / "model.pt"
    try:
        return open(path, "rb")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"checkpoint file {path} is missing") from e


def load_model_weights(model, run_dir, step: int, map_location="cpu", file=None) -> None:
    """Load a checkpoint's weights into an existing model (strict: the architecture must match). ``file``: its
    model.pt as opened before (``open_model_file``), read through that handle."""
    state = _torch_load(step_dir(run_dir, step) / "model.pt", map_location, file=file)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint {step_dir(run_dir, step)} does not match the model built from the flags: {e}") from e
