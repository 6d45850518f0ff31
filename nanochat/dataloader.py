"""Packed pretraining batches with exact resume, and a fixed validation set.

Training stream (per rank), fully determined by (seed, rank, world_size, data files):

* The unit of reading is a parquet row group. Each epoch the list of all row groups of the split is permuted
  with ``seed`` and rank r takes units ``perm[r::world_size]``, so in every epoch each document is read by
  exactly one rank. Inside a row group the documents are permuted too (``seed``, epoch, unit id), so the data
  order depends on the seed at document granularity. The stream loops over epochs forever.
* A background thread reads row groups and tokenizes them in chunks (tiktoken releases the GIL), prepending
  BOS to every document, and hands ``(chunk, cursor after chunk)`` to the consumer through a bounded queue.
* Best-fit packing (as nanochat): each row of seq_len+1 tokens is filled with the largest buffered document
  that fits, repeatedly; when none fits, the shortest one is cropped to fill the row exactly. No padding, and
  every row starts with BOS.

Exact resume: ``state_dict()`` records the cursor of the last chunk the *consumer* took (not how far the
background thread has read ahead) plus the packing buffer (documents are stored with their insertion number
so best-fit ties break identically). Restoring it and restarting the reader at the cursor reproduces the
uninterrupted stream token for token. The buffer costs ~4 bytes x buffered tokens (a few MB per rank).

Resume on another number of ranks (``repartition``) is not token-exact: within the current epoch the new ranks
read exactly the row groups no old rank had started (see ``PackedDataLoader.repartition``).
"""

import math
import queue
import threading
from bisect import bisect_left, bisect_right, insort
from collections import OrderedDict

import numpy as np
import torch

from nanochat.common import rows_to_device
from nanochat.dataset import DataError, open_parquet, read_row_group_texts, split_files, validate_parquet

STATE_VERSION = 1
# the training loader's packing buffer and tokenizing chunk (documents): build_eval_rows packs the train bpb rows
# with the same, so that on one process they are the loader's first rows
BUFFER_DOCS, TOKENIZE_CHUNK = 1000, 128


class BestFitPacker:
    """A buffer of tokenized documents kept sorted by (length, insertion number)."""

    def __init__(self, row_len: int, buffer_docs: int):
        self.row_len, self.buffer_docs = row_len, buffer_docs
        self.items: list[tuple[int, int, np.ndarray]] = []  # (len, seq, int32 tokens)
        self.next_seq = 0

    def add(self, docs: list[np.ndarray]) -> None:
        for doc in docs:
            insort(self.items, (len(doc), self.next_seq, doc))
            self.next_seq += 1

    def fill_row(self, row: np.ndarray, refill) -> bool:
        """Fill ``row`` (row_len,) in place; ``refill()`` adds documents, returning False when the source is dry.

        Returns False (row incomplete) only when a finite source runs out.
        """
        pos = 0
        while pos < self.row_len:
            while len(self.items) < self.buffer_docs and refill():
                pass
            if not self.items:
                return False
            remaining = self.row_len - pos
            idx = bisect_right(self.items, (remaining, math.inf)) - 1  # largest doc with len <= remaining
            if idx >= 0:
                idx = bisect_left(self.items, (self.items[idx][0], -1))  # oldest of the docs with that length
                n, _, doc = self.items.pop(idx)
                row[pos:pos + n] = doc
                pos += n
            else:  # nothing fits: crop the shortest doc (its prefix keeps the BOS at the row start)
                _, _, doc = self.items.pop(0)
                row[pos:] = doc[:remaining]
                pos = self.row_len
        return True

    def state(self) -> dict:
        lengths = [n for n, _, _ in self.items]
        tokens = np.concatenate([d for _, _, d in self.items]) if self.items else np.zeros(0, np.int32)
        return {"lengths": torch.tensor(lengths, dtype=torch.int64), "seqs": torch.tensor(
            [s for _, s, _ in self.items], dtype=torch.int64), "tokens": torch.from_numpy(tokens.copy()),
            "next_seq": self.next_seq}

    def load(self, state: dict) -> None:
        docs = np.split(state["tokens"].numpy().astype(np.int32), np.cumsum(state["lengths"].numpy())[:-1]) \
            if len(state["lengths"]) else []
        self.items = sorted((len(d), int(s), d) for d, s in zip(docs, state["seqs"].tolist()))
        self.next_seq = int(state["next_seq"])


def _tokenize_docs(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """BOS + tokens of each text, as int32 arrays."""
    bos = tokenizer.bos_token_id
    return [np.array([bos, *ids], dtype=np.int32) for ids in tokenizer.encode_batch(texts)]


MAX_OPEN_SHARDS = 64  # parquet files kept open between reads (the least recently read ones are closed)


class _RowGroupIndex:
    """All non-empty row groups (file index, row group index, rows) of a list of parquet files."""

    def __init__(self, files):
        self.files = list(files)
        self.units = []
        for fi, path in enumerate(self.files):
            validate_parquet(path)
            with open_parquet(path) as pf:
                meta = pf.metadata
            self.units += [(fi, rg, meta.row_group(rg).num_rows) for rg in range(meta.num_row_groups)
                           if meta.row_group(rg).num_rows > 0]
        # units are shuffled over all shards, so every rank reads every shard in an epoch: keep a bounded set
        # open (thousands of shards would exceed the process's open-file limit)
        self._open: OrderedDict = OrderedDict()

    def read(self, unit: int) -> list[str]:
        fi, rg, _ = self.units[unit]
        if fi in self._open:
            self._open.move_to_end(fi)
        else:
            if len(self._open) >= MAX_OPEN_SHARDS:
                self._open.popitem(last=False)[1].close()
            self._open[fi] = open_parquet(self.files[fi])
        return [t if t is not None else "" for t in read_row_group_texts(self._open[fi], self.files[fi], rg)]

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()


def epoch_permutation(seed: int, epoch: int, n_units: int) -> np.ndarray:
    """The order in which the ranks together read the row groups of ``epoch`` (rank r: ``[r::world_size]``)."""
    return np.random.default_rng([seed, epoch]).permutation(n_units)


def unit_document_order(seed: int, epoch: int, unit: int, rows: int) -> np.ndarray:
    """The order in which the documents of row group ``unit`` are read in ``epoch``, on whichever rank."""
    return np.random.default_rng([seed, epoch, int(unit), 1]).permutation(rows)


class PackedDataLoader:
    """Infinite iterator of (inputs, targets), both int64 (batch_size, seq_len) on ``device``."""

    def __init__(self, data_dir, split, batch_size, seq_len, tokenizer, rank=0, world_size=1, seed=0,
                 device="cpu", buffer_docs=BUFFER_DOCS, tokenize_chunk=TOKENIZE_CHUNK, prefetch_chunks=8):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.batch_size, self.seq_len, self.tokenizer = batch_size, seq_len, tokenizer
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.device = torch.device(device)
        self.tokenize_chunk, self.prefetch_chunks = tokenize_chunk, prefetch_chunks
        files = split_files(data_dir, split)
        self.file_names = [f.name for f in files]
        self.index = _RowGroupIndex(files)
        if len(self.index.units) < world_size:
            raise DataError(f"the {split} split of {data_dir} has {len(self.index.units)} row groups, fewer than "
                            f"world size {world_size}, so some rank would get no data; prepare more data or use "
                            "smaller row groups (scripts.prepare_data --docs-per-shard / row_group_size)")
        self.packer = BestFitPacker(seq_len + 1, buffer_docs)
        self.cursor = (0, 0, 0)  # (epoch, position in this rank's unit list, document within the unit)
        self.remaining = None  # (epoch, (n,) unit ids read in that epoch instead of its permutation), set by
        # repartition() after a world-size change
        self._queue = self._thread = self._stop = None

    # ---- deterministic document order ---------------------------------------------------------------------
    def _epoch_perm(self, epoch: int) -> np.ndarray:
        return epoch_permutation(self.seed, epoch, len(self.index.units))

    def _rank_units(self, epoch: int) -> np.ndarray:
        if self.remaining is not None and self.remaining[0] == epoch:
            return self.remaining[1][self.rank::self.world_size]
        return self._epoch_perm(epoch)[self.rank::self.world_size]

    def repartition(self, old_states: list[dict]) -> str:
        """Continue from the states of a run with another world size (``--resume-new-world-size``).

        ``old_states[r]`` is old rank r's ``state_dict()``. Let E be the newest epoch an old rank is in. The new
        ranks first read, as their epoch E, every unit that no old rank has started: the unread rest of the
        earlier epochs of old ranks that were behind (in epoch order), then the units of epoch E; this list
        (``self.remaining``) is the same on every new rank and split ``[rank::world_size]``. Later epochs use
        the normal partition. Within an epoch each unit is read once, by the old or by the new ranks; repeated
        changes work because an old rank's units come from its saved ``remaining`` list where it applies.

        Lost for good (the old streams cannot be continued token for token with another number of ranks): the
        documents in the old ranks' packing buffers and the unread rest of the row groups they were reading,
        which count as read. Carried-over units are read with epoch E's document order (one list per loader keeps
        the state format). Returns a one-line summary for the log."""
        for key in ("seed", "seq_len", "files"):
            mine = {"seed": self.seed, "seq_len": self.seq_len, "files": list(self.file_names)}[key]
            if any(s.get(key) != mine for s in old_states):
                raise ValueError(f"dataloader state has a different {key} than this loader; "
                                 "the data files, --data-seed and seq len must match the checkpoint's run")
        if any(s.get("remaining") != old_states[0].get("remaining") for s in old_states):
            raise ValueError("the old ranks' dataloader states disagree on their re-partitioned unit list")
        old_world = len(old_states)
        cursors = [tuple(int(c) for c in s["cursor"]) for s in old_states]  # (epoch, unit position, document)
        epoch = max(e for e, _, _ in cursors)
        left = []  # unit ids no old rank has started, in reading order; may repeat an id across epochs
        for ep in range(min(e for e, _, _ in cursors), epoch + 1):
            units = self._old_units(old_states[0], ep)  # (n,) old rank r read units[r::old_world] in epoch ep
            # position in old rank r's list from which nothing was started: all of it if the rank is in an
            # earlier epoch, none if in a later one; a unit with some documents read counts as started
            first_unread = [0 if e < ep else len(units) if e > ep else upos + (1 if dpos else 0)
                            for e, upos, dpos in cursors]
            carried = len(left)  # in the last iteration (ep == epoch): the units carried from earlier epochs
            left += [int(u) for i, u in enumerate(units) if i // old_world >= first_unread[i % old_world]]
        self.close()
        self.remaining = (epoch, np.array(left, dtype=np.int64))
        self.cursor = (epoch, 0, 0)
        self.packer = BestFitPacker(self.packer.row_len, self.packer.buffer_docs)
        return f"epoch {epoch}, {len(left)} units left to read ({carried} carried over from earlier epochs)"

    def _old_units(self, old_state: dict, epoch: int) -> np.ndarray:
        """The unit list the old ranks striped in ``epoch``: their ``remaining`` list (the same on every old rank,
        set by an earlier repartition) if it is for that epoch, else the epoch's permutation."""
        remaining = old_state.get("remaining")
        if remaining is not None and int(remaining[0]) == epoch:
            return np.array(remaining[1], dtype=np.int64)
        return self._epoch_perm(epoch)

    def _doc_order(self, epoch: int, unit: int) -> np.ndarray:
        return unit_document_order(self.seed, epoch, unit, self.index.units[unit][2])

    def epoch_documents(self, epoch: int) -> list[tuple[int, int]]:
        """(row-group unit, row within it) of every document this rank reads in ``epoch``, in reading order."""
        return [(int(u), int(r)) for u in self._rank_units(epoch) for r in self._doc_order(epoch, int(u))]

    def _produce(self, cursor, out: queue.Queue, stop: threading.Event) -> None:
        """Background thread: read, shuffle and tokenize documents from ``cursor`` on, forever. An error is handed
        to the consumer, which raises it in the training loop: a DataError naming the file being read."""
        where = "the reader thread"
        try:
            epoch, upos, dpos = cursor
            while not stop.is_set():
                units = self._rank_units(epoch)
                if upos >= len(units):
                    epoch, upos, dpos = epoch + 1, 0, 0
                    continue
                unit = int(units[upos])
                fi, rg, _ = self.index.units[unit]
                where = f"{self.index.files[fi]} (row group {rg})"
                texts = self.index.read(unit)
                order = self._doc_order(epoch, unit)
                while dpos < len(order) and not stop.is_set():
                    chunk = [texts[i] for i in order[dpos:dpos + self.tokenize_chunk]]
                    dpos += len(chunk)
                    after = (epoch, upos, dpos) if dpos < len(order) else (epoch, upos + 1, 0)
                    self._put(out, stop, (_tokenize_docs(self.tokenizer, chunk), after))
                upos, dpos = upos + 1, 0
        except DataError as e:  # surface reader errors in the training loop instead of hanging it
            self._put(out, stop, e)
        except Exception as e:  # e.g. the tokenizer failing on this file's text: the same clear error
            err = DataError(f"reading {where} failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            self._put(out, stop, err)
        except BaseException as e:
            self._put(out, stop, e)

    @staticmethod
    def _put(out: queue.Queue, stop: threading.Event, item) -> None:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    # ---- consumer -----------------------------------------------------------------------------------------
    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch_chunks)
        self._thread = threading.Thread(target=self._produce, args=(self.cursor, self._queue, self._stop),
                                        daemon=True, name=f"dataloader-rank{self.rank}")
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._queue = self._thread = self._stop = None

    def _refill(self) -> bool:
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        docs, self.cursor = item
        self.packer.add(docs)
        return True

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._thread is None:
            self._start()
        batch = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
        for row in batch:
            self.packer.fill_row(row, self._refill)
        return rows_to_device(torch.from_numpy(batch), self.device)

    def passes(self) -> float:
        """Passes over this rank's share of the split so far (1.28 = the second epoch, 28% in), counted at the
        documents taken into the packing buffer (up to ``buffer_docs`` ahead of the rows handed out): where the
        reader is, so its documents repeat once this passes 1 (metrics.jsonl's data_read_passes; data_passes is the
        tokens trained, which runs behind it by the buffer and the ends of the documents cropped to fill rows). In an
        epoch re-partitioned by ``repartition`` the units the old ranks started count as read, so the count goes
        on from where the old ranks were instead of restarting with this rank's share of the units left."""
        epoch, position, _ = self.cursor
        done = position / max(len(self._rank_units(epoch)), 1)
        if self.remaining is None or self.remaining[0] != epoch:
            return epoch + done
        n_units = len(self.index.units)
        # units carried over from an earlier epoch can make the list longer than an epoch: then nothing counts
        read_before = max(n_units - len(self.remaining[1]), 0) / max(n_units, 1)
        return epoch + read_before + (1 - read_before) * done

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "seq_len": self.seq_len, "files": list(self.file_names), "cursor": list(self.cursor),
                "buffer": self.packer.state(),
                "remaining": None if self.remaining is None else [self.remaining[0], self.remaining[1].tolist()]}

    def load_state_dict(self, state: dict) -> None:
        mine = {"version": STATE_VERSION, "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "seq_len": self.seq_len, "files": list(self.file_names)}
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(f"dataloader state has {key}={state.get(key)!r} but this loader has {value!r}; "
                                 "exact resume needs the same data files, seed (--data-seed), seq len and world size")
        self.close()
        self.cursor = tuple(int(c) for c in state["cursor"])
        self.packer.load(state["buffer"])
        remaining = state.get("remaining")
        self.remaining = None if remaining is None else (int(remaining[0]), np.array(remaining[1], dtype=np.int64))

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---- validation ---------------------------------------------------------------------------------------------
class EvalRowsTooFew(DataError):
    """A split that packs fewer rows than an eval token budget asks for (build_eval_rows); base_eval names where
    its budget came from."""


def manifest_chunks(data_dir, split, chunk_docs: int):
    """The documents of ``split`` in manifest order, in lists of ``chunk_docs`` (the val rows' order)."""
    from nanochat.dataset import iter_documents

    docs = iter_documents(data_dir, split)
    while chunk := [t or "" for _, t in zip(range(chunk_docs), docs)]:
        yield chunk


def first_read_chunks(data_dir, split, seed: int, chunk_docs: int):
    """The documents of ``split`` in the order a one-process ``PackedDataLoader`` of ``seed`` reads epoch 0, in
    its tokenizing chunks (``chunk_docs`` = its ``tokenize_chunk``; a chunk never spans two row groups), so that
    packing them as it does gives its first rows (unless the split has fewer documents than the loader's buffer:
    its buffer then takes in epoch 1 too). With W processes the ranks together read the same row groups
    first (epoch 0's permutation, striped): the documents of the first rows are read in a run's first steps."""
    index = _RowGroupIndex(split_files(data_dir, split))
    try:
        for unit in epoch_permutation(seed, 0, len(index.units)):
            texts, order = index.read(int(unit)), unit_document_order(seed, 0, unit, index.units[unit][2])
            for start in range(0, len(order), chunk_docs):
                yield [texts[i] for i in order[start:start + chunk_docs]]
    finally:
        index.close()


def eval_rows_order(split: str, data_seed: int | None) -> tuple[int | None, dict]:
    """(``first_read_seed`` for build_eval_rows, the rows' entry in an evaluation's fingerprint) of ``split``: the
    train rows are the documents a run of ``data_seed`` reads first (the final train bpb: data it trained on; None,
    for a run that records no seed, e.g. an imported one: the split's first documents), the val rows the split's
    first documents."""
    from nanochat.report import FIRST_READ  # the prefix its readers of these descriptions match

    if split == "train" and data_seed is not None:
        return data_seed, {"rows": f"{FIRST_READ} with --data-seed {data_seed}"}
    return None, {}


def build_eval_rows(data_dir, split, tokenizer, seq_len, num_tokens, buffer_docs=BUFFER_DOCS, rank=0,
                    world_size=1, first_read_seed: int | None = None,
                    chunk_docs: int = TOKENIZE_CHUNK, budget_flag: str = "--eval-tokens") -> torch.LongTensor:
    """A fixed (N, seq_len+1) set of packed rows, N = ceil(num_tokens / seq_len).

    Documents are taken in manifest order without shuffling and packed exactly like training rows, so the set
    depends only on the data, the tokenizer and seq_len, never on world size or device batch size. With
    ``first_read_seed`` (the train split's rows for the final train bpb: data the run has trained on) they come
    in the order a training loader of that --data-seed reads them first (``first_read_chunks``): the rows are
    then token for token the first rows a one-process run of ``buffer_docs`` and ``chunk_docs`` (its
    ``tokenize_chunk``) trains on, whatever the world size; a multi-process run reads their documents in its
    first steps, packed alongside others.

    With several ranks (collective: every rank must call it) the tokenization is split: the documents come in
    chunks (of ``chunk_docs``), rank r tokenizes chunks r, r+W, ... of each round of W
    chunks and the ranks exchange the tokens, so each tokenizes ~1/W of the text and every rank packs the same
    rows. In an evaluation
    (``nanochat.eval_resume.interrupts_raise``) a signal latched on any rank ends it with ``Interrupted`` on every
    rank after the round it came in. A split too small for ``num_tokens`` raises ``EvalRowsTooFew`` advising to lower
    ``budget_flag`` (the caller's flag for ``num_tokens``).
    """
    n_rows = math.ceil(num_tokens / seq_len)
    chunks = manifest_chunks(data_dir, split, chunk_docs) if first_read_seed is None else \
        first_read_chunks(data_dir, split, first_read_seed, chunk_docs)
    packer = BestFitPacker(seq_len + 1, buffer_docs)
    ready: list[list[np.ndarray]] = []  # tokenized chunks in document order, not yet packed

    def next_round() -> None:
        if world_size == 1:
            ready.append(_tokenize_docs(tokenizer, next(chunks, [])))
            return
        import torch.distributed as dist

        from nanochat.common import portable_error, raise_lowest_rank_error
        from nanochat.eval_resume import latched_signal, stop_if_latched_on_any_rank

        mine, error = [], None
        try:  # every rank reads the data itself: a file only one rank cannot read (its node's copy) fails there alone
            texts = [next(chunks, []) for _ in range(world_size)]
            mine = _tokenize_docs(tokenizer, texts[rank])
        except Exception as e:  # noqa: BLE001 - shared below, so that no rank waits in an exchange the others left
            error = e
        # the exchange carries this rank's error (every rank raises the lowest failing rank's, naming it) and an
        # evaluation's latched signal: a stop while a long split is tokenized takes effect after this round on
        # every rank, not after the whole split (0 outside an evaluation)
        chunks_of = [None] * world_size
        dist.all_gather_object(chunks_of, (mine, latched_signal(), None if error is None else portable_error(error)))
        raise_lowest_rank_error([err for _, _, err in chunks_of], error)
        stop_if_latched_on_any_rank([signum for _, signum, _ in chunks_of])
        ready.extend(chunk for chunk, _, _ in chunks_of)

    def refill() -> bool:
        if not ready:
            next_round()
        chunk = ready.pop(0)
        packer.add(chunk)
        return bool(chunk)

    rows = np.empty((n_rows, seq_len + 1), dtype=np.int64)
    try:
        for i in range(n_rows):
            if not packer.fill_row(rows[i], refill):
                raise EvalRowsTooFew(f"the {split} split of {data_dir} yields only {i} rows of {seq_len + 1} tokens "
                                f"(~{i * seq_len:,} tokens) but {num_tokens:,} eval tokens were asked for; "
                                f"lower {budget_flag} or prepare a larger {split} split")
    finally:
        chunks.close()  # its open shards
    return torch.from_numpy(rows)


def estimate_split_tokens(data_dir, split, tokenizer, sample_docs=1024) -> tuple[int, int]:
    """(estimated tokens, documents sampled) of ``split`` as the loader reads it (BOS + tokens per document): the
    mean length of its first ``sample_docs`` documents times the manifest's document count. For the plan's data
    passes: tokenizing a 4B-token split would take many minutes. metrics.jsonl's data_passes divides the tokens
    trained by it too, so that it ends at the plan's estimate."""
    from nanochat.dataset import load_manifest

    manifest = load_manifest(data_dir)
    documents = sum(manifest["shards"][name]["rows"] for name in manifest[split])
    sample = next(manifest_chunks(data_dir, split, sample_docs), [])
    tokens = sum(len(doc) for doc in _tokenize_docs(tokenizer, sample))
    return round(tokens / max(len(sample), 1) * documents), len(sample)


def iter_eval_batches(rows, batch_size, rank=0, world_size=1, device="cpu"):
    """Yield (inputs, targets) for rows[rank::world_size] in chunks of batch_size (last chunk may be smaller).

    Ranks can get one row / one batch more than others: reduce sums across ranks once at the end, not per batch.
    """
    mine = rows[rank::world_size]
    device = torch.device(device)
    for start in range(0, len(mine), batch_size):
        yield rows_to_device(mine[start:start + batch_size], device)
