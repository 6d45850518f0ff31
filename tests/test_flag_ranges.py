"""Seeds and devices checked at flag parsing (exit 2 naming the flag), session 20: a seed torch cannot take was
'Overflow when unpacking long long' without the flag's name, and base_train --device-type cuda on a machine
without CUDA exited 1 from compute_init after parsing."""

import importlib

import pytest
import torch

from nanochat.cli_types import SEED_MAX

SEED_SCRIPTS = {  # module -> flags that get it past its required ones (parsing stops at the bad seed)
    "scripts.sample": ["--run", "r", "--prompt", "hi"],
    "scripts.wic_probe": ["--run", "r", "--wic", "w.tsv"],
    "scripts.base_train": ["--depth", "2"],
}


def seed_cases():
    for module in sorted(SEED_SCRIPTS):
        flags = ["--seed", "--data-seed"] if module == "scripts.base_train" else ["--seed"]
        for flag in flags:
            for value in (str(2**64), str(2**63), str(SEED_MAX + 1), "-1", "x"):
                yield module, flag, value


@pytest.mark.parametrize("module, flag, value", list(seed_cases()))
def test_seed_out_of_range_is_a_flag_error(module, flag, value, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as e:
        main([*SEED_SCRIPTS[module], flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: must be an integer in [0, {SEED_MAX}] (got '{value}')" in err, err


def test_seed_range_ends_where_the_cpu_generator_repeats():
    """torch's CPU generator keeps the low 32 bits of a seed: SEED_MAX + 1 would silently repeat seed 0's draws."""
    def draws(seed):
        return torch.randint(0, 1 << 30, (8,), generator=torch.Generator().manual_seed(seed))

    assert SEED_MAX == 2**32 - 1
    assert torch.equal(draws(SEED_MAX + 1), draws(0)) and not torch.equal(draws(SEED_MAX), draws(0))


def test_seed_range_ends_are_accepted():
    from nanochat.train_args import parse_args
    from scripts import sample

    assert sample.parse_args(["--run", "r", "--prompt", "hi", "--seed", str(SEED_MAX)]).seed == SEED_MAX
    args = parse_args(["--depth", "2", "--seed", "0", "--data-seed", str(SEED_MAX)])
    assert (args.seed, args.data_seed) == (0, SEED_MAX)


def test_runner_seeds_share_the_range():
    """scripts.run planned a row whose seed base_train then refused (each seed is a base_train --seed)."""
    from scripts.run import parse_seeds

    assert parse_seeds(f"0,{SEED_MAX}") == [0, SEED_MAX]
    wrong = rf"--seeds must be .* integers in \[0, {SEED_MAX}\] \(got '42,{SEED_MAX + 1}'\)"
    with pytest.raises(ValueError, match=wrong):
        parse_seeds(f"42,{SEED_MAX + 1}")


@pytest.mark.parametrize("seeds", [f"[42, {SEED_MAX + 1}]", "[-1]", "[true]", "[42.0]", "[]", "[42, 42]", '"42"',
                                   "[[42]]"])
def test_a_config_rows_seeds_share_the_range(seeds, tmp_path, capsys):
    """The row's default seeds ([row] seeds, used without --seeds) were run unchecked: one base_train refuses
    (above 2**32-1, negative) failed only when its turn came, after the seeds before it had trained; true and 42.0
    ran as seeds 1 and 42."""
    from pathlib import Path

    from scripts import run

    text = (Path(__file__).resolve().parents[1] / "configs" / "mini" / "base.toml").read_text()
    assert "\nseeds = [42]\n" in text
    config = tmp_path / "row.toml"
    config.write_text(text.replace("\nseeds = [42]\n", f"\nseeds = {seeds}\n"))
    with pytest.raises(SystemExit) as e:
        run.main([str(config), "--plan"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"[row] seeds must be a list of distinct integers in [0, {SEED_MAX}]" in err, err
    assert str(config) in err and "--seeds" in err
    config.write_text(text.replace("\nseeds = [42]\n", f"\nseeds = [0, {SEED_MAX}]\n"))
    run.main([str(config), "--plan"])
    assert f"--seed {SEED_MAX} " in capsys.readouterr().out


@pytest.mark.parametrize("value, needle", [("cuda", "no such device here (torch sees 0 CUDA device(s))"),
                                           ("mps", "no such device here (torch sees no MPS device)")])
def test_base_train_device_type_is_a_flag_error(value, needle, capsys, monkeypatch):
    """compute_init's SystemExit(message) exited 1, after parsing (and after the tokenizer was read)."""
    from scripts import base_train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        base_train.main(["--depth", "2", "--synthetic-data", "--device-type", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument --device-type: {value}: {needle}" in err, err


def test_base_train_dry_run_plans_a_gpu_run_on_a_cpu_machine(tmp_path, capsys, monkeypatch):
    """A plan needs no device (nothing is built on it): a GPU row is planned on a laptop, as before."""
    from scripts import base_train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = base_train.main(["--depth", "2", "--synthetic-data", "--device-type", "cuda", "--dry-run",
                            "--run-dir", str(tmp_path / "run")])
    assert code == 0 and (tmp_path / "run" / "plan.json").is_file(), capsys.readouterr().err


# ---- --max-per-task: -1 is "all", 0 was a silent "all" ---------------------------------------------------------
CAP_SCRIPTS = {  # module -> (its flag, flags that get it past its required ones)
    "scripts.base_eval": ("--max-per-task", ["--run", "r"]),
    "scripts.analyze_memory": ("--max-per-task", ["--run", "r"]),
    "scripts.analyze_routing": ("--max-per-task", ["--run", "r", "--corpus", "val"]),
    "scripts.base_train": ("--core-max-per-task", ["--depth", "2"]),
}


@pytest.mark.parametrize("module", sorted(CAP_SCRIPTS))
@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_max_per_task_zero_is_refused_naming_minus_one(module, value, capsys):
    """0 evaluated every example (order_task_data caps only a positive count): a user asking for none got the full,
    slowest run; base_train's --core-max-per-task took -7 as "all" too."""
    flag, required = CAP_SCRIPTS[module]
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as e:
        main([*required, flag, value])
    err = capsys.readouterr().err
    run = "'run', " if flag == "--max-per-task" else ""  # base_eval's and the analyses' default follows the run
    assert e.value.code == 2 and f"argument {flag}: must be {run}an integer >= 1, or -1 for all (got '{value}')" in err, err


def test_max_per_task_all_and_a_cap_parse():
    from nanochat.train_args import parse_args
    from scripts import analyze_memory, base_eval

    assert base_eval.parse_args(["--run", "r", "--max-per-task", "-1"]).max_per_task == -1
    assert analyze_memory.parse_args(["--run", "r", "--max-per-task", "3"]).max_per_task == 3
    assert parse_args(["--depth", "2"]).core_max_per_task == -1
    assert parse_args(["--depth", "2", "--core-max-per-task", "24"]).core_max_per_task == 24
