"""scripts/base_eval end to end on a tiny checkpoint, the bundle locator/downloader, and the shipped subset."""

import functools
import hashlib
import http.server
import json
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _eval_helpers import LM_ROWS, MC_ROWS, write_bundle  # noqa: E402
from conftest import sigterm_after, tiny_config  # noqa: E402

from nanochat import eval_bundle as eb  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards hex jolly plumbers by the river".split()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A checkpoint of a tiny GPT + a 300-token BPE tokenizer + a 2-shard data dir, wired through meta.json."""
    from nanochat.checkpoint import save_checkpoint
    from nanochat.dataset import write_manifest, write_text_shard
    from nanochat.gpt import build_model
    from nanochat.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("run")
    docs = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(40 + i % 13)) for i in range(200)]
    tok = Tokenizer.train_from_iterator(iter(docs + ["xyz ABC abcd mno q zyx efg ABD"] * 5), vocab_size=300)
    tok.save(root / "tok")
    (root / "data").mkdir()
    write_text_shard(root / "data" / "train_000.parquet", docs[:150])
    write_text_shard(root / "data" / "val_000.parquet", docs[150:])
    write_manifest(root / "data", "test", ["train_000.parquet"], ["val_000.parquet"], source="test")
    model = build_model(tiny_config(vocab_size=300, sequence_len=64), seed=0)
    save_checkpoint(root / "run", 7, model, {"tokenizer_dir": str(root / "tok"), "data_dir": str(root / "data")})
    bundle = write_bundle(root / "bundle", {"mc": ("multiple_choice", 1, " ", MC_ROWS),
                                            "lm": ("language_modeling", 1, "\nAnswer: ", LM_ROWS)},
                          {"mc": 25, "lm": 0, "gone": 50}, total_tasks=["gone"])
    (root / "ood.txt").write_text(" ".join(WORDS) * 3)
    return root, tok, model, bundle


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


# -- bundle locating / downloading -------------------------------------------------------------------------
def _serve(directory: Path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _zip_bundle(src: Path, zip_path: Path) -> str:
    with zipfile.ZipFile(zip_path, "w") as zf:  # same layout as upstream: a top-level eval_bundle/ folder
        for p in sorted(src.rglob("*")):
            if p.is_file():
                zf.write(p, Path("eval_bundle") / p.relative_to(src))
    return hashlib.sha256(zip_path.read_bytes()).hexdigest()


def test_download_extract_checksum_and_cache(tmp_path, monkeypatch):
    src = write_bundle(tmp_path / "src", {"mc": ("multiple_choice", 0, " ", MC_ROWS)}, {"mc": 25})
    (tmp_path / "www").mkdir()
    digest = _zip_bundle(src, tmp_path / "www" / "eval_bundle.zip")
    server = _serve(tmp_path / "www")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/eval_bundle.zip"
        monkeypatch.delenv("NANOCHAT_EVAL_BUNDLE", raising=False)
        monkeypatch.setenv("NANOCHAT_EVAL_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", url)
        monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_SHA256", "0" * 64)
        with pytest.raises(RuntimeError, match=f"checksum mismatch .* got sha256 {digest}"):
            eb.find_bundle()
        monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_SHA256", digest)
        got = eb.find_bundle()
        assert got == tmp_path / "cache" / "eval_bundle"
        assert (got / "eval_data" / "cat" / "mc.jsonl").read_bytes() == (src / "eval_data/cat/mc.jsonl").read_bytes()
        assert json.loads((tmp_path / "cache" / "eval_bundle.sha256").read_text())["sha256"] == digest
        assert not list((tmp_path / "cache").glob("*.part"))
    finally:
        server.shutdown()
    assert eb.find_bundle() == got  # cached: no server needed any more


def test_download_failure_is_clear(tmp_path, offline_bundle):
    with pytest.raises(RuntimeError, match=r"after 3 attempts.*--bundle DIR.*--bundle subset"):
        eb.find_bundle()
    assert not list((tmp_path / "cache").glob("eval_bundle.zip*"))


def test_find_bundle_order(tmp_path, monkeypatch):
    a = write_bundle(tmp_path / "a", {}, {})
    b = write_bundle(tmp_path / "b", {}, {})
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE", str(b))
    assert eb.find_bundle(str(a)) == a and eb.find_bundle() == b
    assert eb.find_bundle("subset") == eb.SUBSET_DIR
    with pytest.raises(FileNotFoundError, match="--bundle .* has no core.yaml"):
        eb.find_bundle(str(tmp_path))


# -- the shipped subset ---------------------------------------------------------------------------------------
def test_shipped_subset_is_labelled_and_small():
    tasks = eb.load_core_tasks(eb.SUBSET_DIR)
    info = eb.bundle_info(eb.SUBSET_DIR)
    assert len(tasks) == 22 and info["subset"] is True and info["missing_tasks"] == ["coqa"]
    assert set(info["approx_tasks"]) == {"hellaswag", "hellaswag_zeroshot"}
    baselines = eb.load_random_baselines(eb.SUBSET_DIR)
    for t in tasks:
        path = eb.SUBSET_DIR / "eval_data" / t.dataset_uri
        if t.label == "coqa":
            assert not path.exists()
            continue
        rows = eb.load_task_data(path, t.task_type)
        assert 0 < len(rows) <= 100 and len(rows) == info["tasks"][t.label]["rows"]
        assert t.label in baselines
    assert "subset" in (eb.SUBSET_DIR / "README.md").read_text().lower()


def test_subset_rebuild_is_identical(shared_dir, tmp_path):
    from scripts.make_core_subset import build

    build(shared_dir, tmp_path / "s", 100)
    for p in sorted((eb.SUBSET_DIR).rglob("*")):
        if p.is_file() and p.name != "README.md":
            assert (tmp_path / "s" / p.relative_to(eb.SUBSET_DIR)).read_bytes() == p.read_bytes(), p


def test_subset_file_evaluates_like_max_per_task_on_the_full_file(tmp_path):
    """The evaluator shuffles every task file and draws few-shot examples by position: the subset must give the
    same ordered examples as --max-per-task on the full file (not only the same set), for 100 and fewer rows."""
    from nanochat.core_eval import fewshot_for, order_task_data
    from scripts.make_core_subset import subset_rows

    for n_rows, n in ((250, 100), (32, 100)):
        rows = [{"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(n_rows)]
        full = tmp_path / f"full{n_rows}.jsonl"
        full.write_text("".join(json.dumps(r) + "\n" for r in rows))
        sub = subset_rows(full, "multiple_choice", n)
        expect = order_task_data(rows, n)
        assert order_task_data(sub) == expect
        assert all(fewshot_for(order_task_data(sub), i, 5) == fewshot_for(expect, i, 5) for i in range(len(expect)))


def test_shipped_subset_equals_max_per_task_100(shared_dir):
    bundle = shared_dir / "eval_bundle"
    for task in eb.load_core_tasks(bundle):
        full = bundle / "eval_data" / task.dataset_uri
        if not full.is_file():
            continue
        from nanochat.core_eval import order_task_data

        sub = eb.load_task_data(eb.SUBSET_DIR / "eval_data" / task.dataset_uri, task.task_type)
        assert order_task_data(sub) == order_task_data(eb.load_task_data(full, task.task_type), 100), task.label


def test_shared_bundle_n_comes_from_file(shared_dir):
    arc = eb.load_task_data(shared_dir / "eval_bundle/eval_data/world_knowledge/arc_challenge.jsonl", "multiple_choice")
    assert len(arc) == 1172  # eval_meta_data.csv claims 2,376


def test_torchrun_double_dash_hands_flags_to_the_script():
    """README: `torchrun ... -m scripts.base_eval -- --run=x` works; without `--` torchrun's parser rejects --run."""
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
    """The same checkpoint, one CORE: base_eval's default is the dtype the run trained and evaluated with (bf16
    autocast here, on CPU), and every result says which dtype it is."""
    from scripts import base_eval, base_train

    bundle = write_bundle(tmp_path / "bundle", {"mc": ("multiple_choice", 1, " ", MC_ROWS),
                                                "lm": ("language_modeling", 1, "\nAnswer: ", LM_ROWS)},
                          {"mc": 25, "lm": 0})
    run = tmp_path / "run"
    assert base_train.main(["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir),
                            "--depth", "1", "--aspect-ratio", "64", "--head-dim", "32", "--max-seq-len", "64",
                            "--device-batch-size", "2", "--total-batch-size", "256", "--eval-tokens", "256",
                            "--eval-every", "-1", "--num-iterations", "3", "--dtype", "bfloat16",
                            "--bundle", str(bundle), "--run-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dtype"] == summary["core_dtype"] == "bfloat16"
    assert f"final CORE [bfloat16] {summary['core']:.4f}" in capsys.readouterr().out
    common = ["--run", str(run), "--bundle", str(bundle), "--eval", "core", "--device-batch-size", "2",
              "--no-progress", "--device-type", "cpu"]
    assert base_eval.main(common) == 0
    out = capsys.readouterr().out
    assert "dtype bfloat16 (the run's training dtype)" in out and "CORE [bfloat16]:" in out
    core = json.loads((run / "eval" / "step_000003" / "core.json").read_text())
    assert core["dtype"] == "bfloat16" and core["core"] == pytest.approx(summary["core"], abs=1e-9)
    assert base_eval.main([*common, "--dtype", "float32", "--out-dir", str(tmp_path / "fp32")]) == 0
    assert json.loads((tmp_path / "fp32" / "core.json").read_text())["dtype"] == "float32"


# -- an interrupted evaluation continues -------------------------------------------------------------------------
REPORTS = ("core.json", "core.csv", "core.md", "bpb.json")


def _eval_args(root, bundle, out, *extra):
    return ["--run", str(root / "run"), "--bundle", str(bundle), "--eval-tokens", "256", "--device-batch-size", "3",
            "--bpb-corpus", f"ood={root / 'ood.txt'}", "--no-progress", "--device-type", "cpu", "--dtype", "float32",
            "--out-dir", str(out), *extra]


def _count_calls(monkeypatch, module, name: str) -> list:
    return sigterm_after(monkeypatch, module, name, 10**9)


def test_interrupted_eval_continues_to_the_same_reports(tiny_run, tmp_path, monkeypatch, capsys):
    """SIGTERM in CORE, then in bpb: each rerun keeps what finished (never scoring it again) and the final reports
    equal those of an uninterrupted run byte for byte."""
    from nanochat import core_eval, loss_eval
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    assert main(_eval_args(root, bundle, tmp_path / "whole")) == 0
    out = tmp_path / "resumed"
    with monkeypatch.context() as m:
        sigterm_after(m, core_eval, "evaluate_task", 1)  # the first task (mc) finishes, the second is cut
        assert main(_eval_args(root, bundle, out)) == 128 + 15
    err = capsys.readouterr().err
    assert "interrupted (SIGTERM); finished results (1 core, 0 bpb) are kept in" in err and "Traceback" not in err
    assert list(json.loads((out / "core.partial.json").read_text())["items"]) == ["mc"]
    assert not (out / "core.json").exists()
    with monkeypatch.context() as m:
        tasks = _count_calls(m, core_eval, "evaluate_task")
        sigterm_after(m, loss_eval, "evaluate_bpb", 1)  # train bpb finishes, val is cut
        assert main(_eval_args(root, bundle, out)) == 128 + 15
    assert [a[3].label for a in tasks] == ["lm"]  # mc was not scored again
    assert "CORE tasks: 1 of 2 reused from" in capsys.readouterr().out
    assert list(json.loads((out / "bpb.partial.json").read_text())["items"]) == ["split train"]
    with monkeypatch.context() as m:
        tasks, bpbs = _count_calls(m, core_eval, "evaluate_task"), _count_calls(m, loss_eval, "evaluate_bpb")
        assert main(_eval_args(root, bundle, out)) == 0
    assert (len(tasks), len(bpbs)) == (0, 2)  # val and ood
    assert "bpb results: 1 of 3 reused from" in capsys.readouterr().out
    for name in REPORTS:
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(REPORTS)  # the partial files are gone


def test_changed_settings_or_fresh_recompute(tiny_run, tmp_path, monkeypatch, capsys):
    """Finished tasks are reused only under the same settings and inputs: another --dtype (a setting of the whole
    evaluation), another --max-per-task (an input of each task) or --fresh recompute every task."""
    from nanochat import core_eval
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"

    def interrupted_then(*extra) -> list:
        with monkeypatch.context() as m:
            sigterm_after(m, core_eval, "evaluate_task", 1)
            assert main(_eval_args(root, bundle, out, "--eval", "core")) == 143
        with monkeypatch.context() as m:
            tasks = _count_calls(m, core_eval, "evaluate_task")
            assert main(_eval_args(root, bundle, out, "--eval", "core", *extra)) == 0
        return [a[3].label for a in tasks]

    assert interrupted_then("--dtype", "bfloat16") == ["mc", "lm"]
    assert "computed with other settings (dtype 'float32' -> 'bfloat16'); recomputing them" in capsys.readouterr().out
    assert json.loads((out / "core.json").read_text())["dtype"] == "bfloat16"
    assert interrupted_then("--max-per-task", "2") == ["mc", "lm"]
    assert "the inputs of mc changed (max_per_task -1 -> 2); recomputing it" in capsys.readouterr().out
    assert json.loads((out / "core.json").read_text())["tasks"]["mc"]["n"] == 2
    assert interrupted_then("--fresh") == ["mc", "lm"]
    assert "--fresh: 1 finished result(s) in" in capsys.readouterr().out
    assert interrupted_then() == ["lm"]  # the same command: mc is reused
    # the code that computed the numbers is a setting too (a fix between the interrupt and the rerun)
    from nanochat import eval_resume

    real_version = eval_resume.code_version
    with monkeypatch.context() as m:
        sigterm_after(m, core_eval, "evaluate_task", 1)
        assert main(_eval_args(root, bundle, out, "--eval", "core")) == 143
    with monkeypatch.context() as m:
        m.setattr(eval_resume, "code_version", lambda: {**real_version(), "diff_sha256": "an-edit-of-the-code"})
        tasks = _count_calls(m, core_eval, "evaluate_task")
        assert main(_eval_args(root, bundle, out, "--eval", "core")) == 0
    assert [a[3].label for a in tasks] == ["mc", "lm"] and "'an-edit-of-the-code'" in capsys.readouterr().out


def test_an_evaluation_that_fails_midway_says_what_it_kept(tiny_run, tmp_path, monkeypatch, capsys):
    """E.g. another rank was stopped and this rank's collective failed: the error propagates, after a line saying
    which finished results are on disk for the rerun."""
    from nanochat import core_eval
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    real, calls = core_eval.evaluate_task, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("Connection closed by peer")
        return real(*args, **kwargs)

    monkeypatch.setattr(core_eval, "evaluate_task", failing)
    with pytest.raises(RuntimeError, match="closed by peer"):
        main(_eval_args(root, bundle, tmp_path / "o", "--eval", "core"))
    assert "base_eval: failed (RuntimeError); finished results (1 core) are kept in" in capsys.readouterr().err


def test_two_evaluations_into_one_out_dir_at_once_are_refused(tiny_run, tmp_path, capsys):
    """They would overwrite each other's partial results and reports: the second is refused naming the first."""
    from nanochat.run_dir import RunDirLock
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"
    other = RunDirLock(out).acquire("--out-dir")  # another base_eval holds it
    try:
        assert main(_eval_args(root, bundle, out, "--eval", "core")) == 2
        err = capsys.readouterr().err
        assert f"--out-dir {out} is in use by another" in err and "choose another --out-dir" in err, err
    finally:
        other.release()
    assert main(_eval_args(root, bundle, out, "--eval", "core")) == 0


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


@pytest.mark.slow
@pytest.mark.parametrize("signalled", ["0,1", "1"])
def test_two_ranks_continue_an_interrupted_eval(tiny_run, tmp_path, signalled):
    """Under torchrun (2 gloo ranks) SIGTERM on every rank, or on rank 1 alone, during the second CORE task: every
    rank stops at the same point (once the task's examples are prepared, a set-up step), exit with one line (rank
    0's, with the signal rank 1 got), the first task kept; the rerun reuses it on both ranks (rank 0 decides) and
    finishes. Slow: two torchrun launches, ~30 s on 2 cores."""
    from conftest import run_torchrun

    root, _, _, bundle = tiny_run
    worker = Path(__file__).parent / "_base_eval_worker.py"
    args = ["--run-dir", str(root / "run"), "--bundle", str(bundle), "--eval", "core", "--no-progress",
            "--device-type", "cpu", "--out-dir", str(tmp_path / "o")]
    res = run_torchrun(worker, 2, ["--sigterm-at-task", "1", signalled, *args], timeout=120)
    assert res.returncode != 0 and res.stderr.count("base_eval: interrupted (SIGTERM)") == 1, res.stderr[-3000:]
    assert "exitcode  : 143" in res.stderr and "exitcode  : 1 " not in res.stderr, res.stderr[-3000:]
    saved = json.loads((tmp_path / "o" / "core.partial.json").read_text())
    assert list(saved["items"]) == ["mc"] and saved["settings"]["world_size"] == 2
    res = run_torchrun(worker, 2, args, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "CORE tasks: 1 of 2 reused from" in res.stdout, res.stdout + res.stderr
    core = json.loads((tmp_path / "o" / "core.json").read_text())
    assert (core["tasks"]["mc"]["n"], core["tasks"]["lm"]["n"]) == (4, 3)
    assert not (tmp_path / "o" / "core.partial.json").exists()


def test_a_finished_split_of_the_older_partial_format_is_scored_again(tiny_run, tmp_path, monkeypatch, capsys):
    """bpb.partial.json of the code before the slot balance held a split's bpb as a bare number. Outside a git
    checkout (a copy without .git) the code version cannot tell the two codes apart: the rerun must score that
    split again, not crash on the number."""
    from nanochat import eval_resume, loss_eval
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    out, args = tmp_path / "o", _eval_args(root, bundle, tmp_path / "o", "--eval", "bpb")
    monkeypatch.setattr(eval_resume, "code_version", lambda: {"trees": None, "diff_sha256": None})
    with monkeypatch.context() as m:
        sigterm_after(m, loss_eval, "evaluate_bpb", 1)  # train bpb finishes, val is cut
        assert main(args) == 143
    partial = json.loads((out / "bpb.partial.json").read_text())
    item = partial["items"]["split train"]
    item["result"] = item["result"]["bpb"]  # as the older code wrote it, with its key
    item["key"] = {k: v for k, v in item["key"].items() if k in ("data_sha256", "eval_tokens")}
    (out / "bpb.partial.json").write_text(json.dumps(partial))
    with monkeypatch.context() as m:
        bpbs = _count_calls(m, loss_eval, "evaluate_bpb")
        assert main(args) == 0
    assert len(bpbs) == 3  # train again, val, ood
    assert json.loads((out / "bpb.json").read_text())["splits"]["train"] == item["result"]


def test_the_stop_vote_stops_every_rank_at_the_same_batch(tmp_path):
    """nanochat.eval_resume.stop_voted on 2 gloo ranks: ranks with different batch counts (one with none) all see
    their own batches and finish together; a SIGTERM latched on one rank (between two votes, or after that rank's
    last batch) ends the loop on both at the next vote, with the same Interrupted. One torchrun, ~5 s."""
    from conftest import run_torchrun

    out = tmp_path / "votes.json"
    res = run_torchrun(Path(__file__).parent / "_stop_vote_worker.py", 2, [str(out)], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(out.read_text()) == {
        "uneven, no signal": [[[0, 1, 2, 3, 4], "finished"], [[0, 1, 2], "finished"]],
        "one rank empty": [[[], "finished"], [[0, 1], "finished"]],
        # votes before batches 0 and 2 (every 2nd): the signal during batch 1 stops both before batch 2
        "rank 1 signalled between votes": [[[0, 1], "SIGTERM"], [[0, 1], "SIGTERM"]],
        "rank 0 signalled after its last batch": [[[0, 1], "SIGTERM"], [[0, 1], "SIGTERM"]],
    }


def test_a_signal_during_set_up_stops_every_rank_right_after_that_step(tmp_path):
    """Set-up steps of an evaluation (every_rank_ok, rank0_decides) on 2 gloo ranks under interrupts_raise: a signal
    latched on one rank during a step (or, for rank0_decides, on a rank that does not run fn) ends the evaluation on
    every rank right after that step, with the same Interrupted (the larger signal number when ranks got different
    ones, as the stop vote), not at the first batch's vote. An error in fn is raised first (the signal stays latched
    and stops the next step). Without a signal the results are those of today; in training's set-up (StopSignal,
    no interrupts_raise) a signal changes nothing there, in its final evaluation (StopSignal.interrupts) it stops
    every rank as in base_eval. One torchrun, ~5 s."""
    from conftest import run_torchrun

    out = tmp_path / "setup.json"
    res = run_torchrun(Path(__file__).parent / "_setup_stop_worker.py", 2, [str(out)], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    stopped_after_step = [["step done"], "SIGTERM"]
    assert json.loads(out.read_text()) == {
        "no signal": [[[0, "rank 0's choice", True], "finished"], [[10, "rank 0's choice", False], "finished"]],
        "every_rank_ok, rank 1 signalled": [stopped_after_step, stopped_after_step],
        "every_rank_ok, rank 0 signalled": [stopped_after_step, stopped_after_step],
        "rank0_decides, rank 0 signalled in fn": [stopped_after_step, [[], "SIGTERM"]],
        "rank0_decides, rank 1 signalled before": [[[], "SIGTERM"], [[], "SIGTERM"]],
        "different signals": [stopped_after_step, stopped_after_step],  # SIGINT on rank 0, SIGTERM on rank 1
        "every_rank_ok error and a signal": [[["FileNotFoundError: rank 0 of 2: gone"], "SIGTERM"]] * 2,
        "rank0_decides error and a signal": [[["FileNotFoundError: gone"], "SIGTERM"]] * 2,
        "a later signal changes nothing": [[["step done", "stopped (SIGTERM); latched 15", "SIGINT ignored"],
                                            "SIGTERM"]] * 2,
        "training set-up, rank 1 signalled": [[["step done", 0, "rank 0's choice"], "received None"],
                                              [["step done", 10, "rank 0's choice"], "received SIGTERM"]],
        "training's final evaluation, rank 1 signalled": [[["step done"], "SIGTERM; received None"],
                                                          [["step done"], "SIGTERM; received SIGTERM"]],
    }


def test_a_signal_during_set_up_in_one_process_raises_at_once():
    """One process (no torch.distributed): every_rank_ok and rank0_decides are fn itself, so the signal raises in
    fn, where it arrives, as before."""
    import os
    import signal

    from nanochat.common import every_rank_ok, rank0_decides
    from nanochat.eval_resume import Interrupted, interrupts_raise

    for helper in (every_rank_ok, rank0_decides):
        seen = []

        def step():
            os.kill(os.getpid(), signal.SIGTERM)
            seen.append("after the signal")

        with interrupts_raise(), pytest.raises(Interrupted, match="SIGTERM"):
            helper(step)
        assert seen == [], helper


@pytest.mark.slow
@pytest.mark.parametrize("step,signalled", [("scripts.base_eval:load_chosen_checkpoint", "1"),
                                            ("nanochat.run_dir:RunDirLock.acquire", "0")])
def test_two_ranks_stop_after_the_set_up_step_a_signal_came_in(tiny_run, tmp_path, step, signalled):
    """Under torchrun (2 gloo ranks) SIGTERM on one rank while it loads the checkpoint (every_rank_ok), or on rank 0
    while it takes the output directory's lock (rank0_decides): every rank stops right after that step, before the
    first CORE task, with one line (rank 0's) and exit code 143 on both; the lock is released. Slow: two torchrun
    launches, ~13 s on 2 cores."""
    from conftest import run_torchrun

    from nanochat.run_dir import LOCK_FILE

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"
    res = run_torchrun(Path(__file__).parent / "_base_eval_worker.py", 2,
                       ["--sigterm-in", step, signalled, "--run-dir", str(root / "run"), "--bundle", str(bundle),
                        "--eval", "core", "--no-progress", "--device-type", "cpu", "--out-dir", str(out)],
                       timeout=120)
    assert res.returncode != 0, res.stderr[-3000:]
    assert res.stderr.count("base_eval: interrupted (SIGTERM) before anything was evaluated") == 1, res.stderr[-3000:]
    assert res.stderr.count("base_eval: interrupted") == 1, res.stderr[-3000:]
    assert "exitcode  : 143" in res.stderr and "exitcode  : 1 " not in res.stderr, res.stderr[-3000:]
    # torchrun ends a rank still exiting when the other one has exited (-15); none may die of SIGABRT at its exit
    assert "SIGABRT" not in res.stderr and "terminate called" not in res.stderr, res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == []  # no partial results, no lock left behind
    assert not (out / LOCK_FILE).exists()


def test_a_data_shard_one_rank_cannot_read_stops_every_rank_with_its_error(tiny_run, tmp_path):
    """Under torchrun (2 gloo ranks) rank 1 alone reads a truncated copy of the val shard (a node's corrupt local
    data) while the bpb rows are tokenized: every rank stops with rank 1's DataError naming the file, exit 2, no
    traceback. Before: rank 1 died with a traceback and rank 0 crashed in the next exchange ('Connection closed by
    peer'; under NCCL a hang until the timeout). One torchrun, ~5 s."""
    from conftest import run_torchrun

    from nanochat.run_dir import LOCK_FILE

    root, _, _, _ = tiny_run
    out = tmp_path / "o"
    res = run_torchrun(Path(__file__).parent / "_base_eval_worker.py", 2,
                       ["--truncated-shard-on", "1", "--run-dir", str(root / "run"), "--eval", "bpb", "--splits", "val",
                        "--eval-tokens", "256", "--no-progress", "--device-type", "cpu", "--out-dir", str(out)],
                       timeout=120)
    assert res.returncode != 0, res.stderr[-3000:]
    assert "error: rank 1 of 2: " in res.stderr and "val_000.parquet is not a readable parquet file" in res.stderr, \
        res.stderr[-3000:]
    # (torchrun ends a rank still exiting when the other one has exited: -15)
    assert "exitcode  : 2" in res.stderr and "exitcode  : 1 " not in res.stderr, res.stderr[-3000:]
    assert "Connection closed by peer" not in res.stderr and "]: Traceback" not in res.stderr, res.stderr[-3000:]
    assert not (out / LOCK_FILE).exists() and not (out / "bpb.json").exists()


@pytest.mark.parametrize("name,kept", [("core.partial.json", None), ("bpb.json", "2 core, 1 bpb")])
def test_a_full_disk_under_out_dir_stops_every_rank_with_one_error(tiny_run, tmp_path, name, kept):
    """Under torchrun (2 gloo ranks) rank 0's disk fills up while it writes the first finished CORE task, or the
    last report (bpb.json): every rank stops with one error naming the file and the OSError, exit 2; no temp file
    is left and a line on what was kept counts only what reached the disk. Before: an OSError traceback on rank 0 and
    'Connection closed by peer' on rank 1 (NCCL: a hang), or rank 1 exiting 0; a torn .tmp left behind; "1 core"
    said kept when nothing was. ~5 s each."""
    from conftest import run_torchrun

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"
    res = run_torchrun(Path(__file__).parent / "_base_eval_worker.py", 2,
                       ["--enospc-writing", name, "--run-dir", str(root / "run"), "--bundle", str(bundle),
                        "--splits", "val", "--eval-tokens", "256", "--no-progress", "--device-type", "cpu",
                        "--out-dir", str(out)], timeout=120)
    assert res.returncode != 0, res.stderr[-3000:]
    assert f"{out / name}" in res.stderr and "No space left on device" in res.stderr, res.stderr[-3000:]
    # (torchrun ends a rank still exiting when the other one has exited: -15)
    assert "exitcode  : 2" in res.stderr and "exitcode  : 1 " not in res.stderr, res.stderr[-3000:]
    assert "Connection closed by peer" not in res.stderr and "]: Traceback" not in res.stderr, res.stderr[-3000:]
    if kept:
        assert f"finished results ({kept}) are kept" in res.stderr, res.stderr[-3000:]
    else:  # nothing reached the disk: no line says otherwise
        assert "are kept" not in res.stderr and not (out / name).exists(), res.stderr[-3000:]
    assert not list(out.glob("*.tmp"))


def test_a_stop_voted_at_a_partial_write_counts_the_item_it_wrote(tmp_path, monkeypatch):
    """With several ranks, a signal latched on any rank ends the item's write step with Interrupted once rank 0's
    write has succeeded: the item is on disk, so the "kept" line must count it."""
    import signal

    from nanochat import eval_resume

    calls = []

    def rank0_decides(fn):  # as with 2 ranks: fn runs (on rank 0), then a signal latched elsewhere stops the step
        calls.append(fn)
        value = fn()
        if len(calls) == 2:  # the write, after the reuse decision
            raise eval_resume.Interrupted(signal.SIGTERM)
        return value

    monkeypatch.setattr(eval_resume, "is_dist", lambda: True)
    monkeypatch.setattr(eval_resume, "rank0_decides", rank0_decides)
    store = eval_resume.FinishedResults(tmp_path / "core.partial.json", {"s": 1})
    with pytest.raises(eval_resume.Interrupted):
        store.get_or_run("arc_easy", lambda: {"k": 1}, lambda: {"acc": 0.5})
    on_disk = json.loads((tmp_path / "core.partial.json").read_text())["items"]
    assert list(on_disk) == list(store.items) == ["arc_easy"]
