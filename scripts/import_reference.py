"""Import a checkpoint written by the authors' code (e.g. their released d24 MoME model) as a run of ours.

    python -m scripts.import_reference jojo23333/MOME-NanoChat-D24-100B --run-dir runs/mome_d24_100b --dataset climbmix
    python -m scripts.import_reference path/to/their/files --run-dir runs/X [--step S] [--tokenizer tokenizer.pkl]
    python -m scripts.import_reference their/c2_m12 --run-dir runs/c2m12 --slot-map slotmaps/..._k2_step022412.json

SRC is a local directory holding ``meta_<step>.json`` + ``model_<step>.pt`` (searched recursively; the largest
step unless --step) and their ``tokenizer.pkl`` (+ ``token_bytes.pt``), or a Hugging Face repo id, fetched with
huggingface_hub into its cache (progress bars, checksums, ``HF_TOKEN``/``HF_ENDPOINT``; ``HF_HUB_OFFLINE=1``
reuses the cache): first the small files, then only the chosen step's weights. The run directory gets ``checkpoints/step_<step>/`` (fp32 weights, our
config), ``tokenizer/`` (converted without executing the pickle) and, for a MoME checkpoint with their
``table`` slot mapping (the d12 grouped rows), ``slot_map/`` (a copy of the slot-map JSON, which their checkpoint
does not hold; the run's checkpoint then holds the map too), so base_eval, sample, analyze_memory,
analyze_routing, wic_probe and build_slot_map read it like any run of ours. It is written in a hidden work folder
beside the run directory and renamed into place, so an interrupted import leaves no half run behind (the folder of
one killed outright is removed by the next import into that run); a second import into a run that another is
writing is refused.
"""

import argparse
import errno
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from nanochat.terminal import replace_unencodable_output

HUB_REPO_RE = re.compile(r"^[\w.-]+/[\w.-]+$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
SMALL_FILES = ["*meta_*.json", "*tokenizer.pkl", "*token_bytes.pt"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="local directory of their files, or a Hugging Face model repo id (owner/name)")
    ap.add_argument("--run-dir", "--run", dest="run_dir", required=True, help="new run directory to write")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the largest found)")
    ap.add_argument("--tokenizer", default=None, help="their tokenizer.pkl (default: the one found in SRC)")
    ap.add_argument("--slot-map", default=None, help="the slot-map JSON of a MoME checkpoint with "
                    "moe_ve_slot_mapping 'table' (the d12 grouped rows); default: the meta's moe_ve_slot_map_path "
                    "if that file exists here. Copied into the run")
    ap.add_argument("--revision", default=None, help="hub revision (branch, tag or commit; default: main)")
    ap.add_argument("--dataset", default=None, choices=("fineweb-edu", "climbmix", "embedded", "local"),
                    help="record the dataset the model was trained on, so base_eval's bpb finds its prepared "
                    "data (the released d24 model: climbmix)")
    return ap.parse_args(argv)


def fetch_hub(repo_id: str, revision: str | None, step: int | None) -> tuple[Path, dict]:
    """Download the small files (their layout is found, not assumed), pick the step, then download only that
    step's weights through ``nanochat.download.hub_file`` (checksummed, pinned to the same commit). Returns the
    snapshot directory and the provenance to record."""
    import fnmatch
    import os

    import huggingface_hub

    from nanochat.download import hub_file, verify_hub_blob
    from nanochat.reference_format import SeveralCheckpointFolders, find_meta

    try:
        root = Path(huggingface_hub.snapshot_download(
            repo_id=repo_id, revision=revision, allow_patterns=SMALL_FILES,
            endpoint=os.environ.get("HF_ENDPOINT") or None, token=os.environ.get("HF_TOKEN") or None))
    except Exception as e:  # network, auth, unknown repo, offline without a cached copy
        raise FileNotFoundError(f"SRC {repo_id}: not a local directory, and the hub download failed "
                                f"({type(e).__name__}: {e})") from None
    for path in root.rglob("*"):  # what this download fetched or found: not the weights of steps fetched before
        rel = path.relative_to(root).as_posix()
        if path.is_file() and any(fnmatch.fnmatch(rel, pattern) for pattern in SMALL_FILES):
            verify_hub_blob(path, f"model repo {repo_id}, file {rel}")
    try:
        meta_path, step = find_meta(root, step)
    except SeveralCheckpointFolders as e:  # SRC names the repo, not one of its folders: download the one wanted
        folders = [f.relative_to(root).as_posix() for f in e.folders]
        raise SeveralCheckpointFolders(
            f"hub repo {repo_id} holds checkpoints in several folders {folders}: download the one you want with "
            f"`hf download {repo_id}{f' --revision {revision}' if revision else ''} --include 'FOLDER/*' "
            "'*tokenizer.pkl' '*token_bytes.pt' --local-dir DIR` and "
            "pass DIR/FOLDER as SRC (with --tokenizer DIR/.../tokenizer.pkl if it lies outside FOLDER)",
            e.folders) from None
    pinned = root.name if COMMIT_RE.match(root.name) else revision  # the same commit for the big file
    model_rel = (meta_path.parent / f"model_{step:06d}.pt").relative_to(root).as_posix()
    hub_file(repo_id, model_rel, repo_type="model", revision=pinned)
    return root, {"hub_repo": repo_id, "revision": revision or "main", "commit": pinned}


def load_reference_state(path: Path) -> dict:
    try:  # weights_only: a tensor-only unpickler (their .pt files are plain state dicts)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ValueError(f"{path}: not a readable state dict ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, expected a state dict")
    return state


def work_prefix(run_dir: Path) -> str:
    """The name of an import's hidden work folders beside ``run_dir``, less their owner and random parts."""
    return f".{run_dir.name}.importing-"


@contextmanager
def import_work_dir(run_dir: Path):
    """A folder for the run in a work folder of this import's own beside ``run_dir`` (renamed into place when
    whole), after those of imports killed midway are removed. A live import into the same run is an error: two
    would write one run twice over."""
    from nanochat import work_dirs

    created = [p for p in run_dir.parents if not p.exists()]  # nearest first
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        busy = work_dirs.in_use(run_dir.parent, work_prefix(run_dir))
        if busy:
            raise FileExistsError(f"--run-dir {run_dir} is being written by another import (its work folder "
                                  f"{busy[0]}); wait for it to finish, or choose a new directory; if no import is "
                                  "running, delete that folder")
        with work_dirs.work_dir(run_dir.parent, work_prefix(run_dir)) as work:
            (work / "run").mkdir()  # the run itself under the umask (the work folder is mkdtemp's, 0o700)
            yield work / "run"
    except BaseException:  # a bad SRC, a full disk, Ctrl-C: no empty folders made for the run stay either
        for folder in created:
            try:
                folder.rmdir()
            except OSError:  # not empty: another process's by now
                break
        raise


def publish(tmp: Path, run_dir: Path) -> None:
    """Rename the finished import into place: over nothing or an empty folder, never over a run (one that another
    import, started at the same moment as this one, renamed there first)."""
    from nanochat.jsonfile import fsync_dir

    try:
        os.replace(tmp, run_dir)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise FileExistsError(f"--run-dir {run_dir} was written by another process meanwhile; this import "
                              "left nothing there") from None
    fsync_dir(run_dir.parent)  # else a power cut can take the run's name back


def import_reference(args) -> Path:
    from nanochat.checkpoint import save_checkpoint
    from nanochat import reference_slot_map

    run_dir = Path(args.run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        raise FileExistsError(f"--run-dir {run_dir} exists and is not empty; choose a new directory")
    with import_work_dir(run_dir) as tmp:  # first: a second import into this run is refused before its work
        tok, slot_map, model, step, extra = convert(args, run_dir)
        tok.save(tmp / "tokenizer")
        if slot_map:
            reference_slot_map.copy_into_run(slot_map, tmp)
        save_checkpoint(tmp, step, model, extra)
        publish(tmp, run_dir)  # a failure before this (e.g. a full disk) leaves nothing: the work folder goes
    print(f"wrote {run_dir} (step {step}); evaluate with: python -m scripts.base_eval --run {run_dir}")
    return run_dir


def convert(args, run_dir: Path) -> tuple:
    """Find, read and convert the source checkpoint: (our tokenizer, the slot-map file as read (SourceFile) or None,
    our model, the step, the checkpoint meta to write)."""
    from nanochat.download import file_sha256
    from nanochat.families import meta_device
    from nanochat.gpt import GPT
    from nanochat import reference_slot_map
    from nanochat.reference_format import (SLOT_MAP_KEY, config_from_reference, find_checkpoint, moving_bias_note,
                                           read_meta, state_from_reference)
    from nanochat.reference_tokenizer import read_reference_token_bytes, read_reference_tokenizer

    src = Path(args.src)
    if src.is_dir():
        origin = {"local_dir": str(src.resolve())}
    elif HUB_REPO_RE.match(args.src) and not src.exists():
        print(f"fetching {args.src} from the Hugging Face hub")
        src, origin = fetch_hub(args.src, args.revision, args.step)
    else:
        raise FileNotFoundError(f"SRC {args.src}: not a directory and not a hub repo id (owner/name)")

    model_path, meta_path, step = find_checkpoint(src, args.step)
    meta = read_meta(meta_path)
    slot_map_path = reference_slot_map.source_path(meta["model_config"], args.slot_map)
    slot_map = reference_slot_map.read_source(slot_map_path) if slot_map_path else None  # its one read
    # the grouped index records the run's own copy of the map (written below) with its hash
    slot_map_option = (reference_slot_map.run_path(slot_map.path, run_dir), slot_map.sha256) if slot_map else None
    config = config_from_reference(meta["model_type"], meta["model_config"], slot_map_option)
    print(f"checkpoint {model_path} (step {step}, model_type {meta['model_type']}) -> --memory {config.memory}")
    if note := moving_bias_note(meta["model_config"]):
        print(note)
    if args.tokenizer:
        pkl, tb_path = Path(args.tokenizer), Path(args.tokenizer).parent / "token_bytes.pt"
        tb_path = tb_path if tb_path.is_file() else None
    else:
        from nanochat.reference_format import find_tokenizer

        pkl, tb_path = find_tokenizer(src)
    tok = read_reference_tokenizer(pkl)
    if tok.vocab_size != config.vocab_size:
        raise ValueError(f"vocab mismatch: {pkl} has {tok.vocab_size} tokens but {meta_path} model_config "
                         f"vocab_size is {config.vocab_size}")
    token_bytes = read_reference_token_bytes(tb_path, tok) if tb_path else {"path": None}

    buffers = {}
    if slot_map:
        loaded = reference_slot_map.read_for_import(slot_map, config.memory_options, config.vocab_size, tok)
        buffers[SLOT_MAP_KEY] = loaded.token_to_row
    state, report = state_from_reference(load_reference_state(model_path), config, buffers)
    with meta_device():
        model = GPT(config)
    model.load_state_dict(state, strict=True, assign=True)  # strict: every entry of ours is filled, shapes equal

    files = {"model": str(model_path), "meta": str(meta_path), "tokenizer": str(pkl)}
    print("hashing the source files")
    hashes = {k: file_sha256(p) for k, p in files.items()}
    if slot_map:
        files["slot_map"], hashes["slot_map"] = str(slot_map.path), slot_map.sha256
    imported = {**origin, "step": step, "files": files, "sha256": hashes,
                "model_type": meta["model_type"], "model_config": meta["model_config"],
                "reference_meta": {k: v for k, v in meta.items() if k not in ("model_config", "user_config")},
                **report, "token_bytes": token_bytes}
    # relative: the run's own tokenizer, found again after the run directory is moved or copied (load_meta); its
    # fingerprint, as base_train records it, so that a --tokenizer-dir override of the same size but other token
    # ids is refused by every consumer (base_eval, the analyses, export_reference, --init-from)
    extra = {"reason": "imported", "tokenizer_dir": "tokenizer", "tokenizer_sha256": tok.fingerprint(),
             "imported_from": imported}
    if args.dataset:
        extra["dataset"] = args.dataset
    return tok, slot_map, model, step, extra


def main(argv=None) -> int:
    from nanochat.checkpoint import CheckpointWriteError
    from nanochat.download import DownloadError

    args = parse_args(argv)
    try:
        import_reference(args)
    except (OSError, ValueError, DownloadError, CheckpointWriteError) as e:  # OSError: e.g. a full disk
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # import_work_dir removed the work folder: the run is imported whole or not at all
        print(f"interrupted; nothing was imported into --run-dir {args.run_dir}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
