"""How a base_train run ends: summary.json (the stop reason, throughput, the error and the checkpoint to go on
from), the advice after a non-finite loss, and the stop of every rank together after an error they share."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch.distributed as dist

from nanochat import checkpoint as ckpt
from nanochat.common import print0
from nanochat.metrics import mfu, peak_flops
from nanochat.report import write_run_report
from nanochat.train_setup import write_json

if TYPE_CHECKING:
    from scripts.base_train import Run

EXIT_NONFINITE = 3
# the flag that sets each optimizer group's LR (the families' param_groups; the other groups use --matrix-lr)
GROUP_LR_FLAG = {"lm_head": "--unembedding-lr", "wte": "--embedding-lr", "resid_lambdas": "--scalar-lr",
                 "x0_lambdas": "--scalar-lr", "scalars": "--scalar-lr", "memory_tables": "--memory-lr"}


class NonFiniteLoss(RuntimeError):
    pass


class NonFiniteParams(NonFiniteLoss):
    """The parameters (or optimizer state) about to be saved hold NaN or inf; ``names`` says which."""

    def __init__(self, message: str, names: list[str]):
        super().__init__(message)
        self.names = names



WARMUP_STEPS = 3  # steps of each process (start or resume) left out of throughput: compile, autotune, caches



def throughput(run: Run) -> dict:
    """Steady-state tokens/s and MFU over the steps after the first WARMUP_STEPS of every process (start and each
    resume), as the paper reports it; the all-steps figure (compile and warm-up included) is kept beside it."""
    tb, loop = run.args.total_batch_size, run.loop
    steady_steps, steady_time = loop.get("steady_steps", 0), loop.get("steady_time", 0.0)
    tok_s = steady_steps * tb / steady_time if steady_steps else None
    util = mfu(run.plan["flops_per_token"] * tb, steady_time / steady_steps, peak_flops(run.device), run.world) \
        if steady_steps else None
    return {"tok_per_sec": tok_s, "mfu": util, "tok_per_sec_steps": steady_steps,
            "tok_per_sec_note": f"steady state: steps after the first {WARMUP_STEPS} of each process",
            "tok_per_sec_all_steps": loop["step"] * tb / max(loop["train_time"], 1e-9)}


def write_summary(run: Run, stop_reason: str, evals: dict) -> dict:
    step, tb = run.loop["step"], run.args.total_batch_size
    wall = run.wall_time()
    summary = {"run_name": run.args.run_name, "run_dir": str(run.run_dir), "stop_reason": stop_reason,
               "step": step, "num_iterations": run.plan["num_iterations"], "tokens": step * tb,
               "flops": step * tb * run.plan["flops_per_token"], **{k: run.plan[k] for k in
               ("params_total", "params_memory", "params_backbone", "params_active", "flops_per_token",
                "world_size")},
               "train_time_s": run.loop["train_time"], "wall_time_s": wall, "dtype": run.dtype,
               "attention": "+".join(run.loop.get("attention") or [run.attention]),
               "mome_kernels": "+".join(run.loop.get("mome_kernels") or [run.mome_kernels]), **throughput(run),
               "init_from": run.init_from, **evals}
    if run.rank == 0:
        write_json(run.run_dir / "summary.json", summary)
        write_run_report(run.run_dir)
    return summary



def lr_flags_for(run: Run, names: list[str]) -> list[str]:
    """The LR flags of the optimizer groups that hold the named parameters (model state-dict names)."""
    group_of = {id(p): g["name"] for g in run.optimizer.param_groups for p in g["params"]}
    tied_to_unembedding = getattr(run.model, "lm_head", 0) is None and \
        getattr(run.model, "tied_embedding_lr", None) == "unembedding"  # a tied Llama-family wte
    flags = []
    for name, p in run.model.named_parameters():
        flag = GROUP_LR_FLAG.get(group_of.get(id(p)), "--matrix-lr")
        if group_of.get(id(p)) == "wte" and tied_to_unembedding:
            flag = "--unembedding-lr"
        if name in names and flag not in flags:
            flags.append(flag)
    return flags


def nonfinite_advice(run: Run, error: NonFiniteLoss) -> str:
    """What to do after a non-finite loss or parameters: the last checkpoint (each was checked finite when it was
    saved) and the flags that continue from it with lower learning rates."""
    steps = ckpt.list_steps(run.run_dir)
    flags = lr_flags_for(run, error.names) if isinstance(error, NonFiniteParams) else []
    lower = (f"lower {' and '.join(flags)} (the LR{'s' if len(flags) > 1 else ''} of the non-finite tensors)"
             if flags else "lower the learning rates (--embedding-lr, --unembedding-lr, --matrix-lr, --scalar-lr, "
                           "--memory-lr)")
    if not steps:
        return (f"error: {error}; stopping without saving. No checkpoint was saved before it: start again with "
                f"--overwrite and {lower}, or check the data")
    step = steps[-1]
    checked = ckpt.load_meta(run.run_dir, step).get("params_finite")
    return (f"error: {error}; stopping without saving. Last good checkpoint: step {step} in "
            f"{run.run_dir / ckpt.CKPT_DIR} ("
            + ("its parameters and optimizer state were checked finite when it was saved" if checked else
               "written before finite checks existed: not verified") +
            f"). To continue from it: the same command with --resume {step} --resume-override-lr, and {lower}; "
            "or check the data")



def last_checkpoint_step(run: Run) -> int | None:
    steps = ckpt.list_steps(run.run_dir)
    return steps[-1] if steps else None


def last_checkpoint(run: Run) -> str:
    step = last_checkpoint_step(run)
    return "none" if step is None else f"step {step}"


def error_fields(run: Run, error: BaseException | str) -> dict:
    """summary.json's account of a stop by an error: the error, and the checkpoint a --resume goes on from (None:
    none), which "step" (the last finished step) is not, unless that step's checkpoint was written."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return {"error": text, "last_checkpoint": last_checkpoint_step(run)}


def stop_every_rank(run: Run, reason: str, message: str, error: BaseException | str,
                    evals: dict | None = None) -> int:
    """After an error raised on every rank together (train_step shares one rank's DataError, rank0_decides rank 0's
    failed checkpoint write): rank 0 prints ``message``, summary.json records ``reason`` (if it can be written: the
    disk may be full) with ``error`` and ``evals`` (what finished), and every rank waits for it, since torchrun stops
    the ranks left once one has exited. Exit code 2."""
    print0(message, file=sys.stderr)
    try:
        write_summary(run, reason, {**(evals or {}), **error_fields(run, error)})
    except OSError as e:  # e.g. the full disk that stopped the run
        print0(f"summary.json not written either: {e}", file=sys.stderr)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return 2
