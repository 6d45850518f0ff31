"""Worker for test_mome_trust_region's world-size check (torchrun, gloo): the MoME selection bias after one
trust-region update.

    python -m torch.distributed.run --nproc_per_node=W tests/_mome_trust_region_worker.py OUT_PREFIX

Every rank builds the same seeded tiny MoME model (--mome-balance trust-region) with the same non-zero bias, runs
two training forwards (two micro-steps) on ITS OWN token rows, keeps a copy of its local counts, then calls the
trainer's ``after_optimizer_step`` (all-reduce + update). Each rank writes OUT_PREFIX.rank<r>.pt: its local counts,
the bias before and after the update.
"""
import sys

import torch

from nanochat.common import compute_cleanup, compute_init
from nanochat.gpt import GPTConfig, build_model
from nanochat.train_loop import after_optimizer_step

LR = 2.0 ** -6  # dyadic: the expected bias is exact in fp32


def tiny_trust_region_mome():
    cfg = GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, memory="mome",
                    memory_options={"slots": 6, "topk": 2, "balance": "trust-region", "balance_lr": LR})
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # routers and attention outputs off their zero init (the routing depends on the context),
        gen = torch.Generator().manual_seed(1)  # and a bias some of whose entries are below lr, some above
        for name, p in model.named_parameters():
            if "router" in name or "c_proj" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "router" in name else 0.2))
        model.memory.router_bias.copy_(torch.randn(model.memory.router_bias.shape, generator=gen) * 2 * LR)
    return model


def write(prefix: str, rank: int) -> None:
    """This rank's file, in an initialized process group (tests/_gloo_checks_worker.py runs it in a shared launch)."""
    model = tiny_trust_region_mome()
    before = model.memory.router_bias.clone()
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):  # few distinct tokens: rows are visited often enough to be eligible (total >= M)
        model(torch.randint(0, 4, (3, 16), generator=gen))
    local = model.memory.balance_counts.clone()
    after_optimizer_step(model)
    torch.save({"counts": local, "before": before, "bias": model.memory.router_bias.clone(),
                "counts_after": model.memory.balance_counts.clone()}, f"{prefix}.rank{rank}.pt")


if __name__ == "__main__":
    info, _ = compute_init("cpu")
    write(sys.argv[1], info.rank)
    compute_cleanup()
