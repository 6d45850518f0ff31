"""scripts.run from outside the repo: each path the user types (the config, --runs-root, the path flags after
``--``) means the same folder to the runner and to the base_train it starts from the repo root."""

import json
import os
import shlex

import pytest

from conftest import REPO
from runner_inprocess import run_main

FAST = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--max-seq-len", "64", "--total-batch-size", "1024",
        "--eval-every", "-1", "--eval-tokens", "2048", "--no-final-core", "--no-final-train-bpb", "--save-every", "-1",
        "--dtype", "float32"]


@pytest.fixture
def runner(capsys, monkeypatch):
    """`python -m scripts.run ARGS` from ``cwd``, the runner in this process (runner_inprocess) and its base_train
    in a process of its own: the paths tested are the ones the runner resolves and base_train is given, which one
    Python start fewer per launch (a torch import) does not change."""
    return lambda args, cwd: run_main(args, capsys, monkeypatch, cwd)


def test_a_relative_runs_root_is_the_callers_for_the_runner_and_base_train(tmp_path, runner):
    config = os.path.relpath(REPO / "configs" / "mini" / "base.toml", tmp_path)  # relative to the caller, too
    done = runner([config, "--runs-root", "rr", "--", *FAST, "--num-iterations", "2"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    seed = tmp_path / "rr" / "mini" / "base" / "seed42"
    assert json.loads((seed / "summary.json").read_text())["stop_reason"] == "completed"
    assert {"train.log", "command.txt", "checkpoints", "metrics.jsonl"} <= {p.name for p in seed.iterdir()}
    assert not (REPO / "rr").exists()
    assert f"--run-dir {seed} " in (seed / "command.txt").read_text()
    # the runner's own check, on the folder base_train wrote: the finished seed is not trained again
    again = runner([config, "--runs-root", "rr", "--", *FAST, "--num-iterations", "2"], tmp_path)
    assert again.returncode == 0 and "not overwriting" in again.stdout, again.stdout + again.stderr


def test_path_flags_after_the_separator_are_resolved_where_they_were_typed(tmp_path, runner):
    planned = runner(["configs/mini/base.toml", "--plan", "--runs-root", "rr", "--", "--data-dir", "d",
                      "--tokenizer-dir=t", "--bundle", "../b", "--init-from", "runs/x:5", "--bundle=/abs/b"], REPO)
    assert planned.returncode == 0, planned.stderr
    cmd = shlex.split(planned.stdout.splitlines()[1])
    assert cmd[cmd.index("--run-dir") + 1] == str(REPO / "rr" / "mini" / "base" / "seed42")
    assert cmd[cmd.index("--config") + 1] == str(REPO / "configs" / "mini" / "base.toml")
    tail = cmd[cmd.index("--run-name") + 2:]
    assert tail == ["--data-dir", str(REPO / "d"), f"--tokenizer-dir={REPO / 't'}", "--bundle", str(REPO.parent / "b"),
                    "--init-from", f"{REPO / 'runs' / 'x'}:5", "--bundle=/abs/b", "--resume", "auto"]


@pytest.mark.parametrize("flag, instead", [("--run-dir", "--runs-root"), ("--seed", "--seeds"),
                                           ("--config", "the config"), ("--run-name", "<table>_<row>_seed<N>")])
def test_flags_the_runner_sets_itself_are_refused_after_the_separator(tmp_path, flag, instead, runner):
    """base_train takes the last of a repeated flag: the user's would replace the runner's (a seed 7 trained into
    seed42/, or a run dir the runner neither locks nor checks)."""
    done = runner(["configs/mini/base.toml", "--plan", "--", flag, "7"], REPO)
    assert done.returncode == 2 and f"{flag} after --" in done.stderr and instead in done.stderr, done.stderr


def test_a_home_relative_path_after_the_separator_is_expanded(tmp_path, monkeypatch):
    """os.path.abspath alone made --tokenizer-dir=~/tok <cwd>/~/tok (no shell expands ~ after an =)."""
    from scripts.run import absolute_paths

    monkeypatch.setenv("HOME", str(tmp_path))
    assert absolute_paths(["--tokenizer-dir=~/tok", "--data-dir", "~/d"]) == [
        f"--tokenizer-dir={tmp_path / 'tok'}", "--data-dir", str(tmp_path / "d")]


def test_a_home_relative_runs_root_is_expanded_for_base_train_as_for_the_afresh_command(tmp_path, monkeypatch, runner):
    """--runs-root=~/rr (no shell expands ~ after an =): the commands used <cwd>/~/rr while the afresh command
    named ~/rr expanded, so the two meant different folders."""
    monkeypatch.setenv("HOME", str(tmp_path))
    planned = runner(["configs/mini/base.toml", "--plan", "--runs-root=~/rr"], REPO)
    assert planned.returncode == 0, planned.stderr
    cmd = shlex.split(planned.stdout.splitlines()[1])
    assert cmd[cmd.index("--run-dir") + 1] == str(tmp_path / "rr" / "mini" / "base" / "seed42")


def test_bundle_subset_after_the_separator_is_kept_as_the_name_it_is(tmp_path, monkeypatch):
    """--bundle subset names the shipped subset, not a folder: made absolute it became <cwd>/subset, which base_train
    refused (no core.yaml there). A folder given as ./subset is a path and is made absolute."""
    from scripts.run import absolute_paths

    monkeypatch.chdir(tmp_path)
    assert absolute_paths(["--bundle", "subset", "--bundle=subset", "--bundle", "./subset"]) == [
        "--bundle", "subset", "--bundle=subset", "--bundle", str(tmp_path / "subset")]
