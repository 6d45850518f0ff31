"""The slot-map JSON of the authors' ``table``-mapped MoME checkpoints (the paper's d12 grouped rows), on import
and export.

Their model reads slot = map[token] from a ``nanochat_slot_map_v1`` file (reference notes §3.4, §3.11) whose map
is a non-persistent buffer: ``model_<step>.pt`` does not hold it, and their meta only records where the file was
on THEIR machine (``moe_ve_slot_map_path``). Ours is the grouped index, which loads that format as is
(nanochat.memory.slot_map) and keeps the map in the checkpoint (``memory.slot_map``). So:

* import needs the file (``--slot-map FILE``, else the meta's path if it exists here), checks it against the
  checkpoint (vocab size, S = moe_ve_slot_vocab_size slots of c = V/S tokens) and the tokenizer, and copies it
  into the run (``slot_map/<name>``) so that the run is self-contained;
* export writes their JSON beside the checkpoint: the run's own file byte for byte when it is theirs and holds
  the model's map (its sha256 survives a round trip), else one written from the map the model holds.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from nanochat.jsonfile import write_bytes_atomic
from nanochat.memory.mome import MoMEOptions
from nanochat.memory.slot_map import (FLAG as OUR_FLAG, REFERENCE_FORMAT, check_slot_map_tokenizer, load_slot_map,
                                      slot_map_from_data)
from nanochat.reference_format import ReferenceFormatError

FLAG = "--slot-map"
META_FIELD = "moe_ve_slot_map_path"
RUN_SUBDIR = "slot_map"  # the run's copy of the file


def source_path(model_config: dict, flag_value: str | None) -> Path | None:
    """The JSON a ``table``-mapped checkpoint reads: ``--slot-map``, else the meta's path if that file exists here.
    None when the checkpoint reads no map."""
    mapping = model_config.get("moe_ve_slot_mapping", "none")
    if mapping != "table":
        if flag_value:
            raise ReferenceFormatError(f"{FLAG} {flag_value}: the checkpoint reads no slot map (model_config "
                                       f"moe_ve_slot_mapping is {mapping!r}, not 'table')")
        return None
    if flag_value:
        if not Path(flag_value).is_file():
            raise FileNotFoundError(f"{FLAG} {flag_value}: no such file")
        return Path(flag_value)
    recorded = model_config.get(META_FIELD) or ""
    if recorded and Path(recorded).is_file():
        return Path(recorded)
    raise FileNotFoundError(f"model_config moe_ve_slot_mapping='table' reads a slot-map JSON that their checkpoint "
                            f"does not hold: pass it with {FLAG} FILE (the meta's {META_FIELD} {recorded!r} is not "
                            "a file here)")


@dataclass(frozen=True)
class SourceFile:
    """The file as an import reads it, once: the config's hash, the parse, the run's copy and the provenance hash
    all come from these bytes (a file rewritten during the import cannot give a copy other than the map parsed)."""
    path: Path
    raw: bytes
    sha256: str


def read_source(path: Path) -> SourceFile:
    raw = path.read_bytes()
    return SourceFile(path, raw, hashlib.sha256(raw).hexdigest())


def _import_error(e: ValueError, path) -> ReferenceFormatError:
    """slot_map's messages name our training flag; here the file came from --slot-map."""
    msg = str(e).removeprefix(f"{OUR_FLAG} {path}: ")
    return ReferenceFormatError(f"{FLAG} {path}: {msg}")


def read_for_import(source: SourceFile, options: dict, vocab_size: int, tokenizer):
    """The checked map (SlotMap) of the ``source`` file for our grouped ``options`` (from config_from_reference)."""
    o = MoMEOptions(**options)
    slots = vocab_size // o.group_size
    path = source.path
    try:
        data = json.loads(source.raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReferenceFormatError(f"{FLAG} {path}: not valid JSON ({e})") from None
    rows_key = "slot_vocab_size" if isinstance(data, dict) and data.get("format") == REFERENCE_FORMAT else "num_rows"
    if isinstance(data, dict) and data.get("vocab_size") not in (None, vocab_size):
        raise ReferenceFormatError(f"{FLAG} {path}: built for vocab size {data['vocab_size']}, the checkpoint's "
                                   f"model_config vocab_size is {vocab_size}")
    if isinstance(data, dict) and data.get(rows_key) not in (None, slots):
        raise ReferenceFormatError(f"{FLAG} {path}: has {rows_key} {data[rows_key]}, the checkpoint's table has "
                                   f"{slots} slots (model_config moe_ve_slot_vocab_size; {o.group_size} tokens each)")
    try:
        loaded = slot_map_from_data(data, path, source.sha256, vocab_size, o.group_size)
        check_slot_map_tokenizer(loaded.header, tokenizer, path)
    except ValueError as e:
        raise _import_error(e, path) from None
    return loaded


def run_path(path: Path, run_dir: Path) -> str:
    """Where the run's copy of ``path`` will be: our option holds it absolute (a relative one would be read
    against the working directory). A moved run still loads, since its checkpoint holds the map."""
    return str(run_dir.resolve() / RUN_SUBDIR / path.name)


def copy_into_run(source: SourceFile, tmp_run: Path) -> None:
    """Write the file's bytes into the run being written at ``tmp_run`` (renamed into place afterwards)."""
    (tmp_run / RUN_SUBDIR).mkdir(parents=True, exist_ok=True)
    (tmp_run / RUN_SUBDIR / source.path.name).write_bytes(source.raw)


def _their_json(token_to_row: torch.Tensor, group_size: int, tokenizer, source: str) -> dict:
    """A ``nanochat_slot_map_v1`` file for the map (§3.11 keys): slots in slot-id order, token ids ascending;
    token_texts as their loader compares them (the tokenizer's decode of each id, as tiktoken writes it)."""
    vocab = token_to_row.numel()
    counts = torch.bincount(token_to_row, minlength=vocab // group_size)
    if counts.numel() != vocab // group_size or (counts != group_size).any():
        raise ReferenceFormatError(f"the model's slot map does not group exactly {group_size} tokens per slot "
                                   f"into {vocab // group_size} slots; their table mapping cannot express it")
    order = torch.argsort(token_to_row * vocab + torch.arange(vocab))  # by slot, then token id
    rows = order.view(-1, group_size).tolist()
    return {"format": REFERENCE_FORMAT, "mapping": "table", "vocab_size": vocab, "slot_vocab_size": len(rows),
            "slot_factor": group_size,
            "tokenizer": {"vocab_size": tokenizer.vocab_size, "bos_token_id": tokenizer.bos_token_id},
            "slot_size_histogram": {str(group_size): len(rows)}, "stats": {},
            "metadata": {"source": "mome-nanochat export_reference", "exported_from": source},
            "slots": [{"slot_id": i, "token_ids": r, "token_texts": [tokenizer.decode([t]) for t in r]}
                      for i, r in enumerate(rows)]}


def _own_file(path: Path, token_to_row: torch.Tensor, group_size: int) -> bool:
    """Whether ``path`` is a file in their format holding exactly this map."""
    if not path.is_file():
        return False
    try:
        own = load_slot_map(path, token_to_row.numel(), group_size)
    except ValueError:
        return False  # rebuilt or replaced since: the checkpoint's map is the one to write
    return own.header.get("format") == REFERENCE_FORMAT and torch.equal(own.token_to_row, token_to_row)


def export(model, tokenizer, ckpt_dir: Path, run_dir=None) -> Path:
    """Write their JSON of the map ``model`` holds into ``ckpt_dir``; returns its path (for their meta). The file
    the config names is copied byte for byte when it holds that map; so is the run's own copy (``run_dir``'s
    slot_map/, where an import put it) when the run was moved since and the recorded absolute path is gone."""
    o, token_to_row = model.memory.opts, model.memory.slot_map.detach().cpu()
    src = Path(o.slot_map)
    dst = ckpt_dir / (src.name if src.suffix == ".json" else "slot_map.json")  # their loader takes only .json
    candidates = [src] + ([Path(run_dir) / RUN_SUBDIR / src.name] if run_dir is not None else [])
    own = next((p for p in candidates if _own_file(p, token_to_row, o.group_size)), None)
    if own is not None:
        data = own.read_bytes()
    else:
        data = json.dumps(_their_json(token_to_row, o.group_size, tokenizer, str(src))).encode()
    if dst.exists() and dst.read_bytes() != data:  # another step of the same --model-tag may share it
        raise FileExistsError(f"--out: {dst} already exists with another slot map; choose a new --model-tag")
    write_bytes_atomic(dst, data)
    return dst
