import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import REPO
from nanochat.gpt import GPTConfig, model_summary
from nanochat.plan import batch_lr_scale, build_plan, grad_accum_steps, resolve_num_iterations
from nanochat.train_args import parse_args
from scripts import base_train


def test_d12_base_flop_target_numbers():
    s = model_summary(GPTConfig.from_depth(12, sequence_len=2048, vocab_size=32768))
    assert s["flops_per_token"] == 887_095_296
    n, source = resolve_num_iterations(None, 3e18, 8, s["flops_per_token"], 524_288, s["params_backbone"])
    assert (n, source) == (6450, "target_flops")


def test_horizon_priority_and_ratio():
    assert resolve_num_iterations(7, 3e18, 8, 10**9, 2**19, 10**8) == (7, "num_iterations")
    assert resolve_num_iterations(None, None, 8, 10**9, 2**19, 2**19) == (8, "target_param_data_ratio")
    with pytest.raises(ValueError, match="--target-flops"):
        resolve_num_iterations(None, 1.0, 8, 10**9, 2**19, 10**8)  # less than one step


def test_grad_accum():
    assert grad_accum_steps(524_288, 32, 2048, 4) == 2
    assert grad_accum_steps(524_288, 32, 2048, 1) == 8
    with pytest.raises(ValueError, match="--total-batch-size 1000 is not divisible"):
        grad_accum_steps(1000, 4, 32, 1)
    assert batch_lr_scale(2**17) == pytest.approx(0.5)


def _plan_args(**kw):
    base = dict(total_batch_size=524_288, device_batch_size=32, max_seq_len=2048, num_iterations=None,
                target_flops=3e18, target_param_data_ratio=8.0, weight_decay=0.2, depth=12)
    base.update(kw)
    return SimpleNamespace(**base)


def test_build_plan_wd_and_batch_come_from_real_tokens():
    s = model_summary(GPTConfig.from_depth(24, sequence_len=2048, vocab_size=32768))
    plan = build_plan(_plan_args(depth=24, target_flops=6e19), s, world_size=8)
    assert plan["num_iterations"] == 21655 and plan["grad_accum_steps"] == 1
    assert plan["muon_weight_decay"] == pytest.approx(0.05) and plan["batch_lr_scale"] == 1.0
    assert plan["total_tokens"] == 21655 * 524_288


@pytest.mark.parametrize("depth", [12, 24])
@pytest.mark.parametrize("memory", ["base", "ve", "bigram", "mome"])
def test_dry_run_every_block(tmp_path, capsys, depth, memory):
    rc = base_train.main(["--dry-run", "--depth", str(depth), "--memory", memory, "--target-flops", "3e18",
                          "--run-dir", str(tmp_path)])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("params_total", "params_memory", "params_backbone", "flops_per_token", "num_iterations",
                "total_tokens", "grad_accum_steps", "world_size"):
        assert key in last
    assert json.loads((tmp_path / "plan.json").read_text())["num_iterations"] == last["num_iterations"]
    assert (last["params_memory"] > 0) == (memory != "base")
    if depth == 12 and memory in ("base", "ve", "bigram"):
        assert last["num_iterations"] == 6450
    if depth == 12 and memory == "mome":
        assert last["num_iterations"] == 6443  # the hidden router counts as compute (reference table)


def test_dry_run_subprocess_last_line_is_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "scripts.base_train", "--dry-run", "--target-flops", "3e18",
                        "--run-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout.strip().splitlines()[-1])
    assert plan["flops_per_token"] == 887_095_296 and plan["num_iterations"] == 6450


def test_config_file_defaults_and_cli_override(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('depth = 4\nmatrix-lr = 0.05\ncompile = true\nmemory = "ve"\nmemory_layers = [1, 3]\n')
    args = parse_args(["--config", str(cfg), "--matrix-lr", "0.01"])
    assert args.depth == 4 and args.matrix_lr == 0.01 and args.compile and args.memory == "ve"
    assert args.memory_layers == "1,3"
    row = tmp_path / "row.toml"
    row.write_text('[row]\ntable = "t"\nname = "n"\n[train]\ndepth = 6\ntarget-flops = 1e17\n[paper]\nval_bpb = 1.0\n')
    args = parse_args(["--config", str(row)])
    assert args.depth == 6 and args.target_flops == 1e17


def test_config_file_unknown_key_names_it(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("depth = 4\nmatrix_lrr = 0.05\n")
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(cfg)])
    assert e.value.code == 2
    assert "unknown key 'matrix_lrr'" in capsys.readouterr().err


def test_row_config_is_validated_and_booleans_false_are_kept(tmp_path, capsys):
    """base_train reads a row config through nanochat.row_config: the runner and the trainer cannot disagree."""
    row = tmp_path / "row.toml"
    row.write_text('[row]\ntable = "t"\nname = "n"\n[train]\ndepth = 6\nfinal-core = false\ncompile = true\n')
    args = parse_args(["--config", str(row)])
    assert args.depth == 6 and args.final_core is False and args.compile is True  # default final_core is True
    row.write_text('[row]\ntable = "t"\nname = "n"\n[train]\ndepth = 6\n[papr]\nval_bpb = 1.0\n')
    with pytest.raises(SystemExit):
        parse_args(["--config", str(row)])
    assert "unknown top-level table(s) ['papr']" in capsys.readouterr().err
    row.write_text('[train]\ndepth = 6\n')  # a table-structured file must be a row config
    with pytest.raises(SystemExit):
        parse_args(["--config", str(row)])
    assert "[row] needs a non-empty string 'table'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--warmup-ratio", "0.8"], "--warmup-ratio + --warmdown-ratio must be <= 1"),
    (["--final-lr-frac", "2"], "--final-lr-frac must be in [0, 1]"),
    (["--warmdown-ratio=-0.5"], "--warmdown-ratio must be in [0, 1]"),
])
def test_dry_run_checks_the_schedule_flags(tmp_path, capsys, argv, needle):
    """speedrun's preflight is a dry run: a bad schedule must stop there, before any download or tokenizing."""
    with pytest.raises(SystemExit) as e:
        base_train.main(["--dry-run", "--target-flops", "3e18", "--run-dir", str(tmp_path), *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--conf", "--model-t", "--mem"])
def test_abbreviated_flags_are_refused(tmp_path, capsys, flag):
    """The config file, model type and memory are read by a full-name pre-parser first: an abbreviation the main
    parser accepted would train without the config file or the family's preset geometry."""
    with pytest.raises(SystemExit) as e:
        parse_args([flag, "x"])
    assert e.value.code == 2 and f"unrecognized arguments: {flag} x" in capsys.readouterr().err


def test_dry_run_refuses_a_tokenizer_of_another_size_than_the_pinned_one(tmp_path, capsys, tiny_tokenizer_dir):  # noqa: F811
    """The config rows pin --vocab-size; a 4096-token tokenizer left in the tokenizer dir (the CPU rows') would
    otherwise train a d12 row at V = 4096 without a word, and the speedrun preflight would not notice."""
    flags = ["--dry-run", "--depth", "2", "--run-dir", str(tmp_path), "--tokenizer-dir", str(tiny_tokenizer_dir)]
    assert base_train.main([*flags, "--vocab-size", "32768"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tokenizer-dir") and "vocab size 1024" in err and "--vocab-size 32768" in err
    assert base_train.main([*flags, "--vocab-size", "1024"]) == 0
    assert base_train.main([*flags[:-2], "--tokenizer-dir", str(tmp_path / "none"), "--vocab-size", "32768"]) == 0


def test_dry_run_leaves_the_plan_of_an_existing_run_alone(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "plan.json").write_text('{"num_iterations": 2}')
    assert base_train.main(["--dry-run", "--depth", "2", "--num-iterations", "7", "--run-dir", str(run)]) == 0
    assert json.loads((run / "plan.json").read_text()) == {"num_iterations": 2}
    assert f"plan not written: {run} holds a run" in capsys.readouterr().out
