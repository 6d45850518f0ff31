"""--resume of a run an older version recorded with flag values this version no longer takes (session 21): a
--core-max-per-task 0 (then "all") and a seed above 2**32-1. Both were refusals that did not say what to do: the
parser's range error, or "--seed 4294967338 (checkpoint) != 42"."""

import json

import pytest

from nanochat import checkpoint as ckpt
from nanochat.cli_types import SEED_MAX
from scripts import base_train

TINY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
        "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core", "--num-iterations",
        "2", "--device-batch-size", "4", "--total-batch-size", "256"]
OLD_SEED = SEED_MAX + 43  # an older version took it; torch's CPU generator drew seed 42's numbers from it


def train(run_dir, *extra) -> int:
    return base_train.main([*TINY, "--run-dir", str(run_dir), *extra])


def recorded_as(run_dir, **old_args) -> None:
    """Rewrite the run's records (the checkpoint's meta.json, which --resume reads, and config.json) as the older
    version that wrote ``old_args`` would have."""
    meta_path = ckpt.step_dir(run_dir, 2) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["args"].update(old_args)
    meta_path.write_text(json.dumps(meta))
    config = json.loads((run_dir / "config.json").read_text())
    config["args"].update(old_args)
    (run_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("old") / "r"
    assert train(run) == 0
    return run


def copy_of(run, tmp_path):
    import shutil

    shutil.copytree(run, tmp_path / "r")
    return tmp_path / "r"


@pytest.mark.parametrize("given", [["--core-max-per-task", "0"], [], ["--core-max-per-task", "-1"]])
def test_a_recorded_core_cap_of_zero_resumes_as_all(given, finished_run, tmp_path, capsys):
    """0 meant "all" then (only a positive cap cuts): the requeue's same command, 0 included, continues the run, and
    -1 (the same meaning) does too; one line says how the old record reads."""
    run = copy_of(finished_run, tmp_path)
    recorded_as(run, core_max_per_task=0)
    assert train(run, *given, "--resume") == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "--core-max-per-task" in line]
    assert len(said) == 1 and "recorded with --core-max-per-task 0" in said[0] and "-1 (all)" in said[0], out
    assert json.loads((run / "config.json").read_text())["args"]["core_max_per_task"] == -1


def test_a_core_cap_of_zero_is_refused_unless_the_record_holds_it(finished_run, tmp_path, capsys):
    run = copy_of(finished_run, tmp_path)  # recorded by this version: -1
    assert train(run, "--core-max-per-task", "0", "--resume") == 2
    err = capsys.readouterr().err
    assert "--core-max-per-task 0: must be an integer >= 1, or -1 for all" in err, err
    assert "recorded with --core-max-per-task -1" in err, err
    # --resume auto without a checkpoint starts a new run: 0 is refused as on any new run
    assert train(tmp_path / "new", "--core-max-per-task", "0", "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert "--core-max-per-task 0: must be an integer >= 1, or -1 for all" in err and "no checkpoint" in err, err
    assert not ckpt.list_steps(tmp_path / "new")


def test_without_resume_a_core_cap_of_zero_stays_a_flag_error(capsys):
    with pytest.raises(SystemExit) as e:
        base_train.main(["--depth", "2", "--core-max-per-task", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --core-max-per-task: must be an integer >= 1, or -1 for all (got '0')" \
        in err, err


def unresumable(err: str, flag: str, value: int) -> bool:
    return (f"{flag} {value}" in err and f"[0, {SEED_MAX}]" in err and "cannot be resumed exactly" in err
            and "every bit" in err)


@pytest.mark.parametrize("old, given, named", [
    ({"seed": OLD_SEED, "data_seed": OLD_SEED}, [], ["--seed", "--data-seed"]),
    ({"seed": OLD_SEED, "data_seed": OLD_SEED}, ["--seed", str(OLD_SEED % 2**32)], ["--seed", "--data-seed"]),
    ({"data_seed": OLD_SEED}, ["--data-seed", "7"], ["--data-seed"])])
def test_a_recorded_seed_out_of_range_is_refused_naming_it(old, given, named, finished_run, tmp_path, capsys):
    """No seed this version takes continues such a run: not the recorded one (refused at parsing), not another
    (even its low 32 bits, which repeat torch's draws, change numpy's data order). It says so instead of
    "--seed 4294967338 (checkpoint) != 42", and changes no seed."""
    run = copy_of(finished_run, tmp_path)
    recorded_as(run, **old)
    assert train(run, *given, "--resume") == 2
    err = capsys.readouterr().err
    assert all(unresumable(err, flag, OLD_SEED) for flag in named), err
    assert "(checkpoint) !=" not in err and ckpt.list_steps(run) == [2]


@pytest.mark.parametrize("flag", ["--seed", "--data-seed"])
def test_the_recorded_seed_given_again_with_resume_says_why(flag, capsys):
    """The requeue's own command (the old seed in it) stops at parsing: the message says it cannot be resumed."""
    with pytest.raises(SystemExit) as e:
        base_train.main([*TINY, flag, str(OLD_SEED), "--resume", "auto"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and unresumable(err, flag, OLD_SEED), err
    with pytest.raises(SystemExit) as e:  # without --resume: the range error alone, as before
        base_train.main([*TINY, flag, str(OLD_SEED)])
    err = capsys.readouterr().err
    assert f"argument {flag}: must be an integer in [0, {SEED_MAX}] (got '{OLD_SEED}')" in err
    assert "cannot be resumed" not in err


def test_the_data_order_reads_every_bit_of_a_seed():
    """The reason the refusal gives: real data's epoch order (numpy's SeedSequence) depends on every bit of the data
    seed, so the low 32 bits that torch's CPU generator kept would not replay an old run's batches."""
    from types import SimpleNamespace

    from nanochat.dataloader import PackedDataLoader

    def order(seed):
        loader = SimpleNamespace(seed=seed, index=SimpleNamespace(units=range(64)))
        return PackedDataLoader._epoch_perm(loader, 1).tolist()

    assert order(OLD_SEED) != order(OLD_SEED % 2**32) and order(OLD_SEED) == order(OLD_SEED)


def test_a_checkpoint_that_records_null_args_resumes_saying_its_flags_are_not_checked(finished_run, tmp_path, capsys):
    """meta.json "config": {"args": null} (a hand edit, another tool) stopped --resume with an AttributeError."""
    run = copy_of(finished_run, tmp_path)
    meta_path = ckpt.step_dir(run, 2) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["args"] = None
    meta_path.write_text(json.dumps(meta))
    assert train(run, "--resume") == 0
    out = capsys.readouterr().out
    assert "--resume: the checkpoint records no training flags" in out, out


def test_a_checkpoint_whose_config_is_null_resumes_saying_its_flags_are_not_checked(finished_run, tmp_path, capsys):
    """meta.json "config": null (a hand edit, another tool): every record of the run's flags, plan, world size and
    LR/world-size changes is absent, as in a checkpoint older than them; --resume stopped with an AttributeError."""
    run = copy_of(finished_run, tmp_path)
    meta_path = ckpt.step_dir(run, 2) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"] = None
    meta_path.write_text(json.dumps(meta))
    assert train(run, "--resume") == 0
    out = capsys.readouterr().out
    assert "--resume: the checkpoint records no training flags" in out, out
