"""base_train's final evaluation: val (and train) bpb with MoME's slot balance, then CORE, each part kept as it
finishes so that a signal ends it cleanly and a --resume computes only the rest (nanochat.eval_resume).

Kept apart from scripts/base_train.py so the loop reads top to bottom. Its functions take base_train's ``Run``
(duck-typed: the type is imported for the checker alone, so there is no import cycle).
"""

from __future__ import annotations

import itertools
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING

import torch.distributed as dist

from nanochat import checkpoint as ckpt
from nanochat.common import GroupStore, is_dist, post_rank_error, print0
from nanochat.eval_resume import (FinishedResults, Interrupted, ResultWriteError, eval_settings, evaluation_complete,
                                  partial_path)
from nanochat.report import train_rows_description
from nanochat.run_control import how_to_continue, resume_way
from nanochat.slot_balance import describe, with_slot_balance
from nanochat.train_end import (error_rank_fields, errors_of_failing_ranks, last_checkpoint_step, tell_summary_written,
                                wait_for_rank0_summary, write_summary_after_error)
from nanochat.train_loop import StopSignal, gather_objects
from nanochat.train_setup import run_core, run_split_bpb

if TYPE_CHECKING:
    from scripts.base_train import Run


FINAL_EVAL_PARTIAL = "final_eval"  # <run dir>/final_eval.partial.json: the finished parts of an interrupted one


def final_eval_results(run: Run) -> FinishedResults:
    """The parts of this step's final evaluation that an interrupted earlier session finished, read on rank 0 and
    broadcast (nanochat.eval_resume, as base_eval keeps its own). Fingerprinted by this step's checkpoint (the
    weights evaluated) and all that can move a number down to its last digits: the batch size and world size
    decide which rows share a forward and the order of the sums."""
    a, step = run.args, run.loop["step"]

    def settings():
        return eval_settings(ckpt.step_dir(run.run_dir, step) / "model.pt", run.run_dir, step, run.device,
                             tokenizer_sha256=run.data.tokenizer_sha256, dtype=run.dtype, attention=run.attention,
                             mome_kernels=run.mome_kernels, eval_batch_size=a.eval_batch_size or a.device_batch_size,
                             world_size=run.world)
    return FinishedResults.open(run.run_dir, FINAL_EVAL_PARTIAL, settings, fresh=False)


def final_eval(run: Run, out: dict) -> None:
    """The final evaluation, into ``out`` as each part finishes (a signal may end it: what finished is kept, in
    ``out`` for summary.json and in the partial file for a --resume, which deletes the file once it completes)."""
    from nanochat.dataloader import eval_rows_order

    a = run.args
    finished = final_eval_results(run)
    splits = ["val"] + (["train"] if a.final_train_bpb and run.data.train_rows is not None else [])
    rows = {"data_sha256": run.data.data_sha256, "synthetic_seed": a.data_seed if a.synthetic_data else None,
            "eval_tokens": a.eval_tokens, "seq_len": a.max_seq_len, "result": "bpb, mome_slot_balance"}
    for split in splits:  # bpb, and for MoME the slot balance of the same pass (uncompiled model: see slot_balance)
        def score():
            bpb, balance = with_slot_balance(run.model, lambda: run_split_bpb(
                run.model, run.data, a, run.rank, run.world, run.device, run.autocast, split))
            return {"bpb": bpb, "mome_slot_balance": balance}

        # what decides the rows beyond the data, --eval-tokens and the seq len: the train rows' document order
        rows_key = eval_rows_order(split, a.data_seed)[1]
        scored = finished.get_or_run(f"split {split}", lambda: {**rows, **rows_key}, score)
        out[f"{split}_bpb"], balance = scored["bpb"], scored["mome_slot_balance"]
        if split == "train":  # which documents: results and reports never average it with other rows' numbers
            out["train_bpb_rows"] = train_rows_description(rows_key)
        print0(f"final {split} bpb {out[f'{split}_bpb']:.6f}")
        if balance:
            out[f"{split}_mome_maxvio"], out[f"{split}_mome_abs_load_dev"] = balance["maxvio"], balance["abs_load_dev"]
            print0(f"final {split} {describe(balance)}")
    parts = len(splits)
    if a.final_core and run.data.bundle is not None:
        res = run_core(run.model, run.data, a, run.device, run.autocast, finished=finished)
        out.update(core=res["core"], core_label=res["label"], core_tasks=res.get("tasks"),
                   core_missing=res.get("missing"), core_dtype=run.dtype)
        print0(f"final {res['label']} [{run.dtype}] {res['core']:.4f}")
        parts += len(res.get("tasks") or {})
    if finished.reused:
        print0(f"{finished.reuse_note('final evaluation parts', parts)}: {', '.join(finished.reused)}")
    # every number is in: a signal from here on (the record, deleting the kept parts) ends nothing, as in base_eval
    # after its last report; "interrupted" would send a --resume to compute, from zero once the file is gone
    evaluation_complete()
    run.metrics.log({"kind": "final", "step": run.loop["step"], "tokens": run.loop["step"] * a.total_batch_size,
                     **{k: v for k, v in out.items() if not isinstance(v, (dict, list))}})
    finished.discard()


class FinalEvalError(RuntimeError):
    """The final evaluation failed with an error that no signal explains: the branch agreed by every rank whose
    evaluation failed (agreed_failure_branch). ``error``: this rank's; ``evaluation``: the number of the store keys
    the ranks agreed under; ``training_stop``: why training stopped before it (completed, wall_time_limit)."""

    def __init__(self, error: Exception, evaluation: int, training_stop: str):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error, self.evaluation, self.training_stop = error, evaluation, training_stop


def signal_of_any_rank(stop: StopSignal) -> str | None:
    """Collective: the signal latched on the lowest rank that has one (None: none has). For summary.json, which
    rank 0 writes although it may have no signal itself (one rank alone signalled)."""
    return next((name for name in gather_objects(stop.received) if name is not None), None)


def evaluate_at_the_end(run: Run, training_stop: str, stop: StopSignal, evals: dict) -> str:
    """The final evaluation, into ``evals``, after training stopped by ``training_stop`` (completed or the wall
    time); the run's stop reason. Every rank takes the same branch: a signal on any rank skips or ends it on all,
    and an error either fails every rank or, explained by a signal, interrupts every rank (agreed_failure_branch)."""
    evaluation = next(_evaluations)  # before the gather below: every rank counts every call, so the number agrees
    # a signal latched on any rank (e.g. while the final checkpoint was written): skipped on every rank alike, with
    # that rank's signal in the summary (rank 0, which writes it, may have none)
    latched = signal_of_any_rank(stop)
    if latched is not None:
        return interrupted_final_eval(run, training_stop, latched, evals)
    try:
        with stop.interrupts():  # the checkpoint is saved: a signal ends the evaluation (next vote or set-up step)
            final_eval(run, evals)
    except Interrupted as e:  # raised on every rank alike, with the signal of the rank(s) that got one
        return interrupted_final_eval(run, training_stop, signal.Signals(e.signum).name, evals)
    except ResultWriteError:  # raised on every rank together (rank0_decides): all take its branch, a signal or not
        raise
    except Exception as e:
        signal_name = agreed_failure_branch(stop.received, evaluation, f"{type(e).__name__}: {e}")
        if signal_name is None:
            raise FinalEvalError(e, evaluation, training_stop) from e
        # a signal latched on a rank, and an error before the vote that would have acted on it (e.g. a collective
        # that failed because another rank was killed outright)
        traceback.print_exc()
        return interrupted_final_eval(run, training_stop, signal_name, evals)
    return training_stop


# How long a rank whose final evaluation failed, with a signal latched, waits for the other ranks' word before it
# takes the signal's branch alone: ranks that fail at the same point (an error every rank raises, an OOM at the same
# batch) arrive within a few batches of each other; a scheduler's grace period before SIGKILL is tens of seconds
# (Slurm's KillWait: 30 s), which must still hold the summary written after it.
AGREEMENT_WAIT_S = 10.0
_FAILED = "failed"
# the final evaluations of this process, numbered (the same on every rank): each agrees under its own store keys, so
# a second failure in one process group does not read the first one's decision
_evaluations = itertools.count()


def agreed_failure_branch(own_signal: str | None, evaluation: int, error: str = "") -> str | None:
    """After an error of the final evaluation number ``evaluation`` (of this process, the same on every rank) on this
    rank, with ``own_signal`` latched or None: the branch every rank whose evaluation failed takes, the same on all
    of them. None: the error stops the run (FinalEvalError: summary.json says final_eval_error, exit 1); a signal's
    name: the evaluation counts as interrupted by it (summary.json, exit 0). Each evaluation agrees under store keys
    of its own (``final_eval/<evaluation>/...``). ``error`` (this rank's) is posted beside the failure, in the order
    the ranks failed in, for rank 0's summary.json (common.rank_errors_posted).

    The ranks cannot vote in a collective: one may have raised inside a collective the others are still waiting in
    (or be dead). They agree through the process group's key-value store instead, which needs no other rank to take
    part: each failed rank posts its failure, and the first decision written (``compare_set``) is every rank's. A
    rank without a signal decides "failed" at once (an error no signal explains: as with no signal anywhere). A rank
    with one decides "failed" too once every rank has posted a failure (an error raised on every rank: the error, not
    the signal, is what a rerun would meet), and the signal's branch once ``AGREEMENT_WAIT_S`` passed without (the
    others wait in a collective that failed here, or were killed): then a rank that fails later, when its collective
    breaks as this rank exits, takes that branch too. One process, or a store that fails: this rank's own branch."""
    if not is_dist():  # one process, or a group of one: no other rank to agree with (every rank "failed" alike)
        return own_signal
    try:
        store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
        key = f"final_eval/{evaluation}"
        post_rank_error(f"{key}/error", error, GroupStore(store, rank, world))  # before the failure
        store.set(f"{key}/failed/{rank}", own_signal or "")
        proposal = _FAILED
        if own_signal is not None:
            everyone = [f"{key}/failed/{r}" for r in range(world)]
            deadline = time.monotonic() + AGREEMENT_WAIT_S
            while not (store.check([f"{key}/branch"]) or store.check(everyone)):
                if time.monotonic() >= deadline:
                    proposal = own_signal
                    break
                time.sleep(0.02)
        decided = store.compare_set(f"{key}/branch", "", proposal).decode()
    except Exception as e:  # noqa: BLE001 - the store went with a rank that hosted it: no agreement to be had
        print(f"rank {dist.get_rank()}: the ranks could not agree on the final evaluation's failure "
              f"({type(e).__name__}: {e}); this rank's own branch", flush=True)
        return own_signal
    return None if decided == _FAILED else decided


def training_stop_words(training_stop: str) -> str:
    """How training ended before the final evaluation, for the messages of its error and of its interruption."""
    words = {"completed": "training completed", "wall_time_limit": "training stopped at its wall-time limit"}
    return words.get(training_stop, f"training stopped by {training_stop}")


def record_final_eval_error(run: Run, e: FinalEvalError, evals: dict) -> None:
    """After FinalEvalError, on every rank that raised it: each prints its traceback; rank 0 says what to do and
    writes summary.json (stop_reason final_eval_error): the error (the one posted first), the evaluations that
    finished (``evals``), the step. No collective: a rank may wait in one that cannot complete, or be gone (the ranks
    agreed through the store); the others wait there for rank 0's word, a bounded time (wait_for_rank0_summary).
    Rank 0 waits for the others' errors only once a rank other than 0 has posted one (errors_of_failing_ranks): its
    error alone ends the job at once."""
    traceback.print_exception(e.error)
    if run.rank != 0:  # rank 0's failure first, then its summary (torchrun ends the ranks left once one has exited)
        key = f"final_eval/{e.evaluation}"
        wait_for_rank0_summary(GroupStore.of_the_group(), f"{key}/failed/0", f"{key}/summary")
        return
    step, errors = run.loop["step"], errors_of_failing_ranks(f"final_eval/{e.evaluation}/error", wait_after_own=False)
    first_rank, error = next(iter(errors.items()), (0, str(e)))
    fields = {**evals, "error": error, "training_stop_reason": e.training_stop,
              "last_checkpoint": last_checkpoint_step(run)}  # the step's: the final evaluation follows its save
    fields.update(error_rank_fields(errors))
    run.metrics.log({"kind": "stop", "step": step, "reason": "final_eval_error", "error": error})
    how = training_stop_words(e.training_stop)
    partial = partial_path(run.run_dir, FINAL_EVAL_PARTIAL)
    then = (f"{resume_way()} reruns the final evaluation" + (f", reusing the parts kept in {partial}"
                                                            if partial.is_file() else "")) \
        if e.training_stop == "completed" else how_to_continue()
    where = f" (rank {first_rank}; the errors of every rank that failed are in summary.json)" if len(errors) > 1 else ""
    print(f"error: {error}{where}\nthe final evaluation of step {step} failed ({how}); the checkpoint of step {step} "
          f"is saved; {then}", file=sys.stderr, flush=True)
    write_summary_after_error(run, "final_eval_error", fields)
    if is_dist():
        tell_summary_written(f"final_eval/{e.evaluation}/summary")


def interrupted_final_eval(run: Run, training_stop: str, signal_name: str, evals: dict) -> str:
    """A signal ended (or came before) the final evaluation: the checkpoint of this step is saved. Records the stop
    (metrics.jsonl, and the summary fields it returns the stop reason for) and says how to go on."""
    step = run.loop["step"]
    evals.update(interrupted_during="final_eval", training_stop_reason=training_stop, signal=signal_name)
    run.metrics.log({"kind": "stop", "step": step, "reason": "interrupted", "during": "final_eval",
                     "signal": signal_name})
    then = f"{resume_way()} runs the final evaluation" if training_stop == "completed" else how_to_continue()
    partial = partial_path(run.run_dir, FINAL_EVAL_PARTIAL)
    kept = f" (the finished ones are kept in {partial} for the resume)" if partial.is_file() else ""
    print0(f"interrupted ({signal_name}) during the final evaluation of step {step} "
           f"({training_stop_words(training_stop)}): checkpoint saved, summary.json written without the unfinished "
           f"evaluations{kept}; {then}")
    return "interrupted"
