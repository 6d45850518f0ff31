"""A seed that scripts.run continues (it adds --resume auto itself) refused for a changed flag: base_train's way
forward must be one that a scripts.run user can follow, and following it must work."""

import re
import shlex

from conftest import REPO
from nanochat import checkpoint as ckpt
from runner_inprocess import run_main

FAST = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--max-seq-len", "64", "--total-batch-size", "1024",
        "--eval-every", "-1", "--eval-tokens", "2048", "--no-final-core", "--no-final-train-bpb", "--save-every", "-1",
        "--dtype", "float32"]
STOP = ["--max-wall-time-seconds", "0.001"]  # the set-up alone outlasts it: each launch stops unfinished at one step


def test_a_refused_resume_under_scripts_run_names_ways_forward_that_work(tmp_path, capsys, monkeypatch):
    """The runner runs in this process (runner_inprocess: main(argv), read back as its process would end), each
    base_train in a process of its own, as the runner starts it: the runner's second Python start would add a torch
    import to each of the four launches and test nothing here."""
    runs = tmp_path / "runs"
    seed = runs / "mini" / "base" / "seed42"
    row = ["configs/mini/base.toml", "--runs-root", str(runs), "--"]

    def launch(argv):
        return run_main(argv, capsys, monkeypatch, cwd=REPO, omp_threads="2")

    first = launch([*row, *FAST, "--num-iterations", "6", *STOP])
    assert first.returncode == 1 and "stopped at its wall-time limit" in first.stderr, first.stdout + first.stderr
    assert ckpt.list_steps(seed) == [1]

    changed = launch([*row, *FAST, "--num-iterations", "7", *STOP])
    assert changed.returncode == 1 and "num_iterations 6 (checkpoint) != 7" in changed.stdout, changed.stdout
    # base_train's own advice (drop --resume, add --overwrite) cannot be followed: the runner adds --resume auto
    assert "drop --resume" not in changed.stdout
    afresh = shlex.join(["python", "-m", "scripts.run", str(REPO / "configs/mini/base.toml"), "--seeds", "42",
                         "--runs-root", str(runs), "--", *FAST, "--num-iterations", "7", *STOP, "--overwrite"])
    assert (f"  to start afresh instead (it deletes the run in {seed}), run: {afresh}\n"
            "  or, to continue it, run the row again with the flags it was started with\n") in changed.stdout, \
        changed.stdout

    # the second way first: with the first launch's flags the seed continues (and stops at STOP again)
    again = launch([*row, *FAST, "--num-iterations", "6", *STOP])
    assert again.returncode == 1 and "resumed from" in again.stdout, again.stdout + again.stderr
    assert ckpt.list_steps(seed)[-1] == 2

    command = re.search(r"run: (python -m scripts\.run .*)\n", changed.stdout).group(1)
    fresh = launch(shlex.split(command)[3:])  # after "python -m scripts.run"
    assert fresh.returncode == 1 and "--overwrite: deleted the previous run" in fresh.stdout, fresh.stderr
    assert ckpt.list_steps(seed) == [1]
    assert ckpt.load_meta(seed, 1)["config"]["plan"]["num_iterations"] == 7


def test_flags_the_user_gave_after_the_separator_keep_base_trains_own_advice():
    """`-- --resume latest` is the user's own flag (the runner adds none): base_train's advice to drop it and add
    --overwrite applies as written, so the runner names no command of its own."""
    from nanochat.train_resume import RUNNER_AFRESH_ENV
    from scripts.run import AFRESH_ENV, afresh_command

    assert AFRESH_ENV == RUNNER_AFRESH_ENV

    assert afresh_command("configs/mini/base.toml", ["--resume", "latest"], 42, []) is None
    assert afresh_command("configs/mini/base.toml", ["--overwrite"], 42, []) is None
    assert afresh_command("/abs/c.toml", ["--depth", "2"], 43, ["--nproc-per-node", "2"]) == \
        "python -m scripts.run /abs/c.toml --seeds 43 --nproc-per-node 2 -- --depth 2 --overwrite"


def test_the_afresh_command_carries_absolute_paths(tmp_path, monkeypatch):
    """The command is printed into the seed's train.log and names the seed it deletes by its absolute path: copied
    from another directory, relative paths would start another config's run, or delete no seed and train another."""
    import argparse

    from scripts.run import afresh_command, typed_runner_flags

    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs-root", default="/default/runs")
    args = argparse.Namespace(nproc_per_node=None, device_batch_size=2, runs_root="rr")
    flags = typed_runner_flags(args, parser)
    assert flags == ["--device-batch-size", "2", "--runs-root", str(tmp_path / "rr")]
    assert afresh_command("c.toml", ["--data-dir", "d", "--depth", "2", "--bundle=b"], 43, flags) == shlex.join(
        ["python", "-m", "scripts.run", str(tmp_path / "c.toml"), "--seeds", "43", *flags, "--", "--data-dir",
         str(tmp_path / "d"), "--depth", "2", f"--bundle={tmp_path / 'b'}", "--overwrite"])
