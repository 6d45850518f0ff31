"""Prepare a dataset as parquet shards + manifest.json (see nanochat/dataset.py for the layout).

    python -m scripts.prepare_data --dataset fineweb-edu --num-shards 8          # HF download (+ val shard 369)
    python -m scripts.prepare_data --dataset climbmix --num-shards 8             # HF download (+ val shard 6542)
    python -m scripts.prepare_data --dataset embedded                            # shipped offline corpus
    python -m scripts.prepare_data --dataset local --text-dir DIR                # your .txt/.jsonl/.parquet files
                                                                                 # (hidden .* files/folders skipped)
    python -m scripts.prepare_data --dataset hf:ORG/NAME[:CONFIG] [--split train] [--text-column text] \
        [--max-docs N]                                                           # any Hugging Face text dataset

Output goes to --data-dir (default $NANOCHAT_DATA_DIR/<dataset> or ~/.cache/nanochat/data/<dataset>; an hf:
dataset's name is nanochat.dataset.hf_dir_name's: hf-ORG--NAME--CONFIG, or hf_<spec percent-encoded> for others;
a relative local path by the absolute path it resolves to). A build into a directory holding another dataset, or
this one prepared with other --split/--text-column/--max-docs/--revision/--doc-chars/--text-dir/--val-fraction/
--docs-per-shard, or (hf:) streamed at another hub commit (the dataset changed upstream: --revision pins one), is
refused unless --overwrite (the runs trained on it would read the new data under its name).
For embedded/local data the held-out val set is the last --val-fraction of every source file's documents
(deterministic, disjoint from train, and drawn from every source so it matches the train distribution); files too
small to give a val document of their own (documents x fraction < 1) give the fraction together, evenly spread
over their documents in file order.
An hf: dataset is streamed with `datasets` (nothing but the shards is kept) and a --val-fraction f of its documents
goes to val, evenly spread (document i is val when floor((i+1)f) > floor(i f)), so the split is deterministic and
spread over the whole stream.
"""

import argparse
import codecs
import lzma
import math
import re
import sys
from pathlib import Path

from nanochat.cli_types import int_at_least, open_fraction, positive_int
from nanochat.dataset import (HF_PREFIX, MANIFEST, REMOTE_DATASETS, DataError, check_dataset_name,
                              check_default_dir_holds, default_data_dir, other_dataset_held,
                              download_remote_shards, load_manifest, read_jsonl_texts, remove_build_leftovers,
                              split_files, start_rebuild, write_manifest, write_text_shard)
from nanochat.download import DownloadError, file_sha256
from nanochat.jsonfile import written_path
from nanochat.run_dir import RunDirLock, ensure_writable
from nanochat.terminal import replace_unencodable_output

EMBEDDED_DIR = Path(__file__).resolve().parents[1] / "data" / "embedded"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
OWN_SHARDS = ("train_[0-9]*.parquet", "val_[0-9]*.parquet")  # what the builders write
HUB_COMMIT = re.compile(r"[0-9a-f]{40}")


def split_paragraph_documents(text: str, doc_chars: int) -> list[str]:
    """Group consecutive blank-line separated paragraphs into documents of at most ~doc_chars characters."""
    paragraphs = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n")]
    docs, current, size = [], [], 0
    for p in paragraphs:
        if not p:
            continue
        if current and size + len(p) > doc_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
        current.append(p)
        size += len(p) + 2
    if current:
        docs.append("\n\n".join(current))
    return docs


def read_source_documents(path: Path, doc_chars: int) -> list[str]:
    """Documents of one source file (.txt/.txt.xz: paragraph groups; .jsonl: field text; .parquet: column text).
    A UTF-8 byte order mark at the start of a text file is no text (it would stay in the first document: it is
    not whitespace); one further in is kept. Rows whose text is missing (null) or not a string are skipped with a
    warning naming the file."""
    name = path.name
    try:
        if name.endswith(".txt.xz"):
            return split_paragraph_documents(lzma.decompress(path.read_bytes()).decode("utf-8-sig"), doc_chars)
        if name.endswith(".txt"):
            return split_paragraph_documents(path.read_text(encoding="utf-8-sig"), doc_chars)
        if name.endswith(".jsonl"):
            texts = read_jsonl_texts(path, DataError)
        elif name.endswith(".parquet"):
            import pyarrow.parquet as pq

            from nanochat.dataset import validate_parquet

            validate_parquet(path)
            texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
        else:
            raise DataError(f"{path}: unsupported file type; use one of {LOCAL_SUFFIXES}")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e}); convert it to UTF-8 or leave it out of --text-dir") from e
    except lzma.LZMAError as e:  # only the shipped corpus is .txt.xz
        raise DataError(f"{path} is not a valid .xz file ({e}); restore data/embedded/ from git") from e
    except OSError as e:  # a read error: main's OSError branch is for writes under --data-dir
        raise DataError(f"cannot read {path}: {e.strerror or e}") from e
    docs = [t for t in texts if isinstance(t, str)]
    if len(docs) < len(texts):
        skipped = len(texts) - len(docs)
        print(f"warning: {path}: skipped {skipped} row{'s' * (skipped > 1)} whose text is null or not a string",
              file=sys.stderr)
    return docs


def build_text_dataset(sources: list[Path], data_dir: Path, dataset: str, source_desc: str,
                       doc_chars: int = 1200, val_fraction: float = 0.05, docs_per_shard: int = 1000,
                       row_group_size: int = 64, request: dict | None = None, text_dir: str | None = None) -> dict:
    """Turn text sources into train/val parquet shards + manifest (the same format as the downloaded data).
    ``request`` (``text_request``) is recorded in the manifest: a re-run of the same request can skip the build.
    ``text_dir`` (local: --text-dir resolved) too, outside the request (builds kept from before it was recorded
    stay kept), for ``check_replaces_no_other_build``."""
    if not sources:
        raise DataError(f"no input files for --dataset {dataset} ({source_desc}); "
                        f"expected files ending in {LOCAL_SUFFIXES}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    files = []
    for path in sources:
        docs = [d for d in read_source_documents(path, doc_chars) if d.strip()]
        if not docs:
            print(f"warning: {path} contains no text; skipped", file=sys.stderr)
            continue
        files.append(docs)
    train_docs, val_docs = [], []
    # files too small to give a val document of their own (n f < 1): their own ceil would give 1 of n (50% val from
    # 2-document files) and 1-document files none; together ("the pool") they give ceil(N f) of their N documents,
    # one in every 1/f counted from the pool's last document (which alone is val where one such file has them all)
    pool_left = sum(len(docs) for docs in files if len(docs) * val_fraction < 1)
    for docs in files:
        if len(docs) * val_fraction >= 1:  # its last ceil(n f) documents
            n_val = math.ceil(len(docs) * val_fraction)
            train_docs.extend(docs[:len(docs) - n_val])
            val_docs.extend(docs[len(docs) - n_val:])
            continue
        for doc in docs:
            pool_left -= 1  # documents of the pool after this one
            in_val = math.ceil((pool_left + 1) * val_fraction) > math.ceil(pool_left * val_fraction)
            (val_docs if in_val else train_docs).append(doc)
    if not train_docs or not val_docs:
        raise DataError(f"the corpus ({source_desc}) is too small: {len(train_docs)} train and {len(val_docs)} val "
                        "documents; give more text (at least 2 paragraphs/documents)")
    data_dir.mkdir(parents=True, exist_ok=True)
    start_rebuild(data_dir)
    train_names = _write_shards(data_dir, "train", train_docs, docs_per_shard, row_group_size)
    val_names = _write_shards(data_dir, "val", val_docs, docs_per_shard, row_group_size)
    manifest = write_manifest(data_dir, dataset, train_names, val_names, source=source_desc,
                              documents={"train": len(train_docs), "val": len(val_docs)},
                              **({"request": request} if request else {}),
                              **({"text_dir": text_dir} if text_dir else {}))
    remove_build_leftovers(data_dir, manifest, OWN_SHARDS)
    return manifest


def text_request(sources: list[Path], root: Path, doc_chars: int, val_fraction: float, docs_per_shard: int) -> dict:
    """What an embedded/local build is made from: every source's content (path under ``root``, sha256) and the
    flags that shape the shards. Equal requests build equal datasets. "leading_bom" (only where some text source
    starts with a byte order mark) names those sources: a build made before the mark was dropped recorded no such
    entry, so it is built again rather than kept with the mark in a document."""
    request = {"sources": [[str(p.relative_to(root)), file_sha256(p)] for p in sources], "doc_chars": doc_chars,
               "val_fraction": val_fraction, "docs_per_shard": docs_per_shard}
    with_bom = [str(p.relative_to(root)) for p in sources
                if p.name.endswith((".txt", ".jsonl")) and _starts_with_bom(p)]
    return {**request, "leading_bom": with_bom} if with_bom else request


def _starts_with_bom(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8


def already_prepared(data_dir: Path, dataset: str, request: dict) -> bool:
    """``data_dir`` holds a complete build of ``request``: its manifest recorded the same request and every shard
    it lists is there with its recorded size (an interrupted build has no manifest: start_rebuild drops it)."""
    try:
        manifest = load_manifest(data_dir)
        split_files(data_dir, "train")
        split_files(data_dir, "val")
    except DataError:
        return False
    return manifest["dataset"] == dataset and manifest.get("request") == request


class ShardWriter:
    """Buffers documents of one split and writes ``<prefix>_NNNNN.parquet`` shards of ``docs_per_shard`` each."""

    def __init__(self, data_dir: Path, prefix: str, docs_per_shard: int, row_group_size: int):
        self.data_dir, self.prefix, self.size, self.row_group_size = data_dir, prefix, docs_per_shard, row_group_size
        self.buffer, self.names, self.count = [], [], 0

    def add(self, doc: str) -> None:
        self.buffer.append(doc)
        self.count += 1
        if len(self.buffer) == self.size:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            name = f"{self.prefix}_{len(self.names):05d}.parquet"
            write_text_shard(self.data_dir / name, self.buffer, row_group_size=self.row_group_size)
            self.names.append(name)
            self.buffer = []


def _write_shards(data_dir: Path, prefix: str, docs: list[str], docs_per_shard: int, row_group_size: int):
    writer = ShardWriter(data_dir, prefix, docs_per_shard, row_group_size)
    for doc in docs:
        writer.add(doc)
    writer.flush()
    return writer.names


def embedded_sources() -> list[Path]:
    files = sorted(EMBEDDED_DIR.glob("*.txt.xz"))
    if not files:
        raise DataError(f"the embedded corpus is missing from {EMBEDDED_DIR}; restore data/embedded/ from git")
    return files


def local_sources(text_dir, data_dir=None) -> list[Path]:
    """The input files under ``text_dir``, leaving out those in ``data_dir`` (the output): a re-run would otherwise
    read the previous run's shards, val included, back in as input. A ``data_dir`` above ``text_dir`` holds every
    input: there only the files reached outside ``text_dir``'s own tree (links to the shards) are left out.
    Hidden files and folders (a name starting with ".", at any level below ``text_dir``) are no input either:
    ``.ipynb_checkpoints/`` holds near-copies of the sources (whose train part can hold their val documents),
    ``.git/`` and editors' temp files are not the corpus; a line on stderr says how many were skipped."""
    if text_dir is None:
        raise DataError("--dataset local needs --text-dir DIR (a directory of .txt/.jsonl/.parquet files)")
    text_dir = Path(text_dir)
    if not text_dir.is_dir():
        raise DataError(f"--text-dir {text_dir} is not a directory")
    out = Path(data_dir).resolve() if data_dir is not None else None
    if out is not None and out == text_dir.resolve():
        raise DataError(f"--data-dir {data_dir} is --text-dir: the shards would be written among the inputs; "
                        "give --data-dir another directory")
    src = text_dir.resolve()

    def is_output(path: Path) -> bool:
        real = path.resolve()
        return out is not None and out in real.parents and not (out in src.parents and src in real.parents)

    found = sorted(p for p in text_dir.rglob("*") if p.is_file() and p.name.endswith(LOCAL_SUFFIXES)
                   and not is_output(p))
    hidden = [p for p in found if any(part.startswith(".") for part in p.relative_to(text_dir).parts)]
    if hidden:
        shown = ", ".join(str(p.relative_to(text_dir)) for p in hidden[:3]) + (", ..." if len(hidden) > 3 else "")
        print(f"note: --text-dir {text_dir}: skipped {len(hidden)} hidden file{'s' * (len(hidden) > 1)} (a name "
              f"starting with '.' in its path: {shown})", file=sys.stderr)
    skip = set(hidden)
    return [p for p in found if p not in skip]


# ---- any Hugging Face dataset ------------------------------------------------------------------------------
def parse_hf_spec(dataset: str) -> tuple[str, str | None]:
    """'hf:ORG/NAME[:CONFIG]' -> (path, config); the path may also be a local dataset directory."""
    path, _, config = dataset[len(HF_PREFIX):].partition(":")
    if not path:
        raise ValueError(f"--dataset {dataset!r}: expected hf:ORG/NAME or hf:ORG/NAME:CONFIG")
    return path, config or None


def is_val_doc(index: int, val_fraction: float) -> bool:
    """Document ``index`` (0-based, in stream order) goes to val: one in every 1/val_fraction, evenly spread."""
    return math.floor((index + 1) * val_fraction) > math.floor(index * val_fraction)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def resolved_commit(path: str, builder) -> str | None:
    """The hub commit ``builder`` streams: `datasets` resolves --revision (or the main branch) to a commit once, as
    it makes the builder, and gives the builder that commit as its hash (so no network call of its own here, and
    the data streamed is that commit's). None for a local folder or file (read before the hub), and where the hash
    is not a commit (a `datasets` that hashes otherwise)."""
    if Path(path).exists():
        return None
    commit = getattr(builder, "hash", None)
    return commit if isinstance(commit, str) and HUB_COMMIT.fullmatch(commit) else None


def build_hf_dataset(dataset: str, data_dir: Path, split: str = "train", text_column: str = "text",
                     max_docs: int | None = None, val_fraction: float = 0.05, docs_per_shard: int = 20_000,
                     revision: str | None = None, row_group_size: int = 1024, progress: bool = True,
                     check_commit=None) -> dict:
    """Stream split ``split`` of a Hugging Face dataset into train/val shards + manifest.

    Documents are the non-empty strings of ``text_column`` in stream order, at most ``max_docs`` of them;
    ``is_val_doc`` picks the val ones. Rows whose text is empty or not a string are counted and skipped. The hub
    commit streamed (``resolved_commit``) is recorded as the manifest's hf "commit" (a hub dataset only), and given
    to ``check_commit`` (``same_commit_check``) before anything in ``data_dir`` changes.
    """
    import datasets
    from tqdm import tqdm

    path, config = parse_hf_spec(dataset)
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    if max_docs is not None and max_docs < 2:
        raise ValueError(f"--max-docs must be >= 2 (one train and one val document), got {max_docs}")
    try:
        # load_dataset(..., streaming=True) is these two calls; the builder tells the commit it resolved
        builder = datasets.load_dataset_builder(path, config, revision=revision)
        stream = builder.as_streaming_dataset(split=split)
    except Exception as e:  # unknown dataset/config/split, no network, gated repo: the library says which
        raise DataError(f"--dataset {dataset} --split {split}: cannot open the dataset "
                        f"({type(e).__name__}: {_one_line(e)})") from e
    commit = resolved_commit(path, builder)
    if check_commit is not None:
        check_commit(commit)
    data_dir.mkdir(parents=True, exist_ok=True)
    start_rebuild(data_dir)
    writers = {s: ShardWriter(data_dir, s, docs_per_shard, row_group_size) for s in ("train", "val")}
    kept = skipped = 0
    rows = iter(stream)
    try:
        with tqdm(total=max_docs, unit="doc", desc=dataset, disable=not progress) as bar:
            for row in rows:
                if text_column not in row:
                    raise DataError(f"--dataset {dataset}: no column {text_column!r} (columns: {sorted(row)}); "
                                    "pick one with --text-column")
                text = row[text_column]
                if not isinstance(text, str) or not text.strip():
                    skipped += 1
                    continue
                writers["val" if is_val_doc(kept, val_fraction) else "train"].add(text)
                kept += 1
                bar.update(1)
                if max_docs is not None and kept >= max_docs:
                    break
    except DataError:
        raise
    except Exception as e:  # a row the library cannot decode, a dropped connection mid-stream
        raise DataError(f"--dataset {dataset} --split {split}: reading the stream failed after {kept + skipped} "
                        f"rows ({type(e).__name__}: {_one_line(e)})") from e
    finally:
        if hasattr(rows, "close"):
            rows.close()  # stop the stream's reader threads/files now, not at interpreter exit
    for w in writers.values():
        w.flush()
    if not writers["train"].count or not writers["val"].count:
        raise DataError(f"--dataset {dataset} --split {split} gave {writers['train'].count} train and "
                        f"{writers['val'].count} val documents (skipped {skipped} empty or non-text rows); "
                        "need at least one of each: use more documents or a larger --val-fraction")
    hf = {"path": path, "config": config, "split": split, "revision": revision, "text_column": text_column,
          "max_docs": max_docs, "val_fraction": val_fraction, "docs_per_shard": docs_per_shard,
          "skipped_rows": skipped}
    if Path(path).exists():  # a local folder or file, which `datasets` reads before the hub: where it resolves
        hf["local_path"] = str(Path(path).resolve())
    if commit is not None:
        hf["commit"] = commit
    source = f"{dataset} split={split}" + (f" revision={revision}" if revision else "")
    manifest = write_manifest(data_dir, dataset, writers["train"].names, writers["val"].names, source=source,
                              documents={s: w.count for s, w in writers.items()}, hf=hf)
    remove_build_leftovers(data_dir, manifest, OWN_SHARDS)
    return manifest


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, type=check_dataset_name, metavar="DATASET",
                   help="fineweb-edu, climbmix (hub shards), embedded, local, or hf:ORG/NAME[:CONFIG]")
    p.add_argument("--data-dir", default=None, help="output directory (default: $NANOCHAT_DATA_DIR/<dataset>)")
    p.add_argument("--num-shards", type=positive_int, default=8, help="remote datasets: number of train shards")
    p.add_argument("--base-url", default=None, help="remote datasets: a plain-HTTP mirror holding "
                   "shard_NNNNN.parquet instead of the hub (also env NANOCHAT_DATA_BASE_URL; hub mirrors: HF_ENDPOINT)")
    p.add_argument("--revision", default=None, help="remote and hf: datasets: hub branch, tag or commit")
    p.add_argument("--workers", type=positive_int, default=4, help="remote datasets: parallel downloads")
    p.add_argument("--max-attempts", type=positive_int, default=5, help="remote datasets: attempts per file")
    p.add_argument("--text-dir", default=None, help="--dataset local: directory of .txt/.jsonl/.parquet files, "
                   "read recursively (hidden files and folders, named .*, are skipped)")
    p.add_argument("--doc-chars", type=positive_int, default=1200,
                   help="text files: paragraphs are grouped into documents of up to this many characters")
    p.add_argument("--val-fraction", type=open_fraction, default=0.05,
                   help="embedded/local: held-out fraction per file; hf: one val document in every 1/fraction")
    p.add_argument("--docs-per-shard", type=positive_int, default=None,
                   help="embedded/local/hf: documents per shard (default 1000; hf: 20000)")
    p.add_argument("--split", default="train", help="hf: the dataset split to stream")
    p.add_argument("--text-column", default="text", help="hf: the column holding the document text")
    p.add_argument("--max-docs", type=int_at_least(2), default=None,
                   help="hf: stop after this many documents (default: all; at least one train and one val)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--rebuild", action="store_true", help="embedded/local: build again even when --data-dir already "
                   "holds a complete build from the same sources and flags (which is otherwise kept)")
    p.add_argument("--overwrite", action="store_true", help="embedded/local/hf: replace the build in the output "
                   "directory even where it is another dataset's or was prepared with other --split, --text-column, "
                   "--max-docs, --val-fraction, --docs-per-shard, --revision, --doc-chars or --text-dir (which is "
                   "otherwise refused: the runs trained on it would read the new data)")
    return p.parse_args(argv)


def build_local_dataset(args, data_dir: Path, progress: bool) -> dict:
    """The shards + manifest of an hf:, embedded or local dataset (built here, not downloaded)."""
    if args.dataset.startswith(HF_PREFIX):
        return build_hf_dataset(args.dataset, data_dir, args.split, args.text_column, args.max_docs, args.val_fraction,
                                args.docs_per_shard or 20_000, args.revision, progress=progress,
                                check_commit=None if args.overwrite else same_commit_check(data_dir, args))
    sources = embedded_sources() if args.dataset == "embedded" else local_sources(args.text_dir, data_dir)
    desc = str(EMBEDDED_DIR) if args.dataset == "embedded" else str(args.text_dir)
    docs_per_shard = args.docs_per_shard or 1000
    request = text_request(sources, Path(desc), args.doc_chars, args.val_fraction, docs_per_shard)
    if not args.rebuild and already_prepared(data_dir, args.dataset, request):
        print(f"{args.dataset}: already prepared in {data_dir} from the same sources and flags: kept "
              "(--rebuild builds it again)")
        return load_manifest(data_dir)
    text_dir = str(Path(args.text_dir).resolve()) if args.dataset == "local" else None
    return build_text_dataset(sources, data_dir, args.dataset, desc, doc_chars=args.doc_chars,
                              val_fraction=args.val_fraction, docs_per_shard=docs_per_shard, request=request,
                              text_dir=text_dir)


# the flags that change what a build holds (its documents, their train/val split, its shards): {flag: the key of
# the manifest's "hf" (hf: builds) or "request" (embedded/local builds) recording it}; --text-dir is "text_dir"
HF_BUILD_FLAGS = {"--split": "split", "--text-column": "text_column", "--max-docs": "max_docs",
                  "--val-fraction": "val_fraction", "--docs-per-shard": "docs_per_shard", "--revision": "revision"}
TEXT_BUILD_FLAGS = {"--doc-chars": "doc_chars", "--val-fraction": "val_fraction", "--docs-per-shard": "docs_per_shard"}


def build_flags(args) -> dict:
    """{flag: value} of this build's flags that change what it holds, as its manifest records them."""
    if args.dataset.startswith(HF_PREFIX):
        return {"--split": args.split, "--text-column": args.text_column, "--max-docs": args.max_docs,
                "--val-fraction": args.val_fraction, "--docs-per-shard": args.docs_per_shard or 20_000,
                "--revision": args.revision}
    flags = {"--doc-chars": args.doc_chars, "--val-fraction": args.val_fraction,
             "--docs-per-shard": args.docs_per_shard or 1000}
    if args.dataset == "local" and args.text_dir is not None:
        flags["--text-dir"] = str(Path(args.text_dir).resolve())
    return flags


def recorded_build_flags(manifest: dict) -> dict:
    """The same flags as a build's manifest records them; one it does not record (a manifest written before it was
    recorded: an hf: build's --docs-per-shard, a local build's --text-dir) is left out, so not compared."""
    if isinstance(manifest.get("hf"), dict):
        entry, keys = manifest["hf"], HF_BUILD_FLAGS
    else:
        entry, keys = manifest.get("request") or {}, TEXT_BUILD_FLAGS
    flags = {flag: entry[key] for flag, key in keys.items() if key in entry}
    if entry.get("commit"):  # the commit streamed decides, not the name that pinned it (same_commit_check)
        flags.pop("--revision", None)
    if manifest.get("text_dir"):
        flags["--text-dir"] = manifest["text_dir"]
    return flags


def _shown(flags: dict) -> str:
    return " ".join(f"{flag} {'none' if value is None else value}" for flag, value in flags.items())


def _where(data_dir: Path, args) -> str:
    return f"--data-dir {data_dir}" if args.data_dir else \
        f"{data_dir} (the default directory of --dataset {args.dataset})"


def same_commit_check(data_dir: Path, args):
    """Where ``data_dir`` holds this hf: dataset streamed at a recorded hub commit: the check, for
    ``build_hf_dataset``, that refuses a build streaming another commit (the dataset changed upstream under the same
    flags, or --revision names another): it would replace the data under the same name, as other flags would
    (``check_replaces_no_other_build``). Else None: nothing recorded to compare (no build, an older manifest, a
    local folder)."""
    try:
        manifest = load_manifest(data_dir)
    except DataError:
        return None
    hf = manifest.get("hf")
    recorded = hf.get("commit") if isinstance(hf, dict) and manifest.get("dataset") == args.dataset else None
    if not recorded:
        return None

    def check(commit: str | None) -> None:
        if commit is not None and commit != recorded:
            raise DataError(f"{_where(data_dir, args)} holds --dataset {args.dataset} streamed at hub commit "
                            f"{recorded}; this build streams commit {commit} (the dataset changed upstream, or "
                            f"--revision names another commit) and would replace it under the same name: pass "
                            f"--revision {recorded} to build that commit again, or --overwrite to replace it (or "
                            "give this build a --data-dir of its own)")
    return check


def check_replaces_no_other_build(data_dir: Path, args) -> None:
    """A build (embedded, local, hf:) into a directory whose manifest records another dataset, or this dataset
    prepared with other document-changing flags (``build_flags``: `--split train` then `--split validation` of one
    hf: dataset share its default directory), is refused unless --overwrite: it would replace that data under the
    same name, and the runs that trained on it would read the new data (base_eval's bpb, the analyses). The same
    flags build as before (embedded/local: kept where complete; edited sources under them are built again)."""
    try:
        manifest = load_manifest(data_dir)
    except DataError:  # none (a first or interrupted build) or unreadable: nothing recorded to replace
        return
    where = _where(data_dir, args)
    fixes = (" under the same name, and runs that trained on it would read the new data (base_eval's bpb, the "
             "analyses); give this build a --data-dir of its own, or pass --overwrite to replace it")
    held = other_dataset_held(data_dir, args.dataset, manifest)
    if held is not None:
        raise DataError(f"{where} holds --dataset {held}; this build (--dataset {args.dataset}) would replace it"
                        + fixes)
    recorded, wanted = recorded_build_flags(manifest), build_flags(args)
    differ = [flag for flag in wanted if flag in recorded and recorded[flag] != wanted[flag]]
    if differ:
        raise DataError(f"{where} holds --dataset {manifest['dataset']} prepared with "
                        f"{_shown({f: recorded[f] for f in differ})}; this build "
                        f"({_shown({f: wanted[f] for f in differ})}) would replace it" + fixes)


def main(argv=None) -> int:
    """Exit 2 with one error line for bad flags, inputs or --data-dir and for a write that fails there (a full
    disk), as the other entry points do; 130 after Ctrl-C, saying what was kept."""
    args = parse_args(argv)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir(args.dataset)
    progress = not args.no_progress
    try:
        ensure_writable(data_dir, "--data-dir")  # before any download or tokenizing
        if args.dataset in REMOTE_DATASETS:
            manifest = download_remote_shards(args.dataset, data_dir, args.num_shards, base_url=args.base_url,
                                              workers=args.workers, revision=args.revision, progress=progress,
                                              max_attempts=args.max_attempts)
        else:
            # one builder per directory: two would write the same shard names and manifest (downloads of
            # remote shards need none: each file has a lock of its own, and the same shards are fetched once)
            lock = RunDirLock(data_dir).acquire("--data-dir")
            try:
                if not args.data_dir:
                    check_default_dir_holds(data_dir, args.dataset)
                if not args.overwrite:
                    check_replaces_no_other_build(data_dir, args)
                manifest = build_local_dataset(args, data_dir, progress)
            finally:
                lock.release(remove_file=True)
    except (DataError, DownloadError, ValueError) as e:  # NotWritable is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # reading the inputs raises DataError: this is writing the shards or manifest
        where = written_path(e.filename, data_dir)  # the shard, not its temp name
        print(f"error: could not write {where}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.dataset in REMOTE_DATASETS:
            kept = ("the finished shards are kept (a mirror download's .part file too): running the same command "
                    "again continues")
        elif (data_dir / MANIFEST).is_file():  # stopped while reading the sources, before the rebuild began
            kept = "the dataset already there is unchanged: running the same command again builds the new one"
        else:
            kept = "no manifest was written (loaders refuse the directory): running the same command again builds it"
        print(f"prepare_data: interrupted; in {data_dir} {kept}", file=sys.stderr)
        return 130
    rows = {split: sum(manifest["shards"][n]["rows"] for n in manifest[split]) for split in ("train", "val")}
    print(f"{args.dataset}: {len(manifest['train'])} train shards ({rows['train']} docs), "
          f"{len(manifest['val'])} val shards ({rows['val']} docs) in {data_dir}")
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
