"""test_core_eval's 2-rank check: evaluate CORE (and bpb) under gloo, rank 0 writes JSON; ``write`` runs in
tests/_gloo_checks_worker.py's shared launch and builds its own bundle first."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _eval_helpers import CharTok, tiny_gpt, two_task_bundle  # noqa: E402

from nanochat.core_eval import evaluate_core  # noqa: E402
from nanochat.loss_eval import bpb_rows_from_text, evaluate_bpb, iter_row_batches  # noqa: E402


def evaluate(bundle, rank: int, world: int) -> dict:
    model = tiny_gpt(seq_len=256)
    result = evaluate_core(model, CharTok(), bundle, batch_size=4, progress=False)
    x, y = bpb_rows_from_text(CharTok(), ["abc def ghi. jkl", "mno pqr", "stu vwx yz"], seq_len=8)
    result["bpb"] = evaluate_bpb(model, iter_row_batches(x, y, 2, rank, world), CharTok().token_bytes())
    return result


def write(prefix: str, rank: int, world: int) -> None:
    """_eval_helpers.two_task_bundle at PREFIX_bundle (rank 0), its result at PREFIX.json, in an initialized group."""
    bundle = Path(f"{prefix}_bundle")
    if rank == 0:
        two_task_bundle(bundle)
    dist.barrier()
    result = evaluate(bundle, rank, world)
    if rank == 0:
        Path(f"{prefix}.json").write_text(json.dumps(result))

