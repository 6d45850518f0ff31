"""torchrun worker: scripts.base_train.main on each argument list in turn, in one launch (a torchrun start-up costs
more of the CI's 2 cores than a tiny run: ~2.5 s for each worker's torch import). The lists
are separated by ``--next-run``. Each run initializes its own process group and destroys it at its end, as one launch
per run would, and each after the first on a key-value store of its own (hosted by rank 0 on a port it posts to
torchrun's store, joined by every rank as a client): a group re-created on the same store reads the last group's keys
(gloo's addresses, nanochat's agreements) and fails or agrees on stale words. Exits with the first non-zero code (the
runs after it are not started). Other workers run several runs of their own in one launch the same way (run_each)."""

import contextlib
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from scripts import base_train

AGENT_PORT = int(os.environ["MASTER_PORT"])  # torchrun's store (each later run's MASTER_PORT is its own store's)


def split_runs(argv: list[str]) -> list[list[str]]:
    runs = [[]]
    for arg in argv:
        if arg == "--next-run":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


_stores = []  # the stores rank 0 hosts, alive until this process ends


def use_a_store_of_its_own(run: int) -> None:
    """Point env:// at a fresh store for run number ``run``: rank 0 hosts it on a port the system picks (kept bound:
    a port found free and released could be taken before the store bound it again) and posts the port on torchrun's
    store; every rank then joins it as a client, as under torchrun's own store (TORCHELASTIC_USE_AGENT_STORE)."""
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], AGENT_PORT, is_master=False,
                          timeout=timedelta(seconds=120))
    key = f"train_runs_worker/{run}/port"
    if os.environ["RANK"] == "0":
        _stores.append(dist.TCPStore(os.environ["MASTER_ADDR"], 0, is_master=True, wait_for_workers=False,
                                     timeout=timedelta(seconds=120)))
        agent.set(key, str(_stores[-1].port))
    os.environ["MASTER_PORT"] = agent.get(key).decode()
    assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True", "env:// would host a second store on rank 0"


def run_each(argv: list[str], run_one, out: Path | None = None, stand_ins=(), every_run: bool = False) -> int:
    """``run_one(args)`` (an exit code) for each ``--next-run``-separated argument list in turn, each run after the
    first on a store of its own; the first non-zero code, the runs after it not started (0: every run ended well).
    With ``out``: run N's output (sys.stdout) goes to out/runN.rank<r>.out and its code to out/runN.rank<r>.code, and
    rank 0 copies the run's --run-dir, as the run left it, to out/runN (what a test of several launches read between
    them). ``stand_ins``: the (module, name) attributes a run may replace with a worker's stand-in, put back after each
    run. ``every_run``: runs that are meant to stop with a non-zero code (a stop every rank agreed on, its process
    group destroyed as at any end of main) do not end the launch: every run runs, 0 is returned, and the tests read
    each run's code (out's .code files, or the worker's own record)."""
    for number, args in enumerate(split_runs(argv)):
        if number:
            use_a_store_of_its_own(number)
        real = [(module, name, getattr(module, name)) for module, name in stand_ins]
        try:
            if out is None:
                code = run_one(args)
            else:
                with open(out / f"run{number}.rank{os.environ['RANK']}.out", "w") as f, contextlib.redirect_stdout(f):
                    code = run_one(args)
                (out / f"run{number}.rank{os.environ['RANK']}.code").write_text(str(code))
                if os.environ["RANK"] == "0":
                    shutil.copytree(args[args.index("--run-dir") + 1], out / f"run{number}")
        finally:
            for module, name, value in real:
                setattr(module, name, value)
        if code and not every_run:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(run_each(sys.argv[1:], base_train.main))
