"""Reproduction configs: one TOML file per paper table row (``configs/<table>/<row>.toml``).

    [row]    table, name, label, order (the row's place in the paper's table), seeds (default seeds of the row),
             nproc_per_node (paper hardware), notes,
             reconstructed (true when the design's structure was inferred from the paper's parameter total:
             results tables mark the row),
             train_shards (the number of training shards of [train] dataset the paper's run read: a run on fewer
             prepared shards repeats its data more often, which base_train --dry-run and the run's start warn about),
             compare_to (the [row] name of the row the paper's delta columns subtract: the routing controls' "vs
             MoME"; [paper] val_bpb_vs_ref, core_vs_ref hold the paper's deltas)
    [train]  defaults for scripts.base_train, keyed by flag name without the leading dashes
    [paper]  the paper's reported numbers for the row (train_bpb, val_bpb, core, params_memory_m, ...) and, where
             the reference says so, ``attention``: the kernel its throughput was measured with (sdpa, fa2, fa3)

This module imports no torch, so ``scripts/run.py --plan`` works on a bare Python.
"""

import json
import sys
from pathlib import Path

from nanochat.cli_types import check_int_at_least

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
ROW_KEYS = {"table", "name", "label", "order", "seeds", "nproc_per_node", "notes", "reconstructed", "train_shards",
            "compare_to"}
PAPER_ATTENTION = ("sdpa", "fa2", "fa3")  # [paper] attention: a resolved kernel (--attention auto is not one)


def load_row_config(path) -> dict:
    """Read, parse and check a row config for the runner; errors name the file and the offending key."""
    path = Path(path)
    return check_row_config(read_config(path, f"config {path}"), path)


def read_config(path: Path, named: str) -> dict:
    """The config file ``path`` (a row config or base_train's flat --config file), parsed: ``parse_toml``, after
    a directory (ValueError) or a missing file (FileNotFoundError) is refused in one wording, led by ``named``."""
    if path.is_dir():
        raise ValueError(f"{named}: a directory, not a file (configs/README.md lists the row configs)")
    if not path.is_file():
        raise FileNotFoundError(f"{named}: file not found (configs/README.md lists the row configs)")
    return parse_toml(path, named)


def parse_toml(path: Path, named: str) -> dict:
    """The TOML file ``path``, parsed; an unreadable file, one that is not UTF-8 (what TOML requires: the locale's
    encoding would read other bytes on other machines) or not TOML raises a ValueError that begins with ``named``."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{named}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); TOML files "
                         "are UTF-8") from None
    except OSError as e:
        raise ValueError(f"{named}: cannot be read ({e.strerror or e})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{named}: invalid TOML: {e}") from e


def check_row_config(cfg: dict, path, runner: bool = True) -> dict:
    """Check an already parsed row config (filled with defaults, in place). ``runner=True`` also requires the
    batch keys that scripts/run.py checks hardware overrides with (base_train checks with False)."""
    path = Path(path)
    loose = sorted(key for key, value in cfg.items() if not isinstance(value, dict))
    if loose:
        raise ValueError(f"config {path}: key(s) {loose} outside a table: a file with tables is a row config ([row], "
                         "[train], [paper]); put them under [train]")
    unknown = sorted(set(cfg) - {"row", "train", "paper"})
    if unknown:
        raise ValueError(f"config {path}: unknown top-level table(s) {unknown}; allowed: row, train, paper")
    row, train = cfg.get("row", {}), cfg.get("train", {})
    bad = sorted(set(row) - ROW_KEYS)
    if bad:
        raise ValueError(f"config {path}: unknown [row] key(s) {bad}; allowed: {sorted(ROW_KEYS)}")
    for key in ("table", "name"):
        if not isinstance(row.get(key), str) or not row[key]:
            raise ValueError(f"config {path}: [row] needs a non-empty string '{key}'")
    if "compare_to" in row and (not isinstance(row["compare_to"], str) or not row["compare_to"]):
        raise ValueError(f"config {path}: [row] 'compare_to' must be the [row] name of another row of its table "
                         f"(got {row['compare_to']!r})")
    if not isinstance(row.get("reconstructed", False), bool):
        raise ValueError(f"config {path}: [row] 'reconstructed' must be true or false (a TOML boolean)")
    if not isinstance(row.get("order", 0), int) or isinstance(row.get("order"), bool):
        raise ValueError(f"config {path}: [row] 'order' must be an integer (the row's place in its table)")
    shards = row.get("train_shards", 1)
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"config {path}: [row] 'train_shards' must be a positive integer (the paper's number of "
                         f"training shards), got {shards!r}")
    for key in ("total-batch-size", "max-seq-len", "device-batch-size") if runner else ():
        if key not in train:
            raise ValueError(f"config {path}: [train] must set '{key}' (the runner checks hardware overrides with it)")
        _check_count(path, f"[train] '{key}'", train[key])
    _check_count(path, "[row] 'nproc_per_node'", row.get("nproc_per_node", 1))
    paper_attention = cfg.setdefault("paper", {}).get("attention", "sdpa")
    if paper_attention not in PAPER_ATTENTION:
        raise ValueError(f"config {path}: [paper] 'attention' must be one of {', '.join(PAPER_ATTENTION)} (the kernel "
                         f"the paper's throughput was measured with), got {paper_attention!r}")
    row.setdefault("seeds", [42])
    row.setdefault("nproc_per_node", 1)
    cfg["path"] = str(path.resolve())  # the runner starts base_train from the repo root
    return cfg


def _check_count(path, key: str, value) -> None:
    """A count the runner computes with (the batch split, the process count): a float or a string would be cut or
    fail inside int(), a list or a boolean raise a traceback or read as 1."""
    check_int_at_least(f"config {path}: {key}", value)


def paper_train_shards(cfg: dict) -> tuple[int, str] | None:
    """(training shards, dataset) of the paper's run for a row config, parsed and checked (``check_row_config``);
    None for a row without ``[row] train_shards``."""
    shards = cfg["row"].get("train_shards")
    return (shards, cfg.get("train", {}).get("dataset", "fineweb-edu")) if shards else None


def shipped_row(cfg: dict) -> dict | None:
    """This checkout's own config of ``cfg``'s row (configs/<table>/<name>.toml, as every shipped row is named),
    loaded, when ``cfg`` is another file (a copy); None when ``cfg`` is that file or the row is not a shipped one."""
    row = cfg["row"]
    path = REPO / "configs" / row["table"] / f"{row['name']}.toml"
    if not path.is_file() or path.resolve() == Path(cfg["path"]):
        return None
    return load_row_config(path)


def train_differences(cfg: dict, other: dict) -> list[str]:
    """The [train] keys ``cfg`` sets otherwise than ``other`` ("key value (row: value)", in name order)."""
    ours, theirs = cfg.get("train", {}), other.get("train", {})
    shown = lambda key, train: json.dumps(train[key], default=str) if key in train else "not set"
    return [f"{key} {shown(key, ours)} (row: {shown(key, theirs)})" for key in sorted(set(ours) | set(theirs))
            if ours.get(key, ...) != theirs.get(key, ...)]


def find_configs(root=None) -> list[Path]:
    root = Path(root) if root else REPO / "configs"
    return sorted(root.rglob("*.toml"))
