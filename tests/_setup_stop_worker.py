"""torchrun worker (2 ranks) for test_base_eval_ranks: a signal latched during a set-up step of an evaluation (a step
wrapped in nanochat.common.every_rank_ok or rank0_decides, under ``interrupts_raise`` as base_eval runs it) in the
scenarios of SCENARIOS. Each scenario returns (what the rank did, how it ended); rank 0 writes
{scenario: [rank 0's, rank 1's]} to the JSON file named by the first argument."""

import os
import signal
import sys


from nanochat import eval_resume
from nanochat.common import every_rank_ok, rank0_decides
from nanochat.eval_resume import Interrupted, interrupts_raise
from nanochat.train_loop import StopSignal

from _stop_vote_worker import run_scenarios_to_json, scenarios_to_json  # noqa: E402 - tests/ is the script's directory


def kill_self(signum=signal.SIGTERM) -> None:
    os.kill(os.getpid(), signum)


def signalled_in(rank: int, signalled: dict, seen: list):
    """A set-up step: ranks in ``signalled`` get their signal while they work; the step always runs to its end."""
    def step():
        if rank in signalled:
            kill_self(signalled[rank])
        seen.append("step done")
        return rank * 10
    return step


def no_signal(rank, seen):
    seen.append(every_rank_ok(lambda: rank * 10))
    seen.append(rank0_decides(lambda: f"rank {rank}'s choice"))
    mine = ["rank 0's object"]
    seen.append(rank0_decides(lambda: mine) is mine)  # rank 0 gets fn's own object, the others a copy


def every_rank_ok_one_rank(signalled_rank):
    def scenario(rank, seen):
        seen.append(every_rank_ok(signalled_in(rank, {signalled_rank: signal.SIGTERM}, seen)))
    return scenario


def rank0_decides_rank0_signalled(rank, seen):
    seen.append(rank0_decides(signalled_in(rank, {0: signal.SIGTERM}, seen)))


def rank0_decides_rank1_signalled_before(rank, seen):
    if rank == 1:  # its own work before the step (rank 1 does not run rank 0's fn)
        kill_self()
    seen.append(rank0_decides(lambda: "rank 0's choice"))


def different_signals(rank, seen):
    seen.append(every_rank_ok(signalled_in(rank, {0: signal.SIGINT, 1: signal.SIGTERM}, seen)))


def error_and_signal(helper):
    """Rank 0's step fails while rank 1 is signalled: the error is raised first, the signal at the next step."""
    def scenario(rank, seen):
        def step():
            if rank == 0:
                raise FileNotFoundError("gone")
            return "ok"
        if rank == 1:  # before the step: rank0_decides runs step on rank 0 only
            kill_self()
        try:
            helper(step)
        except FileNotFoundError as e:
            seen.append(f"FileNotFoundError: {e}")
        seen.append(every_rank_ok(lambda: "next step"))
    return scenario


def later_signal_changes_nothing(rank, seen):
    """After a set-up stop every rank holds the stop's signal, as after a vote: a later one (e.g. during the
    clean-up, where the destroyed group takes the one-process path) is ignored on every rank."""
    try:
        every_rank_ok(signalled_in(rank, {1: signal.SIGTERM}, seen))
    except Interrupted as e:
        seen.append(f"stopped ({e}); latched {eval_resume._latched_signum}")
        kill_self(signal.SIGINT)
        seen.append("SIGINT ignored")
        raise


# name: (scenario, run under interrupts_raise as base_eval does)
SCENARIOS = {
    "no signal": no_signal,
    "every_rank_ok, rank 1 signalled": every_rank_ok_one_rank(1),
    "every_rank_ok, rank 0 signalled": every_rank_ok_one_rank(0),
    "rank0_decides, rank 0 signalled in fn": rank0_decides_rank0_signalled,
    "rank0_decides, rank 1 signalled before": rank0_decides_rank1_signalled_before,
    "different signals": different_signals,
    "every_rank_ok error and a signal": error_and_signal(every_rank_ok),
    "rank0_decides error and a signal": error_and_signal(rank0_decides),
    "a later signal changes nothing": later_signal_changes_nothing,
}


def run(scenario, rank) -> tuple[list, str]:
    seen = []
    try:
        with interrupts_raise():
            scenario(rank, seen)
    except Interrupted as e:
        return seen, str(e)
    return seen, "finished"


def training_setup(rank) -> tuple[list, str]:
    """base_train's set-up: StopSignal latches the signal for the next step boundary; every_rank_ok goes on."""
    seen, stop = [], StopSignal().install()
    try:
        seen.append(every_rank_ok(signalled_in(rank, {1: signal.SIGTERM}, seen)))
        seen.append(rank0_decides(lambda: "rank 0's choice"))
    finally:
        stop.uninstall()
    return seen, f"received {stop.received}"


def training_final_eval(rank) -> tuple[list, str]:
    """base_train's final evaluation (StopSignal.interrupts) prepares CORE tasks in every_rank_ok/rank0_decides too:
    a signal there ends it on every rank, as one during its batches (base_train writes the summary then)."""
    seen, stop = [], StopSignal().install()
    try:
        with stop.interrupts():
            seen.append(every_rank_ok(signalled_in(rank, {1: signal.SIGTERM}, seen)))
    except Interrupted as e:
        return seen, f"{e}; received {stop.received}"
    finally:
        stop.uninstall()
    return seen, f"finished; received {stop.received}"


def all_scenarios() -> dict:
    scenarios = {name: (lambda rank, sc=sc: run(sc, rank)) for name, sc in SCENARIOS.items()}
    scenarios.update({"training set-up, rank 1 signalled": training_setup,
                      "training's final evaluation, rank 1 signalled": training_final_eval})
    return scenarios


def write(prefix: str, rank: int) -> None:
    """PREFIX.json, in an initialized group (tests/_gloo_checks_worker.py runs it in a shared launch)."""
    scenarios_to_json(all_scenarios(), f"{prefix}.json", rank)


if __name__ == "__main__":
    run_scenarios_to_json(all_scenarios(), sys.argv[1])
