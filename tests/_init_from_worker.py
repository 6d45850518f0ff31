"""Worker for test_init_from's one 2-rank launch (tests/_train_runs_worker.run_each: runs separated by
``--next-run``, each after the first on a store of its own). A run ``--copies SOURCE OTHER OUT``: every rank starts a
model from the --init-from source SOURCE (checked_source, then start_from_source); then rank 1 alone finds another
file under the same path (as a node holding another copy of the source would: OTHER's files stand in for SOURCE's
there) and every rank starts again. Each rank writes what it saw to OUT/rank<r>.json. Any other run is
scripts.base_train's arguments."""
import json
import sys
from argparse import Namespace
from pathlib import Path

from _train_runs_worker import run_each  # reads torchrun's environment on import
from nanochat import checkpoint as ckpt
from nanochat.common import compute_cleanup, compute_init
from nanochat.families import build_model
from nanochat.init_from import checked_source, start_from_source
from scripts import base_train


def copies(source: Path, other: Path, out: Path) -> int:
    info, device = compute_init("cpu")
    config = ckpt.config_from_meta(ckpt.load_meta(source))
    args = Namespace(init_from=str(source), synthetic_data=True, seed=42, data_seed=None)
    seen = {}
    for attempt in ("same", "rank 1 reads another copy"):
        if attempt != "same" and info.rank == 1:  # put back by run_each after this run
            real = ckpt.step_dir
            ckpt.step_dir = lambda run_dir, step: real(other if Path(run_dir) == source.resolve() else run_dir, step)
        try:
            checked = checked_source(args, out / "run", config, None, None)
            seen[attempt] = start_from_source(build_model(config), checked, device)
        except ValueError as e:
            seen[attempt] = f"ValueError: {e}"
    compute_cleanup()
    (out / f"rank{info.rank}.json").write_text(json.dumps(seen))  # last: the run ended well where it is written
    return 0


def run_one(args: list[str]) -> int:
    if args[:1] == ["--copies"]:
        return copies(*(Path(a) for a in args[1:]))
    return base_train.main(args)


if __name__ == "__main__":
    sys.exit(run_each(sys.argv[1:], run_one, stand_ins=[(ckpt, "step_dir")]))
