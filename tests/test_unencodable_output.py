"""A terminal whose encoding cannot write a character (a non-UTF-8 locale, PYTHONIOENCODING=ascii or latin-1) does
not end an entry point after its work with a UnicodeEncodeError: its stdout writes the character as an escape
(nanochat.terminal.replace_unencodable_output), as Python's stderr already does; the files it writes stay UTF-8."""

import ast
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from nanochat.terminal import replace_unencodable_output
from scripts import report as report_cli
from test_report import fake_run


def run_module(module: str, args: list[str], encoding: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": encoding}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, timeout=120)


@pytest.mark.parametrize("encoding", ["latin-1"])  # results below: ascii
def test_the_report_prints_its_marked_readme_table_on_a_terminal_without_the_mark(tmp_path, encoding):
    # the table's LR_MARK (a row trained in part with other LRs) was printed last, after the report and the
    # README were written: the print raised and the command exited 1
    a = fake_run(tmp_path / "runs", "a", "base")
    b = fake_run(tmp_path / "runs", "b", "mome")
    config = json.loads((a / "config.json").read_text(encoding="utf-8"))
    config["lr_overrides"] = [{"step": 40, "changes": {"matrix_lr": {"checkpoint": 0.02, "now": 0.01}}}]
    (a / "config.json").write_text(json.dumps(config), encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(f"{report_cli.README_START}\n{report_cli.README_END}\n", encoding="utf-8")
    out = run_module("scripts.report", [str(a), str(b), "--no-curves", "--output", str(tmp_path / "c.md"),
                                        "--readme", str(readme)], encoding)
    assert out.returncode == 0, out.stderr.decode(encoding, "replace")
    printed = out.stdout.decode(encoding)
    assert "| a \\u2020 | base |" in printed and "\\u2020 a: learning rates overridden by hand" in printed
    assert printed.rstrip().endswith(f"table written to {readme}")
    assert "| a \u2020 | base |" in readme.read_text(encoding="utf-8")  # the file keeps the mark itself


def test_the_results_tables_print_on_an_ascii_terminal(tmp_path):
    out = run_module("scripts.results", ["--runs-root", str(tmp_path), "--table", "d12", "--out", str(tmp_path / "r")],
                     "ascii")
    assert out.returncode == 0, out.stderr.decode("ascii", "replace")
    printed = out.stdout.decode("ascii")
    assert "| \\u0394 |" in printed and "\\u2013" in printed
    md = (tmp_path / "r" / "d12.md").read_text(encoding="utf-8")
    assert "| \u0394 |" in md and "\u2013" in md
    assert printed.startswith("## d12\n\n" + md.encode("ascii", "backslashreplace").decode("ascii"))


def test_a_stream_that_refuses_a_character_escapes_it_and_one_that_chose_a_handler_keeps_it(monkeypatch):
    import io

    strict = io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict")
    chosen = io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="replace")  # e.g. PYTHONIOENCODING=ascii:replace
    monkeypatch.setattr(sys, "stdout", strict)
    monkeypatch.setattr(sys, "stderr", chosen)
    replace_unencodable_output()
    print("a \u2020 b")
    print("\u00e9", file=sys.stderr)
    strict.flush()
    chosen.flush()
    assert strict.buffer.getvalue() == b"a \\u2020 b\n"
    assert chosen.buffer.getvalue() == b"?\n"


def test_every_script_entry_point_escapes_what_its_terminal_cannot_write():
    # each prints text it does not choose (paths, run names, a sample's text, tokens) or tables with non-ASCII marks
    missing, entry_points = [], 0
    for path in sorted((REPO / "scripts").glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                entry_points += 1
                first = node.body[0]
                if ast.unparse(first) != "replace_unencodable_output()":
                    missing.append(path.name)
    assert entry_points >= 17 and missing == []
