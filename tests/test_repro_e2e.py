"""configs/mini -> runner -> train -> eval -> results table -> plot, end to end on CPU (tiny overrides)."""

import json
import os
import subprocess
import sys

from conftest import REPO
from data_fixtures import TINY_VOCAB

TINY = ["--depth", "2", "--max-seq-len", "64", "--total-batch-size", "1024", "--num-iterations", "6",
        "--eval-every", "-1", "--eval-tokens", "2048", "--core-max-per-task", "2", "--save-every", "-1",
        "--log-every", "3", "--dtype", "float32"]


def _run(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_two_mini_rows_to_results_and_plot(tmp_path, embedded_data_dir, tiny_tokenizer_dir):
    runs = tmp_path / "runs"
    data = ["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir), "--vocab-size", str(TINY_VOCAB)]
    for row in ("base", "mome_c1_m4"):
        r = _run(["-m", "scripts.run", f"configs/mini/{row}.toml", "--runs-root", str(runs), "--", *TINY, *data], tmp_path)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        summary = json.loads((runs / "mini" / row / "seed42" / "summary.json").read_text())
        assert summary["step"] == 6 and summary["stop_reason"] == "completed"
        assert 0 < summary["val_bpb"] < 20 and 0 < summary["train_bpb"] < 20
        assert summary["core_label"].startswith("CORE-")  # the shipped subset lacks coqa: labelled honestly
    # the checkpoint records its tokenizer and data: sampling and evaluation need no extra flags
    mome_run = runs / "mini" / "mome_c1_m4" / "seed42"
    r = _run(["-m", "scripts.sample", "--run", str(mome_run), "--prompt", "The king", "--max-tokens", "5",
              "--temperature", "0"], tmp_path)
    assert r.returncode == 0 and r.stdout.count("--- sample 0") == 1, r.stderr[-2000:]
    r = _run(["-m", "scripts.base_eval", "--run", str(mome_run), "--eval", "bpb", "--splits", "val",
              "--eval-tokens", "2048", "--no-progress"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    bpb = json.loads(next((mome_run / "eval").glob("step_*/bpb.json")).read_text())
    assert abs(bpb["splits"]["val"] - json.loads((mome_run / "summary.json").read_text())["val_bpb"]) < 1e-4, bpb
    # a finished run is not overwritten
    again = _run(["-m", "scripts.run", "configs/mini/base.toml", "--runs-root", str(runs), "--", *TINY, *data], tmp_path)
    assert again.returncode == 0 and "not overwriting" in again.stdout
    out = tmp_path / "results"
    r = _run(["-m", "scripts.results", "--table", "mini", "--runs-root", str(runs), "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stderr
    md = (out / "mini.md").read_text()
    assert "Base (mini)" in md and "MoME A2/4 (mini)" in md and (out / "mini.csv").is_file() and (out / "mini.tex").is_file()
    r = _run(["-m", "scripts.plot", "curves", str(runs / "mini" / "base" / "seed42"),
              str(runs / "mini" / "mome_c1_m4" / "seed42"), "--metric", "loss", "--out", str(out / "curves")], tmp_path)
    assert r.returncode == 0, r.stderr
    assert (out / "curves.png").stat().st_size > 1000 and (out / "curves.pdf").is_file()
