"""torchrun worker for test_rank_consistency: run a script's main() with a per-rank view of the world.

    python -m torch.distributed.run --nproc_per_node=2 tests/_rank_view_worker.py SPEC.json [--next-run SPEC.json ...]

SPEC.json: {"module": "scripts.base_eval", "argv": [...], "out": DIR,
            "rank_argv": {"1": [...]}, "rank_env": {"1": {"NAME": "value"}}}
A rank listed in rank_argv runs with that argv instead (e.g. a different --run-dir: a node that cannot see rank 0's
files); rank_env entries are set before main() runs (e.g. NANOCHAT_EVAL_BUNDLE: a bundle that is missing on one
node). Each rank writes DIR/rank<R>.json with main()'s exit code.
Several specs, separated by ``--next-run``, run one after the other in one torchrun start-up, each main() with its
process group on a store of its own (tests/_train_runs_worker.run_each) and with its rank_env alone; the first
non-zero exit code ends the worker, unless the first argument is ``--every-run`` (specs whose ranks all stop with an
error they agreed on: every spec runs, each rank's code in its rank<R>.json).
"""

import importlib
import json
import os
import sys
from pathlib import Path

import torch


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rank = os.environ["RANK"]
    env = spec.get("rank_env", {}).get(rank, {})
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        argv = spec.get("rank_argv", {}).get(rank, spec["argv"])
        code = importlib.import_module(spec["module"]).main(argv)
    finally:  # the next spec sees the environment of the launch
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps({"code": code}))
    return code


if __name__ == "__main__":
    torch.set_num_threads(1)
    from _train_runs_worker import run_each  # (tests/ is the script's directory)

    every_run = sys.argv[1] == "--every-run"
    sys.exit(run_each(sys.argv[1 + every_run:], lambda spec: main(*spec), every_run=every_run))
