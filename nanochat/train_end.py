"""How a base_train run ends: summary.json (the stop reason, throughput, the error and the checkpoint to go on
from), the advice after a non-finite loss, and the stop of every rank together after an error they share."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from nanochat import checkpoint as ckpt
from nanochat.cli_types import dest_name
from nanochat.common import (GroupStore, compute_cleanup, error_text, errors_by_rank, is_dist, own_error,
                             post_rank_error, print0, rank_errors_count, rank_errors_posted)
from nanochat.gpt import attention_dtype
from nanochat.jsonfile import written_path
from nanochat.metrics import peak_flops
from nanochat.report import REPORT, unfinished, write_run_report
from nanochat.run_control import how_to_continue, resume_way
from nanochat.hand_command import hand_command
from nanochat.train_resume import runner_afresh_command, wrapper_command
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


def count_step_time(loop: dict, dt: float, steady: bool, world: int, peak: float | None) -> None:
    """Add one optimizer step's ``dt`` seconds to the run's clocks in ``loop`` (every checkpoint keeps them):
    train_time; for a ``steady`` step (after the first WARMUP_STEPS of its process) also steady_steps, steady_time,
    steady_device_seconds (dt x ``world``) and steady_peak_flop, the FLOPs the step's ``world`` devices of ``peak``
    FLOP/s each could have done in it (None once a steady step ran on a device of unknown peak). summary.json's MFU
    and per-GPU tok/s divide by those sums, so each step counts with the hardware it ran on when a resume changed
    the GPU kind or the world size (--resume-new-world-size)."""
    loop["train_time"] = loop.get("train_time", 0.0) + dt
    if not steady:
        return
    if "steady_device_seconds" not in loop:  # a checkpoint from before they were kept
        loop["steady_peak_flop"], loop["steady_device_seconds"] = assumed_steady_sums(loop, world, peak)
    capacity = loop["steady_peak_flop"]
    loop["steady_steps"] = loop.get("steady_steps", 0) + 1
    loop["steady_time"] = loop.get("steady_time", 0.0) + dt
    loop["steady_device_seconds"] += dt * world
    loop["steady_peak_flop"] = capacity + dt * world * peak if capacity is not None and peak else None


def eta_seconds(loop: dict, session_steps: int, session_time: float, steps_left: int) -> float:
    """The step line's ETA: ``steps_left`` at the mean steady step time of this session (``session_steps`` steady
    steps in ``session_time`` s; earlier sessions may have run on other GPUs), the run's until it has one; NaN
    (printed "?") before any steady step."""
    if session_steps:
        return session_time / session_steps * steps_left
    if loop.get("steady_steps"):
        return loop["steady_time"] / loop["steady_steps"] * steps_left
    return float("nan")


def assumed_steady_sums(loop: dict, world: int, peak: float | None) -> tuple[float | None, float]:
    """(steady_peak_flop, steady_device_seconds) of a loop from before they were kept: its steady steps taken as run
    on ``world`` devices of ``peak`` (this session's), as summary.json's MFU then took them."""
    if not loop.get("steady_steps"):
        return 0.0, 0.0
    return (loop["steady_time"] * world * peak if peak else None), loop["steady_time"] * world


def throughput(run: Run) -> dict:
    """Steady-state tokens/s and MFU over the steps after the first WARMUP_STEPS of every process (start and each
    resume), as the paper reports it; the all-steps figure (compile and warm-up included) is kept beside it. MFU is
    the model FLOPs of those steps over the peak FLOPs their devices could have done, tok_per_sec_per_gpu their
    tokens over their GPU-seconds (count_step_time): with one kind and number of GPUs throughout, mfu() of their
    mean step time and tok_per_sec / world."""
    tb, loop = run.args.total_batch_size, run.loop
    steady_steps, steady_time = loop.get("steady_steps", 0), loop.get("steady_time", 0.0)
    tok_s = steady_steps * tb / steady_time if steady_steps else None
    capacity, device_s = (loop["steady_peak_flop"], loop["steady_device_seconds"]) if "steady_device_seconds" in loop \
        else assumed_steady_sums(loop, run.world, peak_flops(run.device))
    util = 100.0 * run.plan["flops_per_token"] * tb * steady_steps / capacity if steady_steps and capacity else None
    return {"tok_per_sec": tok_s, "mfu": util, "tok_per_sec_steps": steady_steps,
            "tok_per_sec_per_gpu": steady_steps * tb / device_s if steady_steps and device_s else None,
            "tok_per_sec_note": f"steady state: steps after the first {WARMUP_STEPS} of each process",
            "tok_per_sec_all_steps": loop["step"] * tb / loop["train_time"] if loop["train_time"] > 0 else None}


def write_summary(run: Run, stop_reason: str, evals: dict) -> dict:
    step, tb = run.loop["step"], run.args.total_batch_size
    wall = run.wall_time()
    kernels = run.loop.get("attention") or [run.attention]  # each session's (--dtype cannot change on a resume)
    summary = {"run_name": run.args.run_name, "run_dir": str(run.run_dir), "stop_reason": stop_reason,
               "step": step, "num_iterations": run.plan["num_iterations"], "tokens": step * tb,
               "flops": step * tb * run.plan["flops_per_token"], **{k: run.plan[k] for k in
               ("params_total", "params_memory", "params_backbone", "params_active", "flops_per_token",
                "world_size")},
               "train_time_s": run.loop["train_time"], "wall_time_s": wall, "dtype": run.dtype,
               "attention": "+".join(kernels),
               "attention_dtype": "+".join(dict.fromkeys(attention_dtype(k, run.dtype) for k in kernels)),
               "mome_kernels": "+".join(run.loop.get("mome_kernels") or [run.mome_kernels]), **throughput(run),
               "init_from": run.init_from, **evals}
    if run.rank == 0:
        write_json(run.run_dir / "summary.json", summary)
        write_report_or_warn(run.run_dir)
    return summary


def write_report_or_warn(run_dir) -> None:
    """report.md, read back from the run's files once summary.json is written. It only presents them, and can be
    rebuilt from them at any time: a failure to write it (a full disk; a run file it cannot read) is one warning line
    naming the command that writes it, never a failure of the run, which has finished (summary.json is what the
    runner and scripts.results read)."""
    try:
        write_run_report(run_dir)
    except (OSError, ValueError) as e:
        print(f"warning: {REPORT} not written: {e}; the run is finished (summary.json is written): python -m "
              f"scripts.report {shlex.quote(str(run_dir))} --run-report writes it", file=sys.stderr, flush=True)


def finish(run: Run, reason: str, evals: dict) -> int:
    """A run that stopped as planned (completed, wall_time_limit, interrupted): its summary.json, and the exit code:
    0, or 2 when rank 0 could not write the summary (a full disk; the other ranks have nothing to write): then one
    line names the file, what finished and how a --resume writes the summary."""
    try:
        summary = write_summary(run, reason, evals)
    except OSError as e:
        print(summary_not_written(run, reason, evals, e), file=sys.stderr, flush=True)
        return 2
    if reason == "interrupted" and "interrupted_during" not in evals:
        print0(f"interrupted ({evals['signal']}) at step {run.loop['step']}: checkpoint saved; {how_to_continue()}")
    print0(json.dumps({k: v for k, v in summary.items() if not isinstance(v, (dict, list))}))
    return 0


def summary_not_written(run: Run, reason: str, evals: dict, error: OSError) -> str:
    """The message after a failed write of a planned stop's summary.json (report.md's: write_report_or_warn). Its
    checkpoint is saved whatever the reason, so a --resume writes the summary: for a completed run it reruns the
    final evaluation (the parts kept during it are deleted once it completes) and writes it, as after an
    interruption."""
    from nanochat.final_eval import training_stop_words  # here: final_eval imports this module

    path = written_path(error.filename, run.run_dir / "summary.json")
    step, signal = run.loop["step"], evals.get("signal")
    if reason in ("completed", "wall_time_limit"):
        done = f"{training_stop_words(reason)} and its final evaluation finished"
    else:
        done = f"the final evaluation was interrupted ({signal})" if "interrupted_during" in evals else \
            f"training was interrupted ({signal})"
    then = f"{resume_way()} reruns the final evaluation and writes summary.json" if reason == "completed" else \
        f"{how_to_continue()}: summary.json is written when it stops"
    return f"error: {path.name} not written: {error}\n{done} (the checkpoint of step {step} is saved); free space " \
           f"(or fix the run dir), then {then}"


def write_summary_after_error(run: Run, stop_reason: str, fields: dict) -> None:
    """summary.json of a stop whose error is already said: a failed write (e.g. the full disk that stopped the run)
    is said beside it, never in its place. Only rank 0 writes, so only rank 0 can fail here."""
    try:
        write_summary(run, stop_reason, fields)
    except OSError as e:
        print(f"summary.json not written either: {e}", file=sys.stderr, flush=True)


def stop_nonfinite(run: Run, error: NonFiniteLoss) -> int:
    """A non-finite loss or parameters, raised on every rank together: the advice, summary.json (if it can be
    written: the error and the advice stand either way), exit code 3."""
    print0(nonfinite_advice(run, error))
    write_summary_after_error(run, "nonfinite_params" if isinstance(error, NonFiniteParams) else "nonfinite_loss",
                              error_fields(run, error))
    return EXIT_NONFINITE


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
    saved) and the flags that continue from it with lower learning rates; under a wrapper that runs base_train
    itself (speedrun.sh: CONTINUE_COMMAND_ENV), the base_train command to run by hand (``by_hand``)."""
    steps = ckpt.list_steps(run.run_dir)
    flags = lr_flags_for(run, error.names) if isinstance(error, NonFiniteParams) else []
    lower = (f"lower {' and '.join(flags)} (the LR{'s' if len(flags) > 1 else ''} of the non-finite tensors)"
             if flags else "lower the learning rates (--embedding-lr, --unembedding-lr, --matrix-lr, --scalar-lr, "
                           "--memory-lr)")
    runner = runner_afresh_command() is not None  # under scripts.run: base_train's flags go after its --
    wrapper = wrapper_command()
    head = f"error: {error}; stopping without saving."
    if not steps:
        if wrapper:
            return f"{head} No checkpoint was saved before it. {by_hand(run, flags, wrapper, None, lower)}"
        how = (f"the same scripts.run command with --overwrite and the lower learning rates after -- ({lower})"
               if runner else f"--overwrite and {lower}")
        return f"{head} No checkpoint was saved before it: start again with {how}, or check the data"
    step = steps[-1]
    checked = ckpt.load_meta(run.run_dir, step).get("params_finite")
    last = (f"{head} Last good checkpoint: step {step} in {run.run_dir / ckpt.CKPT_DIR} ("
            + ("its parameters and optimizer state were checked finite when it was saved" if checked else
               "written before finite checks existed: not verified") + ").")
    if wrapper:
        return f"{last} {by_hand(run, flags, wrapper, step, lower)}"
    return (f"{last} To continue from it: the same {'scripts.run ' if runner else ''}command with --resume {step} "
            "--resume-override-lr" + (f" and the lower learning rates after -- ({lower})" if runner else
                                      f", and {lower}") + "; or check the data")


def by_hand(run: Run, named: list[str], wrapper: str, step: int | None, lower: str) -> str:
    """The way on after a non-finite stop under ``wrapper`` (speedrun.sh), which passes its own flags and cannot
    lower learning rates: the base_train command it ran, to run by hand, with --resume ``step`` --resume-override-lr
    (--overwrite with no checkpoint) and half the LRs of the non-finite parameters' groups (``named``, their LR
    flags; every group's where it is empty: a non-finite loss or optimizer state); where this process cannot tell
    that command (``hand_command``), the flags alone (``lower``). A run resumed this way from speedrun.sh's LRs is
    still speedrun.sh's (its checks read the changes the checkpoints and config.json record): stopped again, it is
    continued with the new LRs (scripts.speedrun_preflight.resume_lrs); completed, it is done and gets its report.
    A run started again with other LRs (--overwrite) is another run: speedrun.sh's --resume auto, with the original
    LRs, is refused (the flags do not match)."""
    flags = named or lr_flags_for(run, [name for name, _ in run.model.named_parameters()])
    goal, way = ("continue from it", ["--resume", str(step), "--resume-override-lr"]) if step is not None else \
        ("start again", ["--overwrite"])
    command = hand_command(run.world, way, {flag: repr(getattr(run.args, dest_name(flag)) / 2)
                                            for flag in flags})
    cannot = f"'{wrapper}' cannot lower learning rates: to {goal}, "
    if step is not None:
        after = (f"if it stops again once it has saved a checkpoint, '{wrapper}' continues it with these learning "
                 f"rates; once it has completed, '{wrapper}' takes it as done and goes on to its report (which names "
                 "the changed learning rates); or check the data")
    else:
        after = (f"'{wrapper}' refuses to continue the run once a checkpoint with other learning rates is saved (its "
                 "--resume auto has the original ones: the flags do not match), so finish it by hand; or check the "
                 "data")
    if command is None:
        return f"{cannot}run the base_train command '{wrapper}' ran by hand, with {' '.join(way)} and {lower}; {after}"
    which = "the LRs of the non-finite tensors" if named else "this run's LRs"
    return (f"{cannot}run by hand in {os.getcwd()} the base_train command '{wrapper}' ran, with {' '.join(way)} and "
            f"half {which} ({', '.join(flags)}; lower them as you see fit):\n  {command}\n"
            f"{after[0].upper()}{after[1:]}")


def last_step_in(run_dir: Path) -> int | None:
    steps = ckpt.list_steps(run_dir)
    return steps[-1] if steps else None


def last_checkpoint_step(run: Run) -> int | None:
    return last_step_in(run.run_dir)


def last_checkpoint(run: Run) -> str:
    step = last_checkpoint_step(run)
    return "none" if step is None else f"step {step}"


def error_fields(run: Run, error: BaseException | str) -> dict:
    """summary.json's account of a stop by an error: the error, and the checkpoint a --resume goes on from (None:
    none), which "step" (the last finished step) is not, unless that step's checkpoint was written."""
    text = error if isinstance(error, str) else error_text(error)
    return {"error": text, "last_checkpoint": last_checkpoint_step(run)}


def stop_every_rank(run: Run, reason: str, message: str, error: BaseException | str,
                    evals: dict | None = None) -> int:
    """After an error raised on every rank together (train_step shares one rank's DataError, rank0_decides rank 0's
    failed checkpoint write): rank 0 prints ``message``, summary.json records ``reason`` (if it can be written: the
    disk may be full) with ``error`` and ``evals`` (what finished), and every rank waits for it, since torchrun stops
    the ranks left once one has exited. Exit code 2."""
    print0(message, file=sys.stderr)
    write_summary_after_error(run, reason, {**(evals or {}), **error_fields(run, error)})
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return 2


# the process group's store keys under which each rank that stopped by an unplanned error posts it (stop_by_error)
ERROR_KEY = "train_error"


def post_error(text: str, key: str = ERROR_KEY, group: GroupStore | None = None) -> None:
    """Post this rank's error for rank 0's summary (common.post_rank_error, under ``key`` in ``group``'s store: the
    default group's if None); a store that is gone is said, not raised."""
    if not is_dist():
        return
    try:
        post_rank_error(key, text, group)
    except Exception as e:  # noqa: BLE001 - the store went with the rank that hosted it
        print(f"rank {dist.get_rank()}: could not post the error for rank 0 ({type(e).__name__}: {e})", flush=True)


def error_rank_fields(errors: dict[int, str]) -> dict:
    """summary.json's ``error_rank`` and ``errors_by_rank`` for ``errors`` (by rank, the one named first): only where
    the error named is another rank's than 0, or several ranks failed."""
    first_rank = next(iter(errors), 0)
    if len(errors) <= 1 and first_rank == 0:
        return {}
    return {"error_rank": first_rank, "errors_by_rank": {str(r): t for r, t in errors.items()}}


def way_on_after_error(run_dir: Path, last: int | None) -> str:
    if last is not None:
        return f"last checkpoint: step {last} in {run_dir / ckpt.CKPT_DIR}; fix the cause, then {how_to_continue()}"
    # a --resume finds nothing to continue; the runner's --resume auto starts afresh then
    again = "start again with --overwrite" if resume_way() == "--resume" else how_to_continue()
    return f"no checkpoint was saved: once the cause is fixed, {again}"


def stop_by_error(run: Run, error: Exception, evals: dict) -> int:
    """After an error no stop plans for (an OOM, a bug), on the rank(s) that raised it; exit code 1. Each prints its
    traceback and posts its error (post_error). Rank 0 then records the stop (metrics.jsonl, summary.json: "error",
    the error posted first, the likely cause, as the others' collectives break once its rank has left; the last
    checkpoint; ``evals``: what finished) and says how to go on. No collective: the other ranks may wait in one
    that cannot complete. A rank other than 0 that raised alone leaves the account to rank 0, whose collective
    breaks once this rank has exited (torchrun's SIGTERM to it is latched by StopSignal, so it still writes the
    summary); a launcher that SIGKILLs it leaves none."""
    traceback.print_exception(error)  # first: nothing below may hide it
    text = error_text(error)
    post_error(text)
    if run.rank != 0:
        return 1
    step = run.loop["step"]
    errors = errors_of_failing_ranks() or {0: text}  # one process, or the store gone: rank 0's own
    first_rank, first = next(iter(errors.items()))
    ranks = error_rank_fields(errors)
    where = f" (rank {first_rank}; the errors of every rank that failed are in summary.json)" if ranks else ""
    print(f"error: {first}{where}\ntraining stopped by an error after step {step}", file=sys.stderr, flush=True)
    record_error_stop(run, first, {**evals, **ranks})
    return 1


def errors_of_failing_ranks(key: str = ERROR_KEY, group: GroupStore | None = None,
                            wait_after_own: bool = True) -> dict[int, str]:
    """The errors posted under ``key`` (in ``group``'s store; the default group's if None), in the order the ranks
    failed ({}: one process, or the store gone). Ranks that fail at once (an OOM at the same batch, a bug every rank
    meets) post within moments of each other: when rank 0 posted first, it waits (bounded by final_eval's
    AGREEMENT_WAIT_S) until every rank has posted, so the summary names them all. A rank that is not failing waits
    in a collective and posts nothing before rank 0 has exited (or left the group, as after a set-up error), so an
    error of rank 0 alone in training costs the whole wait (a multi-rank job only); an error that broke rank 0's
    collective costs none: the rank that left posted first. ``wait_after_own`` False (the final evaluation, where
    a lone rank 0's failure ends the job at once): rank 0 waits only once a rank other than 0 has posted, the sign
    of an error that several ranks meet, for the ranks that have not yet (a world of 3 or more)."""
    from nanochat.final_eval import AGREEMENT_WAIT_S  # here: final_eval imports this module

    group = group or GroupStore.of_the_group()
    errors = rank_errors_posted(key, group)
    others_failed = any(rank != 0 for rank in errors)
    if not errors or (next(iter(errors)) != 0 if wait_after_own else not others_failed):
        return errors
    deadline = time.monotonic() + AGREEMENT_WAIT_S
    try:
        while rank_errors_count(key, group) < group.world and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store went with a rank that hosted it: what was read stands
        return errors
    return rank_errors_posted(key, group) or errors


def record_error_stop(run: Run, first: str, fields: dict) -> None:
    """Rank 0's account of a stop by an error (``first``: the error, as summary.json holds it): the stop record in
    metrics.jsonl (if it was opened), the way on, and summary.json with ``fields``. Each write apart: the full disk
    that failed the run may refuse them all, and the error already printed stands. The stop record first, since
    summary.json's run report reads metrics.jsonl."""
    try:
        if run.metrics is not None:
            run.metrics.log({"kind": "stop", "step": run.loop["step"], "reason": "error", "error": first})
    except Exception as e:  # noqa: BLE001
        print(f"metrics.jsonl: the stop record not written: {e}", file=sys.stderr, flush=True)
    try:
        fields = {**fields, **error_fields(run, first)}
        print(way_on_after_error(run.run_dir, fields["last_checkpoint"]), file=sys.stderr, flush=True)
        write_summary(run, "error", fields)
    except Exception as e:  # noqa: BLE001
        print(f"summary.json not written either: {e}", file=sys.stderr, flush=True)


def stop_before_training(run: Run, error: Exception) -> int:
    """After an error in the session's set-up of the run dir (base_train.set_up_run_dir: config.json, plan.json, a
    resume's metrics.jsonl and later checkpoints, opening metrics.jsonl), raised on every rank together (rank 0 did
    that work alone and shared its error): the account of an unplanned error, exit code 1. An OSError (a full disk,
    a permission) is said in one line; anything else may be a bug and keeps its traceback. Every rank waits for
    rank 0's summary, since torchrun stops the ranks left once one has exited."""
    if run.rank == 0:
        if not isinstance(error, OSError):
            traceback.print_exception(error)
        text = error_text(error)
        print(f"error: {text}\ntraining stopped before step {run.loop['step'] + 1}: the set-up of the run dir failed",
              file=sys.stderr, flush=True)
        record_error_stop(run, text, {})
    if run.metrics is not None:
        run.metrics.close()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return 1


# -- an error in base_train's set-up (build_run, prepare_resume): no Run yet -----------------------------------------
SET_UP_ERROR_KEY = "setup_error"  # the store keys of the set-up's errors, as ERROR_KEY is training's
# How long a rank other than 0, after it reported an error, waits for rank 0's summary.json: for rank 0's own post first
# (final_eval's AGREEMENT_WAIT_S by default: a rank 0 without one by then waits in a collective that only this rank's
# exit ends, as with NCCL, where leaving the group does not break it), then for the write, once rank 0 is at it (the
# run report; a slow shared file system). torchrun ends the ranks left once one has exited, which could kill rank 0
# before it.
SUMMARY_WAIT_S = 60.0
# The first of those waits in the set-up under gloo, where a rank that failed alone has left the group: rank 0 fails
# at its next collective, which may be minutes of its own work away (data, eval rows, the model build, a checkpoint
# load), so the lone rank waits that long for rank 0's post, not the final evaluation's moments.
SET_UP_RANK0_WAIT_S = 600.0


def set_up_rank0_wait_s(backend: str) -> float:
    """How long a rank that failed alone in the set-up (and left the group) waits for rank 0's post: long under
    gloo, where rank 0 posts once it reaches its next collective, which breaks; AGREEMENT_WAIT_S under NCCL (or an
    unknown backend), where that collective does not break, rank 0 never posts, and only this rank's exit (torchrun
    then ends rank 0, without a summary) ends the wait."""
    from nanochat.final_eval import AGREEMENT_WAIT_S  # here: final_eval imports this module

    return SET_UP_RANK0_WAIT_S if backend == "gloo" else AGREEMENT_WAIT_S


def wait_for_rank0_summary(group: GroupStore, rank0_key: str, summary_key: str,
                           rank0_wait_s: float | None = None) -> None:
    """On a rank other than 0 after an error: wait, bounded (``rank0_wait_s``; AGREEMENT_WAIT_S if None), until rank
    0 has posted ``rank0_key`` in ``group``'s store (it has met the error too), then until it has written
    summary.json (``summary_key``)."""
    from nanochat.final_eval import AGREEMENT_WAIT_S  # here: final_eval imports this module

    try:
        group.store.wait([rank0_key], timedelta(seconds=AGREEMENT_WAIT_S if rank0_wait_s is None else rank0_wait_s))
        group.store.wait([summary_key], timedelta(seconds=SUMMARY_WAIT_S))
    except Exception as e:  # noqa: BLE001 - a timeout, or the store went with rank 0
        print(f"rank {group.rank}: no word of summary.json from rank 0 ({type(e).__name__}); exiting: a rank 0 that "
              "waits in a collective fails once this rank has left it", flush=True)


def tell_summary_written(summary_key: str, group: GroupStore | None = None) -> None:
    """Rank 0, after its summary.json (written or not): the word the others wait for (wait_for_rank0_summary), in
    ``group``'s store (the default group's if None)."""
    try:
        (group or GroupStore.of_the_group()).store.set(summary_key, "written")
    except Exception:  # noqa: BLE001 - the store is gone: the others stop waiting at their bound
        pass


@dataclass
class SetUpProgress:
    """How far base_train's set-up got, for the account of an error in it."""
    # set once this session holds the run dir (run.lock) and it is this run's to describe: a fresh start into an
    # empty one, or a --resume (not a run that --overwrite deletes only once the set-up has finished)
    run_dir: Path | None = None
    # the checkpoint step this --resume goes on from, once train_resume.resume_point has chosen it (a rewind's K of
    # --resume K, below the latest); None before (then the latest stands for it) and for a fresh start
    resume_step: int | None = None


def stop_set_up_by_error(args, progress: SetUpProgress, error: Exception) -> int:
    """After an error that no refusal plans for in base_train's set-up (an OOM while the model is built, a corrupt
    checkpoint, a bug), on every rank that has it; exit code 1 (a bad flag or file, ValueError or FileNotFoundError,
    stays print_error's exit 2). Each rank prints the traceback of its own error; rank 0 prints the error it names
    first (in a shared step the lowest failing rank's, else the one posted first) and writes summary.json ("error",
    and every failing rank's error beside it) where the run dir is this run's (``progress``) and does not hold a
    completed run's account. An error every rank raised together (a shared step: every_rank_ok, rank0_decides,
    as the set-up's local work runs) carries each failing rank's to rank 0, and the others wait for the summary in
    a barrier. An error of one rank alone, outside a shared step, goes through the store instead (leave_the_group):
    the other ranks may wait in a collective that rank will never enter."""
    own = own_error(error)
    if own is not None:
        traceback.print_exception(own)  # first: nothing below may hide it
    if not is_dist() or getattr(error, "raised_on_every_rank", False):
        world = dist.get_world_size() if is_dist() else 1
        if not is_dist() or dist.get_rank() == 0:
            record_set_up_error(args, progress, errors_by_rank(error), world)
        if is_dist():
            dist.barrier()  # torchrun ends the ranks left once one has exited: rank 0 first writes the summary
        return 1
    group = leave_the_group(error_text(error))
    if group.rank != 0:
        wait_for_rank0_summary(group, f"{SET_UP_ERROR_KEY}/0", f"{SET_UP_ERROR_KEY}/summary",
                               set_up_rank0_wait_s(group.backend))
        return 1
    errors = errors_of_failing_ranks(SET_UP_ERROR_KEY, group) or {0: error_text(error)}
    record_set_up_error(args, progress, errors, group.world)
    tell_summary_written(f"{SET_UP_ERROR_KEY}/summary", group)
    return 1


def leave_the_group(text: str) -> GroupStore:
    """A rank whose set-up failed alone: post its error (``text``) and leave the process group at once, keeping the
    store. Its leaving ends a collective the others wait in (gloo: "Connection closed by peer"), so they reach
    their error branch now, not at the collective's timeout, and post theirs: the first error posted is the cause.
    (NCCL's collectives do not notice: a rank waiting in one is ended by torchrun once this rank has exited, after
    its short wait (set_up_rank0_wait_s), without a summary. Every set-up step that can fail on one rank is a shared
    step, so this is for bugs.)"""
    group = GroupStore.of_the_group()
    post_error(text, SET_UP_ERROR_KEY, group)
    compute_cleanup()  # its gc.collect too: gloo's threads joined now, not at interpreter shutdown
    return group


def record_set_up_error(args, progress: SetUpProgress, errors: dict[int, str], world: int) -> None:
    """Rank 0's account of a set-up stopped by ``errors`` (by rank, the one to name first: the lowest failing rank
    of a shared step, the first to post through the store): the error and the way on, and summary.json if the run
    dir is this run's (``progress``), unless it holds a completed run's summary: the set-up changed nothing in the
    run dir (a resume sets later checkpoints aside only after it), so that account stands, and scripts.results
    reads it. A failed write is said beside the error."""
    first_rank, first = next(iter(errors.items()))
    ranks = error_rank_fields(errors)
    resuming = progress.run_dir is not None and args.resume is not None
    last = last_step_in(progress.run_dir) if resuming else None
    step = progress.resume_step if progress.resume_step is not None else last
    kept = resuming and completed_summary(progress.run_dir)
    written = progress.run_dir is not None and not kept
    each = "; ".join(f"rank {r}: {t}" for r, t in errors.items())
    where = f" (rank {first_rank}; " + ("the errors of every rank that failed are in summary.json)" if written else
                                        f"every failing rank's error: {each})")
    what = "the set-up" if step is None or step == last else f"the set-up of --resume {step}"
    print(f"error: {first}{where if ranks else ''}\ntraining stopped before step {(step or 0) + 1}: {what} failed",
          file=sys.stderr, flush=True)
    if progress.run_dir is None:
        print("summary.json not written: the run dir was not yet this run's (not claimed yet, or it still holds the "
              "run --overwrite deletes)", file=sys.stderr, flush=True)
        return
    print(way_on_after_set_up_error(progress.run_dir, step, last), file=sys.stderr, flush=True)
    if kept:
        print("summary.json not written: it holds the completed run's account, which this failed set-up did not "
              "change", file=sys.stderr, flush=True)
        return
    summary = {"run_name": args.run_name, "run_dir": str(progress.run_dir), "stop_reason": "error",
               "step": step or 0, "world_size": world, "error": first, "last_checkpoint": last, **ranks}
    try:
        write_json(progress.run_dir / "summary.json", summary)
    except OSError as e:
        print(f"summary.json not written either: {e}", file=sys.stderr, flush=True)
        return
    write_report_or_warn(progress.run_dir)


def completed_summary(run_dir: Path) -> bool:
    """summary.json is a completed run's account (report.unfinished: None), which scripts.run and results read."""
    try:
        return unfinished(run_dir) is None
    except (OSError, ValueError):  # unreadable, or not a JSON object: nothing to keep
        return False


def way_on_after_set_up_error(run_dir: Path, step: int | None, last: int | None) -> str:
    """The way on after a failed set-up: a rewind's (``step`` below ``last``, the latest) names its own checkpoint,
    which a plain --resume would not take."""
    if step is None or step == last:
        return way_on_after_error(run_dir, last)
    return f"checkpoint to go on from: step {step} in {run_dir / ckpt.CKPT_DIR} (--resume {step}; the later ones, up " \
           f"to step {last}, are untouched); fix the cause, then run the same command again"
