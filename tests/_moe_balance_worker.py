"""Worker for test_moe's loss-free balancing check (torchrun, gloo): the MoE selection bias after one update.

    python -m torch.distributed.run --nproc_per_node=W tests/_moe_balance_worker.py OUT_PREFIX

Every rank builds the same seeded tiny MoE model, runs two training forwards (two micro-steps) on ITS OWN token
rows, keeps a copy of its local per-layer counts, then calls the trainer's ``after_optimizer_step`` (all-reduce
+ sign update). Each rank writes OUT_PREFIX.rank<r>.pt: its local counts and the biases after the update.
"""
import sys

import torch

from nanochat.common import compute_cleanup, compute_init
from nanochat.gpt import GPTConfig, build_model
from nanochat.train_loop import after_optimizer_step


def write(prefix: str, rank: int) -> None:
    """This rank's file, in an initialized process group (tests/_gloo_checks_worker.py runs it in a shared launch)."""
    cfg = GPTConfig(sequence_len=16, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, mlp="moe",
                    moe_balance_lr=0.01)
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # a non-zero residual stream so the layer-1 router sees token-dependent inputs
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(std=0.05)
            for expert in (*block.mlp.experts, *block.mlp.shared):
                expert.c_proj.weight.normal_(std=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        model(torch.randint(0, 256, (3, 16), generator=gen))
    local = [block.mlp.balance_counts.clone() for block in model.blocks]
    after_optimizer_step(model)
    torch.save({"counts": local, "bias": [block.mlp.bias.clone() for block in model.blocks],
                "counts_after": [block.mlp.balance_counts.clone() for block in model.blocks]},
               f"{prefix}.rank{rank}.pt")


if __name__ == "__main__":
    info, _ = compute_init("cpu")
    write(sys.argv[1], info.rank)
    compute_cleanup()
