"""MFU peak lookup (GPU names as torch reports them), the console line, and W&B run ids across resumes."""

import json
import sys
import types

import pytest
import torch

from nanochat.metrics import (PEAK_BF16_FLOPS, WANDB_ID_FILE, MetricsLogger, format_step_line, gpu_peak_flops, mfu,
                              peak_flops)

# torch.cuda.get_device_name() strings -> dense BF16 peak (None: unknown, MFU n/a)
NAMES = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA GB200": 2500e12,
    "NVIDIA RTX PRO 6000 Blackwell Workstation Edition": 503.8e12,
    "NVIDIA RTX PRO 6000 Blackwell Server Edition": 503.8e12,
    "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition": None,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A10": 125e12,
    "NVIDIA A10G": None,
    "NVIDIA L4": 121e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA L40": None,
    "NVIDIA GeForce RTX 4090": 165.2e12,
    "NVIDIA GeForce RTX 5090": 209.5e12,
    "NVIDIA GeForce RTX 3090": None,
    "Tesla V100-SXM2-32GB": None,
    "NVIDIA H800": None,
}


@pytest.mark.parametrize("name", NAMES)
def test_gpu_peak_by_name(name):
    assert gpu_peak_flops(name) == NAMES[name]


def test_variants_precede_their_family():
    """A later, more general pattern would also match the variant: the order is what picks the variant's peak."""
    patterns = [p for p, _ in PEAK_BF16_FLOPS]
    for variant, family in (("H100.*PCIe", "H100"), ("H100.*NVL", "H100"), ("GH200", "H200"), ("H200.*NVL", "H200"),
                            ("GB200", "B200"), ("RTX PRO 6000 Blackwell.*Max-Q", "RTX PRO 6000 Blackwell"),
                            (r"\bA10G\b", r"\bA10\b")):
        assert patterns.index(variant) < patterns.index(family), (variant, family)


def test_unknown_peak_reports_na_not_zero():
    assert peak_flops(torch.device("cpu")) is None
    assert mfu(1e15, 1.0, None, 8) is None and mfu(1e15, 1.0, 989e12, 1) == pytest.approx(100e15 / 989e12)
    line = format_step_line(5, 10, 3.0, 1.0, 0.5, 1000.0, None, 10.0)
    assert "| mfu n/a |" in line
    assert "| mfu 41.20 |" in format_step_line(5, 10, 3.0, 1.0, 0.5, 1000.0, 41.2, 10.0)


def test_run_report_explains_a_missing_mfu():
    from nanochat.report import NA, fmt_mfu

    env = {"device_name": "NVIDIA H800"}
    assert fmt_mfu({"mfu": None, "tok_per_sec": 1e5}, env) == f"{NA} (no peak FLOP/s known for NVIDIA H800)"
    assert fmt_mfu({"mfu": None, "tok_per_sec": None}, env) == NA  # no timed steps: nothing to explain
    assert fmt_mfu({"mfu": 12.345}, env) == "12.35%"


class FakeWandb(types.ModuleType):
    """Records wandb.init kwargs and logged rows; no network, no files."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged = [], []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, row, step):
                fake.logged.append((kwargs["id"], step, row))

            def finish(self):
                pass

        return Run()


def test_wandb_resume_reuses_the_run_id(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    first = MetricsLogger(tmp_path, 0, "offline", "proj", "r", {})
    first.log({"kind": "train", "step": 1, "loss": 2.0})
    first.close()
    MetricsLogger(tmp_path, 0, "offline", "proj", "r", {}, resume_step=1).close()
    MetricsLogger(tmp_path, 0, "offline", "proj", "r", {}).close()  # a fresh start: a new W&B run
    ids = [kw["id"] for kw in fake.inits]
    assert ids[0] == ids[1] != ids[2] and all(kw["resume"] == "allow" for kw in fake.inits)
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == ids[2]
    assert fake.logged == [(ids[0], 1, {"train/loss": 2.0})]
    MetricsLogger(tmp_path, 1, "offline", "proj", "r", {}, resume_step=1).close()  # ranks != 0 never call W&B
    assert len(fake.inits) == 3


def test_online_resume_rewinds_the_wandb_run_to_the_checkpoint_step(tmp_path, monkeypatch, capsys):
    """Steps logged after the checkpoint by the interrupted session are cut from the W&B run (its "rewind"), so the
    resumed steps are not dropped as non-monotonic; a server that cannot rewind still gets the run, with a warning."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    MetricsLogger(tmp_path, 0, "online", "proj", "r", {}).close()
    run_id = fake.inits[0]["id"]
    MetricsLogger(tmp_path, 0, "online", "proj", "r", {}, resume_step=40).close()
    rewind = fake.inits[1]
    assert rewind["resume_from"] == f"{run_id}?_step=40" and "resume" not in rewind and "id" not in rewind

    def init_without_rewind(**kwargs):
        if "resume_from" in kwargs:
            raise RuntimeError("rewind is not enabled on this server")
        return FakeWandb.init(fake, **kwargs)

    fake.init = init_without_rewind
    logger = MetricsLogger(tmp_path, 0, "online", "proj", "r", {}, resume_step=40)
    logger.log({"kind": "train", "step": 41, "loss": 1.5})
    assert fake.inits[-1]["id"] == run_id and fake.inits[-1]["resume"] == "allow"
    assert fake.logged[-1] == (run_id, 41, {"train/loss": 1.5})
    assert "could not rewind W&B run" in capsys.readouterr().out
    # a resume of a run that never logged to W&B (no recorded id): a new W&B run, nothing to rewind
    (tmp_path / WANDB_ID_FILE).unlink()
    MetricsLogger(tmp_path, 0, "online", "proj", "r", {}, resume_step=40).close()
    assert "resume_from" not in fake.inits[-1] and fake.inits[-1]["id"] != run_id
    assert "could not rewind" not in capsys.readouterr().out


def test_trainer_resume_continues_the_wandb_run(tmp_path, monkeypatch):
    """base_train end to end: an interrupted run resumed with --resume logs to the same W&B run id."""
    import shutil

    from nanochat import checkpoint as ckpt
    from test_train_e2e import train

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "r"
    flags = ("--num-iterations", "4", "--save-every", "2", "--wandb", "offline")
    assert train(run, *flags) == 0
    shutil.rmtree(ckpt.step_dir(run, 4))
    assert train(run, *flags, "--resume") == 0
    first, resumed = fake.inits
    assert resumed["id"] == first["id"] and resumed["resume"] == "allow"
    assert [step for run_id, step, row in fake.logged if "train/loss" in row] == [1, 2, 3, 4, 3, 4]
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "completed"
