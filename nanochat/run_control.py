"""The trainer's run-control flags beside the step counts: a wall-clock budget (--max-wall-time-seconds),
checkpoints and full evals at FLOP counts (--save-at-flops, --eval-every-flops), and greedy samples of fixed
prompts (--sample-every).

FLOP counts are the training FLOPs after ``step`` optimizer steps, ``step x total_batch_size x flops_per_token``
(summary.json's ``flops``). A target is reached at the first step whose count is at least the target; targets are
read as exact rationals (``1e18``, ``2_000_000_000_000_000_000``), so a target equal to a step's count lands on that
step, not one later through float rounding. With --target-flops F the run's last step stands for F: its step count
is round(F / FLOPs per step), which may fall short of F, and a target up to F then falls on the last step.
"""

import math
import sys
import time
from dataclasses import dataclass
from fractions import Fraction

from nanochat.common import print0
from nanochat.engine import generate

# nanochat's base_train prompts (the reference samples the same 7), completed greedily for SAMPLE_TOKENS tokens
SAMPLE_PROMPTS = ("The capital of France is", "The chemical symbol of gold is",
                  "If yesterday was Friday, then tomorrow will be", "The opposite of hot is",
                  "The planets of the solar system are:", "My favorite color is", "If 5*x + 3 = 13, then x is")
SAMPLE_TOKENS = 16
SYNTHETIC_PROMPT_TOKENS = 8  # --synthetic-data has no text: its prompts are the first tokens of fixed val rows


def clock() -> float:
    """The process clock of --max-wall-time-seconds (monotonic: a clock change cannot end a run). Tests replace
    this function, not time.monotonic, which everything else shares."""
    return time.monotonic()


@dataclass
class WallTimeLimit:
    """--max-wall-time-seconds: ``limit_s`` seconds of this process (``started`` = ``clock()`` when main() began,
    so set-up, compile and evals count); off when ``limit_s`` <= 0."""
    limit_s: float
    started: float

    def elapsed(self) -> float:
        return max(0.0, clock() - self.started)

    def reached(self) -> bool:
        return self.limit_s > 0 and self.elapsed() >= self.limit_s


def parse_flop_count(text: str, flag: str) -> Fraction:
    """One FLOP count: a positive int or float literal, ``_`` separators allowed; exact (a Fraction), within the
    float range (the counts are compared with the run's as floats too, and printed as floats)."""
    cleaned = text.strip()
    try:
        if not cleaned or "__" in cleaned or cleaned.startswith("_") or cleaned.endswith("_"):
            raise ValueError
        value = Fraction(cleaned.replace("_", ""))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{flag}: {text!r} is not a FLOP count (a number such as 1e18 or 2_000_000_000)") from None
    if value <= 0:
        raise ValueError(f"{flag}: FLOP counts must be > 0 (got {text.strip()})")
    if value > sys.float_info.max:
        raise ValueError(f"{flag}: {text.strip()} is beyond any run (more than {sys.float_info.max:.6g} FLOPs)")
    return value


def parse_flop_list(text: str, flag: str) -> list[Fraction]:
    """A comma list of FLOP counts (sorted, duplicates dropped)."""
    return sorted(set(parse_flop_count(item, flag) for item in text.split(",")))


def first_step_reaching(target: Fraction, flops_per_step: int) -> int:
    """The first step s with s x flops_per_step >= target."""
    return math.ceil(target / flops_per_step)


@dataclass
class FlopCadence:
    """Steps at which cumulative training FLOPs reach targets: a list of targets, or every ``interval`` FLOPs
    (targets interval, 2 x interval, ...). Several targets reached by one step make that step due once. The
    ``last_step`` reaches ``horizon`` FLOPs when that is more than its count (--target-flops rounded down)."""
    flops_per_step: int
    steps: frozenset = frozenset()  # for a list of targets
    interval: Fraction | None = None
    last_step: int = 0
    horizon: Fraction | None = None

    def reached(self, step: int) -> Fraction:
        """The FLOPs that ``step`` counts as reached."""
        count = Fraction(step * self.flops_per_step)
        return max(count, self.horizon) if step == self.last_step and self.horizon is not None else count

    def due(self, step: int) -> bool:
        if step < 1:
            return False
        if self.interval is None:
            return step in self.steps
        # some multiple of the interval lies in ((step - 1) x F, reached(step)]
        return self.reached(step) // self.interval > ((step - 1) * self.flops_per_step) // self.interval

    def due_steps(self, num_iterations: int) -> list[int]:
        return [s for s in range(1, num_iterations + 1) if self.due(s)]


def _beyond_the_run(flag: str, text: str, plan: dict, horizon: Fraction) -> ValueError:
    budget = f"; its last step stands for --target-flops {float(horizon):.6g}" if horizon > plan["total_flops"] else ""
    return ValueError(f"{flag} {text}: beyond this run's {plan['total_flops']:.6g} training FLOPs "
                      f"({plan['num_iterations']} steps x {plan['total_batch_size']:,} tokens x "
                      f"{plan['flops_per_token']:,} FLOPs/token{budget}; --dry-run prints the plan): it would never "
                      "be reached")


def _flops_per_step(plan: dict) -> int:
    return plan["flops_per_token"] * plan["total_batch_size"]


def _horizon(args, plan: dict) -> Fraction:
    """The training FLOPs the run's last step stands for: its count, or the --target-flops budget when that set the
    step count and the rounding fell short of it."""
    count = Fraction(plan["num_iterations"] * _flops_per_step(plan))
    if plan.get("horizon_source") == "target_flops":
        return max(count, Fraction(args.target_flops))
    return count


def _within(target: Fraction, horizon: Fraction) -> bool:
    """``target`` <= ``horizon``; also when the target is the --target-flops literal, which that flag reads as a
    float (e.g. 1e23 is not exactly 10^23 as a float)."""
    return target <= horizon or float(target) <= float(horizon)


def _cadence(args, plan: dict, **targets) -> FlopCadence:
    return FlopCadence(_flops_per_step(plan), last_step=plan["num_iterations"], horizon=_horizon(args, plan),
                       **targets)


def _target_cadence(text: str, flag: str, args, plan: dict) -> FlopCadence:
    """A comma list of FLOP targets as the steps reaching them; a target the run never reaches is an error."""
    targets, n, horizon = parse_flop_list(text, flag), plan["num_iterations"], _horizon(args, plan)
    if not _within(targets[-1], horizon):
        raise _beyond_the_run(flag, f"{float(targets[-1]):.6g}", plan, horizon)
    return _cadence(args, plan, steps=frozenset(min(first_step_reaching(t, _flops_per_step(plan)), n)
                                                for t in targets))


def save_cadence(args, plan: dict) -> FlopCadence | None:
    """--save-at-flops as steps; a target the run never reaches is an error (a checkpoint silently not written
    would be found missing only after the run). A target on the last step makes the final checkpoint a kept one."""
    return _target_cadence(args.save_at_flops, "--save-at-flops", args, plan) if args.save_at_flops else None


def eval_cadence(args, plan: dict) -> FlopCadence | None:
    """--eval-every-flops: one number is an interval, a comma list the targets; out of reach is an error. The
    last step's is the final evaluation."""
    if not args.eval_every_flops:
        return None
    if "," in args.eval_every_flops:
        return _target_cadence(args.eval_every_flops, "--eval-every-flops", args, plan)
    interval = parse_flop_count(args.eval_every_flops, "--eval-every-flops")
    if not _within(interval, _horizon(args, plan)):
        raise _beyond_the_run("--eval-every-flops", args.eval_every_flops.strip(), plan, _horizon(args, plan))
    return _cadence(args, plan, interval=interval)


def check_flop_flags(args, plan: dict) -> list[str]:
    """Both FLOP flags against the plan (before any work; again with the real vocab in build_run); returns lines
    for --dry-run naming the steps they fall on."""
    lines = []
    for name, cadence in (("save at flops", save_cadence(args, plan)), ("eval at flops", eval_cadence(args, plan))):
        if cadence is not None:
            steps = cadence.due_steps(plan["num_iterations"])
            shown = ", ".join(map(str, steps[:8])) + (f", ... ({len(steps)} steps)" if len(steps) > 8 else "")
            lines.append(f"{name:>26}: steps {shown}")
    return lines


def sample_prompts(tokenizer, val_rows) -> list[tuple[str, list[int]]]:
    """(prompt text, token ids) of the --sample-every prompts: SAMPLE_PROMPTS after BOS; with --synthetic-data
    (no tokenizer) the first SYNTHETIC_PROMPT_TOKENS tokens of the first 7 fixed val rows, shown as ids."""
    if tokenizer is None:
        rows = [val_rows[i, :SYNTHETIC_PROMPT_TOKENS].tolist() for i in range(min(len(SAMPLE_PROMPTS), len(val_rows)))]
        return [(" ".join(map(str, ids)), ids) for ids in rows]
    return [(text, [tokenizer.bos_token_id] + tokenizer.encode(text)) for text in SAMPLE_PROMPTS]


def greedy_samples(model, prompts: list[tuple[str, list[int]]], tokenizer, autocast_ctx,
                   max_tokens: int = SAMPLE_TOKENS) -> list[dict]:
    """Greedy completions of ``prompts`` by ``model`` (the uncompiled one: decoding uses a KV cache), in eval mode
    (no routing statistics or balancing counts are recorded), restoring the model's mode. No collectives: only
    rank 0 calls this."""
    was_training = model.training
    stop = {tokenizer.bos_token_id} if tokenizer is not None else None
    out = []
    try:
        with autocast_ctx:
            for text, ids in prompts:
                completion = generate(model, ids, max_tokens, temperature=0.0, stop_ids=stop)[0]
                if stop and completion and completion[-1] in stop:
                    completion = completion[:-1]  # the stop token ends the sample; it is not text
                shown = tokenizer.decode(completion) if tokenizer is not None else " ".join(map(str, completion))
                out.append({"prompt": text, "completion": shown})
    finally:
        model.train(was_training)
    return out


def periodic_samples(run, step: int, resumed_at: int | None, at_end: bool) -> bool:
    """--sample-every (``run``: the trainer's Run): rank 0 alone completes the fixed prompts, every N steps and at
    the end of the loop. Sampling has no collectives (the model forward has none): the other ranks go on to the
    next one (the step's reduction, or a save's gather) and wait there. Returns whether samples were due at this
    step, the same on every rank (the trainer then votes on a signal that came meanwhile)."""
    every = run.args.sample_every
    if every < 1 or step == resumed_at or not (at_end or (step > 0 and step % every == 0)):
        return False
    if run.rank != 0:
        return True
    prompts = sample_prompts(run.data.tokenizer, run.data.val_rows)
    samples = greedy_samples(run.model, prompts, run.data.tokenizer, run.autocast)
    run.metrics.log({"kind": "sample", "step": step, "tokens": step * run.args.total_batch_size, "samples": samples})
    for sample in samples:
        print0(f"step {step:05d} | sample | {sample['prompt']} ->{sample['completion']!r}")
    return True


def note_wall_time_stop(run, step: int) -> None:
    """A metrics record and a console line for the stop: the record stays after a --resume (a session boundary,
    like the "resume" records), while that session's "final" record is dropped with the later steps."""
    limit = run.wall_limit
    run.metrics.log({"kind": "stop", "step": step, "reason": "wall_time_limit", "limit_s": limit.limit_s,
                     "elapsed_s": limit.elapsed()})
    print0(f"--max-wall-time-seconds {limit.limit_s:g}: {limit.elapsed():.0f} s since start; stopped at step {step} "
           f"of {run.plan['num_iterations']} (checkpoint saved); the final evaluation follows, {how_to_continue()}")


# the command of a wrapper that runs base_train with --resume auto itself (speedrun.sh sets "bash speedrun.sh"): the
# way on a stop names. The runner's RUNNER_AFRESH_ENV, when set, comes first
CONTINUE_COMMAND_ENV = "NANOCHAT_CONTINUE_COMMAND"


def resume_way() -> str:
    """What reruns or continues a stopped run: "--resume"; under scripts.run, which adds --resume auto itself (and
    then names its afresh command in RUNNER_AFRESH_ENV), its own command again: "--resume" is no flag of the
    runner's, and the runner says the same when base_train exits; under a wrapper that passes --resume auto itself
    and names its command in CONTINUE_COMMAND_ENV (speedrun.sh), that command again. Without either (no wrapper, or
    the user's own --resume/--overwrite after the runner's ``--``) the flag is the way on; the runner names it in
    its advice too."""
    from nanochat.train_resume import runner_afresh_command, wrapper_command  # here: train_resume imports this module

    if runner_afresh_command():
        return "running the same scripts.run command again"
    wrapper = wrapper_command()
    return f"running '{wrapper}' again" if wrapper else "--resume"


def how_to_continue() -> str:
    """The way on after a stop, as a clause: "continue with --resume", or "continue by running 'bash speedrun.sh'
    again" (``resume_way``)."""
    way = resume_way()
    return "continue with --resume" if way == "--resume" else f"continue by {way}"
