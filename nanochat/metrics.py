"""Run logging: ``metrics.jsonl`` (one JSON object per record, rank 0), optional W&B, the console step line, MFU.

metrics.jsonl is the source of truth (plots and tables read it); W&B is an optional mirror, off by default.
Every record carries a ``kind`` ("train", "eval", "core", "final") so one file holds the whole run.
"""

import json
import math
import os
from pathlib import Path

import torch

# Dense BF16 peak FLOP/s of one GPU, matched by substring of torch.cuda.get_device_name(); unknown GPUs -> MFU 0.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
    ("RTX 4090", 165e12),
)


def peak_flops(device: torch.device) -> float:
    """Peak BF16 FLOP/s of ``device``; 0.0 when unknown (CPU, MPS, unlisted GPUs) so MFU reports 0."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS:
        if key in name:
            return value
    return 0.0


def mfu(flops_per_step: float, dt: float, peak_per_device: float, world_size: int) -> float:
    """Model FLOPs utilisation in percent (0 when the peak is unknown)."""
    if peak_per_device <= 0 or dt <= 0:
        return 0.0
    return 100.0 * flops_per_step / dt / (peak_per_device * world_size)


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def format_step_line(step: int, num_iterations: int, loss: float, lrm: float, dt: float, tok_per_sec: float,
                     mfu_pct: float, eta_seconds: float) -> str:
    """``step`` is the number of optimizer steps completed (1..N)."""
    pct = 100.0 * step / num_iterations
    return (f"step {step:05d}/{num_iterations:05d} ({pct:5.1f}%) | loss {loss:.6f} | lrm {lrm:.3f} | "
            f"dt {dt * 1000:.0f}ms | tok/s {tok_per_sec:,.0f} | mfu {mfu_pct:.2f} | eta {format_eta(eta_seconds)}")


def truncate_metrics(path: Path, last_step: int) -> None:
    """On resume: drop records logged after the checkpoint step, so the file reads like one uninterrupted run."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a torn last line from a crash
            continue
        if rec.get("step", 0) <= last_step and rec.get("kind") != "final":
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)


class MetricsLogger:
    """Appends records to ``<run_dir>/metrics.jsonl`` and mirrors them to W&B; a no-op on ranks != 0."""

    def __init__(self, run_dir: Path, rank: int, wandb_mode: str = "off", project: str = "mome-nanochat",
                 run_name: str = "", config: dict | None = None):
        self.enabled = rank == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a") if self.enabled else None
        self._wandb = None
        if self.enabled and wandb_mode != "off":
            import wandb  # imported lazily: optional and slow to import

            self._wandb = wandb.init(project=project, name=run_name, config=config or {}, mode=wandb_mode,
                                     dir=str(run_dir), resume="allow")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a crash must not lose already-logged steps
        if self._wandb is not None:
            flat = {f"{record.get('kind', 'train')}/{k}": v for k, v in record.items()
                    if isinstance(v, (int, float)) and k != "step"}
            self._wandb.log(flat, step=record.get("step", 0))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
