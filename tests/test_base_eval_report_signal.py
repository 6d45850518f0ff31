"""A signal that comes once base_eval's last report is written (or in that write's step, under torchrun) stops
nothing: the evaluation is complete, so it finishes (the partial files deleted) and exits 0."""

import json
import os
import signal
from pathlib import Path

import pytest

import base_eval_fixtures
from base_eval_fixtures import _eval_args
from conftest import run_torchrun

tiny_run = base_eval_fixtures.tiny_run  # the fixture (module scope: one tiny trained run for this file)


def test_a_signal_after_the_report_finishes_the_evaluation(tiny_run, tmp_path, monkeypatch, capsys):
    """One process: SIGTERM while the finished partial file is being deleted (the report is on disk)."""
    from nanochat import eval_resume
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"
    real = eval_resume.FinishedResults.discard

    def discard(self):
        os.kill(os.getpid(), signal.SIGTERM)
        real(self)

    monkeypatch.setattr(eval_resume.FinishedResults, "discard", discard)
    assert main(_eval_args(root, bundle, out, "--eval", "core")) == 0
    assert "interrupted" not in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["core.csv", "core.json", "core.md"]


@pytest.mark.slow
def test_two_ranks_finish_when_a_signal_comes_in_the_report_write(tiny_run, tmp_path):
    """Under torchrun (2 gloo ranks) SIGTERM reaches rank 0 as it writes the CORE report, the evaluation's last
    write: the vote of that step comes once the report is on disk, so every rank finishes and exits 0 (it used to
    exit 143, with the partial file left beside the complete report). Slow: a torchrun launch, ~15 s on 2 cores."""
    root, _, _, bundle = tiny_run
    out = tmp_path / "o"
    res = run_torchrun(Path(__file__).parent / "_base_eval_worker.py", 2,
                       ["--sigterm-in", "nanochat.core_eval:write_core_report", "0", "--run-dir", str(root / "run"),
                        "--bundle", str(bundle), "--eval", "core", "--no-progress", "--device-type", "cpu",
                        "--out-dir", str(out)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "base_eval: interrupted" not in res.stderr, res.stderr[-3000:]
    assert res.stdout.count("SIGTERM came as the report was written: the evaluation is complete") == 1, res.stdout
    assert sorted(p.name for p in out.iterdir()) == ["core.csv", "core.json", "core.md"]
    assert json.loads((out / "core.json").read_text())["tasks"]["lm"]["n"] == 3
