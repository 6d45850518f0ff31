"""Paths a run records that are read later, maybe from another directory: the CORE bundle it evaluated on is
recorded resolved (config.json "data" "bundle", and every bundle find_bundle hands out), so base_eval --bundle run
finds the same bundle from anywhere; the flags themselves ("args") stay as given, so a flag given again as it was
(speedrun.sh's relative --bundle) is no flag difference; an older run's relative record reads as it did."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _eval_helpers import write_bundle  # noqa: E402

from nanochat import eval_bundle as eb  # noqa: E402
from nanochat.train_args import parse_args  # noqa: E402
from nanochat.train_setup import RunData, resolve_bundle, write_json  # noqa: E402


def recorded_data(bundle) -> dict:
    """config.json's "data" as base_train writes it (RunData.describe) for a run whose CORE bundle is ``bundle``."""
    return RunData(None, torch.zeros(0, 1), torch.ones(4), None, 4, "d (tokenizer t)", bundle=bundle).describe()


def write_config(run: Path, args, bundle) -> dict:
    config = {"args": json.loads(json.dumps(vars(args), default=str)), "data": recorded_data(bundle)}
    run.mkdir(parents=True, exist_ok=True)
    write_json(run / "config.json", config)
    return config


def test_a_relative_bundle_is_recorded_resolved_and_found_again_from_another_directory(tmp_path, monkeypatch):
    """Trained with --bundle b from work/, evaluated (base_eval --bundle run: run_core_inputs, then find_bundle) from
    elsewhere: config.json recorded "b" in "args" and "data" alike, and from another directory the run's bundle was
    an error (or another bundle of that name). "data" now records the resolved path and the reader takes it."""
    work, elsewhere, run = tmp_path / "work", tmp_path / "elsewhere", tmp_path / "runs" / "r"
    bundle = write_bundle(work / "b", {}, {}).resolve()
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    args = parse_args(["--bundle", "b", "--core-max-per-task", "3"])
    found = resolve_bundle(args)
    assert found == bundle and found.is_absolute()
    config = write_config(run, args, found)
    assert config["args"]["bundle"] == "b"  # the flag as given (see the speedrun test below)
    assert config["data"]["bundle"] == str(bundle)
    monkeypatch.chdir(elsewhere)
    core = eb.run_core_inputs("run", "run", {}, run)
    assert (core.bundle, core.bundle_source, core.max_per_task) == (str(bundle), "the run's bundle, its config.json", 3)
    assert eb.find_bundle(core.bundle) == bundle
    # a bundle of the same name here is not the run's: still the recorded one
    write_bundle(elsewhere / "b", {}, {})
    assert eb.run_core_inputs("run", "run", {}, run).bundle == str(bundle)
    # the checkpoint's copy of the config (no config.json) reads the same
    assert eb.recorded_bundle({"config": config}) == (str(bundle), "the run's bundle, its checkpoint")


def test_the_search_orders_bundle_is_recorded_resolved(tmp_path, monkeypatch):
    """Without --bundle the run records the bundle its search found: a relative $NANOCHAT_EVAL_BUNDLE (or
    $NANOCHAT_EVAL_CACHE) was recorded as given, so from another directory base_eval --bundle run missed it."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    env_bundle = write_bundle(work / "env_b", {}, {}).resolve()
    cached = write_bundle(work / "cache" / "eval_bundle", {}, {}).resolve()
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE", "env_b")
    assert eb.find_bundle() == env_bundle
    args = parse_args([])
    found = resolve_bundle(args)
    write_config(tmp_path / "run", args, found)
    monkeypatch.delenv("NANOCHAT_EVAL_BUNDLE")
    monkeypatch.setenv("NANOCHAT_EVAL_CACHE", "cache")
    assert eb.find_bundle() == cached
    monkeypatch.chdir(elsewhere)
    assert eb.recorded_bundle({}, tmp_path / "run") == (str(env_bundle), "the run's bundle, its config.json")


def test_subset_and_older_relative_records_read_as_before(tmp_path, monkeypatch):
    """--bundle subset keeps its meaning (this checkout's subset, whatever path the training checkout's was); a
    config.json of an older version, whose "data" "bundle" is the relative path as given, is read from here as it
    was, and says so."""
    args = parse_args(["--bundle", "subset"])
    assert resolve_bundle(args) == eb.SUBSET_DIR
    config = write_config(tmp_path / "run", args, Path("/another/checkout/eval_data/core_subset"))
    assert eb.recorded_bundle({"config": config}) == ("subset", "the run's bundle, its checkpoint")
    write_bundle(tmp_path / "b", {}, {})
    monkeypatch.chdir(tmp_path)
    old = {"config": {"args": {"bundle": "b"}, "data": {"bundle": "b"}}}
    assert eb.recorded_bundle(old) == ("b", "the run's bundle, its checkpoint, relative to this directory")


def test_a_relative_bundle_given_again_is_no_flag_difference(tmp_path, monkeypatch):
    """speedrun.sh passes --bundle ../shared/eval_bundle (relative) on every start; its done check
    (speedrun_preflight.unfinished_run) compares config.json "args" with those flags parsed again. The bundle's
    resolved record is in "data", not "args": the same relative flag is the same run, another bundle is not."""
    from scripts import speedrun_preflight as pre

    work, run = tmp_path / "work", tmp_path / "run"
    write_bundle(work / "b", {}, {})
    monkeypatch.chdir(work)
    flags = ["--depth", "4", "--num-iterations", "20", "--bundle", "b", "--run-dir", str(run), "--resume", "auto"]
    args = parse_args(flags)
    args.run_name, args.data_seed, args.compile = "d4-base", args.seed, False  # what base_train resolves
    write_config(run, args, resolve_bundle(args))
    (run / "summary.json").write_text(json.dumps({"stop_reason": "completed", "step": 20, "num_iterations": 20}))
    assert pre.unfinished_run(run, flags) is None
    other = [f if f != "b" else "other" for f in flags]
    assert pre.unfinished_run(run, other) == f"{run} completed with other flags (bundle)"
