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


def test_seeds_of_different_commits_are_averaged_with_a_note_naming_them(tmp_path):
    """environment.json records each session's git commit; seeds of two commits (a fix landed between them) were
    averaged with nothing saying so."""
    runs = tmp_path / "runs"
    a, b = "a" * 40, "b" * 40
    write_seed(runs, "d12", "base", "seed42", {**DONE, "val_bpb": 0.90}, environment={"sessions": [
        {"commit": a, "dirty": False}]})
    write_seed(runs, "d12", "base", "seed43", {**DONE, "val_bpb": 0.92}, environment={"sessions": [
        {"commit": a, "dirty": False}, {"commit": b, "dirty": True}]})
    write_seed(runs, "d12", "base", "seed44", {**DONE, "val_bpb": 0.94})  # an older run: no environment.json
    md, cells = table(tmp_path, runs)
    assert cells("Base")["seeds"] == "3" and cells("Base")["val bpb"] == "0.9200 ± 0.0200", md
    assert ("- Base: seeds of different commits averaged (environment.json): seed42 aaaaaaaaaaaa; seed43 aaaaaaaaaaaa "
            "+ bbbbbbbbbbbb (dirty); seed44 unknown") in md, md


def test_seeds_of_one_commit_get_no_commit_note(tmp_path):
    runs = tmp_path / "runs"
    for seed in (42, 43):
        write_seed(runs, "d12", "base", f"seed{seed}", {**DONE, "val_bpb": 0.9},
                   environment={"sessions": [{"commit": "c" * 40, "dirty": False}]})
    md, _ = table(tmp_path, runs)
    assert "commit" not in md, md


def test_a_bb_avg_that_is_not_a_number_has_a_note(tmp_path):
    """A BigBench task without examples (accuracy NaN) left its seed out of the BB-avg mean, counted by the cell's
    "(1 of 2 seeds)" but with no note naming the seed, as a seed without a CORE has."""
    from scripts.results import BIGBENCH

    runs = tmp_path / "runs"
    tasks = {t: {"accuracy": 0.5} for t in BIGBENCH}
    write_seed(runs, "families", "m125_base", "seed42", {**DONE, "val_bpb": 0.9, "core_tasks": tasks})
    write_seed(runs, "families", "m125_base", "seed43", {**DONE, "val_bpb": 0.9, "core_tasks": {
        **tasks, BIGBENCH[0]: {"accuracy": float("nan")}}})
    md, cells = table(tmp_path, runs, "families")
    label = next(line.split("|")[1].strip() for line in md.splitlines() if "(1 of 2 seeds)" in line)
    assert cells(label)["BB-avg"] == "50.00 (1 of 2 seeds)", md
    assert (f"- {label}: seed43 has no BB-avg (a BigBench task not evaluated, or without examples), not in its "
            "mean") in md, md


def test_a_delta_that_rounds_to_zero_prints_no_minus_sign(tmp_path):
    """Δ is ours - paper from the unrounded mean: 0.86719 - 0.8672 printed "-0.0000"."""
    from nanochat.row_config import load_row_config

    paper = load_row_config(REPO / "configs" / "d12" / "base.toml")["paper"]["val_bpb"]
    runs = tmp_path / "runs"
    write_seed(runs, "d12", "base", "seed42", {**DONE, "val_bpb": paper - 1e-6, "train_bpb": paper + 0.00123})
    md, cells = table(tmp_path, runs)
    header = md.splitlines()[0].strip("|").split("|")
    line = next(l for l in md.splitlines() if l.startswith("| Base |")).strip("|").split("|")
    deltas = [c.strip() for h, c in zip(header, line) if h.strip() == "Δ"]
    assert "-0.0000" not in md and deltas[1] == "+0.0000", md


MINI = (REPO / "configs" / "mini" / "base.toml").read_text()


def plan(capsys, config, runs):
    from scripts import run

    run.main([str(config), "--plan", "--runs-root", str(runs)])
    return capsys.readouterr().out


@pytest.mark.parametrize("file_name", ["my_base.toml", "base.toml"])
def test_a_copied_row_config_with_other_flags_is_refused(tmp_path, capsys, file_name):
    """configs/mini/base.toml copied to change one flag, its [row] name left: scripts.run trained the copy into
    runs/mini/base/, among the row's own seeds (a finished one then stood for the row's seed42, and the row's own
    run said "finished run, not overwriting"). A copy kept under the same file name elsewhere is caught too."""
    from scripts import run

    copy = tmp_path / "mine" / file_name
    copy.parent.mkdir()
    copy.write_text(MINI.replace("\n[train]\n", "\n[train]\nmatrix-lr = 0.05\n", 1))
    runs = tmp_path / "runs"
    for argv, root in (([str(copy), "--plan"], REPO / "runs"), ([str(copy), "--runs-root", str(runs)], runs)):
        with pytest.raises(SystemExit) as stopped:
            run.main(argv)
        out, err = capsys.readouterr()
        assert stopped.value.code == 2 and "Traceback" not in err and "scripts.base_train" not in out, err
        shipped = REPO / "configs" / "mini" / "base.toml"
        assert (f"config {copy} is row mini/base, the row of {shipped}, with another [train] (matrix-lr 0.05 "
                f"(row: not set)): its seeds would train into {root / 'mini' / 'base'}/ among that row's. Give the "
                f"copy a [row] name of its own (its seeds then go to {root / 'mini'}/<name>/), or run the row's own "
                "config with the changed flags after --") in err, err
    assert not runs.exists()


def test_a_copied_row_config_with_a_name_of_its_own_trains_into_its_own_folder(tmp_path, capsys):
    copy = tmp_path / "my_base.toml"
    copy.write_text(MINI.replace("\n[train]\n", "\n[train]\nmatrix-lr = 0.05\n", 1)
                    .replace('name = "base"', 'name = "my_base"', 1))
    runs = tmp_path / "runs"
    out = plan(capsys, copy, runs)
    assert f"--run-dir {runs / 'mini' / 'my_base' / 'seed42'} " in out, out


def test_a_copy_that_trains_what_the_row_trains_is_that_row(tmp_path, capsys):
    """Only [row] changed (other default seeds, a note): its seeds are the row's seeds, in the row's folder."""
    copy = tmp_path / "seeds.toml"
    copy.write_text(MINI.replace("\nseeds = [42]\n", "\nseeds = [7]\n", 1))
    runs = tmp_path / "runs"
    out = plan(capsys, copy, runs)
    assert f"--run-dir {runs / 'mini' / 'base' / 'seed7'} " in out, out


def test_every_shipped_row_is_named_after_its_file_and_folder():
    """scripts.run finds a row's own config as configs/<table>/<name>.toml."""
    from nanochat.row_config import find_configs, load_row_config

    paths = find_configs()
    assert len(paths) == 85
    for path in paths:
        row = load_row_config(path)["row"]
        assert (row["table"], row["name"]) == (path.parent.name, path.stem), path


def test_d12_scaling_has_the_papers_wall_minutes_beside_the_runs(tmp_path):
    """The sweep's paper "Wall (min)" (configs' [paper] wall_min) had no column; a run records its wall time
    (summary.json wall_time_s). A seed on another GPU count than the paper's says so; a row whose seeds record no
    wall time prints n/a, with a footnote."""
    runs = tmp_path / "runs"
    for seed, wall in ((42, 6000.0), (43, 6060.0)):
        write_seed(runs, "d12_scaling", "bigram_b03", f"seed{seed}", {**DONE, "val_bpb": 0.87, "wall_time_s": wall,
                                                                       "world_size": 4})
    write_seed(runs, "d12_scaling", "bigram_b06", "seed42", {**DONE, "val_bpb": 0.86, "wall_time_s": 3000.0,
                                                             "world_size": 8})
    write_seed(runs, "d12_scaling", "bigram_b09", "seed42", {**DONE, "val_bpb": 0.86})
    md, cells = table(tmp_path, runs, "d12_scaling")
    b3 = cells("Bigram 3V")
    assert (b3["Wall (min)"], b3["paper Wall (min)"]) == ("100.50 ± 0.71", "106.72 ± 0.70"), md
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    line = [c.strip() for c in next(l for l in md.splitlines() if l.startswith("| Bigram 3V |")).strip("|").split("|")]
    assert header[header.index("paper Wall (min)") + 1] == "Δ" and line[header.index("paper Wall (min)") + 1] == \
        "-6.2200", md
    assert cells("Bigram 6V")["Wall (min)"] == "50.00 (8 GPUs; paper 4)", md
    assert cells("Bigram 9V")["Wall (min)"] == "n/a", md
    assert ("n/a in Wall (min): the seeds' summary.json has no wall_time_s (runs from before it was recorded)"
            in md), md
    assert ("Wall (min): ours is summary.json wall_time_s / 60 (start-up to the end of the final evaluation, "
            "compile and evaluations included) on the seed's GPUs (8+4: a seed resumed on 4 after 8); the paper does "
            "not say what its wall time spans") in md, md


def test_d24_shows_the_out_of_domain_bpb_base_eval_recorded(tmp_path):
    """The d24 paper rows report FineWeb-Edu/enwik9/Shakespeare bpb; base_eval --bpb-corpus records them in the
    seed's eval/step_<final>/bpb.json. A seed without them prints n/a, with a footnote naming the command."""
    runs = tmp_path / "runs"
    d = write_seed(runs, "d24", "dense", "seed42", {**DONE, "val_bpb": 0.67, "step": 100000})
    out = d / "eval" / "step_100000"
    out.mkdir(parents=True)
    out.joinpath("bpb.json").write_text(json.dumps({"step": 100000, "splits": {"val": 0.67}, "corpora": {
        "fineweb_edu": {"bpb": 0.77, "protocol": "document-reset"},
        "shakespeare": {"bpb": 1.5, "protocol": "document-reset"}}}))
    write_seed(runs, "d24", "ve", "seed42", {**DONE, "val_bpb": 0.65, "step": 100000})
    md, cells = table(tmp_path, runs, "d24")
    dense = cells("Dense (100B)")
    assert (dense["FineWeb-Edu bpb"], dense["paper FineWeb-Edu bpb"]) == ("0.7700", "0.7677"), md
    assert (dense["enwik9 bpb"], dense["paper enwik9 bpb"]) == ("n/a", "0.9037"), md
    assert (dense["Shakespeare bpb"], dense["paper Shakespeare bpb"]) == ("1.5000", "1.4993"), md
    assert cells("VEmbedding (100B)")["FineWeb-Edu bpb"] == "n/a", md
    assert ("n/a in enwik9 bpb: no enwik9 corpus in the seed's eval/step_<final step>/bpb.json; python -m "
            "scripts.base_eval --run <seed dir> --eval bpb --bpb-corpus enwik9=PATH writes it (the document-reset "
            "protocol; the paper does not say its own)") in md, md


def test_the_routing_controls_show_their_delta_vs_mome(tmp_path):
    """The paper's routing-controls table reports each control minus hidden-state MoME (val bpb, CORE)."""
    runs = tmp_path / "runs"
    write_seed(runs, "d24", "ctrl_mome_context", "seed42", {**DONE, "val_bpb": 0.7000, "core": 0.2900})
    write_seed(runs, "d24", "ctrl_mome_token_only", "seed42", {**DONE, "val_bpb": 0.7050, "core": 0.2800})
    md, cells = table(tmp_path, runs, "d24")
    token = cells("MoME, learned token-only routing (6e19) [reconstructed]")  # a reconstructed control (test_faith34)
    assert (token["Δ val bpb vs ref"], token["paper Δ val bpb vs ref"]) == ("+0.0050", "+0.0054"), md
    assert (token["Δ CORE vs ref"], token["paper Δ CORE vs ref"]) == ("-0.0100", "-0.0088"), md
    assert cells("MoME, hidden-state routing (6e19)")["Δ val bpb vs ref"] == "–", md
    assert ("Δ val bpb vs ref, Δ CORE vs ref: a row's mean minus that of the row its [row] compare_to names "
            "(MoME, learned token-only routing (6e19) [reconstructed] vs MoME, hidden-state routing (6e19)), as the "
            "paper's columns") in md, md
