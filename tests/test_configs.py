"""Every reproduction config parses, plans, and its dry-run parameter counts match the paper's numbers."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO
from nanochat.row_config import check_row_config, find_configs, load_row_config, tomllib
from nanochat.memory.slot_map import write_slot_map
from runner_inprocess import run_main

CONFIGS = find_configs()
TABLES = {"d12": 9, "d12_scaling": 16, "d12_compound": 8, "d24": 9, "mini": 5, "families": 14, "families_mini": 8,
          "d24_token_memory": 7, "d24_sparse_moe": 3, "appendix_mini": 6}


def test_inventory():
    counts = {}
    for path in CONFIGS:
        counts[load_row_config(path)["row"]["table"]] = counts.get(load_row_config(path)["row"]["table"], 0) + 1
    assert counts == TABLES
    for path in CONFIGS:  # the directory is the table and the file name is the row
        cfg = load_row_config(path)
        assert path.parent.name == cfg["row"]["table"] and path.stem == cfg["row"]["name"]


@pytest.fixture(scope="module")
def slot_maps(tmp_path_factory):
    """Valid c=2 / c=4 maps for V=32768 (consecutive ids grouped): the dry run only needs the file to be valid."""
    d = tmp_path_factory.mktemp("slotmaps")
    out = {}
    for c in (2, 4):
        rows = [list(range(i, i + c)) for i in range(0, 32768, c)]
        out[c] = d / f"k{c}.json"
        write_slot_map(out[c], rows, 32768, c)
    return out


def _summary(path, slot_maps):
    from scripts.base_train import model_config
    from nanochat.train_args import parse_args
    from nanochat.families import model_summary

    cfg = load_row_config(path)
    argv = ["--config", str(path), "--dry-run"]
    group = cfg["train"].get("mome-group-size")
    if group:
        argv += ["--mome-slot-map", str(slot_maps[group])]
    args = parse_args(argv)
    return cfg, model_summary(model_config(args, 32768))


def _printed(path, key):
    """The paper's number for ``key`` as the row file writes it, and half a unit of its last printed digit (286 is
    286 +- 0.5, 1384.1 is +- 0.05): a count off by more than that disagrees with the paper's table."""
    raw = re.search(rf"^{key} = ([0-9.]+)$", path.read_text(), re.M).group(1)
    return float(raw), 0.5 * 10.0 ** -len(raw.partition(".")[2])


# The one row whose printed number our count misses at its precision, with why (its config's notes say so too): the
# paper's 0.61B memory column for d24 MoME-A2/12 appears to count the routers (2.7M) with the 604M tables (0.604B).
PRINTED_MISMATCH = {("mome_a2_m12", "params_memory_b"): 0.0065}


@pytest.mark.parametrize("path", [p for p in CONFIGS if not p.parent.name.endswith("mini")],
                         ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_dry_run_params_match_paper(path, slot_maps):
    cfg, s = _summary(path, slot_maps)
    paper = cfg["paper"]
    assert paper, f"{path} records no paper numbers"
    counts = {"params_memory_m": s["params_memory"] / 1e6, "params_total_m": s["params_total"] / 1e6,
              "params_memory_b": s["params_memory"] / 1e9,
              "params_network_b": s["params_backbone"] / 1e9}  # network = all but memory tables (d24 100B table)
    checked = [key for key in counts if key in paper]
    assert checked, f"{path} records none of {sorted(counts)}"
    for key in checked:
        printed, half_unit = _printed(path, key)
        tolerance = PRINTED_MISMATCH.get((path.stem, key), half_unit)
        assert abs(counts[key] - printed) <= tolerance + 1e-9, (key, printed, counts[key], s)


def test_mini_rows_have_matched_memory(slot_maps):
    mem = {p.stem: _summary(p, slot_maps)[1]["params_memory"] for p in CONFIGS if p.parent.name == "mini"}
    assert mem["base"] == 0
    assert mem["ve"] == mem["bigram"] == mem["mome_c1_m4"] == mem["mome_c1_m8"] // 2 > 0


def test_family_mini_rows_have_matched_memory(slot_maps):
    for fam in ("mobilellm", "qwen3"):
        s = {p.stem: _summary(p, slot_maps)[1] for p in CONFIGS if p.parent.name == "families_mini"
             and p.stem.startswith(fam)}
        assert s[f"{fam}_base"]["params_memory"] == 0
        assert s[f"{fam}_ve"]["params_memory"] == s[f"{fam}_mome_a2_2"]["params_memory"] > 0  # M = H_kv
        assert s[f"{fam}_stem"]["params_memory"] == 2 * 32768 * 768  # 2 layers x V x F (F = 768 for C = 256)


# spec appendix_adaptations.md §2: exact totals (stored, and active per token for the sparse-MoE table)
APPENDIX_TOTALS = {
    "d24_token_memory/bigram_12v": 1_384_125_000, "d24_token_memory/engram": 1_389_579_120,
    "d24_token_memory/jtok": 1_384_138_800, "d24_token_memory/jtokm": 1_384_143_408,
    "d24_token_memory/move_input": 1_386_700_848, "d24_token_memory/mome_a2_m12": 1_386_780_912,
    "d24_token_memory/dense": 780_140_592,
    "d24_sparse_moe/mome_a2_m12": (1_386_780_912, 782_819_568), "d24_sparse_moe/moe": (1_384_341_552, 780_361_776),
    "d24_sparse_moe/moe_mome": (1_990_981_872, 783_040_752),
}
# spec §1: FLOP-target steps at 6e19 (active parameters for MoE); unlisted rows stay within 35 steps of dense
APPENDIX_STEPS = {"dense": 10_827, "mome_a2_m12": 10_795, "engram": 10_712, "moe": 10_825, "moe_mome": 10_792}
RECONSTRUCTED = {"engram", "jtokm", "move_input"}


# reference training spec §1.6: steps at 3e18 FLOPs x 524,288 tokens; a larger hidden router (6 x M x 768 per memory
# layer) counts as compute, so MoME rows with more slots train on slightly fewer tokens
D12_STEPS = {"base": 6450, "bigram": 6450, "ve": 6450, "mome_c1_m6": 6443, "mome_c2_m12": 6436, "mome_c1_m12": 6436,
             "mome_c4_m24": 6421, "mome_c2_m24": 6421, "mome_c4_m48": 6393}


def test_d12_rows_follow_the_paper_recipe_and_flop_target_steps(slot_maps):
    from nanochat.plan import resolve_num_iterations

    rows = [p for p in CONFIGS if p.parent.name == "d12"]
    assert sorted(p.stem for p in rows) == sorted(D12_STEPS)
    for path in rows:
        cfg, s = _summary(path, slot_maps)
        train = cfg["train"]
        assert (train["target-flops"], train["total-batch-size"], train["max-seq-len"], train["dataset"]) == \
            (3e18, 524_288, 2048, "fineweb-edu"), path.stem
        assert (train["eval-tokens"], cfg["row"]["seeds"], cfg["row"]["nproc_per_node"]) == \
            (20_971_520, [42, 43, 44], 4), path.stem
        steps, _ = resolve_num_iterations(None, train["target-flops"], 8, s["flops_per_token"],
                                          train["total-batch-size"], s["params_backbone"])
        assert steps == D12_STEPS[path.stem], path.stem


def test_d12_base_keeps_the_1e18_flop_checkpoint_the_grouped_rows_build_their_slot_maps_from(slot_maps):
    """The paper's slot maps came from a d12 base run at ~1e18 FLOPs: the base row keeps the checkpoint of the first
    step reaching 1e18 (never pruned by its keep-last 1), and the grouped rows' notes build from that step."""
    from nanochat import run_control
    from nanochat.plan import build_plan
    from nanochat.train_args import parse_args

    path = REPO / "configs/d12/base.toml"
    cfg, summary = _summary(path, slot_maps)
    args = parse_args(["--config", str(path), "--dry-run"])
    plan = build_plan(args, summary, world_size=4)
    per_step = summary["flops_per_token"] * cfg["train"]["total-batch-size"]
    step = -(-10**18 // per_step)  # the first step whose FLOPs reach 1e18, in integers
    assert (step - 1) * per_step < 10**18 <= step * per_step and step == 2151
    assert run_control.save_cadence(args, plan).due_steps(plan["num_iterations"]) == [step]
    assert cfg["train"]["keep-last"] == 1 and f"step {step}" in cfg["row"]["notes"]
    for name in ("mome_c2_m12", "mome_c2_m24", "mome_c4_m24", "mome_c4_m48"):
        notes = load_row_config(REPO / f"configs/d12/{name}.toml")["row"]["notes"]
        assert f"--checkpoint runs/d12/base/seed42 --step {step} " in notes, name


@pytest.mark.parametrize("key", sorted(APPENDIX_TOTALS))
def test_appendix_rows_exact_totals_steps_and_paper_rounding(key, slot_maps):
    cfg, s = _summary(REPO / "configs" / f"{key}.toml", slot_maps)
    stored, active = APPENDIX_TOTALS[key] if isinstance(APPENDIX_TOTALS[key], tuple) else (APPENDIX_TOTALS[key], None)
    assert s["params_total"] == stored
    paper = cfg["paper"]["params_total_m"]
    assert (round(stored / 1e6) if paper == 780 else round(stored / 1e5) / 10) == paper
    if active is not None:
        assert s["params_active"] == active and round(active / 1e5) / 10 == cfg["paper"]["params_active_m"]
    train = cfg["train"]  # the paper's appendix recipe (spec §1), read from the row as the runner reads it
    assert (train["target-flops"], train["total-batch-size"], train["dataset"]) == (6e19, 1_048_576, "climbmix")
    assert cfg["row"]["seeds"] == [42]
    steps = round(train["target-flops"] / (s["flops_per_token"] * train["total-batch-size"]))
    name = key.split("/")[1]
    assert steps == APPENDIX_STEPS[name] if name in APPENDIX_STEPS else abs(steps - 10_827) <= 35, steps


def test_reconstructed_rows_are_flagged():
    rows = [load_row_config(p) for p in CONFIGS if p.parent.name in ("d24_token_memory", "d24_sparse_moe", "appendix_mini")]
    assert len(rows) == 16
    for cfg in rows:
        row = cfg["row"]
        assert row.get("reconstructed", False) == (row["name"] in RECONSTRUCTED), row["name"]
        assert ("RECONSTRUCTED" in row["notes"]) == (row["name"] in RECONSTRUCTED), row["name"]
    assert sum(cfg["row"].get("reconstructed", False) for cfg in rows) == 6


def test_appendix_mini_memory_budgets(slot_maps):
    s = {p.stem: _summary(p, slot_maps)[1]["params_memory"] for p in CONFIGS if p.parent.name == "appendix_mini"}
    ve = 2 * 32768 * 256  # the mini VE row: 2 odd layers x V x C
    assert s["jtok"] == s["move_input"] == s["moe_mome"] == ve and s["moe"] == 0
    assert s["jtokm"] == 4 * 32768 * 256  # one layer of 4 tables

    def primes_from(start, n):
        out, p = [], start
        while len(out) < n:
            out += [p] if p > 1 and all(p % d for d in range(2, int(p ** 0.5) + 1)) else []
            p += 1
        return out

    assert s["engram"] == sum(primes_from(4096, 32)) * 16  # 2 modules x 2 orders x 8 heads, 256 / 16 wide


def test_reconstructed_rows_are_marked_in_results_tables(tmp_path):
    from scripts import results

    runs = tmp_path / "runs"
    for row in ("move_input", "mome_a2_m12"):
        d = runs / "d24_token_memory" / row / "seed42"
        d.mkdir(parents=True)
        d.joinpath("summary.json").write_text(json.dumps({"stop_reason": "completed", "val_bpb": 0.7, "core": 0.28,
                                                          "tok_per_sec": 1000.0,
                                                          "params_memory": 1, "params_total": 2}))
    out = tmp_path / "res"
    results.main(["--table", "d24_token_memory", "--runs-root", str(runs), "--out", str(out)])
    md = (out / "d24_token_memory.md").read_text()
    line = next(l for l in md.splitlines() if "MoVE-Input" in l)
    assert line.startswith("| MoVE-Input adaptation [reconstructed] |")
    assert "[reconstructed]" not in next(l for l in md.splitlines() if "MoME A2/12" in l)
    assert results.RECONSTRUCTED_NOTE in md
    assert "MoVE-Input adaptation [reconstructed]" in (out / "d24_token_memory.csv").read_text()
    assert "MoVE-Input adaptation [reconstructed]" in (out / "d24_token_memory.tex").read_text()


def test_sparse_moe_results_show_active_params_and_paper_throughput(tmp_path):
    from scripts import results

    d = tmp_path / "runs" / "d24_sparse_moe" / "moe" / "seed42"
    d.mkdir(parents=True)
    d.joinpath("summary.json").write_text(json.dumps({"stop_reason": "completed", "val_bpb": 0.69, "core": 0.29,
                                                      "tok_per_sec": 600000.0, "world_size": 8, "attention": "fa3",
                                                      "params_memory": 0, "params_total": 1_384_341_552,
                                                      "params_active": 780_361_776}))
    results.main(["--table", "d24_sparse_moe", "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path / "res")])
    md = (tmp_path / "res" / "d24_sparse_moe.md").read_text()
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    cells = [c.strip() for c in next(l for l in md.splitlines() if "MoE-FFN" in l).strip("|").split("|")]
    row = dict(zip(header, cells))
    assert (row["active params (M)"], row["paper active (M)"], row["tok/s per GPU"], row["paper tok/s per GPU"]) == \
        ("780.4", "780.4", "75,000", "81,629")  # per GPU: 8 x H100 in the paper's table, 8 ranks in this run


def test_results_average_only_finished_seeds_and_one_core_task_set(tmp_path):
    """An interrupted seed is listed, not averaged (nor counted, nor in tok/s); a CORE over fewer tasks carries
    its label, and CORE values over different task sets are not averaged together."""
    from scripts import results

    def write(row, seed, **summary):
        d = tmp_path / "runs" / "d12" / row / f"seed{seed}"
        d.mkdir(parents=True)
        d.joinpath("summary.json").write_text(json.dumps(summary))

    done = dict(stop_reason="completed", params_memory=0, params_total=135_000_000, world_size=1)
    write("base", 42, **done, val_bpb=0.88, core=0.15, core_label="CORE-21/22", tok_per_sec=1000.0)
    write("base", 43, **done, val_bpb=0.90, core=0.17, core_label="CORE-21/22", tok_per_sec=1200.0)
    write("base", 44, stop_reason="interrupted", step=10, tok_per_sec=10.0)
    write("ve", 42, **done, val_bpb=0.86, core=0.15, core_label="CORE", tok_per_sec=900.0)
    write("ve", 43, **done, val_bpb=0.87, core=0.16, core_label="CORE-21/22", tok_per_sec=900.0)
    results.main(["--table", "d12", "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path / "res")])
    md = (tmp_path / "res" / "d12.md").read_text()
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    rows = {cells[0]: dict(zip(header, cells)) for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()[2:] if line.startswith("|"))}
    assert rows["Base"]["seeds"] == "2" and rows["Base"]["val bpb"] == "0.8900 ± 0.0141"
    assert rows["Base"]["tok/s per GPU"] == "1,100"
    assert rows["Base"]["CORE"] == "0.1600 ± 0.0141 (CORE-21/22)"
    assert rows["VEmbedding"]["CORE"] == "–" and rows["VEmbedding"]["val bpb"] == "0.8650 ± 0.0071"
    assert "- Base: seed44 not finished (stop_reason 'interrupted'), not averaged" in md
    assert "- VEmbedding: CORE over different task sets (CORE, CORE-21/22), not averaged" in md


def test_family_rows_bb_avg_is_the_mean_of_the_six_bigbench_tasks():
    rows = [load_row_config(p) for p in CONFIGS if p.parent.name == "families"]
    for cfg in rows:
        bb = [v for k, v in cfg["paper"].items() if k.startswith("acc_bigbench")]
        assert len(bb) == 6 and abs(sum(bb) / 6 - cfg["paper"]["bb_avg"]) < 0.006, cfg["row"]["name"]


@pytest.fixture
def plan(capsys, monkeypatch):
    """`python -m scripts.run ARGS` from the repo root, in this process (runner_inprocess): a --plan starts no
    base_train, and its own Python start (a torch import) is no part of what these tests check. The test of a
    Python without torch below keeps its process."""
    return lambda args: run_main(args, capsys, monkeypatch, cwd=REPO)


def test_plan_needs_no_torch_and_lists_one_command_per_seed(tmp_path):
    # a sitecustomize that makes `import torch` fail as on a Python without it: --plan still plans (it says that
    # base_train's parser, which needs torch, did not check the flags)
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nclass _Block:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Block())\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    r = subprocess.run([sys.executable, "-m", "scripts.run", "configs/d12/mome_c1_m6.toml", "--plan"], cwd=REPO, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ("[run] note: base_train's flags are not checked: this Python has no torch (base_train's "
                        "parser needs it)\n")
    cmds = [l for l in r.stdout.splitlines() if not l.startswith("#")]
    assert len(cmds) == 3
    for seed, cmd in zip((42, 43, 44), cmds):
        assert "--nproc_per_node=4" in cmd and f"--seed {seed}" in cmd and f"runs/d12/mome_c1_m6/seed{seed}" in cmd
    assert "grad accum 2" in r.stdout  # 524288 / (4 x 32 x 2048)


def test_hardware_overrides_keep_total_batch(plan):
    r = plan(["configs/d12/base.toml", "--plan", "--seeds", "7", "--nproc-per-node", "8", "--device-batch-size", "16"])
    assert r.returncode == 0, r.stderr
    assert "grad accum 2" in r.stdout and "--device-batch-size 16" in r.stdout and "--nproc_per_node=8" in r.stdout
    assert r.stdout.count("scripts.base_train") == 1 and "--total-batch-size" not in r.stdout  # comes from the config


@pytest.mark.parametrize("argv,msg", [
    (["--seeds", "42,-1"], "--seeds"), (["--seeds", "a,b"], "--seeds"), (["--seeds", "42,42"], "duplicates"),
    (["--seeds", ""], "--seeds"), (["--nproc-per-node", "0"], "--nproc-per-node"),
    (["--device-batch-size", "0"], "--device-batch-size"), (["--device-batch-size", "3"], "not divisible"),
])
def test_runner_rejects_bad_inputs(argv, msg, plan):
    r = plan(["configs/d12/base.toml", "--plan", *argv])
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_bad_config_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[row]\ntable = "x"\nname = "y"\n[train]\ndepth = 2\n')
    with pytest.raises(ValueError, match="total-batch-size"):
        load_row_config(bad)
    cfg = tomllib.loads(bad.read_text())
    assert check_row_config(cfg, bad, runner=False)["train"] == {"depth": 2}  # base_train needs no batch keys
    bad.write_text('[row]\ntable = "x"\nname = "y"\nreconstructed = "yes"\n[train]\ndepth = 2\n')
    with pytest.raises(ValueError, match="'reconstructed' must be true or false"):
        check_row_config(tomllib.loads(bad.read_text()), bad, runner=False)
    bad.write_text('[row]\ntable = "x"\nname = "y"\ncolor = 1\n')
    with pytest.raises(ValueError, match="color"):
        load_row_config(bad)
    with pytest.raises(FileNotFoundError):
        load_row_config(tmp_path / "missing.toml")


def test_grouped_dry_run_needs_no_slot_map_but_a_real_run_does(tmp_path, capsys):
    """docs/memory.md's c_grp=2 dry run works on a fresh clone (no trained run, no map); training still needs the file."""
    import torch

    from nanochat.gpt import GPTConfig, build_model
    from scripts import base_train

    missing = tmp_path / "k2.json"
    cfg = REPO / "configs" / "d12" / "mome_c2_m12.toml"
    with pytest.warns(UserWarning, match="k2.json does not exist yet: fine for --dry-run"):
        assert base_train.main(["--config", str(cfg), "--dry-run", "--mome-slot-map", str(missing),
                                "--run-dir", str(tmp_path / "plan")]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (plan["params_total"], plan["params_memory"]) == (286_594_632, 150_994_944)  # the paper's Table 1
    tiny = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
            "--max-seq-len", "32", "--num-iterations", "1", "--memory", "mome", "--mome-index", "grouped",
            "--mome-group-size", "2", "--mome-slots", "4", "--mome-slot-map", str(missing)]
    assert base_train.main([*tiny, "--run-dir", str(tmp_path / "r")]) == 2
    assert f"--mome-slot-map {missing}: file does not exist" in capsys.readouterr().err
    # a model built without the file (a checkpoint may still supply the map) cannot run: the same clear error
    options = {"slots": 4, "index": "grouped", "group_size": 2, "slot_map": str(missing)}
    config = GPTConfig(sequence_len=32, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, memory="mome",
                       memory_options=options)
    model = build_model(config, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="k2.json: file does not exist"):
        model.memory.check_ready()
    with pytest.raises(ValueError, match="k2.json: file does not exist"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_plan_shows_the_resume_flag_and_checks_batch_flags_given_after_the_separator(plan):
    r = plan(["configs/mini/base.toml", "--plan", "--", "--device-batch-size", "8"])
    assert r.returncode == 0, r.stderr
    assert "device batch 8, grad accum 2" in r.stdout  # 4096 / (8 x 256)
    cmd = r.stdout.splitlines()[1]
    assert cmd.count("--device-batch-size") == 1 and "--device-batch-size 8" in cmd and cmd.endswith("--resume auto")
    r = plan(["configs/mini/base.toml", "--nproc-per-node", "2", "--plan", "--", "--total-batch-size", "8192"])
    assert r.returncode == 0 and "grad accum 1" in r.stdout and "--total-batch-size=8192" in r.stdout, r.stderr
    r = plan(["configs/mini/base.toml", "--plan", "--", "--max-seq-len", "100"])
    assert r.returncode == 2 and "not divisible" in r.stderr and "seq 100" in r.stderr
    r = plan(["configs/mini/base.toml", "--plan", "--", "--overwrite"])
    assert r.returncode == 0 and "--resume" not in r.stdout and r.stdout.splitlines()[1].endswith("--overwrite")
    r = plan(["configs/mini/base.toml", "--plan", "--device-batch-size", "4", "--", "--device-batch-size", "8"])
    assert r.returncode == 2 and "given both" in r.stderr


def test_every_row_pins_its_vocabulary():
    """Without it base_train takes whatever tokenizer the directory holds (a CPU row's 4096 for a d12 row)."""
    for path in CONFIGS:
        train = load_row_config(path)["train"]
        if path.parent.name.endswith("mini"):
            assert (train["vocab-size"], train["tokenizer-dir"]) == (4096, "tokenizer/v4096"), path
        else:
            assert train["vocab-size"] == 32768 and "tokenizer-dir" not in train, path


def test_results_rows_follow_the_paper_table_and_show_the_paper_std(tmp_path):
    from scripts import results

    (tmp_path / "runs").mkdir()  # no runs in it: the paper's numbers only
    assert results.main(["--table", "d12", "--table", "d12_scaling", "--runs-root", str(tmp_path / "runs"),
                         "--out", str(tmp_path / "res")]) == 0
    md = (tmp_path / "res" / "d12.md").read_text().splitlines()
    header = [c.strip() for c in md[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in md[2:] if line.startswith("|")]
    assert [r["row"] for r in rows] == ["Base", "Bigram (6V)", "VEmbedding", "MoME (c_grp=1) A2/6", "MoME (c_grp=2) A2/12",
                                        "MoME (c_grp=4) A2/24", "MoME (c_grp=1) A2/12", "MoME (c_grp=2) A2/24",
                                        "MoME (c_grp=4) A2/48"]
    assert rows[0]["paper val bpb"] == "0.8785 ± 0.0010" and rows[0]["paper CORE"] == "0.1447 ± 0.0064"
    scaling = (tmp_path / "res" / "d12_scaling.md").read_text()
    assert scaling.index("| Bigram 3V |") < scaling.index("| Bigram 24V |") < scaling.index("| MoME A2/3 |")
    assert "| 0.8667 ± 0.0005 |" in scaling  # MoME A2/3 paper train bpb with its std


# the reference's attention per row (../shared/spec/mome_reference_training.md §4.1-4.2; appendix_adaptations.md §1)
AUTO_ROWS = {f"d12_compound/{p.stem}" for p in CONFIGS if p.parent.name == "d12_compound" and p.stem != "bigram"} | \
    {f"families/qwen3_{r}" for r in ("base", "stem", "ve", "mome_a2_8")} | \
    {f"d24_sparse_moe/{r}" for r in ("mome_a2_m12", "moe", "moe_mome")}
PAPER_SDPA = {f"d12/{p.stem}" for p in CONFIGS if p.parent.name == "d12"} | \
    {"d12_compound/bigram", "d12_scaling/bigram_b06", "d12_scaling/mome_b06", "d12_scaling/mome_b12"} | \
    {f"families/{p.stem}" for p in CONFIGS if p.parent.name == "families" and p.stem.startswith(("m125", "m350"))}


def test_rows_train_and_record_the_references_attention_kernel():
    for path in CONFIGS:
        cfg, key = load_row_config(path), f"{path.parent.name}/{path.stem}"
        assert cfg["train"].get("attention", "sdpa") == ("auto" if key in AUTO_ROWS else "sdpa"), key
        want = "fa3" if key.startswith("d24_sparse_moe/") else "sdpa" if key in PAPER_SDPA else None
        assert cfg["paper"].get("attention") == want, key
        notes = cfg["row"].get("notes", "")
        assert "NANOCHAT_ATTN" not in notes, key
        if key in AUTO_ROWS and not key.startswith("d24_sparse_moe/"):
            assert "[paper] records no attention kernel" in notes, key
    assert len(PAPER_SDPA) == 9 + 4 + 10 and len(AUTO_ROWS) == 14


def test_row_notes_warmdown_for_every_family_and_the_jtok_scale_group():
    for path in CONFIGS:
        cfg = load_row_config(path)
        if path.parent.name == "families":
            assert "the paper text says cosine decay or warmdown, the configs use the linear warmdown" in \
                cfg["row"]["notes"], path
        if path.parent.name == "d24_token_memory" and path.stem in ("jtok", "jtokm"):
            assert "scalar AdamW group (x0_lambdas: lr 0.5 x batch scale, betas (0.96, 0.95)" in cfg["row"]["notes"]


def test_bad_paper_attention_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\[paper\] 'attention' must be one of sdpa, fa2, fa3 .* got 'auto'"):
        check_row_config({"row": {"table": "t", "name": "n"}, "train": {}, "paper": {"attention": "auto"}},
                         tmp_path / "x.toml", runner=False)


def _results_rows(tmp_path, table, runs: dict) -> dict:
    from scripts import results

    for row, summaries in runs.items():
        for seed, extra in enumerate(summaries, 42):
            d = tmp_path / "runs" / table / row / f"seed{seed}"
            d.mkdir(parents=True)
            d.joinpath("summary.json").write_text(json.dumps({"stop_reason": "completed", "val_bpb": 0.7,
                                                              "params_memory": 0, "params_total": 1, "world_size": 1,
                                                              **extra}))
    results.main(["--table", table, "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path / "res")])
    md = (tmp_path / "res" / f"{table}.md").read_text().splitlines()
    header = [c.strip() for c in md[0].strip("|").split("|")]
    return {cells[0]: dict(zip(header, cells)) for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in md[2:] if line.startswith("|"))}


def test_results_mark_throughput_from_another_attention_kernel(tmp_path):
    """Against the paper's FA3 tok/s: SDPA runs (recorded, or older runs without the record) and a run resumed on
    another kernel are marked with the paper's kernel; an FA3 row only names its kernel, as the table mixes them
    (one FA3 row alone: test_sparse_moe_results_show_active_params_and_paper_throughput, unmarked)."""
    rows = _results_rows(tmp_path / "a", "d24_sparse_moe", {
        "mome_a2_m12": [{"tok_per_sec": 800000.0, "attention": "fa3"}],
        "moe": [{"tok_per_sec": 412000.0, "attention": "sdpa"}],
        "moe_mome": [{"tok_per_sec": 400000.0}]})
    assert rows["MoME (odd layers, A2/12)"]["tok/s per GPU"] == "800,000 (fa3)"
    assert rows["MoE-FFN E6/K2/24 (+1 shared)"]["tok/s per GPU"] == "412,000 (sdpa; paper fa3)"
    assert rows["MoE-FFN E6/K2/24 + MoME"]["tok/s per GPU"] == "400,000 (sdpa; paper fa3)"
    rows = _results_rows(tmp_path / "b", "d24_sparse_moe", {"moe": [{"tok_per_sec": 5.0, "attention": "sdpa+fa3"}]})
    assert rows["MoE-FFN E6/K2/24 (+1 shared)"]["tok/s per GPU"] == "5 (sdpa+fa3; paper fa3)"


def test_results_name_the_kernels_of_a_table_whose_rows_mix_them(tmp_path):
    """d12_compound: the Bigram row on SDPA (as the paper), the bigram-indexed MoME rows on auto = FA3 on Hopper
    (the paper's kernel unknown): every tok/s names its kernel; seeds on different kernels are both named."""
    rows = _results_rows(tmp_path, "d12_compound", {
        "bigram": [{"tok_per_sec": 100.0}],
        "mome_n6_m6": [{"tok_per_sec": 150.0, "attention": "fa3"}],
        "mome_n12_m6": [{"tok_per_sec": 150.0, "attention": "fa3"}, {"tok_per_sec": 130.0, "attention": "sdpa"}]})
    assert rows["Bigram (6V)"]["tok/s per GPU"] == "100 (sdpa)" and rows["MoME 6V x 6"]["tok/s per GPU"] == "150 (fa3)"
    assert rows["MoME 12V x 6"]["tok/s per GPU"] == "140 (fa3, sdpa)"
    alone = _results_rows(tmp_path / "c", "d12_compound", {"bigram": [{"tok_per_sec": 100.0}]})
    assert alone["Bigram (6V)"]["tok/s per GPU"] == "100"  # like the paper's kernel, nothing to mark
