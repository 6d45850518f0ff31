"""torchrun worker (2 gloo ranks): the small multi-rank checks of several test files in one launch, one after the
other in one process group (a torchrun start-up costs ~5 s of the CI's 2 cores, each check well under 1 s).

    python -m torch.distributed.run --nproc_per_node=2 tests/_gloo_checks_worker.py OUT_DIR NAME [NAME ...]

NAME is a key of CHECKS; each check's worker writes under OUT_DIR/NAME what its own launch writes (NAME.rank<r>.pt,
NAME.<design>.pt or NAME.json; core_eval also the bundle it evaluates, NAME_bundle): conftest.gloo_checks, the
session fixture the tests read them from."""

import sys

import torch.distributed as dist

import _core_eval_worker
import _dist_optim_worker
import _moe_balance_worker
import _mome_trust_region_worker
import _setup_stop_worker
import _slot_balance_worker
import _stats_worker
import _stop_vote_worker
from nanochat.common import compute_cleanup, compute_init

CHECKS = {  # name: write(prefix, rank, world), each writing what its worker's own launch writes
    "dist_optim": _dist_optim_worker.write,  # test_distributed (PREFIX.<design>.pt, rank 0)
    "moe_balance": lambda prefix, rank, world: _moe_balance_worker.write(prefix, rank),  # test_moe
    "mome_trust_region": lambda prefix, rank, world: _mome_trust_region_worker.write(prefix, rank),
    "slot_balance": _slot_balance_worker.write,  # test_slot_balance
    "routing_stats": lambda prefix, rank, world: _stats_worker.write(prefix, rank),  # test_train_hooks
    "core_eval": _core_eval_worker.write,  # test_core_eval (PREFIX_bundle, PREFIX.json)
    # test_base_eval_ranks (PREFIX.json, rank 0): last, as the scenarios signal their own process
    "eval_stop_votes": lambda prefix, rank, world: _stop_vote_worker.write(prefix, rank),
    "eval_setup_stops": lambda prefix, rank, world: _setup_stop_worker.write(prefix, rank),
}

if __name__ == "__main__":
    out_dir, names = sys.argv[1], sys.argv[2:]
    info, _ = compute_init("cpu")
    for name in names:
        CHECKS[name](f"{out_dir}/{name}", info.rank, info.world_size)
        dist.barrier()  # each check starts with every rank done with the last one
    compute_cleanup()
