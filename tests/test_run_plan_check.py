"""scripts.run checks every planned seed's base_train flags with base_train's own parser before it prints a plan or
starts the first seed: a misspelled [train] key or a bad value was found only when base_train started (after the
row's earlier seeds had trained, when they were not yet done), never by --plan. The check never changes a command."""

import shlex
import subprocess

import pytest

from conftest import REPO
from nanochat.row_config import find_configs
from scripts import run

MINI = (REPO / "configs" / "mini" / "base.toml").read_text()


def row(tmp_path, old: str, new: str):
    """configs/mini/base.toml with ``old`` replaced by ``new`` (which must be in it), as tmp_path/row.toml."""
    assert old in MINI
    path = tmp_path / "row.toml"
    path.write_text(MINI.replace(old, new, 1))
    return path


def refused(capsys, argv) -> str:
    """The runner's error for ``argv`` (exit 2, no traceback, no command printed)."""
    with pytest.raises(SystemExit) as stopped:
        run.main(argv)
    out, err = capsys.readouterr()
    assert stopped.value.code == 2 and "Traceback" not in err, err
    assert "scripts.base_train" not in out, out
    return err.strip().splitlines()[-1]


@pytest.fixture
def no_launch(monkeypatch):
    def launch(*args, **kwargs):
        raise AssertionError(f"a seed was started: {args}")
    monkeypatch.setattr(subprocess, "Popen", launch)


def test_a_misspelled_train_key_is_refused_by_plan_and_before_the_first_seed(tmp_path, capsys, no_launch):
    cfg = row(tmp_path, "\n[train]\n", "\n[train]\nmatrx-lr = 0.01\n")
    want = (f"--config {cfg}: unknown key 'matrx-lr' (not a base_train flag; did you mean 'matrix-lr'?) "
            "(base_train's flags of seed 42; no seed was started)")
    runs = tmp_path / "runs"
    for argv in ([str(cfg), "--plan", "--seeds", "42,43"], [str(cfg), "--seeds", "42,43", "--runs-root", str(runs)]):
        assert refused(capsys, argv).endswith(want)
    assert not runs.exists()  # no seed directory, command.txt or train.log


@pytest.mark.parametrize("old, new, want", [
    # a value only base_train's checks of the parsed flags refuse: the file and its key are named
    ("\n[train]\n", "\n[train]\nwarmup-ratio = 1.5\n", "(--warmup-ratio from --config {cfg})"),
    ('memory = "base"', 'memory = "mem"', "--config {cfg}: key 'memory' must be one of 'base', "),
    # base_train's preflight, from the row's pinned --vocab-size: the model config of the flags, no model built
    ("\n[train]\n", "\n[train]\nmome-slots = 8\n", "--mome-slots only applies to --memory mome (got --memory base)"),
    # the runner's --run-name of the row's seeds: base_train takes a plain name only
    ('name = "base"', 'name = "base/x"', "--run-name must be a plain name without '/' (got 'mini_base/x_seed42')"),
])
def test_a_bad_value_is_refused_with_base_trains_own_message(tmp_path, capsys, no_launch, old, new, want):
    cfg = row(tmp_path, old, new)
    assert want.format(cfg=cfg) in refused(capsys, [str(cfg), "--plan"])


def test_a_bad_flag_after_the_separator_is_refused_before_the_first_seed(tmp_path, capsys, no_launch):
    argv = ["configs/mini/base.toml", "--runs-root", str(tmp_path / "runs"), "--", "--matrix-lr", "-1"]
    assert "--matrix-lr must be >= 0 (got -1.0)" in refused(capsys, argv)
    assert not (tmp_path / "runs").exists()


def test_the_check_changes_no_planned_command(capsys, monkeypatch):
    """Every shipped row plans byte for byte as without the check, which parsed each seed's exact base_train argv."""
    real, parsed = run.check_train_flags, []

    def spy(commands):
        parsed.extend(cmd for _, _, cmd in commands)
        real(commands)
    for path in find_configs():
        monkeypatch.setattr(run, "check_train_flags", spy)
        run.main([str(path), "--plan", "--seeds", "42,43"])
        checked = capsys.readouterr()
        monkeypatch.setattr(run, "check_train_flags", lambda commands: None)
        run.main([str(path), "--plan", "--seeds", "42,43"])
        assert checked == capsys.readouterr(), path  # stdout and stderr alike
        assert [shlex.join(cmd) for cmd in parsed[-2:]] == checked.out.splitlines()[1:], path
