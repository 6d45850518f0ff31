"""A seed that scripts.run started and --max-wall-time-seconds stopped: base_train's line and the runner's own
advice must name one way to continue, and following it must continue the seed."""

from conftest import REPO
from nanochat import checkpoint as ckpt
from runner_inprocess import run_main

FAST = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--max-seq-len", "64", "--total-batch-size", "1024",
        "--eval-every", "-1", "--eval-tokens", "2048", "--no-final-core", "--no-final-train-bpb", "--save-every", "-1",
        "--dtype", "float32", "--num-iterations", "6"]
STOP = ["--max-wall-time-seconds", "0.001"]  # the set-up alone outlasts it: each launch stops unfinished at one step
BASE_TRAINS_OWN = "continue with --resume"  # base_train's line outside the runner


def launch(args: list[str], capsys, monkeypatch):
    """`python -m scripts.run configs/mini/base.toml ARGS` from the repo root, the runner in this process
    (runner_inprocess) and its base_train in a process of its own: the advice tested is the runner's and base_train's
    output, not the runner's process start (a torch import per launch)."""
    return run_main(["configs/mini/base.toml", *args], capsys, monkeypatch, cwd=REPO)


def test_a_wall_time_stop_under_the_runner_names_one_way_to_continue(tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    seed = runs / "mini" / "base" / "seed42"
    row = ["--runs-root", str(runs), "--", *FAST, *STOP]
    for step in (1, 2):  # the runner adds --resume auto: the same command continues the seed
        done = launch(row, capsys, monkeypatch)
        assert done.returncode == 1 and ckpt.list_steps(seed)[-1] == step, done.stdout + done.stderr
        assert BASE_TRAINS_OWN not in done.stdout, done.stdout
        assert "continue by running the same scripts.run command again" in done.stdout, done.stdout
        assert "by re-running the same command" in done.stderr, done.stderr


def test_the_users_own_start_flag_is_named_in_the_runners_advice(tmp_path, capsys, monkeypatch):
    """``-- --overwrite`` run again would delete the seed the runner says to continue: the advice names --resume
    auto in its place (base_train's own line says --resume), and that continues the seed."""
    runs = tmp_path / "runs"
    seed = runs / "mini" / "base" / "seed42"
    first = launch(["--runs-root", str(runs), "--", *FAST, *STOP, "--overwrite"], capsys, monkeypatch)
    assert first.returncode == 1 and ckpt.list_steps(seed) == [1], first.stdout + first.stderr
    assert BASE_TRAINS_OWN in first.stdout, first.stdout
    assert "by re-running the same command with --resume auto in place of --overwrite after --" in first.stderr, \
        first.stderr
    again = launch(["--runs-root", str(runs), "--", *FAST, *STOP, "--resume", "auto"], capsys, monkeypatch)
    assert again.returncode == 1 and "resumed from" in again.stdout, again.stdout + again.stderr
    assert ckpt.list_steps(seed) == [1, 2]
    # --resume auto continues when run again as it is: the runner names no other flag
    assert "by re-running the same command." in again.stderr, again.stderr


def test_the_advice_for_each_start_flag_the_user_may_give():
    from scripts.run import how_to_continue

    same = "by re-running the same command"
    assert how_to_continue([]) == same
    assert how_to_continue(["--resume", "auto", "--depth", "2"]) == same
    # latest refuses the row's later seeds that have no checkpoint yet: auto in its place
    assert how_to_continue(["--depth", "2", "--resume"]) == f"{same} with --resume auto in place of --resume after --"
    assert how_to_continue(["--resume=latest"]) == f"{same} with --resume auto in place of --resume=latest after --"
    assert how_to_continue(["--resume", "3"]) == f"{same} with --resume auto in place of --resume 3 after --"
    assert how_to_continue(["--resume=3"]) == f"{same} with --resume auto in place of --resume=3 after --"
    assert how_to_continue(["--overwrite", "--depth", "2"]) == \
        f"{same} with --resume auto in place of --overwrite after --"
