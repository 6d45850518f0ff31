"""scripts/base_eval end to end on a tiny checkpoint: its reports, flags and one-line errors, and the dtype,
attention kernel and MoME kernels it evaluates with. The bundle it reads: test_base_eval_bundle.py; an interrupted
evaluation that continues: test_base_eval_resume.py; torchrun ranks and signals: test_base_eval_ranks.py."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import base_eval_fixtures  # noqa: E402
from _eval_helpers import MC_ROWS, write_bundle  # noqa: E402
from base_eval_fixtures import _count_calls  # noqa: E402
from conftest import sigterm_after, tiny_config  # noqa: E402

tiny_run = base_eval_fixtures.tiny_run  # the fixture (module scope: one tiny trained run for this file)


def test_base_eval_writes_reports(tiny_run):
    from nanochat.dataloader import build_eval_rows, iter_eval_batches
    from nanochat.loss_eval import evaluate_bpb
    from scripts.base_eval import main

    root, tok, model, bundle = tiny_run
    assert main(["--run", str(root / "run"), "--bundle", str(bundle), "--eval-tokens", "256",
                 "--device-batch-size", "3", "--bpb-corpus", f"ood={root / 'ood.txt'}", "--no-progress",
                 "--device-type", "cpu"]) == 0
    out = root / "run" / "eval" / "step_000007"
    core = json.loads((out / "core.json").read_text())
    assert core["label"] == "CORE-2/3" and core["missing"] == ["gone"] and core["step"] == 7
    assert core["tasks"]["mc"]["n"] == 4 and core["tasks"]["lm"]["n"] == 3
    csv = (out / "core.csv").read_text().splitlines()
    assert csv[0] == "task,accuracy,centered,n" and csv[1].startswith("mc,") and csv[-1].startswith("CORE-2/3,,")
    md = (out / "core.md").read_text()
    assert "| **CORE-2/3** |" in md and "Missing task files (not averaged): gone." in md
    bpb = json.loads((out / "bpb.json").read_text())
    assert set(bpb["splits"]) == {"train", "val"} and bpb["corpora"]["ood"]["protocol"] == "document-reset"
    # a checkpoint that records no --data-seed (as an imported one): its train rows are the split's first documents
    assert bpb["train_bpb_rows"] == "manifest order (no --data-seed recorded)"
    # the val number is exactly evaluate_bpb over the fixed rows (4 rows of 64 tokens)
    rows = build_eval_rows(root / "data", "val", tok, 64, 256)
    direct = evaluate_bpb(model.eval(), iter_eval_batches(rows, 16), tok.token_bytes())
    assert bpb["splits"]["val"] == pytest.approx(direct, rel=1e-5)
    assert 0 < bpb["corpora"]["ood"]["bpb"] < 20


def test_base_eval_flag_errors(tiny_run):
    from scripts.base_eval import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--run", "x", "--eval", "core,sample"])
    with pytest.raises(SystemExit):
        parse_args(["--run", "x", "--bpb-corpus", "no_equals_sign"])


def test_base_eval_bad_data_and_corpus_are_one_line_errors(tiny_run, tmp_path, capsys):
    """A missing data dir is exit 2 with one line (not a traceback); a missing --bpb-corpus file is found before
    CORE and the split bpbs run, not after."""
    from scripts.base_eval import main

    root, _, _, _ = tiny_run
    common = ["--run", str(root / "run"), "--eval", "bpb", "--eval-tokens", "256", "--no-progress",
              "--device-type", "cpu", "--out-dir", str(tmp_path / "o")]
    assert main([*common, "--data-dir", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "manifest.json not found" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main([*common, "--bpb-corpus", f"x={tmp_path / 'missing.txt'}"])
    assert e.value.code == 2 and "missing.txt does not exist" in capsys.readouterr().err


def test_a_synthetic_data_run_is_refused_naming_the_flag(tiny_run, tmp_path, capsys):
    """A run trained with --synthetic-data has token ids of no tokenizer: CORE and every bpb need the run's tokenizer
    (and its data or the bundle), so base_eval refuses it in one line naming the flag, not "no tokenizer in ...", and
    not with a real --tokenizer-dir either (its scores would mean nothing)."""
    from scripts.base_eval import main
    from test_train_e2e import train

    assert train(tmp_path / "syn", "--num-iterations", "1") == 0
    capsys.readouterr()
    root, _, _, _ = tiny_run
    for extra in (["--eval", "core"], ["--eval", "bpb"], ["--tokenizer-dir", str(root / "tok")]):
        assert main(["--run", str(tmp_path / "syn"), "--device-type", "cpu", "--no-progress", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / 'syn'} step 1 was trained with --synthetic-data") and \
            err.count("\n") == 1 and "tokenizer" in err and "no tokenizer in" not in err, err


def test_torchrun_double_dash_hands_flags_to_the_script():
    """docs/training.md: `torchrun ... -m scripts.base_eval -- --run=x` works; without `--` torchrun's parser rejects --run."""
    from torch.distributed.run import parse_args as torchrun_args

    from scripts.base_eval import parse_args as eval_args
    from nanochat.train_args import parse_args as train_args

    with pytest.raises(SystemExit):  # "ambiguous option: --run=x could match --run-path, --run_path"
        torchrun_args(["--standalone", "--nproc_per_node=2", "-m", "scripts.base_eval", "--run=x"])
    ns = torchrun_args(["--standalone", "--nproc_per_node=2", "-m", "scripts.base_eval", "--", "--run=x", "--step", "3"])
    assert ns.training_script == "scripts.base_eval" and ns.training_script_args == ["--run=x", "--step", "3"]
    args = eval_args(ns.training_script_args)
    assert (args.run, args.step) == ("x", 3)
    ns = torchrun_args(["--standalone", "--nproc_per_node=8", "-m", "scripts.base_train", "--",
                        "--config", "configs/d12/ve.toml", "--seed", "43"])
    args = train_args(ns.training_script_args)
    assert (args.memory, args.seed, args.depth) == ("ve", 43, 12)


# -- the run's dtype -------------------------------------------------------------------------------------------
def test_eval_dtype_comes_from_the_run():
    from scripts.base_eval import eval_dtype

    assert eval_dtype("run", {"config": {"dtype": "bfloat16"}}, "cpu")[0] == "bfloat16"
    # older checkpoints: the --dtype flag resolved for the device they trained on
    assert eval_dtype("run", {"config": {"args": {"dtype": "auto"}, "device": "cuda:0"}}, "cpu")[0] == "bfloat16"
    assert eval_dtype("run", {"config": {"args": {"dtype": "auto"}, "device": "cpu"}}, "cuda")[0] == "float32"
    assert eval_dtype("run", {}, "cpu") == ("float32", "default for this device (the checkpoint does not record one)")
    assert eval_dtype("float32", {"config": {"dtype": "bfloat16"}}, "cpu") == ("float32", "--dtype")


def test_base_eval_reproduces_the_core_of_training_in_the_runs_dtype(tmp_path, capsys, embedded_data_dir,
                                                                       tiny_tokenizer_dir):
    """The same checkpoint, one CORE: base_eval's defaults are the dtype the run trained and evaluated with (bf16
    autocast here, on CPU), its bundle (--bundle subset) and its examples per task (--core-max-per-task), and every
    result says which dtype it is. Without them base_eval read the search order's bundle (offline: a download
    error) with every example. An explicit flag is used as given."""
    from scripts import base_eval, base_train

    run = tmp_path / "run"
    assert base_train.main(["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir),
                            "--depth", "1", "--aspect-ratio", "64", "--head-dim", "32", "--max-seq-len", "64",
                            "--device-batch-size", "2", "--total-batch-size", "256", "--eval-tokens", "256",
                            "--eval-every", "-1", "--num-iterations", "3", "--dtype", "bfloat16",
                            "--bundle", "subset", "--core-max-per-task", "1", "--run-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dtype"] == summary["core_dtype"] == "bfloat16"
    assert f"final {summary['core_label']} [bfloat16] {summary['core']:.4f}" in capsys.readouterr().out
    common = ["--run", str(run), "--eval", "core", "--device-batch-size", "2", "--no-progress", "--device-type", "cpu"]
    assert base_eval.main(common) == 0
    out = capsys.readouterr().out
    assert "dtype bfloat16 (the run's training dtype)" in out and f"{summary['core_label']} [bfloat16]:" in out
    assert ("CORE bundle subset (the run's bundle, its config.json); examples per task 1 (the run's "
            "--core-max-per-task, its config.json)") in out
    core = json.loads((run / "eval" / "step_000003" / "core.json").read_text())
    assert core["dtype"] == "bfloat16" and core["core"] == pytest.approx(summary["core"], abs=1e-9)
    assert core["max_per_task"] == 1 and core["subset"] and {t["n"] for t in core["tasks"].values()} == {1}
    bundle = write_bundle(tmp_path / "bundle", {"mc": ("multiple_choice", 1, " ", MC_ROWS)}, {"mc": 25})
    assert base_eval.main([*common, "--dtype", "float32", "--bundle", str(bundle), "--max-per-task", "-1",
                           "--out-dir", str(tmp_path / "fp32")]) == 0
    assert (f"CORE bundle {bundle} (--bundle); examples per task all (--max-per-task)"
            in capsys.readouterr().out)
    core = json.loads((tmp_path / "fp32" / "core.json").read_text())
    assert (core["dtype"], core["bundle"], core["max_per_task"]) == ("float32", str(bundle), -1)
    assert core["tasks"]["mc"]["n"] == len(MC_ROWS)


# -- the run's --eval-tokens -----------------------------------------------------------------------------------
def test_eval_tokens_come_from_the_run():
    from scripts.base_eval import PAPER_EVAL_TOKENS, eval_tokens_of

    assert eval_tokens_of("run", {"config": {"args": {"eval_tokens": 65536}}}) == (
        65536, "the run's --eval-tokens (its checkpoint)")
    assert eval_tokens_of("run", {"reason": "imported"}) == (
        PAPER_EVAL_TOKENS, "default (the checkpoint does not record --eval-tokens)")
    assert eval_tokens_of(256, {"config": {"args": {"eval_tokens": 65536}}}) == (256, "--eval-tokens")


@pytest.mark.parametrize("value", ["abc", "1e6"])  # 0 and -5: tests/test_cli_exits.py
def test_a_bad_eval_tokens_names_run_among_its_values(capsys, value):
    from scripts.base_eval import parse_args

    with pytest.raises(SystemExit) as stopped:
        parse_args(["--run", "x", "--eval-tokens", value])
    assert stopped.value.code == 2
    assert f"argument --eval-tokens: must be 'run' or an integer >= 1 (got '{value}')" in capsys.readouterr().err


def test_eval_tokens_follow_the_final_evaluation_after_a_resume_that_changed_them(tmp_path):
    """A final evaluation stopped by a signal and resumed with another --eval-tokens saves no new checkpoint: the
    checkpoint still records the old budget, config.json (rewritten by every session) the one the summary used."""
    from scripts.base_eval import eval_tokens_of

    meta = {"config": {"args": {"eval_tokens": 256}}}
    (tmp_path / "config.json").write_text(json.dumps({"args": {"eval_tokens": 1024}}))
    assert eval_tokens_of("run", meta, tmp_path) == (1024, "the run's --eval-tokens (its config.json)")
    (tmp_path / "config.json").write_text("{torn")  # unreadable: the checkpoint's, and the line says so
    assert eval_tokens_of("run", meta, tmp_path) == (256, "the run's --eval-tokens (its checkpoint)")
    assert eval_tokens_of("run", meta, tmp_path / "none") == (256, "the run's --eval-tokens (its checkpoint)")
    assert eval_tokens_of(64, meta, tmp_path) == (64, "--eval-tokens")


def test_base_eval_scores_the_bpb_rows_of_training_by_default(tmp_path, capsys, embedded_data_dir,
                                                             tiny_tokenizer_dir):
    """Without --eval-tokens base_eval scores the rows the run's final evaluation scored (its --eval-tokens): the
    mini rows and the CPU demo train with 65,536, and the paper's 20,971,520 asked more of the embedded corpus's
    splits than they hold, failing after CORE had run."""
    from scripts import base_eval, base_train

    run = tmp_path / "run"
    assert base_train.main(["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir),
                            "--depth", "1", "--aspect-ratio", "64", "--head-dim", "32", "--max-seq-len", "64",
                            "--device-batch-size", "2", "--total-batch-size", "256", "--eval-tokens", "256",
                            "--eval-every", "-1", "--num-iterations", "2", "--no-final-core",
                            "--run-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    capsys.readouterr()
    assert base_eval.main(["--run", str(run), "--eval", "bpb", "--no-progress", "--device-type", "cpu"]) == 0
    assert "256 tokens per split (the run's --eval-tokens (its config.json))" in capsys.readouterr().out
    bpb = json.loads((run / "eval" / "step_000002" / "bpb.json").read_text())
    assert bpb["eval_tokens"] == 256
    assert bpb["splits"]["train"] == pytest.approx(summary["train_bpb"], rel=1e-5)
    assert bpb["splits"]["val"] == pytest.approx(summary["val_bpb"], rel=1e-5)

# -- the attention kernel ---------------------------------------------------------------------------------------
def test_eval_attention_comes_from_the_run():
    from scripts.base_eval import eval_attention

    assert eval_attention("run", {"config": {"attention": "fa3"}}) == ("fa3", "the run's kernel")
    assert eval_attention("run", {"reason": "imported"}) == (
        "sdpa", "the code's default (the checkpoint does not record a kernel)")
    assert eval_attention("sdpa", {"config": {"attention": "fa3"}}) == ("sdpa", "--attention")


def test_attention_flag_on_cpu(tiny_run, tmp_path, capsys):
    """fa2/fa3 cannot run on the CPU: an explicit one and a run's recorded one are one-line errors naming
    --attention; the kernel used is written next to the dtype."""
    from nanochat.checkpoint import save_checkpoint
    from scripts.base_eval import main

    root, _, model, bundle = tiny_run
    common = ["--eval", "core", "--bundle", str(bundle), "--no-progress", "--device-type", "cpu"]
    assert main(["--run", str(root / "run"), *common, "--attention", "fa3", "--out-dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --attention fa3: FlashAttention runs on CUDA GPUs only") and err.count("\n") == 1
    run = tmp_path / "fa3_run"
    save_checkpoint(run, 1, model, {"tokenizer_dir": str(root / "tok"), "config": {"attention": "fa3"}})
    assert main(["--run", str(run), *common]) == 2
    assert "error: --attention run: the run trained with fa3, which cannot run here" in capsys.readouterr().err
    assert main(["--run", str(run), *common, "--attention", "sdpa", "--max-per-task", "1"]) == 0
    core = json.loads((run / "eval" / "step_000001" / "core.json").read_text())
    assert (core["attention"], core["dtype"]) == ("sdpa", "float32")


# -- MoME's kernels ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recorded, want", [("fused", "fused"), ("row", "row"), ("torch", "torch"),
                                            ("fused+torch", "fused"), ("torch+row", "row"), ("row+fused", "fused"),
                                            ("torch+row+fused", "fused")])
def test_eval_mome_kernels_come_from_the_run(recorded, want):
    """The run's recorded path (config.json 'mome_kernels') -> the setting that takes it again: a "+"-joined path
    (layers that differ) -> the most capable kernels named, fused > row > torch."""
    from nanochat.memory.mome_mix import KERNEL_SETTINGS
    from scripts.base_eval import KERNEL_PATHS, eval_mome_kernels

    assert sorted(KERNEL_PATHS) == sorted(KERNEL_SETTINGS)  # every path is a setting's, and ranked
    assert eval_mome_kernels("run", {"config": {"mome_kernels": recorded}}) == (want, f"the run's kernels, {recorded}")
    assert eval_mome_kernels("torch", {"config": {"mome_kernels": recorded}}) == ("torch", "--mome-kernels")


@pytest.mark.parametrize("meta", [{"config": {"mome_kernels": "none"}}, {"config": {"attention": "sdpa"}},
                                  {"reason": "imported"}, {"config": None}])
def test_eval_mome_kernels_are_auto_where_the_run_records_none(meta):
    """No MoME in the run ("none"), or no record (imported runs, runs older than --mome-kernels)."""
    from scripts.base_eval import eval_mome_kernels

    assert eval_mome_kernels("run", meta) == ("auto", "the code's default (the checkpoint records no MoME kernels)")


def test_an_unknown_recorded_mome_kernel_path_is_an_error():
    from scripts.base_eval import eval_mome_kernels

    with pytest.raises(ValueError, match=r"^--mome-kernels run: the checkpoint records mome_kernels 'fused\+triton', "
                                         r"not a kernel path of fused, row, torch; pass --mome-kernels auto, fused, "
                                         r"row or torch$"):
        eval_mome_kernels("run", {"config": {"mome_kernels": "fused+triton"}})


def test_mome_kernels_on_cuda_without_triton(monkeypatch, capsys, kernel_globals):
    """A CUDA device string and a patched-out triton stand in for a GPU without triton (as in
    tests/test_mome_kernels_flag.py): explicit fused/row are training's error; the run's fused is an error naming the
    flag and what to pass; the run's torch and an unrecorded run (auto) evaluate on torch ops."""
    from contextlib import ExitStack

    from nanochat.memory import mome_mix, mome_triton
    from scripts.base_eval import setup_eval_mome_kernels

    monkeypatch.setattr(mome_triton, "triton", None)
    cuda = torch.device("cuda")
    fused_run = {"config": {"mome_kernels": "fused"}}
    with ExitStack() as stack:
        with pytest.raises(ValueError, match=r"^--mome-kernels row: the MoME Triton kernels need triton, which cannot "
                                             r"be imported here; install triton"):
            setup_eval_mome_kernels("row", fused_run, cuda, stack)
        with pytest.raises(ValueError, match=r"^--mome-kernels run: the run trained with fused kernels, which cannot "
                                             r"run here \(--mome-kernels fused: the MoME Triton kernels need triton, "
                                             r".*\); pass --mome-kernels torch or auto to evaluate with other "
                                             r"kernels$"):
            setup_eval_mome_kernels("run", fused_run, cuda, stack)
        assert setup_eval_mome_kernels("run", {"config": {"mome_kernels": "torch"}}, cuda, stack) == (
            "torch", "", "the run's kernels, torch")
        assert setup_eval_mome_kernels("run", {}, cuda, stack) == (
            "torch", "--mome-kernels auto: triton cannot be imported",
            "the code's default (the checkpoint records no MoME kernels)")
        assert mome_mix.ROW_SUM == "unrolled"  # installed until the stack closes
    assert (mome_mix.ROW_SUM, mome_mix.FUSE_INJECT) == ("triton", True)
    assert capsys.readouterr().out == ""  # evaluate_into says it, once the model shows it has MoME layers


def _mome_run(root: Path, run: Path, recorded: str | None, model=None) -> Path:
    """A checkpoint of a tiny MoME model (one whose per-layer tables the fused kernels serve) with the tiny run's
    tokenizer and data; ``recorded``: its config.json 'mome_kernels' (None: no record)."""
    from conftest import MEMORY_OPTION_SETS
    from nanochat.checkpoint import save_checkpoint
    from nanochat.gpt import build_model

    if model is None:
        model = build_model(tiny_config(vocab_size=300, sequence_len=64, **MEMORY_OPTION_SETS["mome"]), seed=0)
    save_checkpoint(run, 1, model, {"tokenizer_dir": str(root / "tok"), "data_dir": str(root / "data"),
                                    **({"config": {"mome_kernels": recorded}} if recorded else {})})
    return run


def _reports(out: Path) -> tuple[dict, dict]:
    return tuple(json.loads((out / name).read_text()) for name in ("core.json", "bpb.json"))


def _kernel_eval_args(bundle, out, *extra):
    return ["--bundle", str(bundle), "--max-per-task", "1", "--eval-tokens", "256", "--splits", "val",
            "--no-progress", "--device-type", "cpu", "--out-dir", str(out), *extra]


def test_mome_kernels_on_cpu_are_torch_and_recorded(tiny_run, tmp_path, capsys, kernel_globals):
    """The CPU as shipped runs MoME's torch ops whatever the run took: the run's fused is accepted, said to have no
    effect, and the path the model took ("torch") is in core.json and bpb.json; "none" for a model without MoME."""
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    run = _mome_run(root, tmp_path / "mome", "fused")
    assert main(["--run", str(run), *_kernel_eval_args(bundle, tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "mome kernels: torch (--mome-kernels fused: the MoME Triton kernels run on cuda only, this run is on " \
           "cpu)\n" in out and "; mome kernels torch (the run's kernels, fused)\n" in out, out
    assert [r["mome_kernels"] for r in _reports(tmp_path / "a")] == ["torch", "torch"]
    assert [line for line in out.splitlines() if line.startswith("mome kernels:")] == [
        "mome kernels: torch (--mome-kernels fused: the MoME Triton kernels run on cuda only, this run is on cpu)"]
    assert main(["--run", str(root / "run"), *_kernel_eval_args(bundle, tmp_path / "b")]) == 0
    assert [r["mome_kernels"] for r in _reports(tmp_path / "b")] == ["none", "none"]
    # a Base run has no layer the flag's resolution applies to: only the checkpoint line's "none" (it printed
    # "mome kernels: torch (...)" before, as base_train did)
    out = capsys.readouterr().out
    assert not [line for line in out.splitlines() if line.startswith("mome kernels")] and "; mome kernels none (" in out


@pytest.mark.parametrize("flag, recorded, want", [(None, "fused", "fused"), (None, "row+torch", "row"),
                                                  (None, None, "fused"), ("torch", "fused", "torch")])
def test_mome_kernels_the_model_takes_are_recorded(flag, recorded, want, tiny_run, tmp_path, monkeypatch, capsys,
                                                   kernel_globals):
    """The CPU added to KERNEL_DEVICES (the kernel ops run their torch math): the setting, from the run or the flag,
    is installed for the evaluation only and the path the model's layers took is recorded."""
    from nanochat.memory import mome_mix, mome_triton
    from scripts.base_eval import main

    monkeypatch.setattr(mome_triton, "KERNEL_DEVICES", ("cuda", "cpu"))
    root, _, _, bundle = tiny_run
    run = _mome_run(root, tmp_path / "mome", recorded)
    extra = ["--mome-kernels", flag] if flag else []
    assert main(["--run", str(run), *_kernel_eval_args(bundle, tmp_path / "o", *extra)]) == 0
    assert f"mome kernels: {want}\n" in capsys.readouterr().out
    assert [r["mome_kernels"] for r in _reports(tmp_path / "o")] == [want, want]
    assert (mome_mix.ROW_SUM, mome_mix.FUSE_INJECT) == ("triton", True)  # the module as it was before


def test_results_of_other_mome_kernels_are_recomputed(tiny_run, tmp_path, monkeypatch, capsys, kernel_globals):
    """A CORE task finished on torch ops is not reused by a rerun on the fused kernels (the CPU added to
    KERNEL_DEVICES): they round differently."""
    from nanochat import core_eval
    from nanochat.memory import mome_triton
    from scripts.base_eval import main

    monkeypatch.setattr(mome_triton, "KERNEL_DEVICES", ("cuda", "cpu"))
    root, _, _, bundle = tiny_run
    run = _mome_run(root, tmp_path / "mome", "torch")
    args = ["--run", str(run), *_kernel_eval_args(bundle, tmp_path / "o", "--eval", "core")]
    with monkeypatch.context() as m:
        sigterm_after(m, core_eval, "evaluate_task", 1)
        assert main(args) == 143
    with monkeypatch.context() as m:
        tasks = _count_calls(m, core_eval, "evaluate_task")
        assert main([*args, "--mome-kernels", "fused"]) == 0
    assert [a[3].label for a in tasks] == ["mc", "lm"]
    assert "computed with other settings (mome_kernels 'torch' -> 'fused'); recomputing them" in \
        capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "core.json").read_text())["mome_kernels"] == "fused"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu there)")
def test_fused_and_torch_kernels_agree_on_cuda(tiny_run, tmp_path):
    """bf16 on CUDA: the fused kernels and the torch ops (one function; other rounding, fp32 atomics in a free
    order) give the same bpb to bf16 tolerance, and each report says which ran."""
    from conftest import MEMORY_OPTION_SETS
    from nanochat.gpt import build_model
    from nanochat.memory import mome_triton
    from scripts.base_eval import main

    if mome_triton.triton is None:
        pytest.skip("triton cannot be imported: the fused kernels cannot run")
    root = tiny_run[0]
    model = build_model(tiny_config(vocab_size=300, sequence_len=64, **MEMORY_OPTION_SETS["mome"]), seed=0)
    with torch.no_grad():  # routers and output projections off their zero init: the memory reaches the logits
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "router" in name or "c_proj" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "router" in name else 0.2))
    run = _mome_run(root, tmp_path / "mome", "fused", model)
    bpb = {}
    for name in ("fused", "torch"):
        out = tmp_path / name
        assert main(["--run", str(run), "--eval", "bpb", "--splits", "val", "--eval-tokens", "256", "--no-progress",
                     "--device-type", "cuda", "--dtype", "bfloat16", "--mome-kernels", name,
                     "--out-dir", str(out)]) == 0
        report = json.loads((out / "bpb.json").read_text())
        assert report["mome_kernels"] == name
        bpb[name] = report["splits"]["val"]
    assert bpb["fused"] == pytest.approx(bpb["torch"], rel=5e-3)
