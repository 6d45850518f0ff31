"""Pretrain a GPT (any --model-type family) with a memory block (any --memory: base, ve, bigram, mome, ...).

    python -m scripts.base_train --depth 12 --memory mome --target-flops 3e18
    torchrun --standalone --nproc_per_node=8 -m scripts.base_train --config configs/....toml
    python -m scripts.base_train --depth 24 --memory ve --target-flops 6e19 --dry-run   # plan only, no data

Outputs in the run dir (default runs/<run-name>): config.json (resolved flags, model config, plan), plan.json,
metrics.jsonl, checkpoints/step_NNNNNN/, summary.json. ``--resume`` continues bit-exactly on CPU.

The run dir has one owner: run.lock is held for the life of the run (a second run on it is refused). A fresh run
(no --resume) into a directory that already holds a run is refused unless --overwrite says to delete that run.

Exit codes: 0 = finished; or stopped by --max-wall-time-seconds after saving a checkpoint and running the final
evaluation (stop_reason "wall_time_limit"); or stopped by SIGINT/SIGTERM after saving a checkpoint, without the
final evaluation (stop_reason "interrupted", "signal": its name; a signal during the final evaluation ends it, and
summary.json says so: "interrupted_during": "final_eval", with "training_stop_reason" and what finished); continue
any of them with --resume (from the last step, it runs the final evaluation). Each finished part of the final
evaluation (each bpb split, each CORE task) is kept at once in final_eval.partial.json in the run dir, with a
fingerprint of all that can change its number (the step's checkpoint, dtype, kernels, batch and world size, code
version): a --resume after a signal or a crash during the final evaluation reuses the parts whose fingerprint
matches (one line says which) and computes the rest, with the numbers of an uninterrupted run; the file is deleted
once the final evaluation completes. 2 = bad flags, data, tokenizer, checkpoint or run dir (found before the first
step, nothing trained), or a data file found unreadable during training (the message names it), or a failed write of
a checkpoint or of final_eval.partial.json (a full disk: stop_reason "checkpoint_error" or "final_eval_write_error";
free space, then --resume), or of a stop's own summary.json (no summary then: the message says what finished and that
a --resume writes it); 3 = non-finite loss or parameters (nothing saved for the bad step; every checkpoint was
checked finite when it was saved, the message names the last one and how to continue from it with lower LRs); 1 =
any other error (in the final evaluation: stop_reason "final_eval_error", the step's checkpoint saved, --resume
reruns it; else stop_reason "error", also for an error in the run dir's set-up before the first step (config.json
on a full disk: one line, no traceback) and for an unplanned one in the set-up before it (an OOM while the model is
built, a corrupt checkpoint, a bug: every rank stops together; summary.json only where the run dir is this run's, a
fresh one or a --resume, and not over a completed run's): the traceback on stderr, then the last checkpoint and how
to continue; under torchrun rank 0 writes one rank's error (in a shared step the lowest failing rank's, else the one
posted first: the likely cause), "error_rank" and "errors_by_rank" beside it when it was another rank's or several
failed). A stop by an error writes "error" and "last_checkpoint" in summary.json; a second Ctrl-C aborts at once,
without one.
Under torchrun a SIGTERM to the launcher makes every worker save and exit 0, but torchrun itself exits non-zero
(see docs/training.md, "Stopping and requeueing under a scheduler"): requeue with the same command and --resume auto.
"""

import math
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from nanochat import checkpoint as ckpt
from nanochat import init_from, run_control, train_resume
from nanochat.common import (autocast_context, compute_cleanup, compute_init, every_rank_ok, get_dist_info, print0,
                             print_error, rank0_decides, refuse_before_the_group, resolve_dtype,
                             seed_everything)
from nanochat.eval_resume import Interrupted, ResultWriteError
from nanochat.families import build_model, model_summary, param_groups, preset_lines
from nanochat.final_eval import FinalEvalError, evaluate_at_the_end, record_final_eval_error, signal_of_any_rank
from nanochat.launcher_watch import watch_launcher
from nanochat.lost_output import keep_running_without_output
from nanochat.metrics import MetricsLogger, format_step_line, mfu, peak_flops, truncate_metrics
from nanochat.optim import MuonAdamW
from nanochat.plan import build_plan, grad_accum_steps
from nanochat.report import record_environment
from nanochat.run_dir import claim_run_dir, remove_run, run_contents, set_aside_stale_results
from nanochat.schedules import ScheduleConfig, apply_schedules, init_schedule_state
from nanochat.terminal import replace_unencodable_output
from nanochat.train_end import (WARMUP_STEPS, NonFiniteLoss, NonFiniteParams, SetUpProgress, count_step_time,
                                eta_seconds, finish, last_checkpoint, stop_before_training, stop_by_error,
                                stop_every_rank, stop_nonfinite, stop_set_up_by_error)
from nanochat.train_args import model_config, optim_config, parse_args
from nanochat.run_control import FlopCadence, WallTimeLimit
from nanochat.train_loop import (StopSignal, StopVotes, any_rank, gather_objects, module_stats, summed_stats_buffers,
                                 train_step)
from nanochat.train_resume import ResumePoint
from nanochat.train_setup import (RunData, dry_run, dry_run_vocab, existing_tokenizer, install_mome_kernels,
                                  load_eval_rows, load_run_data, report_data_passes, report_mome_kernels,
                                  resolve_bundle, resolve_run_dir, run_core, run_split_bpb, setup_attention, write_json)

@dataclass
class Run:
    args: object
    rank: int
    world: int
    device: torch.device
    run_dir: Path
    config: object  # the family's config (nanochat.families)
    plan: dict
    model: torch.nn.Module  # uncompiled: checkpoints and evals use it
    step_model: torch.nn.Module  # what the train step calls (compiled with --compile)
    optimizer: MuonAdamW
    sched: ScheduleConfig
    data: RunData
    autocast: object
    metrics: MetricsLogger | None = None
    loop: dict = field(default_factory=dict)
    last_saved: int = -1
    lr_overrides: list = field(default_factory=list)  # --resume-override-lr history (config.json, checkpoints)
    lr_override_now: dict | None = None  # this session's --resume-override-lr change, logged to metrics.jsonl
    world_size_changes: list = field(default_factory=list)  # --resume-new-world-size history (as lr_overrides)
    world_size_now: dict | None = None  # this session's change {"checkpoint": W, "now": W'}, logged to metrics.jsonl
    session_start: float = 0.0  # time.time() when this session's main() began (its set-up counts, as in the limit)
    attention: str = "sdpa"  # the resolved --attention of this session (config.json, summary.json)
    mome_kernels: str = "none"  # the MoME kernel path this session's model takes (config.json, summary.json)
    init_from: dict | None = None  # the --init-from source the run started from (nanochat.init_from)
    resume: ResumePoint | None = None
    init_source: dict | None = None  # the --init-from source as checked before the set-up, loaded after it
    wall_limit: WallTimeLimit | None = None  # --max-wall-time-seconds, on this process's clock (set by main)
    save_flops: FlopCadence | None = None  # --save-at-flops
    eval_flops: FlopCadence | None = None  # --eval-every-flops

    def wall_time(self) -> float:
        """Wall seconds of the run so far: earlier sessions up to the checkpoint resumed from, plus this one (from
        the start of main(): its set-up counts, as the results tables' Wall (min) note says)."""
        return self.loop.get("wall_time", 0.0) + time.time() - self.session_start

    @property
    def dtype(self) -> str:
        """The autocast dtype of training and of the evals during/after it (written into every result)."""
        return resolve_dtype(self.device.type, self.args.dtype)


def build_run(args, stack: ExitStack, tokenizer=None, progress: SetUpProgress | None = None) -> Run:
    """Everything before the first step: devices, run dir, data, model, optimizer; all flag errors surface here.
    ``tokenizer``: the one preflight read, if it did. ``progress``: told once the run dir is this run's. Work a rank
    does on its own (files, the model on its GPU) runs in shared steps (every_rank_ok, rank0_decides): an error of
    one rank is every rank's, and none waits in a collective that a failed rank never enters."""
    info, device = compute_init("" if args.device_type == "auto" else args.device_type)
    stack.callback(compute_cleanup)
    attention = setup_attention(args.attention, device, args.dtype)  # before the model is built and compiled
    kernels = install_mome_kernels(args.mome_kernels, device, stack, args.mome_shared_table_kernel)  # likewise
    # before any expensive work: a busy or unwritable run dir fails now
    run_dir = resolve_run_dir(args)
    claim_run_dir(run_dir, args.resume, args.overwrite, stack)
    if progress is not None and (args.resume is not None or not run_contents(run_dir)):
        progress.run_dir = run_dir  # not a run that --overwrite deletes only after the set-up
    args.data_seed = init_from.data_seed(vars(args))  # --seed where not given
    data = load_run_data(args, info.rank, info.world_size, device, tokenizer)
    config = model_config(args, data.vocab_size)
    plan = build_plan(args, model_summary(config), info.world_size)
    save_flops, eval_flops = run_control.save_cadence(args, plan), run_control.eval_cadence(args, plan)  # real vocab
    report_data_passes(args, plan, data, info.rank)  # passes over the prepared split; shards unlike the paper's
    # before the expensive set-up (CORE bundle, eval rows, model): a requeue with wrong flags, or a wrong
    # --init-from, fails in seconds; a resume never reads the source (its weights are in the run's checkpoints)
    resume = train_resume.resume_point(args, run_dir, config, plan, data, info.world_size)
    if progress is not None and resume is not None:
        progress.resume_step = resume.step  # a rewind's own step, for the account of an error from here on
    source = init_from.checked_source(args, run_dir, config, data.tokenizer, data.data_sha256) \
        if resume is None and args.init_from else None
    data.bundle = resolve_bundle(args)  # may download: a missing --bundle fails before the eval rows' tokenizing
    load_eval_rows(args, data, info.rank, info.world_size)
    if args.compile is None:  # compiled training is the fast (and lower-memory) path on GPUs
        args.compile = device.type == "cuda"

    def build_here():  # on this rank's device: a CUDA OOM on one GPU stops every rank here, none waits for it
        seed_everything(args.seed)
        model = build_model(config, device=device, seed=args.seed)
        # e.g. Engram's compression map; --resume or --init-from then replace it with their checkpoint's buffers
        model.memory.bind_tokenizer(data.tokenizer)
        optimizer = MuonAdamW(param_groups(model, optim_config(args, plan["batch_lr_scale"])))
        init_schedule_state(optimizer)
        return model, optimizer, torch.compile(model, dynamic=False) if args.compile else model

    model, optimizer, step_model = every_rank_ok(build_here)
    mome_kernels = report_mome_kernels(model, kernels)  # what its layers take (recorded; not the flag)
    print0(f"mome kernels in the model: {mome_kernels}")
    sched = ScheduleConfig(plan["num_iterations"], args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac,
                           args.muon_momentum_start, args.muon_momentum_end, args.muon_momentum_ramp)
    autocast = autocast_context(device.type, args.dtype)
    loop = {"step": 0, "train_time": 0.0, "val_bpb": None, "min_val_bpb": None}
    return Run(args, info.rank, info.world_size, device, run_dir, config, plan, model, step_model, optimizer, sched,
               data, autocast, loop=loop, attention=attention, mome_kernels=mome_kernels, resume=resume,
               init_source=source, save_flops=save_flops, eval_flops=eval_flops)


def resolved_config(run: Run) -> dict:
    return {"args": vars(run.args), "model_config": run.config.to_dict(), "plan": run.plan,
            "world_size": run.world, "device": str(run.device), "dtype": run.dtype, "attention": run.attention,
            "mome_kernels": run.mome_kernels, "data": run.data.describe(), "torch": torch.__version__,
            "lr_overrides": run.lr_overrides, "world_size_changes": run.world_size_changes, "init_from": run.init_from}


def save(run: Run, reason: str, keep: bool = False) -> None:
    """Collective: every rank contributes its loader and RNG state; rank 0 writes atomically. ``keep``: never
    pruned by --keep-last (--save-at-flops).

    Never from non-finite numbers: every rank checks its parameters (rank 0's are the ones written) and its own
    shards of the optimizer state (together, all of it); the verdict is all-reduced, so every rank raises
    NonFiniteParams together (after the same collectives) and nothing is written. Only then is the optimizer
    state gathered, onto rank 0 alone: one full copy in host memory per job, not one per rank."""
    step = run.loop["step"]
    loaders = gather_objects(run.data.loader.state_dict())
    rngs = gather_objects(ckpt.rng_state())
    stats = summed_stats_buffers(run.model)  # collective: routing-stats counters since the last log step
    bad = ckpt.nonfinite_tensors(run.model.state_dict())
    bad += [f"optimizer state {name}" for name in ckpt.nonfinite_tensors({"state": run.optimizer.local_state()})]
    if any_rank(bool(bad), run.device):
        raise NonFiniteParams(f"non-finite values after step {step} in "
                              f"{', '.join(bad[:6]) + (' ...' if len(bad) > 6 else '') if bad else 'another rank'}",
                              bad)
    optimizer_state = run.optimizer.state_dict_on_rank0()  # collective; None on the other ranks

    def write() -> Path:  # rank 0 alone; its error (e.g. a full disk) is raised on every rank
        state = {"optimizer": optimizer_state, "loop": {**run.loop, "wall_time": run.wall_time()}, "dataloader": loaders,
                 "rng": rngs, "world_size": run.world, "stats": stats}
        meta = {"reason": reason, "keep": keep, "params_finite": True, "config": resolved_config(run),
                "loop": dict(run.loop),
                "tokenizer_dir": run.data.tokenizer_dir, "data_dir": run.data.data_dir,
                # what was trained on: the manifest's dataset (--dataset, in config.args, is a label with --data-dir)
                "dataset": run.data.dataset or run.args.dataset,
                "tokenizer_sha256": run.data.tokenizer_sha256, "data_sha256": run.data.data_sha256}
        return ckpt.save_checkpoint(run.run_dir, step, run.model, meta, state, keep_last=run.args.keep_last)

    path = rank0_decides(write)  # the other ranks wait for rank 0's write, as a barrier would
    print0(f"saved checkpoint {path} ({reason})")
    run.last_saved = step


def log_train(run: Run, loss: float, aux_loss: float, gnorm: float, sched_vals: dict, dt: float, bar,
              eta: float) -> None:
    step, n, tb = run.loop["step"], run.plan["num_iterations"], run.args.total_batch_size
    tok_s = tb / dt if dt > 0 else 0.0
    util = mfu(run.plan["flops_per_token"] * tb, dt, peak_flops(run.device), run.world)
    muon = next(g for g in run.optimizer.param_groups if g["kind"] == "muon")
    rec = {"kind": "train", "step": step, "tokens": step * tb, "flops": step * tb * run.plan["flops_per_token"],
           "loss": loss, "aux_loss": aux_loss, "grad_norm": gnorm, "lrm": sched_vals["lrm"], "lr_matrix": muon["lr"],
           "muon_momentum": sched_vals["muon_momentum"], "muon_wd": muon["weight_decay"], "dt": dt,
           "tok_per_sec": tok_s, "mfu": util, "train_time": run.loop["train_time"]}
    if run.data.train_split_tokens:  # the tokens trained over the split's (estimated as the plan's data passes)
        rec["data_passes"] = step * tb / run.data.train_split_tokens
    if hasattr(run.data.loader, "passes"):  # where the reader is: documents repeat once it passes 1 (it reads ahead,
        rec["data_read_passes"] = run.data.loader.passes()  # and drops the ends of the documents it crops)
    rec.update(module_stats(run.model))  # keys are "memory/..." and "moe/..."
    run.metrics.log(rec)
    if run.rank == 0:
        line = format_step_line(step, n, loss, sched_vals["lrm"], dt, tok_s, util, eta)
        bar.write(line, file=sys.stdout) if not bar.disable else print(line, flush=True)


def evals_due(run: Run, step: int, resumed_at: int | None) -> tuple[bool, bool]:
    """(val bpb due, CORE due) at ``step``: by step counts, or both together at --eval-every-flops counts (which
    replace them); the same on every rank."""
    a, n = run.args, run.plan["num_iterations"]
    if step == n or step == resumed_at:  # the final eval covers N; a resumed step was evaluated before saving
        return False, False
    if run.eval_flops is not None:
        bpb_due = core_due = run.eval_flops.due(step)
    else:
        bpb_due = a.eval_every > 0 and step % a.eval_every == 0
        core_due = a.core_every > 0 and step > 0 and step % a.core_every == 0
    return bpb_due, core_due and run.data.bundle is not None


def periodic_evals(run: Run, step: int, resumed_at: int | None, stop: StopSignal) -> bool:
    """The evals due at ``step`` (``evals_due``); returns whether any ran. A stop signal, latched before or during
    them, ends them with ``Interrupted`` on every rank together (``stop.interrupts``: at the next batch's stop vote
    or CORE task's set-up step, nanochat.eval_resume.stop_voted); an eval it cuts logs nothing, one that finished
    before it is logged."""
    bpb_due, core_due = evals_due(run, step, resumed_at)
    if not (bpb_due or core_due):  # no evals: a signal waits for the step's vote, as before
        return False
    a = run.args
    at = {"step": step, "tokens": step * a.total_batch_size,
          "flops": step * a.total_batch_size * run.plan["flops_per_token"]}
    with stop.interrupts():
        if bpb_due:
            bpb = run_split_bpb(run.model, run.data, run.args, run.rank, run.world, run.device, run.autocast)
            run.loop["val_bpb"] = bpb
            run.loop["min_val_bpb"] = bpb if run.loop["min_val_bpb"] is None else min(bpb, run.loop["min_val_bpb"])
            run.metrics.log({"kind": "eval", **at, "val_bpb": bpb})
            print0(f"step {step:05d} | val bpb {bpb:.6f}")
        if core_due:
            res = run_core(run.model, run.data, run.args, run.device, run.autocast)
            run.metrics.log({"kind": "core", **at, "core": res["core"], "label": res["label"], "dtype": run.dtype})
            print0(f"step {step:05d} | {res['label']} [{run.dtype}] {res['core']:.4f}")
    return True


def stop_reason(step: int, n: int, votes: StopVotes) -> str | None:
    """Why the loop ends at this step boundary, if it does: the votes come from the last step's reduction, so
    every rank reads the same ones. A signal wins over the wall time (a scheduler is about to kill the job)."""
    if step == n:
        return "completed"
    if votes.signal:
        return "interrupted"
    if votes.wall_time:
        return "wall_time_limit"
    return None


BOUNDARY_PENDING = "boundary_pending"  # loop key of a signal stop's checkpoint: its step's evals/samples not run


def step_boundary(run: Run, step: int, reason: str | None, resumed_at: int | None, stop: StopSignal) -> str | None:
    """The work between two optimizer steps, in order: evals, samples, then one checkpoint if any is due. Saving
    last means a checkpoint of step s holds everything done at s: a resume from it repeats and misses nothing. A
    wall-time stop runs a due periodic eval too, although the final evaluation follows: that final record goes
    with the next --resume, which does not evaluate its own step again, so skipping it would lose the eval. A
    signal stop saves at once (a scheduler's SIGKILL follows its SIGTERM after a grace period that an eval, or
    CORE, could outlast) and marks the checkpoint BOUNDARY_PENDING: its resume runs the step's evals and samples.

    A signal during the periodic evals cuts them short on every rank together (``periodic_evals``) and stops the
    same way: a pending checkpoint of the step. A signal during the samples or a periodic save (latched; that work
    runs whole: it is short) stops the loop right after it, not after the next step and its save: after work that
    ran (never on ordinary steps) every rank votes once (a small all-reduce), and the checkpoint of step s is
    written now unless the work saved it. Returns the stop reason, that one included."""
    interrupted, worked = reason == "interrupted", False
    saved_before = step == run.last_saved  # a resume's checkpoint: a pending one's evals and samples come after it
    keep = run.save_flops is not None and run.save_flops.due(step)
    if not interrupted:
        try:
            worked = periodic_evals(run, step, resumed_at, stop)
        except Interrupted as cut:  # on every rank together
            return stop_in_the_evals(run, step, cut, signal_reason(stop), keep)
        at_end = reason in ("completed", "wall_time_limit")
        worked = run_control.periodic_samples(run, step, resumed_at, at_end=at_end) or worked
    periodic = run.args.save_every > 0 and step > 0 and step % run.args.save_every == 0
    signal_why = signal_reason(stop)
    if step != run.last_saved and (reason or keep or periodic):
        why = {"completed": "final", "wall_time_limit": "wall_time_limit",
               "interrupted": signal_why}.get(reason, "periodic" if periodic else "")
        save_at_boundary(run, why, keep, pending=interrupted)
        worked = True
    if reason is None and worked and any_rank(stop.received is not None, run.device):
        if step != run.last_saved or saved_before:  # not saved, or saved before this work (a pending resume)
            save_at_boundary(run, signal_why, keep)
        reason = "interrupted"
    return reason


def signal_reason(stop: StopSignal) -> str:
    """A signal stop's checkpoint reason: the signal this rank got, or none here (rank 0 prints it)."""
    return f"signal {stop.received or 'on another rank'}"


def stop_in_the_evals(run: Run, step: int, cut: Interrupted, signal_why: str, keep: bool) -> str:
    """After a signal cut the periodic evals of ``step`` short: the step's checkpoint as a signal stop's, pending
    (its resume runs the step's evals and samples again). A pending resume's own step already has that checkpoint
    on disk: not written again, within a scheduler's grace period, unless this session changed its config at this
    step (--resume-override-lr, --resume-new-world-size): saved again with the change, or the next --resume would
    meet the checkpoint's old config and refuse this session's flags."""
    on_disk = step == run.last_saved
    changed = on_disk and (run.lr_override_now is not None or run.world_size_now is not None)
    what = "saving the step again, with this session's resume changes" if changed else \
        "its checkpoint, saved before them, stays" if on_disk else "saving the step"
    print0(f"step {step:05d} | {signal.Signals(cut.signum).name} during the periodic evals: cut short (the cut one "
           f"logs nothing); {what}: its --resume runs them")
    if not on_disk or changed:
        save_at_boundary(run, signal_why, keep, pending=True)
    return "interrupted"


def save_at_boundary(run: Run, why: str, keep: bool, pending: bool = False) -> None:
    """The step's checkpoint; ``pending``: a signal stop's, saved before its step's evals and samples."""
    if pending:
        run.loop[BOUNDARY_PENDING] = True
    save(run, ", ".join(w for w in (why, "save_at_flops" if keep else "") if w), keep=keep)
    run.loop.pop(BOUNDARY_PENDING, None)


def train(run: Run, resumed_at: int | None, stop: StopSignal) -> str:
    """The step loop: exactly N optimizer steps in total (over all resumes), unless a signal (latched by ``stop``)
    or the wall-time budget stops it earlier. Returns the stop reason."""
    n, loop = run.plan["num_iterations"], run.loop
    bar = tqdm(total=n, initial=loop["step"], disable=run.rank != 0, desc="train", dynamic_ncols=True)
    votes, first = StopVotes(), loop["step"]
    peak, own = peak_flops(run.device), (0, 0.0)  # own: this session's steady steps and their seconds
    if loop.pop(BOUNDARY_PENDING, False):  # resumed from a signal stop's checkpoint: its step's evals are to do
        resumed_at = None
    time_up = run.wall_limit.reached if run.wall_limit is not None and run.wall_limit.limit_s > 0 else None
    loop.setdefault("steady_steps", 0)
    loop.setdefault("steady_time", 0.0)
    if run.attention not in loop.setdefault("attention", []):  # a resume on another kernel: tok/s mixes both
        loop["attention"].append(run.attention)
    if run.mome_kernels not in loop.setdefault("mome_kernels", []):  # likewise (checkpoints before it: absent)
        loop["mome_kernels"].append(run.mome_kernels)
    try:
        while True:
            step = loop["step"]
            reason = stop_reason(step, n, votes)  # votes: agreed by all ranks in the last step's reduction
            reason = step_boundary(run, step, reason, resumed_at, stop)
            if reason == "wall_time_limit":
                run_control.note_wall_time_stop(run, step)
            if reason:
                return reason
            sched_vals = apply_schedules(run.optimizer, step, run.sched)
            t0 = time.perf_counter()
            # the latch is read at the step's vote, not now: a signal during this step stops after it
            loss, gnorm, votes, aux_loss = train_step(run.step_model, run.optimizer, run.data.loader,
                                                      run.plan["grad_accum_steps"], run.autocast, run.device,
                                                      lambda: stop.received is not None, time_up,
                                                      (run.args.device_batch_size, run.args.max_seq_len))
            dt = time.perf_counter() - t0  # train_step ends with a host sync: the step's device work is done
            if not math.isfinite(loss):
                raise NonFiniteLoss(f"train loss is {loss} at step {step + 1}")
            loop["step"], steady = step + 1, step - first >= WARMUP_STEPS
            count_step_time(loop, dt, steady, run.world, peak)
            if steady:
                own = (own[0] + 1, own[1] + dt)
            bar.update(1)
            if (step + 1) % run.args.log_every == 0 or step + 1 == n:
                log_train(run, loss, aux_loss, gnorm, sched_vals, dt, bar, eta_seconds(loop, *own, n - step - 1))
    finally:
        bar.close()


def prepare_resume(run: Run) -> int | None:
    """Load the --resume checkpoint that ``train_resume.resume_point`` checked (clear errors for corrupt files), or
    the weights of the --init-from source that ``init_from.checked_source`` checked. A rank that cannot load them
    stops all ranks (none trains alone)."""
    resumed_at = run.resume.step if run.resume else None
    if run.resume is not None:
        every_rank_ok(lambda: train_resume.restore(run, run.resume))  # e.g. a file corrupt on one node only
    if run.init_source is not None:
        run.init_from = init_from.start_from_source(run.model, run.init_source, run.device)
    # e.g. a slot map neither on disk nor in the checkpoint, or on disk but not the checkpoint's
    every_rank_ok(lambda: run.model.memory.check_ready(training=True))
    return resumed_at


def set_up_run_dir(run: Run, resumed_at: int | None) -> None:
    """Rank 0's writes before the first step (base_train's files, a resume's clean-up) and metrics.jsonl opened."""
    if run.args.overwrite:
        removed = remove_run(run.run_dir)
        if removed:
            print0(f"--overwrite: deleted the previous run in {run.run_dir} ({', '.join(removed)})")
    write_json(run.run_dir / "config.json", resolved_config(run))
    write_json(run.run_dir / "plan.json", {**run.plan, "model_config": run.config.to_dict()})
    record_environment(run.run_dir, run.device, run.world, fresh=resumed_at is None)
    if resumed_at is not None:
        # The later checkpoints go before their records: a kill in between (no signal handler yet) leaves this
        # step the latest, whose next --resume drops the records again. The other order left the latest
        # checkpoint's steps without records for good.
        later, folder = ckpt.set_aside_later(run.run_dir, resumed_at)
        if later:
            print0(f"--resume {resumed_at}: the checkpoints of later steps {later} belong to the abandoned "
                   f"continuation; moved to {folder} (not deleted)")
        set_aside_stale_results(run.run_dir, resumed_at, folder)
        # a pending checkpoint's evals and samples, and the "resume" record, logged by a resume that died before
        # it saved: drop that copy (this one logs its own). W&B cannot recall what that resume sent.
        truncate_metrics(run.run_dir / "metrics.jsonl", resumed_at, pending=bool(run.loop.get(BOUNDARY_PENDING)),
                         saved_changes=train_resume.changes_saved_at(run.resume.meta, resumed_at))
    elif (run.run_dir / "metrics.jsonl").exists():
        (run.run_dir / "metrics.jsonl").unlink()  # a fresh run owns its metrics file
    a = run.args
    run.metrics = MetricsLogger(run.run_dir, run.rank, a.wandb, a.wandb_project, a.run_name, resolved_config(run),
                                resume_step=resumed_at)
    changes = {**({"lr_override": run.lr_override_now["changes"]} if run.lr_override_now else {}),
               **({"world_size": run.world_size_now} if run.world_size_now else {})}
    if changes:
        run.metrics.log({"kind": "resume", "step": resumed_at, **changes})


def execute(run: Run, resumed_at: int | None) -> int:
    run.session_start = run.session_start or time.time()  # main() sets it: the set-up counts in the wall time
    try:  # rank 0's error is every rank's: none goes on to wait in the first step's collective
        rank0_decides(lambda: set_up_run_dir(run, resumed_at))
    except Exception as e:  # a full disk, a bug: summary.json says so, as for an error in training
        return stop_before_training(run, e)
    if run.metrics is None:  # a rank other than 0: its logger logs nothing
        run.metrics = MetricsLogger(run.run_dir, run.rank)
    a = run.args
    print0(f"run dir {run.run_dir} | {run.plan['num_iterations']} steps x {a.total_batch_size:,} tokens "
           f"(grad accum {run.plan['grad_accum_steps']}, world {run.world}) | {run.plan['params_total']:,} params")
    stop = StopSignal().install()  # until the summary is written, the final evaluation's included
    try:
        return train_and_evaluate(run, resumed_at, stop)
    finally:
        stop.uninstall()


def train_and_evaluate(run: Run, resumed_at: int | None, stop: StopSignal) -> int:
    """The step loop, the final evaluation and the summary; the exit code."""
    from nanochat.dataset import DataError

    evals = {}
    try:
        reason = train(run, resumed_at, stop)
        if reason == "interrupted":  # on every rank together; rank 0 may not be the one with the signal
            evals["signal"] = signal_of_any_rank(stop)
        if reason in ("completed", "wall_time_limit"):
            reason = evaluate_at_the_end(run, reason, stop, evals)
    except NonFiniteLoss as e:
        return stop_nonfinite(run, e)
    except DataError as e:  # a file a loader's reader thread could not read: named in the message
        return stop_every_rank(run, "data_error", (
            f"error: {e}\ntraining stopped during step {run.loop['step'] + 1}; last checkpoint: {last_checkpoint(run)} "
            f"in {run.run_dir / ckpt.CKPT_DIR}. Replace the file (or re-run scripts.prepare_data), then "
            f"{run_control.how_to_continue()}"), e)
    except ckpt.CheckpointWriteError as e:
        return stop_every_rank(run, "checkpoint_error", (
            f"error: {e}\ntraining stopped at step {run.loop['step']}; last checkpoint: {last_checkpoint(run)}. Free "
            f"space (or fix the run dir), then {run_control.how_to_continue()}"), e)
    except ResultWriteError as e:  # keeping a finished part in final_eval.partial.json (rank 0's write)
        return stop_every_rank(run, "final_eval_write_error", (
            f"error: {e.failure or e}\nthe final evaluation of step {run.loop['step']} stopped; its checkpoint is "
            f"saved. Free space (or fix the run dir), then {run_control.how_to_continue()} (it reuses the parts kept)"),
            e.failure or e, evals)
    except FinalEvalError as e:  # agreed through the store: no collective from here on (a rank may be stuck in one)
        record_final_eval_error(run, e, evals)
        return 1
    except Exception as e:  # unplanned (an OOM, a bug): summary.json still says how the run ended; not Ctrl-C's abort
        return stop_by_error(run, e, evals)
    finally:
        run.metrics.close()
    return finish(run, reason, evals)


def preflight(args):
    """Flag checks that need the memory registry or the world size, before any process group, data or model.
    The vocab is the run's where it is known (--vocab-size, the synthetic stream's, the tokenizer's): memory
    shapes depend on it (e.g. --mome-slot-factor f: N = ceil(V / f)), so an assumed one could refuse valid flags.
    Returns the tokenizer it read (None: none read), for the rest of the run: one read of its files per run."""
    tokenizer = existing_tokenizer(args) if args.vocab_size is None else None
    summary = model_summary(model_config(args, dry_run_vocab(args, tokenizer)[0]))  # geometry, memory flags (meta)
    try:
        grad_accum_steps(args.total_batch_size, args.device_batch_size, args.max_seq_len, get_dist_info().world_size)
    except ValueError as e:
        if args.resume is None:
            raise
        # another total batch would be refused next, as a change of the trajectory
        raise ValueError(f"{e}\n  (a --resume keeps the checkpoint's --total-batch-size: change --device-batch-size "
                         "or the number of processes instead, with --resume-new-world-size for the latter)") from None
    if args.vocab_size is not None or args.synthetic_data:  # the real FLOPs/token: FLOP targets checked now
        run_control.check_flop_flags(args, build_plan(args, summary, get_dist_info().world_size))
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    started = run_control.clock()  # --max-wall-time-seconds counts from here: set-up and compile count
    session_start = time.time()  # and so does summary.json's wall_time_s (on the wall clock: it adds up sessions)
    keep_running_without_output()  # a dead reader of the output (a killed runner or `| tee`) does not end the run
    watch_launcher()  # under torchrun: a SIGKILLed launcher stops this worker as a SIGTERM would
    args = parse_args(argv)  # exits with code 2 and a message on bad flags
    try:
        tokenizer = preflight(args)
    except ValueError as e:
        return refuse_before_the_group(e)
    for line in preset_lines(args):  # --model-type's defaults: a design without a table preset is said so
        print0(line)
    if args.dry_run:
        try:
            dry_run(args, tokenizer)
        except (ValueError, FileNotFoundError) as e:  # flags, tokenizer, --init-from source
            return refuse_before_the_group(e)
        return 0
    with ExitStack() as stack:  # on every exit path: release run.lock, then the process group
        progress = SetUpProgress()
        try:
            run = build_run(args, stack, tokenizer, progress)
            run.wall_limit, run.session_start = WallTimeLimit(args.max_wall_time_seconds, started), session_start
            resumed_at = prepare_resume(run)
        except (ValueError, FileNotFoundError) as e:  # flag/data/tokenizer/checkpoint/run-dir problems, before any step
            print_error(e)  # once, where every rank raised it together
            return 2
        except Exception as e:  # unplanned (an OOM, a corrupt checkpoint, a bug): every rank stops, with a summary
            return stop_set_up_by_error(args, progress, e)
        return execute(run, resumed_at)


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
