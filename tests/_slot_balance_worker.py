"""Worker for test_slot_balance's world-size check (torchrun, gloo): the slot balance of an eval over fixed rows.

    python -m torch.distributed.run --nproc_per_node=W tests/_slot_balance_worker.py OUT_PREFIX

Every rank builds the same seeded tiny MoME model and scores ITS share of the same fixed rows (rows rank,
rank + W, ..., as the bpb evaluation splits them) under ``with_slot_balance``, then does the same as one training
step of a --mome-maxvio-window 1 model. Each rank writes OUT_PREFIX.rank<r>.pt: (the balance metrics, the window
metrics) it got.
"""
import sys

import torch

from nanochat.common import compute_cleanup, compute_init
from nanochat.dataloader import iter_eval_batches
from nanochat.gpt import GPTConfig, build_model
from nanochat.slot_balance import with_slot_balance

VOCAB, SEQ = 64, 16


def tiny_mome(M: int = 4, K: int = 2, **options):
    cfg = GPTConfig(sequence_len=SEQ, vocab_size=VOCAB, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, memory="mome",
                    memory_layers=(0, 1), memory_options={"slots": M, "topk": K, **options})
    model = build_model(cfg, seed=0).eval()
    with torch.no_grad():  # routers and output projections off their zero init: selections depend on the context
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "router" in name or "c_proj" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "router" in name else 0.2))
    return model


def eval_rows(n: int = 5) -> torch.Tensor:
    """Few distinct tokens, so each token's row is visited in several contexts."""
    return torch.randint(0, 6, (n, SEQ + 1), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def balance(rows: torch.Tensor, rank: int = 0, world: int = 1) -> dict:
    model = tiny_mome()
    return with_slot_balance(model, lambda: [model(x) for x, _ in iter_eval_batches(rows, 2, rank, world)])[1]


@torch.no_grad()
def window(rows: torch.Tensor, rank: int = 0, world: int = 1) -> dict:
    """The --mome-maxvio-window metrics after one "optimizer step" whose forwards are this rank's share of the
    rows (training mode: the counting forward)."""
    model = tiny_mome(maxvio_window=1).train()
    for x, _ in iter_eval_batches(rows, 2, rank, world):
        model(x)
    model.memory.after_optimizer_step()  # closes the window: sums the counts over the ranks
    return {k: v for k, v in model.memory.stats().items() if "maxvio_window" in k}


def write(prefix: str, rank: int, world: int) -> None:
    """This rank's file, in an initialized process group (tests/_gloo_checks_worker.py runs it in a shared launch)."""
    rows = eval_rows()
    torch.save((balance(rows, rank, world), window(rows, rank, world)), f"{prefix}.rank{rank}.pt")


if __name__ == "__main__":
    info, _ = compute_init("cpu")
    write(sys.argv[1], info.rank, info.world_size)
    compute_cleanup()
