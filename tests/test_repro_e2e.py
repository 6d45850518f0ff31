"""configs/mini -> runner -> train -> eval -> results table -> plot, end to end on CPU (tiny overrides)."""

import json
import os
import subprocess
import sys

from conftest import REPO
from data_fixtures import TINY_VOCAB
from runner_inprocess import run_main
from scripts import base_eval, plot, results, run, sample

TINY = ["--depth", "2", "--max-seq-len", "64", "--total-batch-size", "1024", "--num-iterations", "6",
        "--eval-every", "-1", "--eval-tokens", "2048", "--core-max-per-task", "2", "--save-every", "-1",
        "--log-every", "3", "--dtype", "float32"]


def _run(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_two_mini_rows_to_results_and_plot(tmp_path, capsys, monkeypatch, kernel_globals, embedded_data_dir,
                                          tiny_tokenizer_dir):
    runs = tmp_path / "runs"
    data = ["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir), "--vocab-size", str(TINY_VOCAB)]
    for row in ("base", "mome_c1_m4"):
        argv = [f"configs/mini/{row}.toml", "--runs-root", str(runs), "--", *TINY, *data]
        # the base row is the CLI end to end (runner process -> base_train process); the MoME row's runner runs in
        # this process (runner_inprocess), its base_train still a process of its own: one torch import fewer
        if row == "base":
            r = _run(["-m", "scripts.run", *argv], tmp_path)
        else:
            r = run_main(argv, capsys, monkeypatch, cwd=REPO, omp_threads="2")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        summary = json.loads((runs / "mini" / row / "seed42" / "summary.json").read_text())
        assert summary["step"] == 6 and summary["stop_reason"] == "completed"
        assert 0 < summary["val_bpb"] < 20 and 0 < summary["train_bpb"] < 20
        assert summary["core_label"].startswith("CORE-")  # the shipped subset lacks coqa: labelled honestly
    # the checkpoint records its tokenizer and data: sampling and evaluation need no extra flags. The tools run in
    # this process (their main(argv), as `python -m` calls it; each subprocess cost a torch import, ~2 s of CPU)
    mome_run = runs / "mini" / "mome_c1_m4" / "seed42"
    capsys.readouterr()
    assert sample.main(["--run", str(mome_run), "--prompt", "The king", "--max-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.count("--- sample 0") == 1
    assert base_eval.main(["--run", str(mome_run), "--eval", "bpb", "--splits", "val", "--eval-tokens", "2048",
                           "--no-progress"]) == 0
    bpb = json.loads(next((mome_run / "eval").glob("step_*/bpb.json")).read_text())
    assert abs(bpb["splits"]["val"] - json.loads((mome_run / "summary.json").read_text())["val_bpb"]) < 1e-4, bpb
    # a finished run is not overwritten (the runner launches nothing: it returns, as its process exits 0)
    capsys.readouterr()
    run.main([str(REPO / "configs" / "mini" / "base.toml"), "--runs-root", str(runs), "--", *TINY, *data])
    assert "not overwriting" in capsys.readouterr().out
    out = tmp_path / "results"
    assert results.main(["--table", "mini", "--runs-root", str(runs), "--out", str(out)]) == 0
    md = (out / "mini.md").read_text()
    assert "Base (mini)" in md and "MoME A2/4 (mini)" in md and (out / "mini.csv").is_file() and (out / "mini.tex").is_file()
    assert plot.main(["curves", str(runs / "mini" / "base" / "seed42"), str(runs / "mini" / "mome_c1_m4" / "seed42"),
                      "--metric", "loss", "--out", str(out / "curves")]) == 0
    assert (out / "curves.png").stat().st_size > 1000 and (out / "curves.pdf").is_file()
