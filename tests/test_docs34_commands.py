"""Every command a reader can copy from README.md, configs/README.md and docs/*.md names a script that exists and
flags that script's parser takes: each `python -m scripts.X ...`, `torchrun ... -m scripts.X ...` and
`python bench/X.py ...` line of a code block (backslash continuations joined) and each inline code span that holds
one. Flags after `--` in a `scripts.run` line are base_train's; a flag with a choice list must be given one of its
choices (placeholders such as `N`, `DIR`, `<row>` and `{a,b}` lists are read as such); a command with no
placeholder parses whole (value types and forms, missing values). Nothing is run: each parser is taken from the
script's own argument parsing, which is stopped before it reads anything."""

import argparse
import contextlib
import importlib
import io
import re
import runpy
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "configs" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"-m\s+scripts\.[a-z_]+|bench/[a-z_0-9]+\.py")
SEPARATORS = {"&&", "||", ";", "|", ">", ">>", "2>&1"}
PLACEHOLDER = re.compile(r"[A-Z_]+|\.\.\.|<.*")  # N, DIR, RUN, ..., <row>
# an argument that stands for the reader's own value, or lists choices: such a command is not parsed whole
TEMPLATE = re.compile(r"^[A-Z_]+$|\.\.\.|<|[{}|]|^\[|\]$|(^|[=:/])[A-Z]+$")
# dated records of flags that existed when the command ran (docs/performance_history.md keeps commands as run)
RECORDS = {("docs/performance_history.md", "bench/train_step.py", "--fuse-inject")}


def commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) for each code-block line and inline code span that runs a script or a bench."""
    found, block, inside = [], [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if inside:
                start, joined = None, ""
                for n, part in block:
                    start = n if start is None else start
                    if part.rstrip().endswith("\\"):
                        joined += part.rstrip()[:-1] + " "
                        continue
                    found.append((start, joined + part))
                    start, joined = None, ""
                block = []
            inside = not inside
        elif inside:
            block.append((number, line))
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    for m in re.finditer(r"`([^`]+)`", prose):
        found.append((prose[:m.start()].count("\n") + 1, m.group(1).replace("\n", " ")))
    return [(n, c) for n, c in found if COMMAND.search(c)]


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def _grab(self, *args, **kwargs):
    raise _Captured(self)


_parsers: dict = {}


def parser_of(target: str):
    """The argparse parser of `scripts.X` or `bench/X.py`, captured at its first parse (None: the file parses no
    flags). The scripts' parse_args/main and the benches' parse functions build their parser first thing."""
    if target in _parsers:
        return _parsers[target]
    if target == "scripts.base_train":
        from nanochat.train_args import build_parser
        _parsers[target] = build_parser()
        return _parsers[target]
    mp = pytest.MonkeyPatch()
    mp.setattr(argparse.ArgumentParser, "parse_args", _grab)
    mp.setattr(argparse.ArgumentParser, "parse_known_args", _grab)
    mp.setattr("sys.argv", [target, "--help"])
    parser = None
    try:
        if target.startswith("scripts."):
            module = vars(importlib.import_module(target))
        else:  # module-level code runs (a bench may parse there); its `if __name__ == "__main__"` does not
            module = runpy.run_path(str(REPO / target), run_name="docs34_probe")
        for name in ("parse_args", "parse", "main"):
            if callable(module.get(name)):
                fn = module[name]
                fn(["--help"]) if fn.__code__.co_argcount else fn()
                break
    except _Captured as c:
        parser = c.parser
    finally:
        mp.undo()
    _parsers[target] = parser
    return parser


def _subcommand(parser, word):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(word, "missing")
    return None


def problems(command: str, page: str = "") -> list[str]:
    """What is wrong with one command line: a missing script, an unknown flag or subcommand, a value off a choice
    list. Arguments that are not flags (paths, placeholders) are not checked."""
    try:
        tokens = [t.strip("[]") for t in shlex.split(command, comments=True)]
    except ValueError as e:
        return [f"cannot split: {e}"]
    out, i = [], 0
    while i < len(tokens):
        word = tokens[i]
        if word == "-m" and i + 1 < len(tokens) and tokens[i + 1].startswith("scripts."):
            target, i = tokens[i + 1], i + 2
            path = REPO / (target.replace(".", "/") + ".py")
        elif re.fullmatch(r"(\S*/)?bench/[a-z_0-9]+\.py", word):
            target, i = "bench/" + word.split("bench/")[1], i + 1
            path = REPO / target
        else:
            i += 1
            continue
        if not path.is_file():
            out.append(f"{target}: no such file {path.relative_to(REPO)}")
            continue
        parser, named, chose = parser_of(target), target, False
        while i < len(tokens) and tokens[i] not in SEPARATORS:
            word, i = tokens[i], i + 1
            if word == "--":
                if target == "scripts.run":  # what follows goes to base_train
                    parser, named = parser_of("scripts.base_train"), "scripts.run (after --, base_train)"
                continue
            sub = None
            if parser is not None and not word.startswith("-") and not chose:  # the first word picks a subcommand
                sub, chose = _subcommand(parser, word), True
            if sub == "missing":
                out.append(f"{named}: no subcommand {word!r}")
            elif sub is not None:
                parser = sub
            if not word.startswith("--"):
                continue
            flag, eq, value = word.partition("=")
            if (page, target, flag) in RECORDS:
                continue
            action = parser._option_string_actions.get(flag) if parser is not None else None
            if action is None:
                out.append(f"{named}: unknown flag {flag}")
                continue
            if action.choices and action.nargs != 0:
                if not eq and i < len(tokens) and not tokens[i].startswith("-") and tokens[i] not in SEPARATORS:
                    value = tokens[i]
                for v in re.split(r"[|,{}]", value):
                    if v and not PLACEHOLDER.fullmatch(v) and v not in [str(c) for c in action.choices]:
                        out.append(f"{named}: {flag} {v!r} is not one of {[str(c) for c in action.choices]}")
    return out


def parse_failures(command: str, page: str = "") -> list[str]:
    """A command with nothing left to fill in, parsed whole by its script's parser (after scripts.run's `--`:
    base_train's): values of the wrong type or form, missing values, arguments the script does not take. GPU
    commands are parsed with `--device cpu` (the parser checks that the device exists here; a bench's default
    device can be cuda)."""
    tokens, out, i = shlex.split(command, comments=True), [], 0
    while i < len(tokens):
        word = tokens[i]
        if word == "-m" and i + 1 < len(tokens) and tokens[i + 1].startswith("scripts."):
            target, i = tokens[i + 1], i + 2
        elif re.fullmatch(r"(\S*/)?bench/[a-z_0-9]+\.py", word):
            target, i = "bench/" + word.split("bench/")[1], i + 1
        else:
            i += 1
            continue
        args = []
        while i < len(tokens) and tokens[i] not in SEPARATORS:
            args.append(tokens[i])
            i += 1
        parser = parser_of(target) if (REPO / (target.replace(".", "/") + ".py" if target.startswith("scripts.")
                                               else target)).is_file() else None
        if (not args or parser is None or any(TEMPLATE.search(a) for a in args)
                or any((page, target, a) in RECORDS for a in args)):
            continue  # a bare mention, a missing script (problems() says so), a template or a dated record
        args = ["cpu" if a == "cuda" and k and args[k - 1] in ("--device", "--device-type") else a
                for k, a in enumerate(args)]
        if "--device" in parser._option_string_actions and "--device" not in args:
            args = ["--device", "cpu", *args]
        parts = [(parser, args)]
        if "--" in args:
            k = args.index("--")
            if target == "scripts.run":  # what follows goes to base_train
                parts = [(parser, args[:k]), (parser_of("scripts.base_train"), args[k + 1:])]
            else:  # torchrun's `--` before the script's own flags
                parts = [(parser, args[:k] + args[k + 1:])]
        for p, part in parts:
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    p.parse_args(part)
            except SystemExit:
                out.append(f"{target}: {err.getvalue().strip().splitlines()[-1]}")
    return out


def documented_faults(check) -> tuple[int, list[str]]:
    """(commands found, 'page:line: fault' for each fault ``check(command, page)`` finds) over every page."""
    found, bad = 0, []
    for page in PAGES:
        name = str(page.relative_to(REPO))
        for number, command in commands(page.read_text(encoding="utf-8")):
            found += 1
            bad += [f"{name}:{number}: {fault}\n    {command[:150]}" for fault in check(command, name)]
    return found, bad


def test_every_documented_command_without_placeholders_parses():
    _, bad = documented_faults(parse_failures)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("command, want", [
    ("python -m scripts.base_train --depth twelve --dry-run",
     ["scripts.base_train: python -m scripts.base_train: error: argument --depth: invalid int value: 'twelve'"]),
    ("python -m scripts.run configs/mini/base.toml --seeds 42 -- --num-iterations",
     ["scripts.run: python -m scripts.base_train: error: argument --num-iterations: expected one argument"]),
    ("python bench/step.py --device cuda --threads 1", []),
    ("python -m scripts.base_eval --run runs/X --step S", []),  # a template: not parsed
])
def test_the_whole_parse_finds_bad_values(command, want):
    assert parse_failures(command) == want


def test_every_documented_command_names_real_scripts_and_flags():
    found, bad = documented_faults(problems)
    assert found >= 100, found  # the extraction still finds the pages' commands (154 on 2026-11-28)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("command, want", [
    ("python -m scripts.base_train --depth 12 --no-such-flag 3", ["scripts.base_train: unknown flag --no-such-flag"]),
    ("torchrun --standalone --nproc_per_node=8 -m scripts.base_train -- --config x.toml --mome-kernels fast",
     ["scripts.base_train: --mome-kernels 'fast' is not one of ['auto', 'fused', 'row', 'torch']"]),
    ("python -m scripts.run c.toml --plan -- --seeds 42", ["scripts.run (after --, base_train): unknown flag --seeds"]),
    ("python -m scripts.run c.toml --num-iterations 5", ["scripts.run: unknown flag --num-iterations"]),
    ("python -m scripts.plot scaling --metric loss", ["scripts.plot: unknown flag --metric"]),
    ("python -m scripts.plot bars --table d12", ["scripts.plot: no subcommand 'bars'",
                                                "scripts.plot: unknown flag --table"]),
    ("python -m scripts.nope --x 1", ["scripts.nope: no such file scripts/nope.py"]),
    ("python bench/step.py --threads 1 --sections layer && python bench/nope.py",
     ["bench/nope.py: no such file bench/nope.py"]),
    ("python -m scripts.base_eval --run RUN [--step S] [--bundle run|DIR|subset] [--attention run|fa9]",
     ["scripts.base_eval: --attention 'fa9' is not one of ['run', 'sdpa', 'fa2', 'fa3', 'auto']"]),
])
def test_the_check_finds_what_is_wrong(command, want):
    """The checker itself: each fault is found and named, and placeholders pass."""
    assert problems(command) == want


def test_commands_are_found_in_blocks_continuations_and_inline_spans():
    text = ("intro `python -m scripts.report A\nB --output r.md`\n\n```bash\n"
            "torchrun -m scripts.base_train --depth 12 \\\n    --run-name x   # comment\nls\n```\n")
    assert commands(text) == [(5, "torchrun -m scripts.base_train --depth 12      --run-name x   # comment"),
                              (1, "python -m scripts.report A B --output r.md")]
