"""A stop signal that arrives during the set-up (before the first step) on a run with an eval at step 0: the eval is
cut on entry and the run saves a pending checkpoint of step 0 (no optimizer state yet); its --resume runs step 0's
eval and trains like the uninterrupted run, to the bit (same process, same threads)."""

import json

import torch

from nanochat import checkpoint as ckpt
from nanochat import train_loop
from test_run_control import records
from test_train_e2e import losses, train

FLAGS = ["--num-iterations", "2", "--eval-every", "1"]


def test_a_signal_before_the_first_step_saves_step_0_pending_and_the_resume_is_exact(tmp_path, monkeypatch):
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train(ref, *FLAGS) == 0
    real_install = train_loop.StopSignal.install

    def install(self):  # a SIGTERM latched as the handler goes in, before step 0's eval
        real_install(self)
        self.received = "SIGTERM"
        return self

    monkeypatch.setattr(train_loop.StopSignal, "install", install)
    assert train(run, *FLAGS) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["step"]) == ("interrupted", 0)
    assert ckpt.list_steps(run) == [0] and ckpt.load_meta(run, 0)["loop"]["boundary_pending"] is True
    assert records(run, "eval") == [] and losses(run) == {}
    monkeypatch.undo()
    assert train(run, *FLAGS, "--resume") == 0
    assert losses(run) == losses(ref) and len(losses(ref)) == 2
    assert [(r["step"], r["val_bpb"]) for r in records(run, "eval")] == \
        [(r["step"], r["val_bpb"]) for r in records(ref, "eval")]
    want, got = (torch.load(ckpt.step_dir(d, 2) / "model.pt") for d in (ref, run))
    assert all(torch.equal(want[k], got[k]) for k in want)
