"""Run logging: ``metrics.jsonl`` (one JSON object per record, rank 0), optional W&B, the console step line, MFU.

metrics.jsonl is the source of truth (plots and tables read it); W&B is an optional mirror, off by default.
Every record carries a ``kind`` ("train", "eval", "core", "final"; "resume" for --resume-override-lr and
--resume-new-world-size; "sample" for --sample-every; "stop", with its "reason", for a stop by
--max-wall-time-seconds ("wall_time_limit"), by a signal during the final evaluation ("interrupted", "during":
"final_eval"), or by an error in the final evaluation ("final_eval_error") or during training ("error"); a signal
during training writes none: its checkpoint and summary.json say it) so one file holds the whole run.
"""

import json
import math
import re
import secrets
from pathlib import Path

import torch

from nanochat.jsonfile import write_text_atomic

# Dense BF16 tensor-core peak FLOP/s of one GPU, matched against torch.cuda.get_device_name() in order (first match
# wins, so variants precede their family: "H100 PCIe" before "H100", "GB200" before "B200", "GH200" before "H200").
# Sources: NVIDIA datasheets. Their "BF16 Tensor Core" row quotes 2:4 sparsity; dense is half of it (H100 SXM 1,979
# -> 989 TF). GeForce/RTX numbers are the "FP16 Tensor with FP32 accumulate" (= BF16) dense rate from the Ada and
# Blackwell architecture whitepapers. None marks a known variant whose peak we do not have: MFU is then n/a, never a
# number computed against another GPU's peak.
PEAK_BF16_FLOPS: tuple[tuple[str, float | None], ...] = (
    (r"H100.*NVL", 835e12),  # H100 NVL (94 GB, PCIe): 1,671 TF sparse
    (r"H100.*PCIe", 756e12),  # H100 PCIe: 1,513 TF sparse
    (r"H100", 989e12),  # H100 SXM ("NVIDIA H100 80GB HBM3"; the paper names only "H100 (80GB)"): 1,979 TF sparse
    (r"GH200", 989e12),  # GH200 Grace Hopper: the H100 SXM/H200 GPU
    (r"H200.*NVL", 835e12),  # H200 NVL: 1,671 TF sparse
    (r"H200", 989e12),  # H200 SXM: 1,979 TF sparse
    (r"GB200", 2500e12),  # GB200: 10 PF sparse per superchip of 2 GPUs
    (r"B200", 2250e12),  # HGX B200: 36 PF sparse per 8 GPUs
    (r"RTX PRO 6000 Blackwell.*Max-Q", None),  # 300 W variant, lower clocks than the row below
    (r"RTX PRO 6000 Blackwell", 503.8e12),  # Workstation/Server Edition (the paper's other GPU): 1,007.6 TF sparse
    (r"A100", 312e12),  # A100 SXM and PCIe: 624 TF sparse
    (r"L40S", 362e12),  # L40S: 733 TF sparse
    (r"\bL4\b", 121e12),  # L4: 242 TF sparse
    (r"\bA10G\b", None),  # AWS variant of the A10 with other clocks
    (r"\bA10\b", 125e12),  # A10: 250 TF sparse
    (r"RTX 5090", 209.5e12),  # GeForce RTX 5090 (Blackwell whitepaper)
    (r"RTX 4090", 165.2e12),  # GeForce RTX 4090 (Ada whitepaper)
)


def gpu_peak_flops(name: str) -> float | None:
    """Dense BF16 peak FLOP/s for a CUDA device name; None when unknown."""
    for pattern, value in PEAK_BF16_FLOPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return value
    return None


def peak_flops(device: torch.device) -> float | None:
    """Peak BF16 FLOP/s of ``device``; None when unknown (CPU, MPS, unlisted GPUs), so MFU reports n/a."""
    if device.type != "cuda":
        return None
    return gpu_peak_flops(torch.cuda.get_device_name(device))


def mfu(flops_per_step: float, dt: float, peak_per_device: float | None, world_size: int) -> float | None:
    """Model FLOPs utilisation in percent; None when the peak is unknown or dt is not positive."""
    if not peak_per_device or dt <= 0:
        return None
    return 100.0 * flops_per_step / dt / (peak_per_device * world_size)


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def format_step_line(step: int, num_iterations: int, loss: float, lrm: float, dt: float, tok_per_sec: float,
                     mfu_pct: float | None, eta_seconds: float) -> str:
    """``step`` is the number of optimizer steps completed (1..N); ``mfu_pct`` None (unknown peak) prints n/a."""
    pct = 100.0 * step / num_iterations
    util = "n/a" if mfu_pct is None else f"{mfu_pct:.2f}"
    return (f"step {step:05d}/{num_iterations:05d} ({pct:5.1f}%) | loss {loss:.6f} | lrm {lrm:.3f} | "
            f"dt {dt * 1000:.0f}ms | tok/s {tok_per_sec:,.0f} | mfu {util} | eta {format_eta(eta_seconds)}")


# The records of a step's periodic work (evals, samples), which a signal stop's checkpoint saved before running
PERIODIC_WORK_KINDS = ("eval", "core", "sample")


def held_by_checkpoint(rec: dict, saved: dict) -> bool:
    """Whether a "resume" record's changes are among ``saved`` (lists by key, as the record spells them), which
    then gives them up: a checkpoint's history entry accounts for one record."""
    parts = {k: rec[k] for k in saved if k in rec}
    if any(v not in saved[k] for k, v in parts.items()):
        return False
    for k, v in parts.items():
        saved[k].remove(v)
    return True


def kept_on_resume(rec: dict, last_step: int, pending: bool, saved: dict | None) -> bool:
    """Whether a resume from checkpoint ``last_step`` keeps the record (see truncate_metrics)."""
    step, kind = rec.get("step", 0), rec.get("kind")
    if step > last_step or kind == "final":  # the end's evaluation is redone
        return False
    if step < last_step:
        return True
    if kind in PERIODIC_WORK_KINDS:
        # of a pending step, only a resume that died before it saved again logged them (the signal stop itself
        # ran none), and this resume runs them again
        return not pending
    if kind == "resume" and saved is not None:
        return held_by_checkpoint(rec, saved)
    return True  # the step's train record, and "stop" records (session boundaries)


def truncate_metrics(path: Path, last_step: int, pending: bool = False, saved_changes: dict | None = None) -> None:
    """On resume: drop records logged after the checkpoint step, so the file reads like one uninterrupted run.
    ``pending``: the checkpoint is a signal stop's, whose step's evals and samples the resume runs (their records
    are dropped too, so that a resume that crashed after them leaves no second copy). ``saved_changes``: the
    --resume-override-lr / --resume-new-world-size changes the checkpoint holds of sessions that resumed from its
    own step ({"lr_override": [...], "world_size": [...]}); a "resume" record at that step without one is of a
    session that died or was abandoned before it saved this step again, and goes (this resume logs its own)."""
    if not path.is_file():
        return
    saved = None if saved_changes is None else {k: list(v) for k, v in saved_changes.items()}
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a torn last line from a crash
            continue
        if kept_on_resume(rec, last_step, pending, saved):
            kept.append(line)
    write_text_atomic(path, "".join(k + "\n" for k in kept))


WANDB_ID_FILE = "wandb_id.txt"


def wandb_run_id(run_dir: Path, resume: bool) -> tuple[str, bool]:
    """(the W&B run id of ``run_dir``, whether it was recorded before): the recorded one when resuming, else a new
    one (recorded for later resumes)."""
    path = Path(run_dir) / WANDB_ID_FILE
    if resume and path.is_file() and path.read_text(encoding="utf-8").strip():
        return path.read_text(encoding="utf-8").strip(), True
    run_id = secrets.token_hex(4)  # W&B ids are short [a-z0-9] strings
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id, False


def _init_wandb(run_dir: Path, mode: str, common: dict, resume_step: int | None):
    import wandb  # imported lazily: optional and slow to import

    run_id, recorded = wandb_run_id(run_dir, resume=resume_step is not None)
    if mode == "online" and recorded:  # a resume of a run that logged to W&B before
        try:
            return wandb.init(**common, resume_from=f"{run_id}?_step={resume_step}")
        except Exception as e:  # noqa: BLE001 (any refusal: a server without rewind, a run that was never synced)
            print(f"warning: could not rewind W&B run {run_id} to step {resume_step} ({type(e).__name__}: {e}); "
                  "trying to continue it without a rewind (its steps after the checkpoint would hide the resumed "
                  "ones)")
    return wandb.init(**common, id=run_id, resume="allow")


class MetricsLogger:
    """Appends records to ``<run_dir>/metrics.jsonl`` and mirrors them to W&B; a no-op on ranks != 0.

    ``resume_step`` (the checkpoint step of a resume) continues the run dir's W&B run (same id, so the curves join
    up); a fresh start gets a new one. Online, the run is rewound to ``resume_step`` first: W&B drops a logged step
    that is not above the run's last one, so the steps the interrupted session logged after its checkpoint would
    otherwise hide the resumed ones until they were passed. Rewinding is a W&B beta feature (untested here: no
    network); when the server refuses it, the run continues without it and a warning says so.
    """

    def __init__(self, run_dir: Path, rank: int, wandb_mode: str = "off", project: str = "mome-nanochat",
                 run_name: str = "", config: dict | None = None, resume_step: int | None = None):
        self.enabled = rank == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8") if self.enabled else None
        self._wandb = None
        if self.enabled and wandb_mode != "off":
            self._wandb = _init_wandb(run_dir, wandb_mode, dict(project=project, name=run_name, config=config or {},
                                                               mode=wandb_mode, dir=str(run_dir)), resume_step)

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
