"""--mome-kernels: the globals each name installs (mome_mix.set_kernels), its resolution by device and triton
(mome_triton.resolve_kernels; a CUDA device string and a patched-out triton stand in for a GPU without triton), and
base_train runs that record it and train on the path it chose (the CPU added to KERNEL_DEVICES, so the kernel ops
run their torch math and spies see whether the model called them)."""

import json
import shutil
from contextlib import ExitStack

import pytest
import torch

from nanochat import checkpoint as ckpt
from nanochat import train_setup
from nanochat.memory import mome as mome_module
from nanochat.memory import mome_mix
from nanochat.memory import mome_triton
from nanochat.train_args import parse_args
from scripts import base_train

TINY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
        "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core",
        "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "2", "--memory", "mome"]


@pytest.mark.parametrize("name, want", [("fused", ("triton", True)), ("row", ("triton", False)),
                                        ("torch", ("unrolled", "untouched"))])
def test_set_kernels_sets_exactly_its_globals(name, want, monkeypatch, kernel_globals):
    monkeypatch.setattr(mome_mix, "ROW_SUM", "reduce")  # neither value any name sets
    monkeypatch.setattr(mome_mix, "FUSE_INJECT", "untouched")
    set_ = mome_mix.set_kernels(name)
    assert (mome_mix.ROW_SUM, mome_mix.FUSE_INJECT) == want
    assert set_ == {"ROW_SUM": want[0], **({} if name == "torch" else {"FUSE_INJECT": want[1]})}


@pytest.mark.parametrize("name", ["auto", "triton", "Fused", ""])
def test_set_kernels_refuses_unknown_names(name, kernel_globals):
    before = (mome_mix.ROW_SUM, mome_mix.FUSE_INJECT)
    with pytest.raises(ValueError, match=r"unknown; allowed: fused, row, torch"):
        mome_mix.set_kernels(name)
    assert (mome_mix.ROW_SUM, mome_mix.FUSE_INJECT) == before


@pytest.mark.parametrize("name, value", [("MIX", "row"), ("MIX", None), ("TOPK_BY_ARGMAX", False),
                                         ("TOPK_BY_ARGMAX", None), ("ROW_SUM", "reduce")])
def test_set_path_forces_one_setting(name, value, monkeypatch, kernel_globals):
    for key in ("MIX", "TOPK_BY_ARGMAX"):
        monkeypatch.setattr(mome_mix, key, getattr(mome_mix, key))
    mome_mix.set_path(name, value)
    assert getattr(mome_mix, name) is value or getattr(mome_mix, name) == value


@pytest.mark.parametrize("name, value, needle", [("MIX", "fused", "MIX 'fused' is unknown"),
                                                 ("TOPK_BY_ARGMAX", 1, "TOPK_BY_ARGMAX 1 is unknown"),
                                                 ("ROW_SUM", None, "ROW_SUM None is unknown"),
                                                 ("FUSE_INJECT", False, "'FUSE_INJECT' is not a path setting")])
def test_set_path_refuses_what_the_model_would_refuse_later(name, value, needle, kernel_globals):
    """Checked when set, not at the model's first call (FUSE_INJECT is a kernel setting: set_kernels')."""
    before = {key: getattr(mome_mix, key) for key in (*mome_mix.FORCEABLE, "FUSE_INJECT")}
    with pytest.raises(ValueError, match=needle):
        mome_mix.set_path(name, value)
    assert {key: getattr(mome_mix, key) for key in before} == before


def test_auto_resolves_to_the_module_defaults():
    """auto = fused where the kernels run: the globals of the module as it ships."""
    assert mome_mix.KERNEL_SETTINGS["fused"] == {"ROW_SUM": "triton", "FUSE_INJECT": True}
    assert (mome_mix.ROW_SUM, mome_mix.FUSE_INJECT) == ("triton", True)


def test_resolve_on_cpu_runs_torch_ops_for_every_name():
    assert mome_triton.resolve_kernels("torch", "cpu") == ("torch", "")
    for name in ("auto", "fused", "row"):
        got, reason = mome_triton.resolve_kernels(name, "cpu")
        assert got == "torch" and reason == f"--mome-kernels {name}: the MoME Triton kernels run on cuda only, " \
                                            "this run is on cpu"


def test_resolve_on_cuda_with_triton(monkeypatch):
    monkeypatch.setattr(mome_triton, "triton", object())  # importable, as on a GPU machine
    got = {name: mome_triton.resolve_kernels(name, "cuda") for name in mome_mix.MOME_KERNELS}
    assert got == {"auto": ("fused", ""), "fused": ("fused", ""), "row": ("row", ""), "torch": ("torch", "")}


@pytest.mark.parametrize("name", ["fused", "row"])
def test_an_explicit_kernel_on_cuda_without_triton_is_an_error(name, monkeypatch):
    monkeypatch.setattr(mome_triton, "triton", None)
    with pytest.raises(ValueError, match=rf"--mome-kernels {name}: the MoME Triton kernels need triton, which cannot "
                                         r"be imported here; install triton \(pip install triton\), or pass "
                                         r"--mome-kernels torch or auto \(allowed: auto, fused, row, torch\)"):
        mome_triton.resolve_kernels(name, "cuda")
    assert mome_triton.resolve_kernels("auto", "cuda") == ("torch", "--mome-kernels auto: triton cannot be imported")
    assert mome_triton.resolve_kernels("torch", "cuda:0") == ("torch", "")


def test_resolve_refuses_unknown_names():
    with pytest.raises(ValueError, match=r"--mome-kernels must be one of auto, fused, row, torch \(got 'triton'\)"):
        mome_triton.resolve_kernels("triton", "cpu")


def test_the_flag_parses_from_the_command_line_and_config_files(tmp_path, capsys):
    assert parse_args(["--dry-run"]).mome_kernels == "auto"
    assert parse_args(["--mome-kernels", "row", "--dry-run"]).mome_kernels == "row"
    cfg = tmp_path / "c.toml"
    cfg.write_text('mome-kernels = "torch"\n')
    assert parse_args(["--config", str(cfg), "--dry-run"]).mome_kernels == "torch"
    with pytest.raises(SystemExit) as e:
        parse_args(["--mome-kernels", "triton", "--dry-run"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--mome-kernels" in err and all(v in err for v in mome_mix.MOME_KERNELS), err


def _spies(monkeypatch) -> dict[str, int]:
    """Calls of the two kernel ops from MoMEMemory.value (row mix alone; row mix + injection)."""
    calls = {"row": 0, "fused": 0}
    for key, attr in (("row", "kernel_row_mix"), ("fused", "kernel_row_mix_inject")):
        real = getattr(mome_module, attr)

        def spy(*args, _real=real, _key=key):
            calls[_key] += 1
            return _real(*args)

        monkeypatch.setattr(mome_module, attr, spy)
    return calls


@pytest.mark.parametrize("name", ["fused", "row", "torch"])
def test_base_train_installs_records_and_trains_on_the_choice(name, tmp_path, monkeypatch, capsys, kernel_globals):
    """The CPU added to KERNEL_DEVICES: fused calls the injecting op, row the row-mix op, torch neither (ROW_SUM
    "unrolled" while it trained); config.json and summary.json record the name, config's args the flag."""
    monkeypatch.setattr(mome_triton, "KERNEL_DEVICES", ("cuda", "cpu"))
    calls = _spies(monkeypatch)
    run = tmp_path / "r"
    assert base_train.main([*TINY, "--run-dir", str(run), "--mome-kernels", name]) == 0
    assert f"mome kernels: {name}\n" in capsys.readouterr().out
    assert (mome_mix.ROW_SUM, mome_mix.FUSE_INJECT) == ("triton", True)  # the module as it was before the run
    assert {k: v > 0 for k, v in calls.items()} == {"fused": name == "fused", "row": name == "row"}
    config = json.loads((run / "config.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert config["mome_kernels"] == summary["mome_kernels"] == config["args"]["mome_kernels"] == name


def test_base_train_on_cpu_resolves_auto_and_fused_to_torch(tmp_path, capsys, kernel_globals):
    """The CPU as shipped (KERNEL_DEVICES CUDA only): the kernels never run, fused is accepted and said to have no
    effect, and what ran (torch ops) is recorded next to the flag."""
    run = tmp_path / "r"
    assert base_train.main([*TINY, "--run-dir", str(run), "--mome-kernels", "fused"]) == 0
    assert "mome kernels: torch (--mome-kernels fused: the MoME Triton kernels run on cuda only, this run is on " \
           "cpu)" in capsys.readouterr().out
    config = json.loads((run / "config.json").read_text())
    assert config["mome_kernels"] == "torch" and config["args"]["mome_kernels"] == "fused"


@pytest.mark.parametrize("extra, ran", [(["--mome-shared-expert"], "row"), (["--mome-per-head-table"], "torch"),
                                        (["--mome-index", "bigram"], "torch"), (["--memory", "ve"], "none")])
def test_base_train_records_the_path_the_model_takes(extra, ran, tmp_path, monkeypatch, capsys, kernel_globals):
    """--mome-kernels fused, the CPU added to KERNEL_DEVICES: tables the fused pair does not serve (a shared expert:
    the row-mix pair; per-head and bigram-indexed tables: torch ops; no MoME: none) are recorded as what ran."""
    monkeypatch.setattr(mome_triton, "KERNEL_DEVICES", ("cuda", "cpu"))
    calls = _spies(monkeypatch)
    run = tmp_path / "r"
    assert base_train.main([*TINY, *extra, "--run-dir", str(run), "--mome-kernels", "fused"]) == 0
    assert f"mome kernels in the model: {ran}\n" in capsys.readouterr().out
    assert {k: v > 0 for k, v in calls.items()} == {"fused": False, "row": ran == "row"}
    config = json.loads((run / "config.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert config["mome_kernels"] == summary["mome_kernels"] == ran


@pytest.mark.parametrize("memory, lines", [
    ("base", ["mome kernels in the model: none"]),
    ("mome", ["mome kernels: torch (--mome-kernels fused: the MoME Triton kernels run on cuda only, this run is on "
              "cpu)", "mome kernels in the model: torch"])])
def test_base_train_logs_the_flags_resolution_only_for_a_mome_model(memory, lines, tmp_path, capsys, kernel_globals):
    """A Base run logged 'mome kernels: torch (...)' (the flag, which its layers never read) and then 'mome kernels
    in the model: none'; both runs still record what their layers take."""
    run = tmp_path / "r"
    assert base_train.main([*TINY, "--memory", memory, "--run-dir", str(run), "--mome-kernels", "fused"]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("mome kernels")] == lines
    config = json.loads((run / "config.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    want = "none" if memory == "base" else "torch"
    assert config["mome_kernels"] == summary["mome_kernels"] == want and config["args"]["mome_kernels"] == "fused"


def test_setup_installs_the_choice_until_the_run_ends(monkeypatch, capsys, kernel_globals):
    monkeypatch.setattr(mome_triton, "KERNEL_DEVICES", ("cuda", "cpu"))
    with ExitStack() as stack:
        assert train_setup.install_mome_kernels("row", torch.device("cpu"), stack) == ("row", "")
        assert (mome_mix.ROW_SUM, mome_mix.FUSE_INJECT) == ("triton", False)
    assert (mome_mix.ROW_SUM, mome_mix.FUSE_INJECT) == ("triton", True)
    assert capsys.readouterr().out == ""  # the callers say it, once the model shows it has MoME layers


def test_ranks_that_resolve_differently_stop_the_run(monkeypatch, kernel_globals):
    monkeypatch.setattr(train_setup, "gather_objects", lambda name: ["fused", name])
    with pytest.raises(ValueError, match=r"--mome-kernels auto resolved to \['fused', 'torch'\] on ranks 0..1: "
                                         r"install triton on every node, or pass --mome-kernels torch"):
        train_setup.install_mome_kernels("auto", torch.device("cpu"), ExitStack())
    assert (mome_mix.ROW_SUM, mome_mix.FUSE_INJECT) == ("triton", True)  # nothing installed


def test_a_resume_on_other_kernels_continues_and_names_both(tmp_path, monkeypatch, capsys, kernel_globals):
    """Like --attention, the kernels do not define the run: a resume may change them (the losses then differ by
    rounding only), and summary.json names every kernel choice its steps ran on; config.json this session's."""
    monkeypatch.setattr(mome_triton, "KERNEL_DEVICES", ("cuda", "cpu"))
    run, flags = tmp_path / "r", [*TINY, "--num-iterations", "4", "--save-every", "2"]
    assert base_train.main([*flags, "--run-dir", str(run), "--mome-kernels", "torch"]) == 0
    shutil.rmtree(ckpt.step_dir(run, 4))
    calls = _spies(monkeypatch)
    assert base_train.main([*flags, "--run-dir", str(run), "--mome-kernels", "row", "--resume"]) == 0
    assert calls["row"] > 0 and calls["fused"] == 0
    summary = json.loads((run / "summary.json").read_text())
    config = json.loads((run / "config.json").read_text())
    assert summary["step"] == 4 and summary["mome_kernels"] == "torch+row" and config["mome_kernels"] == "row"
