"""scripts.results and scripts.run (session 33): one read of a seed's config.json, notes for seeds of different
commits and for a BB-avg that is not a number, no "-0.0000" Δ, the columns the paper's tables have beyond train/val
bpb and CORE, and a copied row config that would have trained into the original row's folder."""

import json

import pytest

from conftest import REPO

DONE = dict(stop_reason="completed", params_memory=0, params_total=135_000_000, tok_per_sec=1000.0)


def write_seed(root, table, row, name, summary, config=None, environment=None):
    d = root / table / row / name
    d.mkdir(parents=True)
    d.joinpath("summary.json").write_text(json.dumps(summary))
    if config is not None:
        d.joinpath("config.json").write_text(json.dumps(config, default=str))
    if environment is not None:
        d.joinpath("environment.json").write_text(json.dumps(environment))
    return d


def table(tmp_path, runs, name="d12"):
    from scripts import results

    assert results.main(["--table", name, "--runs-root", str(runs), "--out", str(tmp_path / "res")]) == 0
    md = (tmp_path / "res" / f"{name}.md").read_text()
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]

    def cells(label):
        line = next(l for l in md.splitlines() if l.startswith(f"| {label} |"))
        return dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
    return md, cells


def row_args(seed):
    from nanochat.train_args import parse_args

    return vars(parse_args(["--config", str(REPO / "configs" / "d12" / "base.toml"), "--seed", str(seed)]))


def test_a_seeds_config_json_is_read_once(tmp_path, monkeypatch):
    """not_a_seed, flag_differences and the lr_overrides check each read config.json: three reads of one file per
    seed (and three chances to see different contents while a seed is being rewritten)."""
    from scripts import results

    runs = tmp_path / "runs"
    for seed in (42, 43):
        write_seed(runs, "d12", "base", f"seed{seed}", {**DONE, "val_bpb": 0.9}, {"args": row_args(seed)})
    reads = []
    real = results.read_json_object

    def counting(path, *args, **kwargs):
        reads.append(path.name)
        return real(path, *args, **kwargs)
    monkeypatch.setattr(results, "read_json_object", counting)
    md, cells = table(tmp_path, runs)
    assert cells("Base")["seeds"] == "2", md
    assert reads.count("config.json") == 2, reads
