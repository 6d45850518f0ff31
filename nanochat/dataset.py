"""Prepared datasets: parquet shards with a ``text`` column + ``manifest.json`` saying which files are train/val.

Every dataset (FineWeb-Edu, ClimbMix, the embedded corpus, a user's local files) ends up in the same layout::

    <data_dir>/manifest.json   {"dataset", "source", "train": [files], "val": [files], "shards": {file: {rows, bytes}}}
    <data_dir>/<file>.parquet  column "text", one document per row

so everything after preparation (tokenizer training, the loader, evaluation) has one code path. The split is
whatever the manifest says; it never depends on file-name sorting.

The remote datasets (FineWeb-Edu, ClimbMix) come from the Hugging Face hub through ``nanochat.download``.
"""

import argparse
import hashlib
import json
import os
import re
import urllib.parse
from pathlib import Path
from typing import NamedTuple

from nanochat.download import (DownloadError, DownloadStopped, StopFlag, download_file, hub_file, place_file,
                              run_in_daemon_threads)
from nanochat.jsonfile import read_json_object, remove_stale_temps, write_atomic, write_text_atomic

MANIFEST = "manifest.json"
DATASET_MARK = ".dataset"  # remote datasets: which dataset this directory's shard_NNNNN.parquet files belong to
BASE_URL_ENV = "NANOCHAT_DATA_BASE_URL"

# name -> (Hugging Face dataset repo, number of shards, validation shard index)
REMOTE_DATASETS = {
    "fineweb-edu": ("karpathy/fineweb-edu-100b-shuffle", 1823, 369),
    "climbmix": ("karpathy/climbmix-400b-shuffle", 6543, 6542),
}
NAMED_DATASETS = (*REMOTE_DATASETS, "embedded", "local")
HF_PREFIX = "hf:"  # --dataset hf:ORG/NAME[:CONFIG]: any Hugging Face text dataset (scripts/prepare_data.py)


class DataError(RuntimeError):
    """Bad or missing data; the message names the file/flag and what to do."""


# ---- layout -----------------------------------------------------------------------------------------------
def check_dataset_name(name: str) -> str:
    """argparse type of --dataset: a named dataset or hf:ORG/NAME[:CONFIG] (any Hugging Face text dataset)."""
    if name in NAMED_DATASETS or (name.startswith(HF_PREFIX) and len(name) > len(HF_PREFIX)):
        return name
    raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(NAMED_DATASETS)} or hf:ORG/NAME[:CONFIG]")


def default_data_dir(dataset: str) -> Path:
    """$NANOCHAT_DATA_DIR/<dataset> (default ~/.cache/nanochat/data), an hf: dataset's name by ``hf_dir_name``
    (of the absolute path a relative local path resolves to: ``_local_hf_spec``). An hf: dataset prepared under
    the name an older scheme gave it (a local path, a config without an org; a relative local path's text) is
    found there, but only where that directory's manifest names this very dataset (the older names collided)."""
    root = os.environ.get("NANOCHAT_DATA_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "nanochat" / "data"
    if not dataset.startswith(HF_PREFIX):
        return base / dataset
    spec = dataset[len(HF_PREFIX):]
    named = _local_hf_spec(spec)
    new = base / hf_dir_name(named)
    if (new / MANIFEST).is_file():
        return new
    # older names: the spec's text (a relative local path, before it was named by where it resolves), then the
    # scheme before session 33
    for older in dict.fromkeys((hf_dir_name(spec), _older_hf_dir_name(spec))):
        if older != new.name and _holds_dataset(base / older, dataset,
                                                None if named == spec else named.partition(":")[0]):
            return base / older
    return new


def _local_hf_spec(spec: str) -> str:
    """hf:<spec> with a relative path that names a local folder or file (`datasets` loads those before the hub) as
    the absolute path it resolves to: `hf:data/x` run from two folders is two datasets, with two directories."""
    path, sep, config = spec.partition(":")
    if path and not os.path.isabs(path) and os.path.exists(path):
        return str(Path(path).resolve()) + sep + config
    return spec


def _holds_dataset(data_dir: Path, dataset: str, local_path: str | None) -> bool:
    """``data_dir``'s manifest names ``dataset``; for a relative local path (``local_path``: the folder it resolves
    to), one recording another folder ("hf" "local_path") is that folder's (one recording none is older: kept)."""
    manifest = _previous_manifest(data_dir)
    if _dir_key(manifest.get("dataset", "")) != _dir_key(dataset):
        return False
    hf = manifest.get("hf")
    recorded = hf.get("local_path") if isinstance(hf, dict) else None
    return local_path is None or recorded is None or recorded == local_path


_HF_NAME_PART = re.compile(r"[A-Za-z0-9._]+(?:-[A-Za-z0-9._]+)*")  # a hub name's characters; no "--", no -x or x-


def hf_dir_name(spec: str) -> str:
    """The default directory name of --dataset hf:<spec>, different for different datasets. The documented forms
    keep the older names, hf-ORG--NAME--CONFIG, hf-ORG--NAME and hf-NAME, when each part is a hub-style name (no
    "--", not starting or ending with "-": the name then splits back into its parts). Anything else (a local
    path, a config without an org, which older names confused with ORG/NAME) is hf_<spec percent-encoded>, over
    200 characters cut with a sha256 of the spec after it."""
    path, _, config = spec.partition(":")  # as parse_hf_spec: an empty config is none
    parts = path.split("/") + ([config] if config else [])
    documented = len(parts) == 3 if config else len(parts) in (1, 2)  # ORG/NAME:CONFIG, ORG/NAME, NAME
    if documented and all(_HF_NAME_PART.fullmatch(part) for part in parts):
        return "hf-" + "--".join(parts)
    key = path + (f":{config}" if config else "")
    name = "hf_" + urllib.parse.quote(key, safe="")  # "%" is encoded too: one name per spec
    if len(name) > 200:  # a file name has at most 255 bytes; the cut ones are longer than every uncut one
        name = name[:200] + "~" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return name


def check_default_dir_holds(data_dir, dataset: str) -> None:
    """Before ``dataset`` is built into ``data_dir``, its default directory: refuse where a manifest there names
    another dataset (an hf: dataset prepared under its older default name, which is this one's name now): the
    build would overwrite the data that dataset's runs read."""
    held = other_dataset_held(data_dir, dataset)
    if held is None:
        return
    why, move = "", ""
    if held.startswith(HF_PREFIX):
        why = " (prepared there under the default name it had before session 33)"
        move = f"move it to {Path(data_dir).parent / _dir_key(held)} (where --dataset {held} finds it) or "
    raise DataError(f"{data_dir}, the default directory of --dataset {dataset}, holds the data of --dataset "
                    f"{held}{why}; {move}give --dataset {dataset} a --data-dir of its own")


def check_default_dir_dataset(data_dir, dataset: str, manifest: dict | None = None) -> None:
    """Before a run reads ``data_dir``, the default directory of its ``dataset`` (no --data-dir: base_train,
    tok_train): refuse where the manifest there records another dataset (an hf: dataset prepared under the default
    name it had before session 33, which is this one's now, or data copied there by hand): the run would train on
    it under this dataset's name. ``manifest``: the one the caller read, else it is read here; none, an unreadable
    one or one recording no dataset is left to the loader. An explicit --data-dir is the user's choice: not checked."""
    data_dir = Path(data_dir)
    held = other_dataset_held(data_dir, dataset, manifest)
    if held is None:
        return
    older = held.startswith(HF_PREFIX) and data_dir.name == _older_hf_dir_name(held[len(HF_PREFIX):])
    why = " (prepared there under the default name it had before session 33)" if older else f" (its {MANIFEST})"
    try:
        named = check_dataset_name(held)
    except argparse.ArgumentTypeError:  # a name no flag takes (a hand-written manifest)
        named = None
    move = f"move that data to {data_dir.parent / _dir_key(held)} (where --dataset {held} finds it)" if named \
        else "move that data out of it"
    alt = f"--dataset {held}" if named and default_data_dir(held) == data_dir else \
        f"--data-dir {data_dir}" + (f" --dataset {held}" if named else "")
    raise DataError(f"--dataset {dataset} reads its default directory {data_dir} (no --data-dir), which holds the "
                    f"data of --dataset {held}{why}; to train on {dataset}, {move} and prepare {dataset}'s: "
                    f"`{prepare_data_command(data_dir, dataset)}`; to train on that data, pass {alt}")


def other_dataset_held(data_dir, dataset: str, manifest: dict | None = None) -> str | None:
    """The dataset ``data_dir``'s manifest (``manifest``, else read here) records where it is not ``dataset``
    (hf:a/b: is hf:a/b); None where it is, or where there is no readable manifest recording one."""
    held = (manifest if manifest is not None else _previous_manifest(Path(data_dir))).get("dataset")
    if held is None or held == "" or _dir_key(str(held)) == _dir_key(dataset):
        return None
    return str(held)


def _dir_key(dataset: str) -> str:
    return hf_dir_name(_local_hf_spec(dataset[len(HF_PREFIX):])) if dataset.startswith(HF_PREFIX) else dataset


def _older_hf_dir_name(spec: str) -> str:
    """The default directory name of hf:<spec> before session 33 (hf:a/b and hf:a--b had one)."""
    return "hf-" + re.sub(r"[^A-Za-z0-9._-]+", "--", spec).strip("-")


class RunDataDir(NamedTuple):
    path: Path
    source: str  # where the path came from, for the printed line
    dataset: str | None  # the dataset the checkpoint records (meta "dataset"), None where it records none
    recorded_default: bool = False  # the default directory of ``dataset``: neither --data-dir nor meta's data_dir
    trained_sha256: str | None = None  # meta's data_sha256 (what the step trained on) where --data-dir is not given


def check_run_data(found: RunDataDir, manifest: dict | None = None) -> None:
    """Before an evaluation reads the data a checkpoint records (no --data-dir: an explicit one is the user's
    choice), refuse data whose numbers would be another data's under this run's name: a recorded dataset's default
    directory (an imported run) whose manifest records another dataset, or prepared data whose fingerprint is not
    the meta's data_sha256 (rebuilt or replaced since the step was trained; check_default_dir_dataset is the
    training side). ``manifest``: ``found.path``'s, else read here where needed."""
    held = other_dataset_held(found.path, found.dataset, manifest) if found.recorded_default else None
    if held is not None:
        raise DataError(f"{found.path} ({found.source}) holds the data of dataset {held!r} (its {MANIFEST}), not "
                        f"the checkpoint's {found.dataset!r}: pass --data-dir DIR of {found.dataset!r}'s prepared "
                        f"data (`python -m scripts.prepare_data --dataset {found.dataset} --data-dir DIR` makes it)")
    if found.trained_sha256:
        now = manifest_fingerprint(manifest if manifest is not None else load_manifest(found.path, found.dataset))
        if now != found.trained_sha256:
            raise DataError(f"{found.path} ({found.source}) holds other prepared data than the checkpoint was "
                            f"trained on (data_sha256 {found.trained_sha256[:12]}... in meta.json, {now[:12]}... "
                            f"there now: rebuilt or replaced since): prepare the run's data again, or pass "
                            f"--data-dir {found.path} to evaluate on what is there")


def run_data_dir(flag_value, meta: dict) -> RunDataDir:
    """The prepared data a checkpoint's evaluations read (base_eval's bpb and the analyses' val/train domains
    alike): --data-dir, else its meta's "data_dir" (base_train records the one it trained on), else the directory
    scripts.prepare_data fills for its meta's "dataset" (an import's --dataset; "embedded" where none is recorded)."""
    dataset = meta.get("dataset") or None
    if flag_value:
        return RunDataDir(Path(flag_value), "--data-dir", dataset)
    if meta.get("data_dir"):
        return RunDataDir(Path(meta["data_dir"]), "checkpoint meta 'data_dir'", dataset,
                          trained_sha256=meta.get("data_sha256"))
    where = f"the run's dataset {dataset!r}" if dataset else "dataset 'embedded' (the checkpoint records none)"
    return RunDataDir(default_data_dir(dataset or "embedded"),
                      f"default directory of {where}: no --data-dir and no 'data_dir' in meta.json", dataset,
                      recorded_default=dataset is not None, trained_sha256=meta.get("data_sha256"))


def read_jsonl_texts(path, error: type[Exception] = ValueError) -> list[str]:
    """The "text" field of every non-blank line of a JSONL file; a bad line raises ``error`` naming file:line.
    A byte order mark at the start of the file (some editors' UTF-8) is dropped, as json would refuse line 1."""
    texts = []
    with open(path, encoding="utf-8-sig") as f:  # -sig: only a BOM at the very start; one inside a text stays
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise error(f"{path}:{lineno}: expected a JSON object with a 'text' field ({e})") from e
    return texts


def prepare_data_command(data_dir, dataset: str | None = None) -> str:
    """The scripts.prepare_data command that fills ``data_dir`` with ``dataset`` (the embedded corpus, as an
    example, where the caller knows none); --data-dir only where it is not the dataset's default directory."""
    dataset = dataset or "embedded"
    at = "" if Path(data_dir) == default_data_dir(dataset) else f" --data-dir {data_dir}"
    return f"python -m scripts.prepare_data --dataset {dataset}{at}"


def load_manifest(data_dir, dataset: str | None = None) -> dict:
    """``data_dir``'s manifest; ``dataset`` (the one the caller expects there) names the command of a missing one."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} not found: prepare the data first, {'' if dataset else 'e.g. '}"
                        f"`{prepare_data_command(data_dir, dataset)}`")
    manifest = read_json_object(path, DataError, "re-run scripts.prepare_data")
    for key in ("dataset", "train", "val", "shards"):
        if key not in manifest:
            raise DataError(f"{path} has no {key!r} entry; re-run scripts.prepare_data")
    return manifest


def manifest_fingerprint(manifest: dict) -> str:
    """sha256 of the splits' shard lists with each shard's row count and size (not of paths or the source):
    the same data prepared in another directory has the same fingerprint."""
    shards = manifest["shards"]
    splits = {split: [[name, shards.get(name)] for name in manifest[split]] for split in ("train", "val")}
    return hashlib.sha256(json.dumps(splits, sort_keys=True).encode()).hexdigest()


def split_files(data_dir, split: str) -> list[Path]:
    """Files of ``split`` ('train' or 'val') in manifest order; each must exist."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    manifest = load_manifest(data_dir)
    files = [Path(data_dir) / name for name in manifest[split]]
    if not files:
        raise DataError(f"{Path(data_dir) / MANIFEST} lists no {split} files; re-run scripts.prepare_data")
    for f in files:
        if not f.is_file():
            raise DataError(f"shard {f} listed in the manifest is missing; re-run scripts.prepare_data "
                            f"(it re-downloads or rebuilds missing shards)")
        expected = manifest["shards"].get(f.name, {}).get("bytes")
        if expected is not None and f.stat().st_size != expected:  # overwritten since: not the data it describes
            raise DataError(f"shard {f} has {f.stat().st_size} bytes, the manifest says {expected}; re-run "
                            "scripts.prepare_data (the shard was changed after the manifest was written)")
    return files


def start_rebuild(data_dir) -> None:
    """Before a builder (re)writes shards into ``data_dir``: drop the old manifest, so that a run failing midway
    leaves no manifest (loaders refuse) rather than an old one listing a mix of old and new shards."""
    (Path(data_dir) / MANIFEST).unlink(missing_ok=True)


def remove_build_leftovers(data_dir, manifest: dict, patterns: tuple[str, ...]) -> None:
    """After a build wrote ``manifest``: delete the files matching ``patterns`` that it does not list (shards of an
    earlier, larger run), and the temp files that builders killed midway left of those shards (the manifest's went
    with its write: write_atomic removes its own file's)."""
    listed = set(manifest["train"]) | set(manifest["val"])
    for pattern in patterns:
        for path in Path(data_dir).glob(pattern):
            if path.name not in listed:
                path.unlink()
    remove_stale_temps(data_dir, patterns)


def write_manifest(data_dir, dataset: str, train: list[str], val: list[str], source: str, **extra) -> dict:
    """Validate every listed shard and write manifest.json atomically."""
    data_dir = Path(data_dir)
    if set(train) & set(val):
        raise DataError(f"shards {sorted(set(train) & set(val))} are in both train and val")
    shards = {}
    for name in list(train) + list(val):
        path = data_dir / name
        shards[name] = {"rows": validate_parquet(path), "bytes": path.stat().st_size}
    manifest = {"dataset": dataset, "source": source, "train": list(train), "val": list(val),
                "shards": shards, **extra}
    write_text_atomic(data_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


# ---- reading ----------------------------------------------------------------------------------------------
def open_parquet(path):
    """``pyarrow.parquet.ParquetFile(path)``; an unreadable file (truncated, garbage) raises DataError naming it."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for truncated/garbage files
        raise DataError(f"{path} is not a readable parquet file ({type(e).__name__}: {e}); "
                        "delete it and re-run scripts.prepare_data") from e


def validate_parquet(path) -> int:
    """Return the row count; raise DataError if the file is unreadable, has no ``text`` column or no rows."""
    path = Path(path)
    with open_parquet(path) as pf:
        meta = pf.metadata
    if "text" not in meta.schema.names:
        raise DataError(f"{path} has no 'text' column (columns: {meta.schema.names}); "
                        "every shard needs one document per row in a column named 'text'")
    if meta.num_rows <= 0:
        raise DataError(f"{path} has 0 rows; delete it and re-run scripts.prepare_data")
    return meta.num_rows


def read_row_group_texts(pf, path, rg: int) -> list:
    """Column ``text`` of row group ``rg`` of the open ParquetFile ``pf``; unreadable data pages (a file whose footer
    is intact but whose data is not) raise DataError naming the file and the row group."""
    try:
        return pf.read_row_group(rg, columns=["text"]).column("text").to_pylist()
    except Exception as e:  # pyarrow raises several types (ArrowInvalid, OSError, ...) for corrupt pages
        raise DataError(f"{path}: row group {rg} cannot be read ({type(e).__name__}: {e}); the file is corrupt: "
                        "delete it and re-run scripts.prepare_data") from e


def iter_documents(data_dir, split: str):
    """Yield every document string of ``split`` in manifest / row-group order (one pass)."""
    for path in split_files(data_dir, split):
        with open_parquet(path) as pf:
            for rg in range(pf.num_row_groups):
                yield from read_row_group_texts(pf, path, rg)


def write_text_shard(path, texts: list[str], row_group_size: int = 256) -> None:
    """Write documents to a parquet shard (write_atomic: never a torn shard or a temp file left). Small row groups
    let ranks stripe small data."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not texts:
        raise DataError(f"refusing to write the empty shard {path}")
    table = pa.table({"text": pa.array(texts, type=pa.string())})
    write_atomic(path, lambda tmp: pq.write_table(table, tmp, row_group_size=row_group_size, compression="zstd"))


# ---- downloading ------------------------------------------------------------------------------------------
def shard_name(index: int) -> str:
    return f"shard_{index:05d}.parquet"


def remote_shard_plan(dataset: str, num_shards: int) -> tuple[list[int], int]:
    """Train shard indices (the first ``num_shards`` indices, skipping the val shard) and the val index."""
    if dataset not in REMOTE_DATASETS:
        raise ValueError(f"--dataset {dataset!r} is not a remote dataset; choose from {sorted(REMOTE_DATASETS)}")
    _, total, val_index = REMOTE_DATASETS[dataset]
    if not 1 <= num_shards <= total - 1:
        raise ValueError(f"--num-shards must be in 1..{total - 1} for {dataset}, got {num_shards}")
    train = [i for i in range(num_shards + 1) if i != val_index][:num_shards]
    return train, val_index


def resolve_base_url(base_url: str | None = None) -> str | None:
    """--base-url flag > env NANOCHAT_DATA_BASE_URL > None (= the Hugging Face hub)."""
    url = base_url or os.environ.get(BASE_URL_ENV)
    return url.rstrip("/") if url else None


def download_remote_shards(dataset: str, data_dir, num_shards: int, base_url: str | None = None,
                           workers: int = 4, revision: str | None = None, progress: bool = True,
                           **http_kw) -> dict:
    """Download the train shards + the pinned val shard of a remote dataset and write the manifest.

    From the Hugging Face hub by default (``hub_file``: hub cache, HF_TOKEN, HF_ENDPOINT, checksums; each shard
    is hard-linked into ``data_dir``), or from a plain-HTTP mirror holding ``<base_url>/shard_NNNNN.parquet``
    when ``base_url`` / NANOCHAT_DATA_BASE_URL is set (``download_file``: retries, resumable ``.part`` files).
    """
    from tqdm import tqdm

    train_idx, val_idx = remote_shard_plan(dataset, num_shards)
    repo_id = REMOTE_DATASETS[dataset][0]
    url = resolve_base_url(base_url)
    data_dir = Path(data_dir)
    claim_for_dataset(data_dir, dataset)

    failed = StopFlag()  # the first failure or a Ctrl-C: queued shards are skipped, mirror downloads stop

    def fetch(index: int) -> str | None:
        """Download one shard into data_dir; returns the hub commit it came from (None: mirror, already there, or
        skipped because another shard failed: the first failure is what gets reported)."""
        if failed.is_set():
            return None
        try:
            return fetch_one(index)
        except DownloadStopped:  # by another shard's failure or the Ctrl-C: that is what gets reported
            return None
        except BaseException:
            failed.set()
            raise

    def fetch_one(index: int) -> str | None:
        name = shard_name(index)
        if (data_dir / name).is_file():  # a re-run: only the missing shards are fetched (validated below)
            return None
        if url:
            download_file(f"{url}/{name}", data_dir / name, validate=validate_parquet, progress=progress,
                          hint=f"check --base-url / ${BASE_URL_ENV} and the shard index", stop=failed, **http_kw)
            return None
        cached = hub_file(repo_id, name, revision=revision, progress=progress, stop=failed)
        try:
            validate_parquet(cached)
        except DataError as e:
            raise DownloadError(f"hub dataset {repo_id}, file {name}: {e}") from e
        with failed.placing(name):  # a hub download still running after Ctrl-C places nothing
            place_file(cached, data_dir / name)
        return cached.parent.name  # snapshots/<commit>/<file>

    indices = [val_idx] + train_idx
    # the first failure (or Ctrl-C) is reported now, not after every queued shard's retries or the downloads in
    # flight: these stop within a piece (a mirror's .part file is kept; huggingface_hub deletes its partial file),
    # and one that cannot stop (Xet) is left to run in its daemon thread until the process exits
    with tqdm(total=len(indices), desc=f"{dataset} shards", unit="shard", disable=not progress) as bar:
        commits = set(run_in_daemon_threads(fetch, indices, workers, failed, done=lambda: bar.update(1)))
    if url:
        source, provenance = url, {}
    else:
        source = f"hf://datasets/{repo_id}"
        previous = _previous_manifest(data_dir).get("hub_revision", [])
        provenance = {"hub_repo": repo_id, "hub_revision": sorted({*previous, *(c for c in commits if c)})}
    return write_manifest(data_dir, dataset, [shard_name(i) for i in train_idx], [shard_name(val_idx)],
                          source=source, train_indices=train_idx, val_index=val_idx, **provenance)


def claim_for_dataset(data_dir: Path, dataset: str) -> None:
    """Mark ``data_dir`` as holding ``dataset``'s shards, refusing a directory that holds another dataset's: remote
    shards are reused by name (shard_NNNNN.parquet), so the other dataset's files would be taken as this one's."""
    mark = data_dir / DATASET_MARK
    held = mark.read_text(encoding="utf-8").strip() if mark.is_file() else _previous_manifest(data_dir).get("dataset")
    if held and held != dataset:
        raise DataError(f"--data-dir {data_dir} holds the {held!r} dataset; give --dataset {dataset} a directory "
                        "of its own (the default is one per dataset)")
    data_dir.mkdir(parents=True, exist_ok=True)
    mark.write_text(dataset + "\n", encoding="utf-8")


def _previous_manifest(data_dir: Path) -> dict:
    try:
        manifest = json.loads((data_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}
