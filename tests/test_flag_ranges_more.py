"""More flags checked at parsing (exit 2 naming the flag), session 20: wic_probe's --bootstrap accepted a handful
of resamples whose "95% interval" one extreme draw set, and the benches took --device cuda on a machine without
CUDA, to fail late in torch (bench/train_step.py: once per design process, then exit 0 with a table of failures)."""

import pytest
import torch

from conftest import load_bench
from nanochat.memory.engram import layer_multipliers
from nanochat.routing_metrics import stratified_bootstrap
from scripts import wic_probe


def test_engram_seed_needs_no_32_bit_cap():
    """--engram-seed feeds NumPy's default_rng (SeedSequence keeps every bit), not torch's CPU generator (which
    keeps the low 32): seeds 2**32 apart draw different multipliers, so the flag keeps only its >= 0 check."""
    assert layer_multipliers(2**32, 1, 3, 512) != layer_multipliers(0, 1, 3, 512)
    assert layer_multipliers(2**64, 1, 3, 512) != layer_multipliers(0, 1, 3, 512)


# ---- wic_probe --bootstrap: 0 (no intervals) or enough resamples for a 95% interval -----------------------------
def bootstrap_ends(n_boot: int, extreme: float) -> tuple[float, float]:
    """The interval of n_boot resamples whose statistic is 0, 1, ..., n_boot - 1, the first replaced by
    ``extreme`` and the last by -extreme: the smallest and largest resample."""
    values = iter([extreme, *range(1, n_boot - 1), n_boot - 1 - extreme])
    lo, hi = stratified_bootstrap(lambda idx: torch.tensor([float(next(values))]),
                                  torch.tensor([True, False]), n_boot, seed=0)
    return lo.item(), hi.item()


def test_bootstrap_below_the_minimum_lets_one_extreme_draw_set_the_interval():
    """torch.quantile puts the 2.5% end at (n - 1) x 0.025 in the sorted resamples: below 41 between the smallest
    and the next, so moving the single most extreme draw moves the interval; from 41 on it does not."""
    low = wic_probe.MIN_BOOTSTRAP
    assert low == 41
    assert bootstrap_ends(low, 0.0) == bootstrap_ends(low, -1e6)
    assert bootstrap_ends(low - 1, 0.0) != bootstrap_ends(low - 1, -1e6)
    lo, hi = bootstrap_ends(1, 0.0)
    assert lo == hi  # one resample: a "95% interval" of width 0


@pytest.mark.parametrize("value", ["1", "5", "40", "-1"])
def test_wic_probe_bootstrap_too_small_is_a_flag_error(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        wic_probe.parse_args(["--run", str(tmp_path), "--wic", "w.tsv", "--bootstrap", value])
    err = capsys.readouterr().err
    want = f"--bootstrap must be 0 (no intervals) or >= {wic_probe.MIN_BOOTSTRAP} resamples (got {value})"
    assert e.value.code == 2 and want in err, err


@pytest.mark.parametrize("value", [0, 41, 1000])
def test_wic_probe_bootstrap_none_or_enough_parses(value, tmp_path):
    args = wic_probe.parse_args(["--run", str(tmp_path), "--wic", "w.tsv", "--bootstrap", str(value)])
    assert args.bootstrap == value


# ---- bench --device: a device torch cannot see stops at parsing ----------------------------------------------
BENCH_PARSERS = {"train_step": "parse_args", "step": "parse_args", "decode": "parse", "mome_ops": "parse_args",
                 "dist_optim": "main"}


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("name", sorted(BENCH_PARSERS))
def test_bench_device_cuda_without_cuda_is_a_flag_error(name, no_gpu, capsys):
    bench = load_bench(name)
    with pytest.raises(SystemExit) as e:
        getattr(bench, BENCH_PARSERS[name])(["--device", "cuda"])
    err = capsys.readouterr().err
    want = "argument --device: cuda: no such device here (torch sees 0 CUDA device(s))"
    assert e.value.code == 2 and want in err, err


def test_train_step_parent_fails_before_any_design_process(no_gpu, monkeypatch, tmp_path, capsys):
    """It exited 0 with one "failed" row per design, each child having set up and failed alone."""
    bench = load_bench("train_step")
    spawned = []
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: spawned.append(a))
    out = tmp_path / "ts.json"
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cuda", "--designs", "base,ve", "--out", str(out)])
    assert e.value.code == 2 and "argument --device: cuda" in capsys.readouterr().err
    assert spawned == [] and not out.exists()


def test_bench_cpu_devices_and_automatic_default_parse(no_gpu):
    assert load_bench("train_step").parse_args(["--device", "cpu"]).device == "cpu"
    assert load_bench("step").parse_args([]).device == "cpu"
    assert load_bench("decode").parse([]).device == "cpu"
    assert load_bench("mome_ops").parse_args([]).device == "cpu"  # cuda if available, else cpu: still so


def test_train_step_default_cuda_on_a_cpu_machine_names_the_flag(no_gpu, capsys):
    """Its default is cuda (the paper's table is GPU throughput), not chosen by what the machine has."""
    with pytest.raises(SystemExit) as e:
        load_bench("train_step").parse_args([])
    assert e.value.code == 2 and "argument --device: cuda: no such device here" in capsys.readouterr().err
