"""Prepared datasets: parquet shards with a ``text`` column + ``manifest.json`` saying which files are train/val.

Every dataset (FineWeb-Edu, ClimbMix, the embedded corpus, a user's local files) ends up in the same layout::

    <data_dir>/manifest.json   {"dataset", "source", "train": [files], "val": [files], "shards": {file: {rows, bytes}}}
    <data_dir>/<file>.parquet  column "text", one document per row

so everything after preparation (tokenizer training, the loader, evaluation) has one code path. The split is
whatever the manifest says; it never depends on file-name sorting.

This module also holds the robust downloader used for the remote datasets (retries with exponential backoff,
resumable ``.part`` files via HTTP Range, validation before a file gets its final name).
"""

import json
import os
import time
from pathlib import Path

MANIFEST = "manifest.json"
BASE_URL_ENV = "NANOCHAT_DATA_BASE_URL"

# name -> (default base URL, number of shards, validation shard index)
REMOTE_DATASETS = {
    "fineweb-edu": ("https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main", 1823, 369),
    "climbmix": ("https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main", 6543, 6542),
}


class DataError(RuntimeError):
    """Bad or missing data; the message names the file/flag and what to do."""


class DownloadError(DataError):
    pass


# ---- layout -----------------------------------------------------------------------------------------------
def default_data_dir(dataset: str) -> Path:
    root = os.environ.get("NANOCHAT_DATA_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "nanochat" / "data"
    return base / dataset


def read_jsonl_texts(path, error: type[Exception] = ValueError) -> list[str]:
    """The "text" field of every non-blank line of a JSONL file; a bad line raises ``error`` naming file:line."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise error(f"{path}:{lineno}: expected a JSON object with a 'text' field ({e})") from e
    return texts


def load_manifest(data_dir) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} not found: prepare the data first, e.g. "
                        f"`python -m scripts.prepare_data --dataset embedded --data-dir {data_dir}`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}); re-run scripts.prepare_data") from e
    for key in ("dataset", "train", "val", "shards"):
        if key not in manifest:
            raise DataError(f"{path} has no {key!r} entry; re-run scripts.prepare_data")
    return manifest


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
    return files


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
    tmp = data_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, data_dir / MANIFEST)
    return manifest


# ---- reading ----------------------------------------------------------------------------------------------
def validate_parquet(path) -> int:
    """Return the row count; raise DataError if the file is unreadable, has no ``text`` column or no rows."""
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises several types for truncated/garbage files
        raise DataError(f"{path} is not a readable parquet file ({type(e).__name__}: {e}); "
                        "delete it and re-run scripts.prepare_data") from e
    if "text" not in meta.schema.names:
        raise DataError(f"{path} has no 'text' column (columns: {meta.schema.names}); "
                        "every shard needs one document per row in a column named 'text'")
    if meta.num_rows <= 0:
        raise DataError(f"{path} has 0 rows; delete it and re-run scripts.prepare_data")
    return meta.num_rows


def iter_documents(data_dir, split: str):
    """Yield every document string of ``split`` in manifest / row-group order (one pass)."""
    import pyarrow.parquet as pq

    for path in split_files(data_dir, split):
        pf = pq.ParquetFile(path)
        for rg in range(pf.num_row_groups):
            yield from pf.read_row_group(rg, columns=["text"]).column("text").to_pylist()


def write_text_shard(path, texts: list[str], row_group_size: int = 256) -> None:
    """Write documents to a parquet shard (temp name + rename). Small row groups let ranks stripe small data."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not texts:
        raise DataError(f"refusing to write the empty shard {path}")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.table({"text": pa.array(texts, type=pa.string())}), tmp,
                   row_group_size=row_group_size, compression="zstd")
    os.replace(tmp, path)


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


def resolve_base_url(dataset: str, base_url: str | None = None) -> str:
    """--base-url flag > env NANOCHAT_DATA_BASE_URL > the dataset's Hugging Face URL."""
    url = base_url or os.environ.get(BASE_URL_ENV) or REMOTE_DATASETS[dataset][0]
    return url.rstrip("/")


def download_file(url: str, dest, *, max_attempts: int = 5, backoff: float = 2.0, timeout: float = 60.0,
                  progress: bool = True, validate=validate_parquet) -> Path:
    """Download ``url`` to ``dest`` robustly; returns ``dest``.

    Bytes go to ``dest.part`` (resumed with an HTTP Range request after a dropped connection); the file gets its
    final name only after ``validate(part)`` succeeds, so a final name always holds a complete, valid file.
    A ``.part`` left by a network failure is kept so the next run resumes it; one with invalid content is deleted.
    """
    dest = Path(dest)
    if dest.is_file():
        return dest
    part = dest.with_name(dest.name + ".part")
    last_error = None
    for attempt in range(max_attempts):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            _fetch_into(url, part, timeout=timeout, progress=progress)
            break
        except _PermanentHTTPError as e:
            part.unlink(missing_ok=True)
            raise DownloadError(f"{url}: {e}; check --base-url / ${BASE_URL_ENV} and the shard index") from e
        except Exception as e:  # network errors, 5xx, truncated bodies: retry and resume
            last_error = e
    else:
        resume = f"; re-running resumes from {part.name}" if part.exists() else ""
        raise DownloadError(f"could not download {url} after {max_attempts} attempts "
                            f"({type(last_error).__name__}: {last_error}); check the network or "
                            f"--base-url / ${BASE_URL_ENV}{resume}")
    try:
        validate(part)
    except DataError as e:
        part.unlink(missing_ok=True)
        raise DownloadError(f"downloaded {url} but the file is invalid: {e}") from e
    os.replace(part, dest)
    return dest


class _PermanentHTTPError(Exception):
    pass


def _fetch_into(url: str, part: Path, timeout: float, progress: bool) -> None:
    """One attempt: append the missing bytes of ``url`` to ``part``; raise if the body ends early."""
    import requests
    from tqdm import tqdm

    offset = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    with requests.get(url, stream=True, timeout=timeout, headers=headers) as r:
        if r.status_code == 416:  # our .part is not a prefix of this file any more: start over
            part.unlink(missing_ok=True)
            raise IOError("range not satisfiable; restarting the download from scratch")
        if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
            raise _PermanentHTTPError(f"HTTP {r.status_code}")
        r.raise_for_status()
        if r.status_code != 206:  # server ignored the Range header: rewrite from the start
            offset = 0
        remaining = r.headers.get("Content-Length")
        total = offset + int(remaining) if remaining is not None else None
        written = offset
        with open(part, "ab" if offset else "wb") as f, tqdm(
            total=total, initial=offset, unit="B", unit_scale=True, desc=part.name[:-5],
            disable=not progress, leave=False,
        ) as bar:
            for chunk in r.iter_content(chunk_size=1 << 16):  # small chunks: little is lost when a read fails
                f.write(chunk)
                written += len(chunk)
                bar.update(len(chunk))
    if total is not None and written < total:
        raise IOError(f"connection closed after {written} of {total} bytes")


def download_remote_shards(dataset: str, data_dir, num_shards: int, base_url: str | None = None,
                           workers: int = 4, **download_kw) -> dict:
    """Download the train shards + the pinned val shard of a remote dataset and write the manifest."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    train_idx, val_idx = remote_shard_plan(dataset, num_shards)
    url = resolve_base_url(dataset, base_url)
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    indices = [val_idx] + train_idx
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        jobs = [pool.submit(download_file, f"{url}/{shard_name(i)}", data_dir / shard_name(i), **download_kw)
                for i in indices]
        for job in tqdm(jobs, desc=f"{dataset} shards", unit="shard"):
            job.result()
    return write_manifest(data_dir, dataset, [shard_name(i) for i in train_idx], [shard_name(val_idx)],
                          source=url, train_indices=train_idx, val_index=val_idx)
