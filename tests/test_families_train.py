"""The trainer with --model-type: named-size presets, dry-run accounting, flag errors, train + bit-exact resume
of a tiny MobileLLM/Qwen3 model with STEM and MoME, and evaluation/sampling from its checkpoint."""

import json
import shutil

import pytest

from nanochat import checkpoint as ckpt
from nanochat.train_args import parse_args
from scripts import base_train

TINY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--model-dim", "64", "--num-heads", "4",
        "--num-kv-heads", "2", "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core",
        "--device-batch-size", "4", "--total-batch-size", "256"]


def dry(tmp_path, capsys, *argv) -> dict:
    assert base_train.main([*argv, "--dry-run", "--run-dir", str(tmp_path / "dry")]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_named_sizes_are_presets_that_flags_override(tmp_path, capsys):
    plan = dry(tmp_path, capsys, "--model-type", "qwen3-0.6b", "--memory", "stem", "--num-iterations", "38146")
    assert (plan["params_total"], plan["params_memory"]) == (1_839_267_840, 1_409_286_144)
    assert plan["muon_weight_decay"] == pytest.approx(0.2 * (12 / 28) ** 2) and plan["total_tokens"] == 19_999_490_048
    args = parse_args(["--model-type", "mobilellm-350m", "--depth", "4"])
    assert (args.depth, args.model_dim, args.num_heads, args.num_kv_heads, args.tie_embeddings) == (4, 960, 15, 5, False)
    cfg = base_train.model_config(args, 32768)
    assert (cfg.family, cfg.n_layer, cfg.head_dim, cfg.ffn_hidden, cfg.tie_embeddings) == ("mobilellm", 4, 64, 2560, False)
    # a config file's model-type selects the preset too, and the command line still wins over both
    conf = tmp_path / "c.toml"
    conf.write_text('model-type = "mobilellm-125m"\nnum-kv-heads = 9\n')
    args = parse_args(["--config", str(conf), "--depth", "3"])
    assert (args.model_type, args.depth, args.model_dim, args.num_kv_heads) == ("mobilellm-125m", 3, 576, 9)
    assert base_train.resolve_run_dir(args).name == "mobilellm-125m-base"


def test_family_recipe_defaults_are_presets():
    a = parse_args(["--model-type", "mobilellm-125m", "--memory", "ve"])
    assert (a.memory_lr, a.memory_beta1, a.memory_beta2, a.memory_wd, a.warmup_ratio) == (0.1, 0.8, 0.95, None, 0.0)
    a = parse_args(["--model-type", "qwen3", "--memory", "stem"])
    assert (a.memory_lr, a.memory_beta2, a.memory_wd, a.warmup_ratio) == (0.3, 0.95, 0.0, 0.01)
    a = parse_args(["--model-type", "qwen3-0.6b", "--memory", "mome", "--memory-lr", "0.05", "--warmup-ratio", "0"])
    assert (a.memory_lr, a.memory_beta2, a.warmup_ratio) == (0.05, 0.995, 0.0)  # flags win over the recipe
    a = parse_args(["--memory", "ve"])  # nanochat: unchanged defaults
    assert (a.memory_lr, a.memory_beta2, a.warmup_ratio) == (0.2, 0.995, 0.0)


def test_qwen3_explicit_head_dim_and_family_defaults(tmp_path, capsys):
    args = parse_args(["--model-type", "qwen3", "--depth", "2", "--model-dim", "96", "--num-heads", "4",
                       "--head-dim", "32", "--num-kv-heads", "2"])
    cfg = base_train.model_config(args, 256)
    assert (cfg.n_head * cfg.head_dim, cfg.n_embd, cfg.ffn_hidden, cfg.tie_embeddings) == (128, 96, 288, True)
    plan = dry(tmp_path, capsys, "--model-type", "mobilellm", "--depth", "2", "--aspect-ratio", "128",
               "--head-dim", "64", "--num-iterations", "5")
    # C = 256, H = 4 heads of 64 (MHA), F = int(8*256/3) -> 768, tied: 2*(4*256^2 + 3*256*768 + 2*256) + 256 + V*C
    assert plan["params_total"] == 2 * (4 * 256 * 256 + 3 * 256 * 768 + 2 * 256) + 256 + 32768 * 256


@pytest.mark.parametrize("argv, needle", [
    (["--ffn-dim", "100"], "--ffn-dim does not apply to --model-type nanochat"),
    (["--tie-embeddings"], "--tie-embeddings does not apply to --model-type nanochat"),
    (["--memory", "stem"], "--memory stem replaces the up-projection of a SwiGLU FFN"),
    (["--model-type", "mobilellm", "--num-heads", "2", "--num-kv-heads", "3"], "not divisible by --num-kv-heads 3"),
    (["--model-type", "llama-7b"], "--model-type: invalid choice: 'llama-7b'"),
])
def test_bad_family_flags_fail_before_any_work(tmp_path, capsys, argv, needle):
    argv = ["--synthetic-data", "--depth", "2", "--model-dim", "64", "--head-dim", "32", "--num-iterations", "2", *argv]
    try:
        rc = base_train.main([*argv, "--run-dir", str(tmp_path / "r")])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def _losses(run_dir):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}


@pytest.mark.parametrize("family,memory", [("mobilellm", ["--memory", "stem"]),
                                           ("qwen3", ["--memory", "mome", "--mome-slots", "4", "--head-dim", "32"])])
def test_train_resume_bit_exact_and_checkpoint_tools(tmp_path, family, memory):
    run = tmp_path / family
    argv = [*TINY, "--model-type", family, *memory, "--run-dir", str(run), "--num-iterations", "6", "--save-every", "3",
            "--warmup-ratio", "0.34"]
    assert base_train.main(argv) == 0
    full = _losses(run)
    assert full[6] < full[1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["params_memory"] > 0
    shutil.rmtree(ckpt.step_dir(run, 6))
    assert base_train.main([*argv, "--resume"]) == 0
    assert _losses(run) == full  # identical floats after the resume
    model, meta = ckpt.load_model(run)
    assert meta["model_config"]["family"] == family and type(model).__name__ == {"mobilellm": "Llama", "qwen3": "Qwen3"}[family]
    # another family: refused (the head size given as nanochat takes it with --num-heads: 64 / 4)
    assert base_train.main([*argv, "--resume", "--model-type", "nanochat", "--head-dim", "16"]) == 2


def test_real_data_core_bpb_and_sampling(tmp_path, capsys, embedded_data_dir, tiny_tokenizer_dir):
    """A tiny Qwen3 + STEM on the embedded corpus: final val/train bpb and CORE (shipped subset) in summary.json,
    then scripts.base_eval and scripts.sample read the checkpoint (its meta names the family)."""
    from scripts import base_eval, sample

    run = tmp_path / "q"
    argv = ["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir), "--model-type", "qwen3",
            "--depth", "2", "--model-dim", "64", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "32",
            "--max-seq-len", "64", "--device-batch-size", "2", "--total-batch-size", "256", "--eval-tokens", "512",
            "--eval-every", "-1", "--num-iterations", "3", "--memory", "stem", "--bundle", "subset",
            "--core-max-per-task", "2", "--run-dir", str(run)]
    assert base_train.main(argv) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_bpb"] > 0 and summary["train_bpb"] > 0 and -1 <= summary["core"] <= 1
    assert base_eval.main(["--run", str(run), "--eval", "bpb", "--eval-tokens", "512", "--device-batch-size", "2",
                           "--no-progress", "--device-type", "cpu"]) == 0
    capsys.readouterr()
    sample.main(["--run", str(run), "--prompt", "The", "--max-tokens", "5", "--temperature", "0", "--device-type", "cpu"])
    assert "--- sample 0 (step 3) ---" in capsys.readouterr().out


def test_results_table_and_plot_for_the_families_table(tmp_path, capsys):
    """Fake finished runs for two rows of the m125 block: BB-avg from core_tasks, Wall from tok/s vs the block's
    Base, the paper's numbers beside ours; the families plot draws every block (paper-only bars for missing runs)."""
    from scripts import plot, results

    runs = tmp_path / "runs"
    bigbench = {t: {"accuracy": 0.1 * (i + 1)} for i, t in enumerate(results.BIGBENCH)}  # mean 35%
    for row, tps in (("m125_base", 100.0), ("m125_mome_a2_6", 80.0)):
        d = runs / "families" / row / "seed42"
        d.mkdir(parents=True)
        d.joinpath("summary.json").write_text(json.dumps({"stop_reason": "completed", "val_bpb": 0.9, "train_bpb": 0.91,
                                                          "core": 0.15,
                                                          "core_tasks": bigbench, "tok_per_sec": tps, "world_size": 1,
                                                          "params_memory": 188_743_680, "params_total": 313_828_794}))
    results.main(["--table", "families", "--runs-root", str(runs), "--out", str(tmp_path / "res")])
    md = (tmp_path / "res" / "families.md").read_text()
    header = md.splitlines()[0]
    assert "paper BB-avg" in header and "paper Wall" in header
    line = next(l for l in md.splitlines() if "MoME-A2/6" in l)
    cells = [c.strip() for c in line.strip("|").split("|")]
    i = header.strip("|").split("|").index(" BB-avg ")
    assert cells[i:i + 6] == ["35.00", "21.98", "+13.0200", "1.25", "1.07", "+0.1800"]
    assert "188.7 / 313.8" in line and "188.7 / –" in line
    assert plot.main(["families", "--runs-root", str(runs), "--out", str(tmp_path / "fam")]) == 0
    assert (tmp_path / "fam.png").stat().st_size > 1000


TWO_PROCESS_FAMILIES = {
    "qwen3_stem": ["--model-type", "qwen3", "--head-dim", "32", "--memory", "stem"],
    "mobilellm_mome_value_untied": ["--model-type", "mobilellm", "--memory", "mome", "--mome-slots", "3",
                                    "--mome-topk", "1", "--mome-router-input", "value", "--no-tie-embeddings"]}


def _two_process_args(family: str) -> list[str]:
    return [*TINY, "--device-batch-size", "2", "--num-iterations", "3", *TWO_PROCESS_FAMILIES[family]]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """{family: run dir} of each TWO_PROCESS_FAMILIES run on 2 gloo ranks, all in one torchrun launch (one start-up,
    ~5 s of the 2 CI cores, for every family; each run has its own process group, as in a launch of its own)."""
    from conftest import REPO, run_torchrun

    tmp = tmp_path_factory.mktemp("families_w2")
    argv = []
    for family in TWO_PROCESS_FAMILIES:
        argv += [*(["--next-run"] if argv else []), *_two_process_args(family), "--run-dir", str(tmp / family)]
    r = run_torchrun(REPO / "tests" / "_train_runs_worker.py", 2, argv)
    assert r.returncode == 0, r.stderr[-3000:]
    return {family: tmp / family for family in TWO_PROCESS_FAMILIES}


@pytest.mark.parametrize("family", list(TWO_PROCESS_FAMILIES))
def test_two_process_torchrun_matches_one_process(tmp_path, two_process_runs, family):
    """The sharded MuonAdamW (row-sharded STEM/MoME tables, GQA matrices, untied head) under 2 gloo ranks."""
    args = _two_process_args(family)
    # the 1-process reference in this process (a 1-process torchrun start-up costs ~8 s of the 2 CI cores); its
    # 2 threads vs the workers' 1 change summation order only, as the reduce-scatter does
    assert base_train.main([*args, "--run-dir", str(tmp_path / "w1")]) == 0
    runs = {1: _losses(tmp_path / "w1"), 2: _losses(two_process_runs[family])}
    assert json.loads((two_process_runs[family] / "plan.json").read_text())["world_size"] == 2
    assert runs[1].keys() == runs[2].keys() == {1, 2, 3}
    for s in runs[1]:
        assert abs(runs[1][s] - runs[2][s]) < 1e-5, (s, runs[1][s], runs[2][s])
