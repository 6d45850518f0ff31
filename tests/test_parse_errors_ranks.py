"""Flag errors of base_train and base_eval under torchrun: one an every rank of a node finds alike (syntax, choices,
ranges, this node's files) is printed once, by local rank 0 (usage, error, exit 2), and never lost; one that can
differ between ranks (a device this process does not see) is printed by each rank at once. One process: argparse's
own usage, error line and exit code 2."""

import argparse
import os
import re
import time
from types import SimpleNamespace

import pytest
import torch

import torchrun_forked
from conftest import REPO, torchrun_env
from nanochat import common
from nanochat.cli_types import NodeParser
from nanochat.launcher_watch import LAUNCHER_ENV
from nanochat.train_args import parse_args as train_parse_args
from scripts.base_eval import parse_args as eval_parse_args

BAD_FLAGS = {  # script, flags, the error's words
    "train-unknown": ("scripts.base_train", ["--synthetic-data", "--no-such-flag"], "unrecognized arguments"),
    "train-range": ("scripts.base_train", ["--synthetic-data", "--eval-tokens", "0"], "--eval-tokens"),
    "eval-range": ("scripts.base_eval", ["--run-dir", "nowhere", "--max-per-task", "0"], "--max-per-task"),
}


# train-unknown is slow (~6 s a torchrun launch on an idle 2-core box): train-range launches base_train the same way,
# and its error and argparse's own "unrecognized arguments" both end in NodeParser.error, whose wait on a local rank
# other than 0 test_an_error_alike_on_every_rank_waits_for_the_reporter_off_local_rank_0 checks for an unknown flag
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c == "train-unknown" else [])
                                  for c in sorted(BAD_FLAGS)])
def test_a_flag_error_is_printed_once_under_torchrun(case):
    module, flags, needle = BAD_FLAGS[case]
    env = torchrun_env(WANDB_MODE="disabled")
    done = torchrun_forked.run(["--standalone", "--nproc_per_node=2", "-m", module, *flags], env=env, cwd=REPO,
                               timeout=300)
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and needle in errors[0], done.stderr
    assert sum(line.startswith("usage: ") for line in done.stderr.splitlines()) == 1, done.stderr
    cause = done.stderr[done.stderr.index("Root Cause"):]  # local rank 0 printed it and exited first, code 2
    assert re.search(r"local_rank: 0\)\s+exitcode\s+: 2 ", cause), done.stderr
    assert done.returncode != 0


def in_rank(monkeypatch, local_rank: str | None) -> list:
    """This process as ``local_rank`` of a 2-process torchrun job (None: no torchrun); the list collects the waits
    for the node's reporter (none happen: the wait is recorded, not slept)."""
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", LAUNCHER_ENV):
        monkeypatch.delenv(name, raising=False)
    if local_rank is not None:
        monkeypatch.setenv(LAUNCHER_ENV, "job")
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setenv("RANK", local_rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
    waits = []
    monkeypatch.setattr(common, "wait_for_the_node_reporter", lambda: waits.append(os.environ.get("LOCAL_RANK")))
    return waits


def exit_code(parse, argv) -> int:
    with pytest.raises(SystemExit) as stopped:
        parse(argv)
    return stopped.value.code


@pytest.mark.parametrize("parse,argv", [(train_parse_args, ["--eval-tokens", "0"]),
                                        (train_parse_args, ["--no-such-flag"]),  # argparse's own error
                                        (train_parse_args, ["--config"]),  # the pre-parser's error
                                        (eval_parse_args, ["--run", "x", "--eval", "nope"])])
def test_an_error_alike_on_every_rank_waits_for_the_reporter_off_local_rank_0(monkeypatch, capsys, parse, argv):
    waits = in_rank(monkeypatch, "1")
    assert exit_code(parse, argv) == 2
    assert waits == ["1"]  # before it printed: the wait of the real function, then its own line
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and ": error: " in err


@pytest.mark.skipif(getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
                    reason="an MPS device is here")
@pytest.mark.parametrize("parse,argv", [(train_parse_args, ["--device-type", "mps"]),
                                        (eval_parse_args, ["--run", "x", "--device-type", "mps"])])
def test_a_missing_device_is_reported_by_each_rank_at_once(monkeypatch, capsys, parse, argv):
    waits = in_rank(monkeypatch, "1")
    assert exit_code(parse, argv) == 2
    assert waits == []  # another rank of the node may see the device: it does not report for this one
    assert "no such device here" in capsys.readouterr().err


def test_one_process_prints_what_argparse_prints(monkeypatch, capsys):
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    printed = []
    for cls in (argparse.ArgumentParser, NodeParser):
        parser = cls(prog="p")
        parser.add_argument("--n", type=int, choices=(1, 2))
        for argv in (["--n", "3"], ["--n", "x"], ["--m"]):
            assert exit_code(parser.parse_args, argv) == 2
        printed.append(capsys.readouterr())
    assert printed[0] == printed[1] and printed[0].err.count("usage: p") == 3


def test_the_waiting_rank_prints_the_error_itself_if_not_ended(monkeypatch, capsys):
    """The real wait, shortened: without torchrun's teardown local rank 1 prints after it; local rank 0 at once."""
    monkeypatch.setattr(common, "PEER_PRINT_WAIT_S", 0.5)
    monkeypatch.setenv(LAUNCHER_ENV, "job")
    for local_rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        started = time.monotonic()
        assert exit_code(eval_parse_args, ["--run", "x", "--eval", "nope"]) == 2
        waited = time.monotonic() - started
        assert "--eval: unknown evaluation(s) ['nope']" in capsys.readouterr().err
        if local_rank == "1":
            assert waited >= 0.5


def test_help_is_printed_once_under_torchrun():
    env = torchrun_env(WANDB_MODE="disabled")
    done = torchrun_forked.run(["--standalone", "--nproc_per_node=2", "-m", "scripts.base_train", "--help"], env=env,
                               cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("usage: python -m scripts.base_train") == 1, done.stdout
    assert "--mome-shared-table-kernel" in done.stdout


@pytest.mark.parametrize("parse", [train_parse_args, eval_parse_args])
@pytest.mark.parametrize("local_rank", ["0", "1", None])
def test_help_is_printed_by_local_rank_0_alone_and_no_rank_waits(monkeypatch, capsys, parse, local_rank):
    """Every rank exits 0 at once: torchrun ends no rank for another's exit 0, so rank 0's help is never cut short."""
    waits = in_rank(monkeypatch, local_rank)
    assert exit_code(parse, ["--help"]) == 0
    out = capsys.readouterr()
    assert waits == [] and out.err == ""
    assert out.out.startswith("usage: ") if local_rank != "1" else out.out == ""


@pytest.mark.parametrize("parse", [train_parse_args, eval_parse_args])
def test_help_is_printed_with_a_leftover_local_rank_outside_torchrun(monkeypatch, capsys, parse):
    """A LOCAL_RANK exported by hand (not torchrun: it sets TORCHELASTIC_RUN_ID, which a shell never does) made
    --help print nothing, exit 0."""
    in_rank(monkeypatch, None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert exit_code(parse, ["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: ")


def test_a_leftover_local_rank_outside_torchrun_does_not_delay_an_error(monkeypatch, capsys):
    """A LOCAL_RANK exported by hand in a shell (no TORCHELASTIC_RUN_ID): no torchrun will end this process, so a
    wait for the node's reporter only delays the error by PEER_PRINT_WAIT_S."""
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    slept = []
    monkeypatch.setattr(common, "time", SimpleNamespace(sleep=slept.append))
    assert exit_code(eval_parse_args, ["--run", "x", "--eval", "nope"]) == 2
    assert "--eval: unknown evaluation(s) ['nope']" in capsys.readouterr().err and slept == []
