"""--resume for scripts/base_train.py, in two halves around the expensive set-up: ``resume_point`` (before it)
picks the checkpoint and refuses flags that would not continue its run, in seconds; ``restore`` (after the model and
optimizer are built) only loads it. ``run`` is the trainer's Run (scripts/base_train.py)."""

import os
from dataclasses import dataclass
from pathlib import Path

from nanochat import checkpoint as ckpt
from nanochat import init_from
from nanochat.cli_types import flag_name, is_seed, unresumable_seeds
from nanochat.common import every_rank_ok, print0, rank0_decides
from nanochat.hand_command import hand_command
from nanochat.run_control import CONTINUE_COMMAND_ENV
from nanochat.train_loop import restore_stats_buffers
from nanochat.train_setup import RunData

# Flags that change the optimisation trajectory: a resume with different values would not continue the run.
# Not the kernel choices (--attention, --mome-kernels, --mome-shared-table-kernel): the same equations, summed in
# another order, so a resume may change them (e.g. a requeue onto nodes without triton); summary.json joins the
# paths each session's steps ran on (loop["attention"], loop["mome_kernels"]: "torch+fused").
TRAJECTORY_KEYS = ("depth", "aspect_ratio", "head_dim", "max_seq_len", "total_batch_size", "embedding_lr",
                   "unembedding_lr", "matrix_lr", "scalar_lr", "adam_beta1", "adam_beta2", "weight_decay",
                   "memory_lr", "memory_beta1", "memory_beta2", "memory_wd", "warmup_ratio", "warmdown_ratio",
                   "final_lr_frac", "muon_momentum_start", "muon_momentum_end", "muon_momentum_ramp", "seed",
                   "data_seed", "synthetic_data", "dtype")
LR_KEYS = ("embedding_lr", "unembedding_lr", "matrix_lr", "scalar_lr", "memory_lr")  # --resume-override-lr
# scripts.run's AFRESH_ENV, spelled out: neither module imports the other (the runner's --plan imports no torch)
RUNNER_AFRESH_ENV = "NANOCHAT_RUN_AFRESH_COMMAND"


@dataclass
class ResumePoint:
    """The checkpoint --resume continues, checked against this run's flags before the expensive set-up."""
    step: int
    meta: dict
    lr_changes: dict  # --resume-override-lr: {key: [checkpoint, now]}


def zero_cap_refused(why: str) -> str:
    return ("--core-max-per-task 0: must be an integer >= 1, or -1 for all; 0 (all, in the older versions that took "
            f"it) is read as -1 only to resume a run recorded with it, and {why}")


def read_old_records(args, saved_args: dict) -> None:
    """Flag values an older version recorded that this one refuses at parsing (nanochat.cli_types): seeds above
    SEED_MAX stop the resume saying why no seed continues the run; --core-max-per-task 0 ("all" then) reads as -1,
    the same evaluation. Before the comparison of flags, whose "!=" would say nothing of either."""
    seeds = [(flag_name(key), saved_args[key]) for key in ("seed", "data_seed")
             if type(saved_args.get(key)) is int and not is_seed(saved_args[key])]
    if seeds:
        raise ValueError("--resume: the checkpoint's run (see its config.json) was recorded with "
                         + unresumable_seeds(seeds))
    recorded = saved_args.get("core_max_per_task")
    if args.core_max_per_task == 0 and recorded != 0:
        with_what = "without it" if recorded is None else f"with --core-max-per-task {recorded}"
        raise ValueError(zero_cap_refused(f"the checkpoint's run was recorded {with_what}"))
    if recorded == 0 and args.core_max_per_task in (0, -1):
        args.core_max_per_task = -1
        print0("--resume: the checkpoint's run was recorded with --core-max-per-task 0, which meant all examples in "
               "the older version that started it; read as -1 (all), the same CORE evaluation")


def runner_afresh_command() -> str | None:
    """The scripts.run command that starts this run afresh, which the runner names in RUNNER_AFRESH_ENV when it
    starts base_train; None outside the runner (unset or empty)."""
    return os.environ.get(RUNNER_AFRESH_ENV) or None


def wrapper_command() -> str | None:
    """The command of a wrapper that passes --resume auto itself (speedrun.sh: CONTINUE_COMMAND_ENV), unless
    scripts.run (``runner_afresh_command``, whose own way comes first) started this base_train."""
    return None if runner_afresh_command() else os.environ.get(CONTINUE_COMMAND_ENV)


def how_to_start_afresh(run_dir: Path, values: dict[str, str] | None = None, world: int = 1) -> str:
    """The way forward after a refused resume. scripts.run adds --resume auto itself and names its own command in
    RUNNER_AFRESH_ENV: "drop --resume" could not be followed there; nor under a wrapper that does too
    (``wrapper_command``: speedrun.sh, whose user typed 'bash speedrun.sh'): ``under_wrapper``."""
    runner = runner_afresh_command()
    if runner:
        return (f"to start afresh instead (it deletes the run in {run_dir}), run: {runner}\n"
                "  or, to continue it, run the row again with the flags it was started with")
    wrapper = wrapper_command()
    if wrapper:
        return under_wrapper(wrapper, run_dir, values, world)
    return (f"to start afresh instead, drop --resume and add --overwrite (it deletes the run in {run_dir}), or pass "
            "another --run-dir")


def under_wrapper(wrapper: str, run_dir: Path, values: dict[str, str] | None, world: int) -> str:
    """The ways a wrapper's user has after a refused resume: the wrapper again once the run dir is gone, or with what
    the run was trained with (speedrun.sh's DEMO_STEPS, a config file, a default an update changed: the wrapper, not
    base_train, knows its settings), or by hand the base_train command it ran (``hand_command``,
    ``world`` processes) with the checkpoint's ``values`` ({flag: value}) of the flags that differ, the one way on
    for a run continued by hand with other LRs (a non-finite stop's advice). ``values`` None: some difference is no
    flag's (the step count, the data, the model config), so no command names it."""
    ways = (f"to start afresh instead, delete (or move) {run_dir} and run '{wrapper}' again; to continue it instead, "
            f"run '{wrapper}' again with what the run was trained with (what differs above: a setting it reads, a "
            "config file, a default an update changed)")
    if values is None:
        return ways
    command = hand_command(world, ["--resume", "latest"], values)
    if command is None:
        return (f"{ways}, or run by hand the base_train command '{wrapper}' ran, with --resume latest and the "
                "checkpoint's values of the flags above")
    return (f"{ways}, or run by hand in {os.getcwd()} the base_train command '{wrapper}' ran, with the checkpoint's "
            f"values of the flags above:\n  {command}")


def check_resume_compatible(args, config, plan: dict, data: RunData, meta: dict, run_dir: Path,
                            world: int) -> dict:
    """Refuse to continue a checkpoint with flags that would change the trajectory; name every difference, and
    end with how to start afresh instead (the flags may be the ones wanted: another step count, say).
    With --resume-override-lr the LR flags may differ: returns those changes {key: [checkpoint, now]}."""
    diffs, lr_changes = [], {}
    values = {}  # {flag: the checkpoint's value} of the differing flags a command line can pass back
    diffs += [f"model config: {d}" for d in
              init_from.config_differences(meta["model_config"], config.to_dict(), theirs="checkpoint")]
    saved_args = ckpt.recorded_run_args(meta)
    if not saved_args:  # as for a flag added since the run, what is not recorded is not compared: said, not silent
        print0("--resume: the checkpoint records no training flags (its meta.json \"config\" has no \"args\"), so "
               "this run's flags are not checked against the ones it trained with")
    for key in TRAJECTORY_KEYS:
        if key in saved_args and saved_args[key] != getattr(args, key):
            if key in LR_KEYS and args.resume_override_lr:
                lr_changes[key] = [saved_args[key], getattr(args, key)]
                continue
            flag = flag_name(key)
            diffs.append(f"{flag} {saved_args[key]!r} (checkpoint) != {getattr(args, key)!r}")
            if type(saved_args[key]) in (int, float, str):  # not a store_true flag's bool, nor an unset None
                values[flag] = str(saved_args[key])
    for key, dir_flag, what, where in (
            ("tokenizer_sha256", "--tokenizer-dir", "tokenizer", "tokenizer_dir"),
            ("data_sha256", "--data-dir", "prepared data (shards, rows, sizes)", "data_dir")):
        saved = meta.get(key)  # absent in checkpoints of older versions and of synthetic-data runs
        if saved is not None and saved != getattr(data, key):
            diffs.append(f"{dir_flag}: the {what} of {getattr(data, where)} differs from the checkpoint's "
                         f"({meta.get(where)})")
    recorded = ckpt.recorded_config(meta)
    diffs += init_from.resume_differences(recorded.get("init_from"), args.init_from)
    saved_n = (recorded.get("plan") or {}).get("num_iterations")
    if saved_n is not None and saved_n != plan["num_iterations"]:
        diffs.append(f"num_iterations {saved_n} (checkpoint) != {plan['num_iterations']}")
    if diffs:
        # not under a wrapper, whose user cannot pass the flag: its advice names a command with the LRs to go on
        lr_hint = any(f"{flag_name(k)} " in d for d in diffs for k in LR_KEYS) and not wrapper_command()
        hint = ("\n  (to continue with other learning rates on purpose, e.g. after a non-finite loss, add "
                "--resume-override-lr)") if lr_hint else ""
        raise ValueError("--resume: the flags do not match the checkpoint's run (see its config.json):\n  "
                         + "\n  ".join(diffs) + hint + "\n  "
                         + how_to_start_afresh(run_dir, values if len(values) == len(diffs) else None, world))
    return lr_changes


def override_lrs(run, step: int, changes: dict, fresh_initial_lrs: list[float]) -> None:
    """--resume-override-lr: the groups keep the LRs built from this run's flags (load_state_dict restored the
    checkpoint's); the change is recorded in config.json (lr_overrides) and metrics.jsonl (kind "resume")."""
    for group, lr in zip(run.optimizer.param_groups, fresh_initial_lrs):
        group["initial_lr"] = lr
    run.lr_override_now = {"step": step, "changes": {k: {"checkpoint": old, "now": new}
                                                     for k, (old, new) in changes.items()}}
    run.lr_overrides.append(run.lr_override_now)
    print0(f"--resume-override-lr: continuing from step {step} with "
           + ", ".join(f"{flag_name(k)} {new} (checkpoint {old})" for k, (old, new) in changes.items())
           + "; recorded in config.json (lr_overrides) and metrics.jsonl")


def processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def check_world_size(args, step: int, saved_world: int, world: int) -> None:
    if saved_world != world and not args.resume_new_world_size:
        raise ValueError(f"--resume: checkpoint step {step} was written by {processes(saved_world)} but this run has "
                         f"{world}; the data order is per rank, so an exact resume needs the same world size. "
                         "Pass --resume-new-world-size to continue anyway with the data re-partitioned")


def resume_point(args, run_dir: Path, config, plan: dict, data: RunData, world: int) -> ResumePoint | None:
    """The cheap half of --resume (the step, its files, its flags and world size against this run's), so that
    ``restore`` after the model is built only loads. Rank 0 picks the step for every rank; a rank that cannot
    see or accept it stops all ranks (none trains alone). None: a fresh start."""
    step = rank0_decides(lambda: ckpt.resolve_resume_step(run_dir, args.resume))
    if step is None:
        if args.core_max_per_task == 0:  # --resume auto about to start a new run (latest and STEP raised above)
            raise ValueError(zero_cap_refused(f"there is no checkpoint in {run_dir / ckpt.CKPT_DIR}: a new run"))
        if args.resume == "auto":
            print0(f"--resume auto: no checkpoint in {run_dir / ckpt.CKPT_DIR}, starting from step 0")
        return None
    every_rank_ok(lambda: ckpt.require_files(run_dir, step))

    def check() -> ResumePoint:
        meta = ckpt.load_meta(run_dir, step)
        read_old_records(args, ckpt.recorded_run_args(meta))
        lr_changes = check_resume_compatible(args, config, plan, data, meta, run_dir, world)
        saved_world = ckpt.recorded_config(meta).get("world_size")  # absent in older checkpoints: restore checks
        if saved_world is not None:
            check_world_size(args, step, saved_world, world)
        return ResumePoint(step, meta, lr_changes)

    return every_rank_ok(check)


def changes_saved_at(meta: dict, step: int) -> dict:
    """The --resume-override-lr and --resume-new-world-size changes that checkpoint ``step`` (its ``meta``) holds of
    sessions that resumed from this same step and saved it again (after a signal during the evals or samples a
    pending checkpoint owed), as their "resume" records in metrics.jsonl spell them."""
    config = ckpt.recorded_config(meta)
    return {"lr_override": [e["changes"] for e in config.get("lr_overrides") or [] if e["step"] == step],
            "world_size": [{k: e[k] for k in ("checkpoint", "now")}
                           for e in config.get("world_size_changes") or [] if e["step"] == step]}


def restore(run, point: ResumePoint) -> None:
    step, meta = point.step, point.meta
    recorded = ckpt.recorded_config(meta)
    run.lr_overrides = list(recorded.get("lr_overrides") or [])
    run.world_size_changes = list(recorded.get("world_size_changes") or [])
    run.init_from = recorded.get("init_from")  # recorded when the run started; not read again
    fresh_initial_lrs = [g["initial_lr"] for g in run.optimizer.param_groups]
    # on the CPU: loader and RNG states must stay there; the optimizer moves its state to each parameter's device
    state = ckpt.load_training_state(run.run_dir, step)
    saved_world = state["world_size"]
    check_world_size(run.args, step, saved_world, run.world)
    ckpt.load_model_weights(run.model, run.run_dir, step, map_location=run.device)
    run.optimizer.load_state_dict(state["optimizer"])
    if point.lr_changes:
        override_lrs(run, step, point.lr_changes, fresh_initial_lrs)
    if saved_world == run.world:
        run.data.loader.load_state_dict(state["dataloader"][run.rank])
        ckpt.set_rng_state(state["rng"][run.rank])
    else:
        repartition_data(run, state, step)
    restore_stats_buffers(run.model, state.get("stats", {}), run.rank, step)
    run.loop = dict(state["loop"])
    run.last_saved = step
    print0(f"resumed from {ckpt.step_dir(run.run_dir, step)} (step {step}/{run.plan['num_iterations']})")


def repartition_data(run, state: dict, step: int) -> None:
    """--resume-new-world-size: the loaders continue from the old ranks' states re-partitioned over this world
    size (not token-for-token exact); RNG states are taken from old rank (rank mod old world size). The move is
    recorded in config.json (world_size_changes) and metrics.jsonl (kind "resume"), as --resume-override-lr.

    A new rank thus shares an old rank's RNG state (2 -> 3: ranks 0 and 2), on purpose: every rank is seeded with
    --seed (seed_everything) and none draws alone, so all ranks of a run hold one state (test_train_dist.py checks
    a 2-rank checkpoint), as a fresh run of the new size would. A state of its own (from the seed and the rank)
    would set the new rank apart from its peers, and draws that must agree across ranks would then differ."""
    summary = run.data.loader.repartition(state["dataloader"])
    run.world_size_now = {"checkpoint": state["world_size"], "now": run.world}
    run.world_size_changes.append({"step": step, **run.world_size_now})
    ckpt.set_rng_state(state["rng"][run.rank % len(state["rng"])])
    print0(f"--resume-new-world-size: step {step} was saved by {processes(state['world_size'])}, this run has "
           f"{run.world}; data order re-partitioned ({summary})")
