"""nanochat.cli_types.flag_name: the command-line spelling of an argparse dest, used by every message that names
a flag from its config.json/args key; and dest_name, its inverse, for code that holds a flag and reads its value."""

import subprocess
import sys

import pytest

from conftest import REPO
from nanochat.cli_types import dest_name, flag_name
from nanochat.train_args import build_parser


def test_flag_name_spells_a_dest_as_its_long_flag():
    assert flag_name("seed") == "--seed"
    assert flag_name("matrix_lr") == "--matrix-lr"
    assert flag_name("max_wall_time_seconds") == "--max-wall-time-seconds"


def test_flag_name_is_the_long_flag_of_every_base_train_dest():
    # argparse derives dest from the first long option by "-" -> "_": flag_name is its inverse for every flag
    # whose dest is not set by hand
    long_flags = [a for a in build_parser()._actions if any(s.startswith("--") for s in a.option_strings)]
    assert len(long_flags) > 50
    for action in long_flags:
        if action.dest == "help":
            continue
        assert flag_name(action.dest) in action.option_strings, (action.dest, action.option_strings)


def test_dest_name_spells_a_long_flag_as_its_dest():
    assert dest_name("--seed") == "seed"
    assert dest_name("--matrix-lr") == "matrix_lr"
    assert dest_name("--max-wall-time-seconds") == "max_wall_time_seconds"


@pytest.mark.parametrize("text", ["matrix-lr", "-m", "matrix_lr", "", "--", "-matrix-lr"])
def test_dest_name_refuses_what_is_not_a_long_flag(text):
    # a key without "--" (a config file's) would lose its first two letters silently
    with pytest.raises(ValueError, match="not a long flag"):
        dest_name(text)


def test_dest_name_inverts_flag_name_for_every_base_train_dest():
    dests = [a.dest for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(dests) > 50
    for dest in dests:
        assert dest_name(flag_name(dest)) == dest


def test_cli_types_stays_free_of_torch():
    # nanochat.report, scripts.results and scripts.report import flag_name without importing torch
    code = "import sys, nanochat.cli_types, nanochat.report, nanochat.schedules; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
