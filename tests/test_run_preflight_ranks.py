"""base_train's errors before the process group (preflight, --dry-run) under torchrun: printed once per node, by
its local rank 0, and never lost. torchrun ends the ranks left as soon as one exits, so a rank that printed nothing
must not exit first: it waits to be ended, and prints the error itself only if that never comes."""

import re
import time
from types import SimpleNamespace

import pytest

import torchrun_forked
from conftest import REPO, torchrun_env
from nanochat import common
from nanochat.launcher_watch import LAUNCHER_ENV
from scripts import base_train

TINY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--max-seq-len", "64", "--device-type", "cpu"]
NOT_DIVISIBLE = ["--total-batch-size", "1000", "--device-batch-size", "3"]  # preflight: 3 x 64 x 2 ranks
NEEDLE = {"preflight": "--total-batch-size 1000 is not divisible", "dry-run": "--init-from"}


# "dry-run" is slow: base_train.main refuses a --dry-run's error (here --init-from's FileNotFoundError) with the same
# common.refuse_before_the_group as a preflight one, the "preflight" case; dry_run's source check, in one process:
# test_init_from.py::test_dry_run_checks_the_source
@pytest.mark.parametrize("where", ["preflight", pytest.param("dry-run", marks=pytest.mark.slow)])
def test_an_error_before_the_process_group_is_printed_once_under_torchrun(tmp_path, where):
    flags = NOT_DIVISIBLE if where == "preflight" else ["--dry-run", "--init-from", str(tmp_path / "nosuch")]
    env = torchrun_env(WANDB_MODE="disabled")
    done = torchrun_forked.run(["--standalone", "--nproc_per_node=2", "-m", "scripts.base_train", *TINY,
                                "--run-dir", str(tmp_path / "run"), *flags], env=env, cwd=REPO, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and NEEDLE[where] in errors[0], done.stderr
    # local rank 0 printed it and exited first, with base_train's code: the root cause torchrun names
    cause = done.stderr[done.stderr.index("Root Cause"):]
    assert re.search(r"local_rank: 0\)\s+exitcode\s+: 2 ", cause), done.stderr
    assert done.returncode != 0


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_a_rank_that_is_not_ended_prints_the_error_itself(monkeypatch, capsys, local_rank):
    """Without torchrun's teardown (another launcher, or local rank 0 far behind) the waiting rank prints the
    error after its wait: twice at worst, never lost. Local rank 0 does not wait."""
    monkeypatch.setattr(common, "PEER_PRINT_WAIT_S", 0.5)
    monkeypatch.setenv(LAUNCHER_ENV, "job")  # under torchrun (another launcher: no wait, every rank prints)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("RANK", local_rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    slept = []  # common's sleeps, recorded and slept: a wait shows in the record, not only in the clock

    def sleep(seconds):
        slept.append(seconds)
        time.sleep(seconds)
    monkeypatch.setattr(common, "time", SimpleNamespace(sleep=sleep))
    started = time.monotonic()
    assert base_train.main([*TINY, *NOT_DIVISIBLE]) == 2
    waited = time.monotonic() - started
    assert "error: --total-batch-size 1000 is not divisible" in capsys.readouterr().err
    assert slept == ([0.5] if local_rank == "1" else [])
    if local_rank == "1":
        assert waited >= 0.5
