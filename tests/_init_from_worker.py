"""Worker for test_init_from: every rank starts a model from the --init-from source SOURCE (checked_source, then
start_from_source); then rank 1 alone finds another file under the same path (as a node holding another copy of the
source would: OTHER's files stand in for SOURCE's there) and every rank starts again. Each rank writes what it saw to
OUT/rank<r>.json."""
import json
import sys
from argparse import Namespace
from pathlib import Path

from nanochat import checkpoint as ckpt
from nanochat.common import compute_cleanup, compute_init
from nanochat.families import build_model
from nanochat.init_from import checked_source, start_from_source

source, other, out = (Path(a) for a in sys.argv[1:4])
info, device = compute_init("cpu")
config = ckpt.config_from_meta(ckpt.load_meta(source))
args = Namespace(init_from=str(source), synthetic_data=True, seed=42, data_seed=None)
seen = {}
for attempt in ("same", "rank 1 reads another copy"):
    if attempt != "same" and info.rank == 1:
        real = ckpt.step_dir
        ckpt.step_dir = lambda run_dir, step: real(other if Path(run_dir) == source.resolve() else run_dir, step)
    try:
        checked = checked_source(args, out / "run", config, None, None)
        seen[attempt] = start_from_source(build_model(config), checked, device)
    except ValueError as e:
        seen[attempt] = f"ValueError: {e}"
(out / f"rank{info.rank}.json").write_text(json.dumps(seen))
compute_cleanup()
