"""torchrun worker: scripts.base_train where each train step advances a fake --max-wall-time-seconds clock by
10 s on rank 1 and 1 s on rank 0 (so the ranks' budgets run out at different steps), and each rank records the
steps at which it sampled into <run-dir>/samples.rank<r>.json."""

import json
import os
import sys
from pathlib import Path

from nanochat import run_control
from scripts import base_train

rank = int(os.environ["RANK"])
now, current = {"t": 0.0}, {"step": None}
real_step, real_periodic, real_samples = base_train.train_step, run_control.periodic_samples, run_control.greedy_samples
sampled = []


def step(*args, **kwargs):
    now["t"] += 10.0 if rank == 1 else 1.0
    return real_step(*args, **kwargs)


def periodic_samples(run, step, *args, **kwargs):  # every rank, every step boundary
    current["step"] = step
    return real_periodic(run, step, *args, **kwargs)


def samples(*args, **kwargs):  # the sampling itself
    sampled.append(current["step"])
    run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
    (run_dir / f"samples.rank{rank}.json").write_text(json.dumps(sampled))
    return real_samples(*args, **kwargs)


run_control.clock = lambda: now["t"]
run_control.greedy_samples = samples
base_train.train_step = step
run_control.periodic_samples = periodic_samples
sys.exit(base_train.main(sys.argv[1:]))
