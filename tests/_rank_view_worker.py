"""torchrun worker for test_rank_consistency: run a script's main() with a per-rank view of the world.

    python -m torch.distributed.run --nproc_per_node=2 tests/_rank_view_worker.py SPEC.json

SPEC.json: {"module": "scripts.base_eval", "argv": [...], "out": DIR,
            "rank_argv": {"1": [...]}, "rank_env": {"1": {"NAME": "value"}}}
A rank listed in rank_argv runs with that argv instead (e.g. a different --run-dir: a node that cannot see rank 0's
files); rank_env entries are set before main() runs (e.g. NANOCHAT_EVAL_BUNDLE: a bundle that is missing on one
node). Each rank writes DIR/rank<R>.json with main()'s exit code.
"""

import importlib
import json
import os
import sys
from pathlib import Path

import torch


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = os.environ["RANK"]
    os.environ.update(spec.get("rank_env", {}).get(rank, {}))
    argv = spec.get("rank_argv", {}).get(rank, spec["argv"])
    code = importlib.import_module(spec["module"]).main(argv)
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps({"code": code}))
    return code


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
