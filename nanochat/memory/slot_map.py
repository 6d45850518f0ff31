"""Slot maps for MoME's grouped row indexer f: V -> [N] (paper Sec. 3.4, "Token-Index Grouping Function").

File format (JSON, ``format = "mome_nanochat_slot_map"``, ``version = 1``)::

    {"format": ..., "version": 1, "vocab_size": V, "group_size": c, "num_rows": N = V / c,
     "source_checkpoint": str | null, "source": "wte" | "ve" | ..., "tokenizer_fingerprint": str | null,
     "bos_token_id": int | null, "special_token_ids": [...], "rows": [[token ids of row 0], [row 1], ...]}

The authors' ``nanochat_slot_map_v1`` files (reference notes §3.11: ``slots`` of ``{slot_id, token_ids,
token_texts, ...}``, ``slot_factor``, ``tokenizer {vocab_size, bos_token_id}``) load too, so the exact maps of the
paper's grouped rows can be used. Either way the map is checked against the run's tokenizer (``bind_tokenizer``):
our files by the tokenizer's fingerprint and BOS id, theirs by vocab size, BOS id and every token text that is
valid UTF-8 (a map built on another tokenizer of the same size would silently group unrelated tokens). Files
written before the fingerprint was recorded (``tokenizer_sha256``, a hash of the files) are not checked.

Every row holds EXACTLY c token ids and the rows partition [0, V) (disjoint, complete), so N = V / c and the
MoME table has exactly N*M rows regardless of the map (param counts are known without reading the file).

Special tokens are grouped only with other specials, in id order. When their count s is not a multiple of c,
the last special row is completed with the c - (s mod c) ordinary tokens that the greedy kNN pass leaves over
(the least-clustered ones), which keeps "exactly c per row" while never splitting specials across normal rows.

The builder (``build_groups``) is the paper's offline kNN grouping: cosine similarity on a trained embedding,
top-k neighbour lists computed in chunks (a 32768 x 32768 similarity matrix is never held at once), then a
greedy pass that seeds the tightest neighbourhoods first and gives each seed its c-1 nearest unassigned tokens.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from nanochat.jsonfile import write_text_atomic

FORMAT_NAME = "mome_nanochat_slot_map"
FORMAT_VERSION = 1
REFERENCE_FORMAT = "nanochat_slot_map_v1"  # the authors' files
FLAG = "--mome-slot-map"


@dataclass
class SlotMap:
    token_to_row: torch.Tensor  # (V,) int64
    header: dict  # every top-level key except "rows"
    sha256: str


def _fail(path, msg):
    raise ValueError(f"{FLAG} {path}: {msg}")


def validate_rows(rows, vocab_size: int, group_size: int, path="<rows>") -> torch.Tensor:
    """Check that ``rows`` is a partition of [0, vocab_size) into rows of exactly group_size; return the map."""
    with torch.device("cpu"):  # host-side work, also when the model is being built under torch.device("meta")
        return _validate_rows(rows, vocab_size, group_size, path)


def _validate_rows(rows, vocab_size, group_size, path):
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        _fail(path, "'rows' must be a list of lists of token ids")
    if vocab_size % group_size:
        _fail(path, f"vocab size {vocab_size} is not divisible by the group size {group_size}")
    if len(rows) != vocab_size // group_size:
        _fail(path, f"has {len(rows)} rows, expected vocab {vocab_size} / group size {group_size} = "
                    f"{vocab_size // group_size}")
    bad = [i for i, r in enumerate(rows) if len(r) != group_size]
    if bad:
        _fail(path, f"row {bad[0]} has {len(rows[bad[0]])} tokens, every row must have exactly {group_size}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for r in rows for t in r):
        _fail(path, "token ids must be integers")  # torch.tensor would truncate 0.9 to 0
    flat = torch.tensor(rows, dtype=torch.long).view(-1)  # (N*c,)
    if flat.numel() and (flat.min() < 0 or flat.max() >= vocab_size):
        _fail(path, f"token ids must lie in [0, {vocab_size}) (found {int(flat.min())}..{int(flat.max())})")
    counts = torch.bincount(flat, minlength=vocab_size)
    if (counts != 1).any():
        dup = int((counts > 1).nonzero()[0]) if (counts > 1).any() else None
        miss = int((counts == 0).nonzero()[0]) if (counts == 0).any() else None
        _fail(path, f"rows are not a disjoint full partition of the vocabulary (duplicate {dup}, missing {miss})")
    token_to_row = torch.empty(vocab_size, dtype=torch.long)
    token_to_row[flat] = torch.arange(len(rows)).repeat_interleave(group_size)
    return token_to_row


def load_slot_map(path, vocab_size: int, group_size: int, sha256: str | None = None) -> SlotMap:
    """Load and fully validate a slot-map file against the model's vocab size and --mome-group-size."""
    path = Path(path)
    if not path.is_file():
        _fail(path, "file does not exist (build one with scripts/build_slot_map.py)")
    raw = path.read_bytes()  # one read: the hash and the parse are of the same bytes
    digest = hashlib.sha256(raw).hexdigest()
    if sha256 and digest != sha256:
        _fail(path, f"content hash {digest[:12]}.. differs from the one recorded in the model config "
                    f"({sha256[:12]}..): the file changed since the model was configured")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        _fail(path, f"corrupt file, not valid JSON ({e})")
    return slot_map_from_data(data, path, digest, vocab_size, group_size)


def slot_map_from_data(data, path: Path, digest: str, vocab_size: int, group_size: int) -> SlotMap:
    """``load_slot_map``'s checks of the file's parsed JSON ``data`` (``digest``: the file's sha256), for a caller
    that has parsed it already."""
    if isinstance(data, dict) and data.get("format") == REFERENCE_FORMAT:
        rows, header = _reference_rows(data, path, vocab_size, group_size)
        return SlotMap(validate_rows(rows, vocab_size, group_size, path), header, digest)
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        _fail(path, f"not a slot map (format must be {FORMAT_NAME!r} or {REFERENCE_FORMAT!r})")
    if data.get("version") != FORMAT_VERSION:
        _fail(path, f"unsupported version {data.get('version')!r} (this code reads version {FORMAT_VERSION})")
    _check_sizes(data, path, ("num_rows", "rows"), vocab_size, "group_size", group_size)
    if data["num_rows"] != len(data["rows"]):
        _fail(path, f"header says {data['num_rows']} rows but the file has {len(data['rows'])}")
    token_to_row = validate_rows(data["rows"], vocab_size, group_size, path)
    header = {k: v for k, v in data.items() if k != "rows"}
    return SlotMap(token_to_row, header, digest)


def _check_sizes(data: dict, path, keys, vocab_size: int, group_key: str, group_size: int) -> None:
    """The keys are there, and the vocab and group sizes are the model's (``group_key``: the format's name)."""
    for key in ("vocab_size", group_key, *keys):
        if key not in data:
            _fail(path, f"missing key {key!r}")
    if data["vocab_size"] != vocab_size:
        _fail(path, f"was built for vocab size {data['vocab_size']} but the model has vocab size {vocab_size}")
    if data[group_key] != group_size:
        _fail(path, f"has {group_key} {data[group_key]} but --mome-group-size is {group_size}")


def _reference_rows(data: dict, path, vocab_size: int, group_size: int) -> tuple[list, dict]:
    """The rows of an authors' ``nanochat_slot_map_v1`` file, with their loader's structural checks, and a header
    that keeps what the tokenizer check needs (``tokenizer``, the token texts)."""
    if data.get("mapping") != "table":
        _fail(path, f"{REFERENCE_FORMAT} with mapping {data.get('mapping')!r}: only 'table' maps are slot maps")
    _check_sizes(data, path, ("slot_vocab_size", "slots"), vocab_size, "slot_factor", group_size)
    slots = data["slots"]
    if not isinstance(slots, list) or len(slots) != data["slot_vocab_size"]:
        _fail(path, f"has {len(slots) if isinstance(slots, list) else 'no'} slots, slot_vocab_size says "
                    f"{data['slot_vocab_size']}")
    texts = {}
    for i, slot in enumerate(slots):
        if not isinstance(slot, dict) or slot.get("slot_id") != i or "token_ids" not in slot:
            _fail(path, f"slot {i} must be an object with slot_id {i} and token_ids (slots in slot_id order)")
        for key in ("token_texts", "token_texts_visible", "sample_counts"):
            if key in slot and len(slot[key]) != len(slot["token_ids"]):
                _fail(path, f"slot {i}: {key} has {len(slot[key])} entries for {len(slot['token_ids'])} token ids")
        texts.update(zip(slot["token_ids"], slot.get("token_texts", [])))
    header = {k: v for k, v in data.items() if k != "slots"}
    header["token_texts"] = texts
    return [slot["token_ids"] for slot in slots], header


def check_slot_map_tokenizer(header: dict, tokenizer, path) -> None:
    """Refuse a map built on another tokenizer (see the module docstring); a no-op when the file records none."""
    if header.get("format") == REFERENCE_FORMAT:
        tok = header.get("tokenizer") or {}
        if tok.get("vocab_size", tokenizer.vocab_size) != tokenizer.vocab_size:
            _fail(path, f"was built for a tokenizer of {tok['vocab_size']} tokens, this run's has {tokenizer.vocab_size}")
        bos = tok.get("bos_token_id")
        texts = header.get("token_texts", {})
        bad = [(i, t) for i, t in texts.items() if _utf8_text(tokenizer, i) not in (None, t)]
    else:
        bos = header.get("bos_token_id")
        fingerprint = header.get("tokenizer_fingerprint")
        if fingerprint is not None and fingerprint != tokenizer.fingerprint():
            _fail(path, "was built with another tokenizer (its tokenizer_fingerprint differs from this run's "
                        "tokenizer): rebuild it with scripts/build_slot_map.py --tokenizer-dir <this run's tokenizer>")
        bad = []
    if bos is not None and bos != tokenizer.bos_token_id:
        _fail(path, f"was built for BOS id {bos}, this run's tokenizer has {tokenizer.bos_token_id}")
    if bad:
        shown = ", ".join(f"{i}: {t!r} (here {_utf8_text(tokenizer, i)!r})" for i, t in bad[:3])
        _fail(path, f"{len(bad)} token texts differ from this run's tokenizer ({shown}): it was built for another "
                    "tokenizer")


def _utf8_text(tokenizer, token_id: int) -> str | None:
    """The token's text, or None when its bytes are not valid UTF-8 on their own (then texts are not comparable)."""
    try:
        return tokenizer.decode_bytes([int(token_id)]).decode("utf-8")
    except UnicodeDecodeError:
        return None


def write_slot_map(path, rows: list[list[int]], vocab_size: int, group_size: int, *, source_checkpoint=None,
                   source="wte", tokenizer_fingerprint=None, bos_token_id=None, special_token_ids=()) -> str:
    """Validate and write a slot-map file; returns its sha256."""
    validate_rows(rows, vocab_size, group_size, path)
    data = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "vocab_size": vocab_size, "group_size": group_size,
            "num_rows": len(rows), "source_checkpoint": source_checkpoint, "source": source,
            "tokenizer_fingerprint": tokenizer_fingerprint, "bos_token_id": bos_token_id,
            "special_token_ids": sorted(int(i) for i in special_token_ids), "rows": rows}
    text = json.dumps(data, separators=(",", ":"))
    write_text_atomic(path, text)  # a failed write keeps the old map and leaves no temp file
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- builder -----------------------------------------------------------------------------------------------
def knn_lists(emb: torch.Tensor, k: int, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k cosine neighbours (excluding self) of every row of emb (V, D): (V, k) sims and ids, chunked."""
    x = F.normalize(emb.float(), dim=-1)
    V = x.size(0)
    k = min(k, V - 1)
    sims, ids = [], []
    for start in range(0, V, chunk):
        s = x[start : start + chunk] @ x.T  # (chunk, V)
        rows = torch.arange(start, min(start + chunk, V))
        s[rows - start, rows] = -float("inf")  # a token is not its own neighbour
        top = s.topk(k, dim=-1)
        sims.append(top.values)
        ids.append(top.indices)
    return torch.cat(sims), torch.cat(ids)


def build_groups(emb: torch.Tensor, group_size: int, special_ids=(), k: int = 64) -> list[list[int]]:
    """Partition the V tokens of emb (V, D) into V/c rows of exactly c mutually near tokens (cosine)."""
    V, c = emb.size(0), group_size
    if c < 1 or V % c:
        raise ValueError(f"--group-size {c} must be >= 1 and divide the vocab size {V}")
    specials = sorted(set(int(i) for i in special_ids))
    if any(not 0 <= i < V for i in specials):
        raise ValueError(f"special token ids must lie in [0, {V})")
    if c == 1:
        return [[i] for i in range(V)]
    n_fill = (-len(specials)) % c  # ordinary tokens needed to complete the last special row
    x = F.normalize(emb.float(), dim=-1)
    sims, nbrs = knn_lists(emb, max(k, c), chunk=2048)
    free = np.ones(V, dtype=bool)
    free[specials] = False
    # tightest neighbourhoods first: order seeds by similarity to their (c-1)-th nearest neighbour
    order = torch.argsort(sims[:, c - 2], descending=True).numpy()
    nbrs_np = nbrs.numpy()
    rows: list[list[int]] = []
    n_free = int(free.sum())
    for seed in order:
        if n_free <= n_fill:
            break
        if not free[seed]:
            continue
        cand = nbrs_np[seed][free[nbrs_np[seed]]][: c - 1]
        if len(cand) < c - 1:  # neighbour list exhausted: exact search over the remaining free tokens
            rest = np.flatnonzero(free)
            rest = rest[rest != seed]
            s = (x[rest] @ x[seed]).numpy()
            cand = rest[np.argsort(-s, kind="stable")[: c - 1]]
        group = [int(seed), *map(int, cand)]
        free[group] = False
        n_free -= c
        rows.append(group)
    leftovers = np.flatnonzero(free).tolist()
    special_rows = [specials[i : i + c] for i in range(0, len(specials), c)]
    if special_rows and len(special_rows[-1]) < c:
        special_rows[-1] = special_rows[-1] + leftovers
        leftovers = []
    if leftovers:  # only possible without specials: n_fill == 0 makes the loop consume everything
        raise AssertionError("greedy partition left tokens unassigned")
    return rows + special_rows
