"""Our text files (README/markdown, JSON, config, CSV, logs) are UTF-8 whatever the locale: a text-mode open()
without ``encoding=`` takes the locale's (Latin-1 under LANG=en_US.ISO-8859-1, ASCII under LC_ALL=C with
PYTHONUTF8=0), so scripts.report --readme read the README's "—" wrong and wrote it back changed (or stopped on it),
and a hand-written manifest.json with a non-ASCII value stopped data preparation with a UnicodeDecodeError."""

import ast
import json
import os
import subprocess
import sys

from conftest import REPO

# Python's locale encoding is ASCII here: no coercion of the C locale to C.UTF-8 (PEP 538), no UTF-8 mode (PEP 540)
ASCII_LOCALE = {"LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}

READ_BACK = r"""
import json, locale, sys
from pathlib import Path

from nanochat.dataset import DataError, claim_for_dataset
from nanochat.jsonfile import read_json_object, write_text_atomic
from scripts import report

assert locale.getpreferredencoding(False) == "ANSI_X3.4-1968", locale.getpreferredencoding(False)
tmp = Path(sys.argv[1])
report.replace_readme_table(tmp / "README.md", ["| run | val bpb |", "| caf\u00e9 \u2020 | 2.07 |"])
try:
    claim_for_dataset(tmp / "data", "climbmix")
except DataError as e:
    assert "'fineweb-\u00e9'" in str(e), e
else:
    raise AssertionError("another dataset's directory was claimed")
assert read_json_object(tmp / "config.json", ValueError) == {"args": {"run_name": "caf\u00e9"}}
write_text_atomic(tmp / "note.md", "caf\u00e9 \u2014 \u2020\n")
print("ok")
"""


def test_our_files_read_and_write_as_utf8_under_an_ascii_locale(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("Caf\u00e9 \u2014 intro\n<!-- cpu-demo-table -->\nold\n<!-- /cpu-demo-table -->\nend \u2014\n",
                      encoding="utf-8")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"dataset": "fineweb-\u00e9"}, ensure_ascii=False),
                                                      encoding="utf-8")
    (tmp_path / "config.json").write_text('{"args": {"run_name": "caf\u00e9"}}', encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("LANG", "LANGUAGE", "PYTHONIOENCODING")}
    out = subprocess.run([sys.executable, "-c", READ_BACK, str(tmp_path)], cwd=REPO, env={**env, **ASCII_LOCALE},
                         capture_output=True, timeout=120)
    assert out.returncode == 0 and out.stdout == b"ok\n", out.stderr.decode("utf-8", "replace")
    assert readme.read_text(encoding="utf-8") == ("Caf\u00e9 \u2014 intro\n<!-- cpu-demo-table -->\n| run | val bpb |\n"
                                                  "| caf\u00e9 \u2020 | 2.07 |\n<!-- /cpu-demo-table -->\nend \u2014\n")
    assert (tmp_path / "note.md").read_bytes() == "caf\u00e9 \u2014 \u2020\n".encode("utf-8")


def _text_opens_without_encoding(tree):
    """The open()/Path.open()/read_text()/write_text() calls in ``tree`` that open text without naming its encoding
    (binary modes, os.open and our classes' own .open(...) with a non-mode first argument are not text opens)."""
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or any(k.arg == "encoding" for k in call.keywords):
            continue
        func = call.func
        mode = next((k.value for k in call.keywords if k.arg == "mode"), None)
        if isinstance(func, ast.Name) and func.id == "open":
            mode = mode or (call.args[1] if len(call.args) > 1 else None)
        elif isinstance(func, ast.Attribute) and func.attr == "open" and ast.unparse(func.value) != "os":
            first = call.args[0] if call.args else None
            if first is not None and not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue  # e.g. FinishedResults.open(out_dir, ...): not a file object's open
            mode = mode or first
        elif not (isinstance(func, ast.Attribute) and func.attr in ("read_text", "write_text")):
            continue
        modes = [mode] if not isinstance(mode, ast.IfExp) else [mode.body, mode.orelse]  # "ab" if offset else "wb"
        if mode is None or not all(isinstance(m, ast.Constant) and "b" in str(m.value) for m in modes):
            yield call, ast.unparse(call)


def test_every_text_open_names_its_encoding():
    found, files = [], 0
    for folder in ("nanochat", "scripts", "bench", "dev"):
        for path in sorted((REPO / folder).rglob("*.py")):
            files += 1
            source = path.read_text(encoding="utf-8")
            if "open(" not in source and "_text(" not in source:
                continue
            found += [f"{path.relative_to(REPO)}:{call.lineno}: {what}"
                      for call, what in _text_opens_without_encoding(ast.parse(source))]
    assert files > 80
    assert found == [], "\n".join(found)
