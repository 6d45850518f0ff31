"""torchrun worker (2 ranks) for test_base_eval_ranks: nanochat.eval_resume.stop_voted in the scenarios of
SCENARIOS, each a number of batches per rank, a vote stride, and the rank that sends itself SIGTERM (under
``interrupts_raise``, as base_eval does) while it handles its batch K. Rank 0 writes {scenario: [[rank 0's batches,
outcome], [rank 1's ...]]} to the JSON file named by the first argument."""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from nanochat.eval_resume import Interrupted, interrupts_raise, stop_voted

# name: ((rank 0's batch count, rank 1's), vote every, (signalled rank, at its batch) or None)
SCENARIOS = {
    "uneven, no signal": ((5, 3), 2, None),
    "one rank empty": ((0, 2), 1, None),
    "rank 1 signalled between votes": ((5, 3), 2, (1, 1)),
    "rank 0 signalled after its last batch": ((2, 5), 1, (0, 1)),
}


def run(counts, every, signalled, rank) -> tuple[list[int], str]:
    seen = []
    try:
        with interrupts_raise():
            for batch in stop_voted(range(counts[rank]), "cpu", every):
                seen.append(batch)
                if signalled == (rank, batch):
                    os.kill(os.getpid(), signal.SIGTERM)
    except Interrupted as e:
        return seen, str(e)
    return seen, "finished"


def scenarios_to_json(scenarios: dict, path: str, rank: int) -> None:
    """Run each ``scenarios[name](rank)`` on both ranks of the (initialized) gloo group; rank 0 writes {name: [rank
    0's outcome, rank 1's]} to ``path``. Each scenario starts with no latched signal (interrupts_raise and
    StopSignal begin afresh), so the scenarios of several workers can run in one group."""
    results = {}
    for name, scenario in scenarios.items():
        both = [None, None]
        dist.all_gather_object(both, scenario(rank))
        results[name] = both
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)


def run_scenarios_to_json(scenarios: dict, path: str) -> None:
    """scenarios_to_json in a gloo group of its own."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    scenarios_to_json(scenarios, path, dist.get_rank())
    dist.destroy_process_group()


def vote_scenarios() -> dict:
    return {name: (lambda rank, sc=sc: run(*sc, rank)) for name, sc in SCENARIOS.items()}


def write(prefix: str, rank: int) -> None:
    """PREFIX.json, in an initialized group (tests/_gloo_checks_worker.py runs it in a shared launch)."""
    scenarios_to_json(vote_scenarios(), f"{prefix}.json", rank)


if __name__ == "__main__":
    run_scenarios_to_json(vote_scenarios(), sys.argv[1])
