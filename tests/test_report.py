"""Run reports (nanochat/report.py) and the comparison report (scripts/report.py)."""

import json
import shutil
import subprocess

import pytest
import torch

from nanochat import checkpoint as ckpt
from nanochat import report
from scripts import base_train
from scripts import report as report_cli

REPO = report.REPO
TINY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
        "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core",
        "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "4", "--save-every", "2"]


def table_value(md: str, key: str) -> str:
    """The value column of the ``| key | value |`` row of a report."""
    rows = [line for line in md.splitlines() if line.startswith(f"| {key} | ")]
    assert len(rows) == 1, (key, rows)
    return rows[0][len(f"| {key} | "):-2]


def test_tiny_run_report_has_provenance_and_results(tmp_path):
    run = tmp_path / "run"
    assert base_train.main([*TINY, "--run-dir", str(run), "--run-name", "tiny"]) == 0
    md = (run / "report.md").read_text()
    summary = json.loads((run / "summary.json").read_text())
    git = report.git_state()
    if git["commit"] is None:  # e.g. an exported tarball: the report must say so instead of inventing one
        assert table_value(md, "code") == "n/a"
    else:
        assert table_value(md, "code").startswith(f"`{git['commit'][:12]}` (")
    assert table_value(md, "software") == f"Python {report.platform.python_version()}, torch {torch.__version__}, " \
                                          f"CUDA {torch.version.cuda or 'n/a'}, driver n/a"
    assert table_value(md, "hardware").startswith("CPU: ") and table_value(md, "world size") == "1"
    assert table_value(md, "val bpb") == f"{summary['val_bpb']:.6f}" and table_value(md, "CORE") == "n/a"
    assert table_value(md, "tokens") == "1,024" and table_value(md, "parameters").endswith(" total, 0 memory")
    assert table_value(md, "throughput (tok/s)") == (
        f"{summary['tok_per_sec']:,.0f} (attention sdpa; steady state: steps after the first 3 of each process; "
        f"timed steps: 1; all steps incl. warm-up: {summary['tok_per_sec_all_steps']:,.0f})")
    if not torch.cuda.is_available():  # CPU: no peak FLOP/s, so the MFU of 0 is reported as unknown
        cpu = json.loads((run / "environment.json").read_text())["sessions"][0]["device_name"]
        assert table_value(md, "MFU") == f"n/a (no peak FLOP/s known for {cpu})"
    assert table_value(md, "data") == "synthetic token stream (--synthetic-data)"
    assert md.startswith("# Run report: tiny\n\nStop reason: completed, step 4 of 4.")
    # a resumed run records a second session; the report lists both
    shutil.rmtree(ckpt.step_dir(run, 4))
    assert base_train.main([*TINY, "--run-dir", str(run), "--run-name", "tiny", "--resume"]) == 0
    sessions = json.loads((run / "environment.json").read_text())["sessions"]
    assert len(sessions) == 2 and all(s["world_size"] == 1 and s["device_type"] == "cpu" for s in sessions)
    assert "Trained in 2 sessions (resumed):" in (run / "report.md").read_text()
    # a fresh run in the same directory (--overwrite) starts the record afresh
    assert base_train.main([*TINY, "--run-dir", str(run), "--run-name", "tiny", "--num-iterations", "2",
                            "--overwrite"]) == 0
    assert len(json.loads((run / "environment.json").read_text())["sessions"]) == 1
    assert "sessions (resumed)" not in (run / "report.md").read_text()


def fake_run(root, name, memory, summary_extra=None, env_extra=None, metrics=None):
    """A run directory written by hand: the files base_train writes, with chosen values."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({
        "args": {"run_name": name, "total_batch_size": 4096, "max_seq_len": 256, "dataset": "embedded",
                 "data_dir": str(root / "data")},
        "model_config": {"memory": memory}, "plan": {"num_iterations": 300}, "world_size": 8}))
    summary = {"run_name": name, "stop_reason": "completed", "step": 300, "num_iterations": 300,
               "tokens": 1_228_800, "params_total": 5_242_888, "params_memory": 0, "train_time_s": 264.0,
               "wall_time_s": 300.0, "val_bpb": 2.066043, "core": -0.016284, "core_label": "CORE-19/22",
               **(summary_extra or {})}
    (run / "summary.json").write_text(json.dumps(summary))
    env = {"commit": "0123456789abcdef" * 2 + "01234567", "dirty": True, "python": "3.11.7", "torch": "2.13.0",
           "cuda": "12.8", "driver": "570.124.06", "device_type": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
           "device_count": 8, "world_size": 8, **(env_extra or {})}
    (run / "environment.json").write_text(json.dumps({"sessions": [env]}))
    records = metrics or [{"kind": "train", "step": s, "tokens": s * 4096, "loss": 8.0 - s / 100} for s in
                          range(10, 301, 10)] + [{"kind": "final", "step": 300, "tokens": 1_228_800, "val_bpb": 2.066043}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_report_reads_throughput_mfu_and_gpu_environment(tmp_path):
    run = fake_run(tmp_path, "a", "mome", {"tok_per_sec": 512_345.6, "tok_per_sec_steps": 297, "mfu": 41.234,
                                           "tok_per_sec_all_steps": 498_765.4, "tok_per_sec_window": "4-300"})
    md = report.run_report(run)
    assert table_value(md, "throughput (tok/s)") == ("512,346 (timed steps: 297; all steps incl. warm-up: 498,765; "
                                                      "tok_per_sec_window: 4-300)")
    assert table_value(md, "MFU") == "41.23%"
    assert table_value(md, "hardware") == "8 x NVIDIA H100 80GB HBM3 visible"
    assert table_value(md, "software") == "Python 3.11.7, torch 2.13.0, CUDA 12.8, driver 570.124.06"
    assert table_value(md, "code") == "`0123456789ab` (dirty: uncommitted changes)"
    assert table_value(md, "CORE") == "-0.0163 (CORE-19/22)" and table_value(md, "last train loss") == "5.000000"
    assert table_value(md, "wall time") == "5.0 min" and table_value(md, "data").startswith("embedded in `")
    # keys an older run (or a CPU run) lacks are "n/a", never invented
    (run / "summary.json").write_text(json.dumps({"run_name": "a", "step": 3, "mfu": 0.0}))
    (run / "environment.json").unlink()
    md = report.run_report(run)
    for key in ("throughput (tok/s)", "val bpb", "code", "software", "hardware", "world size"):
        assert table_value(md, key) == "n/a", key
    assert table_value(md, "MFU") == "n/a (no peak FLOP/s known for this device)"


def test_comparison_report_curves_and_readme_table(tmp_path, capsys):
    a = fake_run(tmp_path / "runs", "speedrun_cpu_base", "base", {"tok_per_sec": 4655.0})
    b = fake_run(tmp_path / "runs", "speedrun_cpu_mome", "mome",
                 {"params_total": 8_401_208, "params_memory": 3_145_728, "val_bpb": 2.05331, "core": None},
                 {"dirty": False, "device_type": "cpu", "cpu": "AMD EPYC", "cpu_count": 2, "torch_threads": 2})
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report_cli.README_START}\n| old | table |\n{report_cli.README_END}\n(notes)\n")
    assert report_cli.main([str(a), str(b), "--title", "CPU demo", "--readme", str(readme)]) == 0
    rows = ["| speedrun_cpu_base | base | 5,242,888 | 0 | 300 | 1,228,800 | 4.4 | 2.0660 | -0.0163 (CORE-19/22) |",
            "| speedrun_cpu_mome | mome | 8,401,208 | 3,145,728 | 300 | 1,228,800 | 4.4 | 2.0533 | n/a |"]
    out = capsys.readouterr().out
    assert out.splitlines()[2:4] == rows and report.COMPARISON_HEADER in out
    md = (tmp_path / "runs" / "report.md").read_text()
    assert md.startswith("# CPU demo\n\n" + report.COMPARISON_HEADER) and all(r in md for r in rows)
    assert "| speedrun_cpu_mome | `0123456789ab` (clean) | CPU: AMD EPYC (2 cores, 2 torch threads) | 8 |" in md
    assert "![train loss and val bpb against tokens](report_curves.png)" in md
    assert "| speedrun_cpu_base | 4,655 | n/a | 5.0 |" in md  # no "mfu" key in this summary
    assert (tmp_path / "runs" / "report_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = readme.read_text()
    assert text == ("intro\n" + report_cli.README_START + "\n" + "\n".join(report.comparison_table(
        [report.run_facts(a), report.run_facts(b)])) + "\n" + report_cli.README_END + "\n(notes)\n")
    assert "| old | table |" not in text and rows[0] in text
    # errors: not a run directory, a README without the markers
    assert report_cli.main([str(tmp_path / "nothing")]) == 2
    assert "neither config.json nor summary.json" in capsys.readouterr().err
    readme.write_text("no markers\n")
    assert report_cli.main([str(a), "--no-curves", "--output", str(tmp_path / "c.md"), "--readme", str(readme)]) == 2
    assert "<!-- cpu-demo-table -->" in capsys.readouterr().err
    # a single run: the default comparison file does not overwrite the run's own report.md
    assert report_cli.main([str(a), "--no-curves"]) == 0 and (a / "comparison.md").is_file()
    assert report_cli.main([str(a), "--run-report"]) == 0 and (a / "report.md").read_text().startswith("# Run report")


def test_readme_cpu_demo_table_is_the_report_table():
    """The README's CPU-demo figures sit between the markers scripts.report --readme rewrites, in its format."""
    text = (REPO / "README.md").read_text()
    assert text.count(report_cli.README_START) == 1 and text.count(report_cli.README_END) == 1
    block = text.split(report_cli.README_START)[1].split(report_cli.README_END)[0].strip().splitlines()
    assert block[0] == report.COMPARISON_HEADER and len(block) == 4
    assert [row.split(" | ")[0] for row in block[2:]] == ["| speedrun_cpu_base", "| speedrun_cpu_mome"]


def test_git_state(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    assert report.git_state(tmp_path) == {"commit": None, "dirty": None}
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f.txt").write_text("a")
    subprocess.run([*git, "-C", str(tmp_path), "add", "f.txt"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-qm", "x"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    (tmp_path / "untracked.txt").write_text("not part of the code")
    assert report.git_state(tmp_path) == {"commit": head.strip(), "dirty": False}
    (tmp_path / "f.txt").write_text("b")
    assert report.git_state(tmp_path) == {"commit": head.strip(), "dirty": True}


def test_check_completed_stops_the_cpu_demo_on_an_interrupted_model(tmp_path, capsys):
    """speedrun.sh's CPU demo runs `scripts.report --check-completed` after each model: a model stopped by Ctrl-C
    or SIGTERM (base_train exits 0 after saving) is reported as stopped at its step, not as done."""
    from scripts.report import main

    done = fake_run(tmp_path, "done", "base")
    stopped = fake_run(tmp_path, "stopped", "mome", {"stop_reason": "interrupted", "step": 120})
    killed = fake_run(tmp_path, "killed", "mome")
    (killed / "summary.json").unlink()
    assert main([str(done), "--check-completed"]) == 0
    assert main([str(done), str(stopped), str(killed), "--check-completed"]) == 1
    err = capsys.readouterr().err
    assert f"not completed: {stopped}: stopped at step 120 of 300 (stop reason: interrupted)" in err
    assert f"not completed: {killed}: no summary.json" in err and f"{done}:" not in err
    # the demo models' flags come before cpu_demo (the one preflight start before the demo checks them too)
    flags, demo = (REPO / "speedrun.sh").read_text().split("cpu_demo() {")
    demo = demo.split("\n}\n")[0]
    assert "--resume auto" in flags.split("common=(")[1]  # running the demo again continues an interrupted model
    for run in ("base", "mome"):
        assert f'--run-dir "$root/{run}"' in flags.split(f"{run}=(")[1].split("\n")[0]
        assert demo.index(f'train_demo "$root/{run}" "${{{run}[@]}}"') < demo.index(f'finished "$root/{run}"') \
            < demo.index("scripts.report \"$root/base\" \"$root/mome\"")


def test_comparison_and_curves_with_a_run_killed_before_its_first_log_and_a_diverged_one(tmp_path, capsys):
    """One run without metrics.jsonl stopped the whole comparison; a NaN val bpb read "n/a" like "not evaluated",
    hiding the divergence; `plot curves` stopped when one run lacked the metric."""
    from scripts import plot

    a = fake_run(tmp_path / "runs", "a", "base")
    b = fake_run(tmp_path / "runs", "b", "mome", {"val_bpb": float("nan"), "stop_reason": "nonfinite_loss"})
    (b / "metrics.jsonl").unlink()
    assert report_cli.main([str(a), str(b), "--output", str(tmp_path / "c.md")]) == 0
    md = (tmp_path / "c.md").read_text()
    assert "| b | mome |" in md and "| NaN |" in md
    assert "b: no metrics.jsonl (stopped before its first log): no curves" in md
    assert (tmp_path / "c_curves.png").is_file()
    out = tmp_path / "curves"
    paths = plot.plot_curves([a, b], "val_bpb", out)
    assert paths and "b: no 'val_bpb' values, left out of the plot" in capsys.readouterr().err
    with pytest.raises(plot.PlotError, match="no run has 'grad_norm' values"):
        plot.plot_curves([a, b], "grad_norm", out)


def test_comparison_table_marks_a_run_stopped_at_its_wall_time_limit():
    """A --max-wall-time-seconds stop runs the final evaluation, so its summary has a val bpb (an interrupted run's
    has none): the table says the run is unfinished beside its steps, and a completed run's row is unchanged."""
    def row(**summary):
        facts = {"run_name": "r", "memory": "mome", "plan": {}, "summary": {"step": 120, "num_iterations": 300,
                                                                          "val_bpb": 2.5, **summary}}
        return report.comparison_table([facts])[-1].split(" | ")

    assert row(stop_reason="wall_time_limit")[4] == "120 of 300 (wall_time_limit)"
    assert row(stop_reason="completed", step=300)[4] == "300"


def test_a_run_whose_lrs_were_overridden_on_a_resume_says_so_in_its_report_and_the_comparison(tmp_path, capsys):
    """A run finished by hand with --resume-override-lr (a non-finite stop's advice) read like one trained with the
    flags' LRs throughout: its report.md and the speedrun/CPU-demo comparison now name each change on one line, from
    config.json's lr_overrides; a run without overrides (or an older one) has no such line."""
    a = fake_run(tmp_path / "runs", "a", "base")
    b = fake_run(tmp_path / "runs", "b", "mome")
    config = json.loads((b / "config.json").read_text())
    config["lr_overrides"] = [{"step": 120, "changes": {"matrix_lr": {"checkpoint": 0.02, "now": 0.01},
                                                        "memory_lr": {"checkpoint": 0.3, "now": 0.15}}},
                              {"step": 200, "changes": {"matrix_lr": {"checkpoint": 0.01, "now": 0.005}}}]
    (b / "config.json").write_text(json.dumps(config))
    changes = ("--matrix-lr 0.02 -> 0.01 from step 120, --memory-lr 0.3 -> 0.15 from step 120, --matrix-lr 0.01 -> "
               "0.005 from step 200")
    assert table_value(report.run_report(b), "learning rates") == f"overridden by hand (--resume-override-lr): {changes}"
    assert "| learning rates |" not in report.run_report(a)
    out = tmp_path / "comparison.md"
    assert report_cli.main([str(a), str(b), "--no-curves", "--output", str(out)]) == 0
    md = out.read_text()
    assert f"- b: learning rates overridden by hand (--resume-override-lr): {changes}\n" in md
    assert md.count("overridden by hand") == 1
    # the line follows the table it qualifies
    table_end = md.index("| b | mome |")
    assert table_end < md.index("- b: learning rates") < md.index("## Throughput")


def test_the_readme_table_marks_a_row_whose_lrs_were_overridden_and_says_how_under_it(tmp_path, capsys):
    """The README's CPU-demo table (--readme) was the bare table: a model finished by hand with other LRs (a
    non-finite stop's advice) read as trained with the demo's. Its row is marked and one line under the table (after
    a blank line: a line right below a table is one of its rows) says how; a table without overrides is as before."""
    a = fake_run(tmp_path / "runs", "speedrun_cpu_base", "base")
    b = fake_run(tmp_path / "runs", "speedrun_cpu_mome", "mome")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report_cli.README_START}\n{report_cli.README_END}\n")
    config = json.loads((a / "config.json").read_text())
    config["lr_overrides"] = [{"step": 40, "changes": {"matrix_lr": {"checkpoint": 0.02, "now": 0.01}}}]
    (a / "config.json").write_text(json.dumps(config))
    args = [str(a), str(b), "--no-curves", "--output", str(tmp_path / "c.md"), "--readme", str(readme)]
    assert report_cli.main(args) == 0
    block = readme.read_text().split(report_cli.README_START + "\n")[1].split(report_cli.README_END)[0]
    rows = report.comparison_table([report.run_facts(a), report.run_facts(b)])
    marked = rows[2].replace("| speedrun_cpu_base |", "| speedrun_cpu_base † |")
    assert marked != rows[2] and rows[3].startswith("| speedrun_cpu_mome | mome |")
    note = "† speedrun_cpu_base: learning rates overridden by hand (--resume-override-lr): --matrix-lr 0.02 -> 0.01 " \
           "from step 40"
    assert block == "\n".join([*rows[:2], marked, rows[3], "", note, ""])
    assert capsys.readouterr().out.startswith(block)  # what it prints is what the README shows
    (a / "config.json").write_text(json.dumps({**config, "lr_overrides": []}))
    assert report_cli.main(args) == 0
    assert readme.read_text().split(report_cli.README_START + "\n")[1] == "\n".join([*rows, report_cli.README_END, ""])


def test_two_overridden_runs_get_two_notes_that_markdown_keeps_apart(tmp_path):
    """Each note under the README table is its own paragraph: two lines with nothing between them are one markdown
    paragraph, so two runs' notes read as one sentence. A blank line before each note keeps them apart (and keeps the
    first off the table); each run still has one note, in the table's row order."""
    runs = [fake_run(tmp_path / "runs", name, "mome") for name in ("r1", "r2", "r3")]
    for run, lr in ((runs[0], 0.01), (runs[2], 0.005)):
        config = json.loads((run / "config.json").read_text())
        config["lr_overrides"] = [{"step": 40, "changes": {"matrix_lr": {"checkpoint": 0.02, "now": lr}}}]
        (run / "config.json").write_text(json.dumps(config))
    facts = [report.run_facts(r) for r in runs]
    lines = report_cli.readme_table(facts)
    rows = report.comparison_table(facts, report_cli.LR_MARK)
    assert [r.split(" | ")[0] for r in rows[2:]] == ["| r1 †", "| r2", "| r3 †"]
    note = "† {}: learning rates overridden by hand (--resume-override-lr): --matrix-lr 0.02 -> {} from step 40"
    assert lines == [*rows, "", note.format("r1", 0.01), "", note.format("r3", 0.005)]


def full_disk_write_text(monkeypatch, victim):
    """Path.write_text truncates ``victim`` (opens it for writing) and then fails as a full disk does."""
    import errno
    import pathlib

    real = pathlib.Path.write_text

    def write_text(self, *a, **k):
        if victim in self.name:
            self.open("w").close()
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)


def test_a_full_disk_keeps_the_readme_and_is_one_error(tmp_path, capsys, monkeypatch):
    """--readme rewrote README.md in place: a full disk left it empty, with an OSError traceback (exit 1); so did
    --output."""
    a = fake_run(tmp_path / "runs", "a", "base")
    readme = tmp_path / "README.md"
    original = f"intro\n{report_cli.README_START}\n| old |\n{report_cli.README_END}\n"
    readme.write_text(original)
    full_disk_write_text(monkeypatch, "README")
    assert report_cli.main([str(a), "--no-curves", "--output", str(tmp_path / "c.md"), "--readme", str(readme)]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot write {readme}: [Errno 28] No space left on device")
    assert readme.read_text() == original and not list(tmp_path.glob("README*.tmp"))
    full_disk_write_text(monkeypatch, "c.md")
    assert report_cli.main([str(a), "--no-curves", "--output", str(tmp_path / "c.md")]) == 2
    assert f"error: cannot write {tmp_path / 'c.md'}: [Errno 28]" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--check-completed", "--run-report"], ["--check-completed", "--output", "x.md"],
                                   ["--run-report", "--readme", "R.md"], ["--run-report", "--no-curves"]])
def test_flags_of_another_mode_are_refused(tmp_path, capsys, flags):
    """--check-completed silently won over --run-report, and each mode ignored the other modes' flags."""
    with pytest.raises(SystemExit) as e:
        report_cli.main([str(tmp_path), *flags])
    assert e.value.code == 2 and "cannot be combined" in capsys.readouterr().err


def test_a_summary_that_is_not_a_json_object_is_one_error(tmp_path, capsys):
    """summary.json holding a list was an AttributeError traceback in every mode."""
    a = fake_run(tmp_path, "a", "mome")
    (a / "summary.json").write_text("[1, 2]")
    for extra in (["--check-completed"], ["--run-report"], ["--no-curves"]):
        assert report_cli.main([str(a), *extra]) == 2
        assert f"error: {a / 'summary.json'} is not a JSON object" in capsys.readouterr().err


def test_a_run_without_summary_reads_as_unfinished_in_the_comparison(tmp_path):
    """A run still training (no summary.json) showed a row of n/a, like a finished run that recorded nothing."""
    a = fake_run(tmp_path, "a", "mome")
    (a / "summary.json").unlink()
    row = report.comparison_table([report.run_facts(a)])[-1].split(" | ")
    assert row[4] == "n/a (not finished: no summary.json)"


def test_runs_with_the_same_name_are_told_apart_by_their_paths(tmp_path, capsys):
    """runs/a/x and runs/b/x (both named x) were two identical rows in every table of the comparison; now each
    colliding name shows the shortest end of its path that differs, and a unique name stays as it was."""
    a = fake_run(tmp_path / "runs" / "a", "x", "base")
    b = fake_run(tmp_path / "runs" / "b", "x", "mome", {"val_bpb": 2.05331})
    c = fake_run(tmp_path / "runs" / "b", "y", "mome")
    assert report_cli.main([str(a), str(b), str(c), "--output", str(tmp_path / "c.md")]) == 0
    md = (tmp_path / "c.md").read_text()
    for row in ("| a/x | base | 5,242,888 |", "| b/x | mome | 5,242,888 |", "| y | mome |",  # results
                "| a/x | n/a | n/a | 5.0 |", "| b/x | n/a | n/a | 5.0 |",  # throughput
                "| a/x | `0123456789ab` (dirty: uncommitted changes) |", "| b/x | `0123456789ab`"):  # provenance
        assert md.count(row) == 1, (row, md)
    assert "| x |" not in md and "| b/y |" not in md
    assert "| b/x | mome | 5,242,888 | 0 | 300 | 1,228,800 | 4.4 | 2.0533 |" in capsys.readouterr().out


def test_run_labels_show_the_name_and_the_path_that_differs():
    def facts(run_dir, name):
        return {"run_dir": run_dir, "run_name": name}

    # the run name is not the directory's: it stays in front of the distinguishing path
    assert report.run_labels([facts("/r/s1/seed0", "mome"), facts("/r/s2/seed0", "mome"), facts("/r/s1/b", "base")]) \
        == ["mome (s1/seed0)", "mome (s2/seed0)", "base"]
    # paths of different depths; three runs of one name, two of which share their parent's name
    assert report.run_labels([facts("/r/a/x", "x"), facts("/q/a/x", "x"), facts("/x", "x")]) == ["r/a/x", "q/a/x", "/x"]
    # the same directory given twice is one run shown twice: the same row, as it is the same run
    assert report.run_labels([facts("/r/a/x", "x"), facts("/r/a/x", "x")]) == ["x", "x"]


def test_the_report_says_which_rows_the_train_bpb_read(tmp_path):
    """report.md named no rows for its train bpb, which moved to the first-read documents on 2026-11-27."""
    run = fake_run(tmp_path, "a", "base", {"train_bpb": 0.91, "train_bpb_rows": "first read with --data-seed 7"})
    md = report.run_report(run)
    assert table_value(md, "train bpb") == "0.910000"
    assert table_value(md, "train bpb rows") == "first read with --data-seed 7"
    (run / "summary.json").write_text(json.dumps({"run_name": "a", "step": 3, "train_bpb": 0.91}))
    assert table_value(report.run_report(run), "train bpb rows") == "manifest order (before 2026-11-27)"
    (run / "summary.json").write_text(json.dumps({"run_name": "a", "step": 3}))
    assert "| train bpb rows |" not in report.run_report(run)


def test_the_data_row_shows_the_data_dir_the_checkpoints_record(tmp_path):
    """A run on the default data dir (no --data-dir) showed `embedded in `the default data dir``, and no manifest
    source: the path its checkpoints' meta.json record, resolved ($NANOCHAT_DATA_DIR or the cache), is the one."""
    run = fake_run(tmp_path, "a", "base")
    config = json.loads((run / "config.json").read_text())
    config["args"]["data_dir"] = None
    (run / "config.json").write_text(json.dumps(config))
    assert table_value(report.run_report(run), "data") == "embedded in `the default data dir`"  # no checkpoint yet
    data = tmp_path / "cache" / "embedded"
    data.mkdir(parents=True)
    (data / "manifest.json").write_text(json.dumps({"source": "data/embedded"}))
    for step, where in ((2, tmp_path / "old"), (4, data)):  # the last checkpoint's
        ckpt.step_dir(run, step).mkdir(parents=True)
        (ckpt.step_dir(run, step) / "meta.json").write_text(json.dumps({"model_config": {"memory": "base"},
                                                                        "data_dir": str(where)}))
    assert table_value(report.run_report(run), "data") == f"embedded in `{data}` (source: data/embedded)"


def test_config_json_records_the_data_dir_resolved_and_the_report_reads_it_from_anywhere(
        tmp_path, monkeypatch, embedded_data_dir, tiny_tokenizer_dir):
    """config.json's "data" recorded a relative --data-dir as given ("data"): a report of a run with no checkpoint yet,
    read from another directory, named `data` and read no manifest (or another one). It records the resolved path,
    as meta.json's data_dir and tokenizer_dir; an older config.json (no "data" "data_dir") reads as it did."""
    from nanochat.train_args import parse_args
    from nanochat.train_setup import load_run_data

    work = tmp_path / "work"
    work.mkdir()
    (work / "data").symlink_to(embedded_data_dir)
    (work / "tok").symlink_to(tiny_tokenizer_dir)
    monkeypatch.chdir(work)
    args = parse_args(["--data-dir", "data", "--tokenizer-dir", "tok", "--dataset", "embedded"])
    data = load_run_data(args, 0, 1, "cpu")
    data.val_rows = torch.zeros(0, 1)  # load_eval_rows' work, not needed for the record
    recorded = data.describe()
    assert recorded["data_dir"] == str(embedded_data_dir.resolve()), recorded
    assert recorded["source"] == f"{embedded_data_dir.resolve()} (tokenizer {tiny_tokenizer_dir.resolve()})", recorded
    run = fake_run(tmp_path, "r", "base")
    config = json.loads((run / "config.json").read_text())
    config["args"]["data_dir"], config["data"] = "data", recorded
    (run / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)  # the report is read elsewhere: the relative flag no longer names the data
    assert table_value(report.run_report(run), "data") == \
        f"embedded in `{embedded_data_dir.resolve()}` (source: data/embedded)"
    del config["data"]["data_dir"]  # an older run's config.json: the flag as given, as before
    (run / "config.json").write_text(json.dumps(config))
    assert table_value(report.run_report(run), "data") == "embedded in `data`"
