"""Worker for test_train_hooks' routing-stats check (torchrun, gloo): logged stats cover every rank's tokens.

    python -m torch.distributed.run --nproc_per_node=W tests/_stats_worker.py OUT_PREFIX

For two seeded tiny models (MoME memory + MoE FFN; JTok-M memory), every rank runs two training forwards on ITS
OWN token rows, keeps a copy of its local counters (``stats_buffers``), then calls the trainer's ``module_stats``.
Each rank writes OUT_PREFIX.rank<r>.pt: {design: {"local": counters, "stats": the logged dict}}.
"""
import sys

import torch

from nanochat.common import compute_cleanup, compute_init
from nanochat.gpt import GPTConfig, build_model
from nanochat.train_loop import module_stats, stats_buffers

DESIGNS = {
    "mome+moe": dict(memory="mome", memory_layers=(0, 1), memory_options={"slots": 4, "topk": 1}, mlp="moe"),
    "jtokm": dict(memory="jtokm", memory_layers=(0, 1), memory_options={"experts": 4, "topk": 2}),
}


def model_for(name: str):
    cfg = GPTConfig(sequence_len=16, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, **DESIGNS[name])
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # routers and gates off their zero init, so the loads and gates depend on the tokens
        gen = torch.Generator().manual_seed(1)
        for p_name, p in model.named_parameters():
            if "router" in p_name or "gates" in p_name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def run(name: str, rank: int) -> dict:
    model = model_for(name)
    gen = torch.Generator().manual_seed(100 + rank)
    high = 40 if rank == 0 else 256  # rank 0 sees few distinct tokens: its loads alone differ from the global ones
    for _ in range(2):
        model(torch.randint(0, high, (3, 16), generator=gen))
    local = {k: v.clone() for k, v in stats_buffers(model).items()}
    return {"local": local, "stats": module_stats(model)}


def write(prefix: str, rank: int) -> None:
    """This rank's file, in an initialized process group (tests/_gloo_checks_worker.py runs it in a shared launch)."""
    torch.save({name: run(name, rank) for name in DESIGNS}, f"{prefix}.rank{rank}.pt")


if __name__ == "__main__":
    info, _ = compute_init("cpu")
    write(sys.argv[1], info.rank)
    compute_cleanup()
