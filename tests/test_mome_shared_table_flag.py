"""--mome-shared-table-kernel (base_train, base_eval): parsing, the refusals where it can change nothing, its
installation into mome_mix.SHARED_TABLE_KERNEL before the model is built (restored afterwards), the kernel path
config.json and summary.json record, the resume rule (as --mome-kernels: it may change), and base_eval taking the
run's setting. The CPU added to mome_triton.KERNEL_DEVICES stands in for a GPU: the kernel ops run their torch math
and spies see whether the model called them (as tests/test_mome_kernels_flag.py)."""

import json
import math
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from nanochat import checkpoint as ckpt
from nanochat import train_setup
from nanochat.memory import mome as mome_module
from nanochat.memory import mome_mix, mome_triton
from nanochat.train_args import parse_args
from scripts import base_train

sys.path.insert(0, str(Path(__file__).parent))
import base_eval_fixtures  # noqa: E402
from conftest import MEMORY_OPTION_SETS, tiny_config  # noqa: E402

tiny_run = base_eval_fixtures.tiny_run  # module scope: a tokenizer, data and CORE bundle for base_eval

FLAG = "--mome-shared-table-kernel"
TINY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
        "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core",
        "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "2", "--memory", "mome"]
BIGRAM = [*TINY, "--mome-index", "bigram", "--mome-bigram-factor", "1"]


@pytest.fixture
def shared_global(monkeypatch, kernel_globals):
    """SHARED_TABLE_KERNEL (besides ROW_SUM and FUSE_INJECT) back as it was after the test."""
    monkeypatch.setattr(mome_mix, "SHARED_TABLE_KERNEL", mome_mix.SHARED_TABLE_KERNEL)


@pytest.fixture
def cpu_kernels(monkeypatch, shared_global):
    monkeypatch.setattr(mome_triton, "KERNEL_DEVICES", ("cuda", "cpu"))


def _spies(monkeypatch) -> list[tuple[str, bool, bool]]:
    """(op, unique_rows, SHARED_TABLE_KERNEL at the call) per call of the two kernel ops from MoMEMemory.value."""
    calls = []
    for key, attr in (("row", "kernel_row_mix"), ("fused", "kernel_row_mix_inject")):
        real = getattr(mome_module, attr)

        def spy(*args, _real=real, _key=key):
            calls.append((_key, args[-1], mome_mix.SHARED_TABLE_KERNEL))
            return _real(*args)

        monkeypatch.setattr(mome_module, attr, spy)
    return calls


def _records(run) -> tuple[dict, dict]:
    return json.loads((run / "config.json").read_text()), json.loads((run / "summary.json").read_text())


def test_the_flag_parses_from_the_command_line_and_config_files(tmp_path):
    assert parse_args(["--dry-run"]).mome_shared_table_kernel == "off"
    assert parse_args([*BIGRAM, FLAG, "on", "--dry-run"]).mome_shared_table_kernel == "on"
    assert parse_args(["--memory", "ve", FLAG, "off", "--dry-run"]).mome_shared_table_kernel == "off"
    cfg = tmp_path / "c.toml"
    cfg.write_text('memory = "mome"\nmome-index = "bigram"\nmome-shared-table-kernel = "on"\n')
    assert parse_args(["--config", str(cfg), "--dry-run"]).mome_shared_table_kernel == "on"


@pytest.mark.parametrize("value", ["yes", "true", "On", ""])
def test_a_bad_value_names_the_flag_and_the_allowed_values(value, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args([*BIGRAM, FLAG, value, "--dry-run"])
    assert e.value.code == 2
    assert f"argument {FLAG}: invalid choice: '{value}' (choose from 'off', 'on')" in capsys.readouterr().err


@pytest.mark.parametrize("extra, needle", [
    (["--memory", "ve"], "only --memory mome --mome-index bigram has a shared table (got --memory ve)"),
    ([], "only --memory mome --mome-index bigram has a shared table (got --memory mome --mome-index token)"),
    (["--mome-index", "bigram", "--mome-per-head-table"], "per-head tables (--mome-per-head-table) never take"),
    (["--mome-index", "bigram", "--mome-kernels", "torch"], "which --mome-kernels torch turns off: pass "
                                                            "--mome-kernels auto, fused or row, or "
                                                            "--mome-shared-table-kernel off")])
def test_on_where_it_can_change_nothing_is_refused_at_parsing(extra, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args([*TINY, *extra, FLAG, "on", "--dry-run"])
    assert e.value.code == 2
    assert f"{FLAG} on: " in (err := capsys.readouterr().err) and needle in err, err


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_base_train_switches_the_shared_table_and_records_the_path(on, tmp_path, monkeypatch, capsys, cpu_kernels):
    """Kernels as on a GPU: with the flag on every memory layer calls the fused op on the shared table's gathered
    rows (unique_rows) with SHARED_TABLE_KERNEL on, and the run records the path "fused"; off: no kernel op, torch.
    The global is back as it was afterwards."""
    calls = _spies(monkeypatch)
    run = tmp_path / "r"
    assert base_train.main([*BIGRAM, "--run-dir", str(run), FLAG, "on" if on else "off"]) == 0
    out = capsys.readouterr().out
    want = "fused" if on else "torch"
    assert f"mome kernels in the model: {want}\n" in out
    assert ("mome kernels: fused (the shared table too: --mome-shared-table-kernel on)\n" in out) is on
    assert mome_mix.SHARED_TABLE_KERNEL is False
    assert calls if on else not calls
    assert set(calls) <= {("fused", True, True)}
    config, summary = _records(run)
    assert config["mome_kernels"] == summary["mome_kernels"] == want
    assert config["args"]["mome_shared_table_kernel"] == ("on" if on else "off")


def test_base_train_on_the_cpu_says_it_has_no_effect(tmp_path, capsys, shared_global):
    """The CPU as shipped: accepted (as --mome-kernels fused there), said once, and what ran is recorded."""
    run = tmp_path / "r"
    assert base_train.main([*BIGRAM, "--run-dir", str(run), FLAG, "on"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("mome kernels")]
    assert lines == ["mome kernels: torch (--mome-kernels auto: the MoME Triton kernels run on cuda only, this run is "
                     "on cpu; --mome-shared-table-kernel on: no effect either, this run is on cpu)",
                     "mome kernels in the model: torch"]
    config, summary = _records(run)
    assert config["mome_kernels"] == summary["mome_kernels"] == "torch"
    assert config["args"]["mome_shared_table_kernel"] == "on" and mome_mix.SHARED_TABLE_KERNEL is False


def test_a_shared_table_the_kernels_refuse_stops_the_run(tmp_path, monkeypatch, capsys, cpu_kernels):
    """A shape mome_triton.applies refuses (here: the tile limit lowered below d12's) would train on torch ops
    although the flag asked for the kernels: an error, before any step."""
    monkeypatch.setattr(mome_triton, "MAX_TILE", 16)
    run = tmp_path / "r"
    assert base_train.main([*BIGRAM, "--run-dir", str(run), FLAG, "on"]) == 2
    assert f"{FLAG} on: the model's shared table does not take the MoME Triton kernels" in capsys.readouterr().err
    assert not ckpt.list_steps(run)


def test_kernels_off_on_cuda_are_an_error_and_the_global_is_restored(monkeypatch, shared_global):
    """auto on CUDA without triton resolves to torch ops: the shared table cannot take kernels that do not run."""
    monkeypatch.setattr(mome_triton, "triton", None)
    with pytest.raises(ValueError, match=rf"^{FLAG} on: the MoME kernels resolved to torch ops on cuda \(triton "
                                         rf"cannot be imported\), so the shared table cannot take them; install "
                                         rf"triton, or pass {FLAG} off$"):
        train_setup.install_mome_kernels("auto", torch.device("cuda"), ExitStack(), "on")
    assert mome_mix.SHARED_TABLE_KERNEL is False
    monkeypatch.setattr(mome_triton, "KERNEL_DEVICES", ("cuda", "cpu"))
    with ExitStack() as stack:
        assert train_setup.install_mome_kernels("row", "cpu", stack, "on") == (
            "row", "the shared table too: --mome-shared-table-kernel on")
        assert (mome_mix.SHARED_TABLE_KERNEL, mome_mix.ROW_SUM, mome_mix.FUSE_INJECT) == (True, "triton", False)
    assert (mome_mix.SHARED_TABLE_KERNEL, mome_mix.ROW_SUM, mome_mix.FUSE_INJECT) == (False, "triton", True)


def test_a_resume_may_switch_it_and_the_summary_names_both_paths(tmp_path, monkeypatch, capsys, cpu_kernels):
    """As --mome-kernels (nanochat.train_resume: kernel choices are not trajectory flags; rounding only): a resume
    with the flag on continues the run off; summary.json joins the paths its steps ran on, config.json has this
    session's."""
    run, flags = tmp_path / "r", [*BIGRAM, "--num-iterations", "4", "--save-every", "2"]
    assert base_train.main([*flags, "--run-dir", str(run)]) == 0
    shutil.rmtree(ckpt.step_dir(run, 4))
    calls = _spies(monkeypatch)
    assert base_train.main([*flags, "--run-dir", str(run), FLAG, "on", "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out and calls
    config, summary = _records(run)
    assert summary["step"] == 4 and summary["mome_kernels"] == "torch+fused" and config["mome_kernels"] == "fused"
    assert config["args"]["mome_shared_table_kernel"] == "on"


BIGRAM_MODEL = {"memory": "mome", "memory_options": {"index": "bigram", "per_head_table": False}}


@pytest.mark.parametrize("model, recorded, kernels, want", [
    (BIGRAM_MODEL, "fused", "fused", "on"), (BIGRAM_MODEL, "row", "row", "on"),
    (BIGRAM_MODEL, "torch", "torch", "off"), (BIGRAM_MODEL, None, "auto", "off"),
    (BIGRAM_MODEL, "fused", "torch", "off"),  # --mome-kernels torch given: the shared table follows it
    ({"memory": "mome", "memory_options": {"index": "token"}}, "fused", "fused", "off"),
    ({"memory": "ve"}, "none", "auto", "off")])
def test_base_eval_takes_the_runs_setting(model, recorded, kernels, want):
    """run: on where the checkpoint's shared table took the kernels (with the flag off it records torch)."""
    from scripts.base_eval import eval_shared_table_kernel

    meta = {"model_config": model, **({"config": {"mome_kernels": recorded}} if recorded else {})}
    assert eval_shared_table_kernel("run", kernels, meta) == want
    assert eval_shared_table_kernel("off", kernels, meta) == "off"


def test_base_eval_refuses_on_for_a_model_without_a_shared_table():
    from scripts.base_eval import eval_shared_table_kernel

    with pytest.raises(ValueError, match=rf"^{FLAG} on: only --memory mome --mome-index bigram has a shared table "
                                         r"\(got --memory mome --mome-index token\)"):
        eval_shared_table_kernel("on", "auto", {"model_config": {"memory": "mome", "memory_options": {"index": "token"}}})
    assert eval_shared_table_kernel("on", "fused", {"model_config": BIGRAM_MODEL}) == "on"
    with pytest.raises(ValueError, match="which --mome-kernels torch turns off"):
        eval_shared_table_kernel("on", "torch", {"model_config": BIGRAM_MODEL})


@pytest.mark.parametrize("flag, want", [([], "fused"), ([FLAG, "off"], "torch")])
def test_base_eval_evaluates_on_the_runs_shared_table_kernels(flag, want, tiny_run, tmp_path, monkeypatch, capsys,
                                                              cpu_kernels):
    """A bigram-indexed checkpoint whose run recorded "fused" (its shared table took the kernels): base_eval takes
    them again by default (the fused op on the gathered rows, SHARED_TABLE_KERNEL on), and off evaluates on torch
    ops; core.json and bpb.json record the path, and the global is back as it was afterwards."""
    from nanochat.checkpoint import save_checkpoint
    from nanochat.gpt import build_model
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    model = build_model(tiny_config(vocab_size=300, sequence_len=64, **MEMORY_OPTION_SETS["mome_bigram_index"]),
                        seed=0)
    run = tmp_path / "mome"
    save_checkpoint(run, 1, model, {"tokenizer_dir": str(root / "tok"), "data_dir": str(root / "data"),
                                    "config": {"mome_kernels": "fused"}})
    calls = _spies(monkeypatch)
    out = tmp_path / "o"
    assert main(["--run", str(run), "--bundle", str(bundle), "--max-per-task", "1", "--eval-tokens", "256",
                 "--splits", "val", "--no-progress", "--device-type", "cpu", "--out-dir", str(out), *flag]) == 0
    assert f"; mome kernels {want} (the run's kernels, fused)\n" in capsys.readouterr().out
    assert set(calls) == ({("fused", True, True)} if want == "fused" else set())
    reports = [json.loads((out / name).read_text()) for name in ("core.json", "bpb.json")]
    assert [r["mome_kernels"] for r in reports] == [want, want] and mome_mix.SHARED_TABLE_KERNEL is False


@pytest.mark.slow  # about a minute of interpreted kernels on 2 CPU cores
def test_base_train_on_the_interpreted_kernels(tmp_path, monkeypatch, cpu_kernels):
    """End to end with the real Triton kernels (TRITON_INTERPRET=1 on the CPU, see tests/test_mome_triton_unique.py):
    base_train with the flag on trains the shared table through them, with unique_rows, to the losses of the torch
    ops (flag off), to the rounding of fp32 sums taken in another order."""
    from test_mome_triton import INTERPRETED, _InterpretedRowMix
    from test_mome_triton_inject import _InterpretedInject

    if not INTERPRETED:
        pytest.skip("needs triton and TRITON_INTERPRET=1 (set before the import) to run the Triton kernels on the CPU")
    uniques = []

    def interpreted(function):
        def call(*args):
            uniques.append(args[-1])
            return function.apply(*args)
        return call

    monkeypatch.setattr(mome_triton, "mome_row_mix_inject_op", interpreted(_InterpretedInject))
    monkeypatch.setattr(mome_triton, "mome_row_mix_op", interpreted(_InterpretedRowMix))
    losses = {}
    for flag in ("on", "off"):
        run = tmp_path / flag
        assert base_train.main([*BIGRAM, "--num-iterations", "4", "--run-dir", str(run), FLAG, flag]) == 0
        config, summary = _records(run)
        assert (summary["mome_kernels"], config["args"]["mome_shared_table_kernel"]) == (
            "fused" if flag == "on" else "torch", flag)
        losses[flag] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
                        if json.loads(line).get("kind", "train") == "train" and "loss" in json.loads(line)]
    assert uniques and all(uniques)
    assert len(losses["on"]) == 4 and all(math.isfinite(v) for v in losses["on"])
    assert losses["on"] == pytest.approx(losses["off"], rel=2e-7), losses  # an fp32 ulp of the loss
    # the losses barely see the memory after 4 steps from its zero-init gates (a kernel off by 1.5x moves them by
    # 2e-6); the weights do: fp32 sums in another order leave them ~1e-9 apart (here: equal), that kernel 1.3e-2
    weights = {flag: ckpt.load_model(tmp_path / flag, 4)[0].state_dict() for flag in ("on", "off")}
    worst = max((weights["on"][k].float() - v.float()).abs().max().item() for k, v in weights["off"].items())
    assert worst < 1e-6, worst


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_base_eval_run_follows_the_kernels_that_resolve_here(kernels, monkeypatch, shared_global):
    """A run whose shared table took the kernels, evaluated on a CUDA node without triton with --mome-kernels auto
    (the advice of run's own error there): run's shared-table default was decided against the requested kernels, so
    it asked for on and failed with an error naming a flag value the user never gave. It follows the resolved ones."""
    from scripts.base_eval import setup_eval_mome_kernels

    monkeypatch.setattr(mome_triton, "triton", None)
    meta = {"model_config": BIGRAM_MODEL, "config": {"mome_kernels": "fused"}}
    with ExitStack() as stack:
        name, _, _ = setup_eval_mome_kernels(kernels, meta, torch.device("cuda"), stack, "run")
        assert (name, mome_mix.SHARED_TABLE_KERNEL) == ("torch", False)
    with pytest.raises(ValueError, match=rf"^{FLAG} on: the MoME kernels resolved to torch ops on cuda") as caught:
        setup_eval_mome_kernels("auto", meta, torch.device("cuda"), ExitStack(), "on")  # asked for: still an error
    assert caught.value.raised_on_every_rank  # every rank agreed on the kernels: print_error prints it once
