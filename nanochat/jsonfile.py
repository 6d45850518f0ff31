"""The small JSON files every tool depends on (manifest, tokenizer header, checkpoint meta, eval reports): reading
them with one clear error that names the file, whatever is wrong with it (not UTF-8, not JSON, not a JSON object),
and writing text so that a reader never sees half a file."""

import json
from collections.abc import Callable
from pathlib import Path


def read_json_object(path, error: type[Exception], advice: str = "") -> dict:
    """The JSON object in ``path``; raises ``error`` naming the file (and ending with ``advice``, if any) otherwise."""
    path = Path(path)
    advice = f"; {advice}" if advice else ""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise error(f"{path} is not valid JSON ({e}){advice}") from e
    if not isinstance(obj, dict):
        raise error(f"{path} is not a JSON object{advice}")
    return obj


def write_atomic(path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` to write the file at a temp name beside ``path``, then rename it over ``path``: a kill
    mid-write leaves the old file (or none), never a torn one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        tmp.replace(path)
    except BaseException:  # e.g. a full disk, Ctrl-C: no torn temp file left beside ``path``
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path, text: str) -> None:
    """``write_atomic`` of ``text`` (UTF-8)."""
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
