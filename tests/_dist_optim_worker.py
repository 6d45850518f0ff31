"""Worker for test_distributed: train a tiny model a few steps on a fixed global batch of 4 micro-batches; save
the parameters before and after.

    python -m torch.distributed.run --nproc_per_node=2 tests/_dist_optim_worker.py OUT_DIR STEPS DESIGN[,DESIGN...]

Each design (base, mome_bigram_shared) is trained in turn from its own seed in the same process group and rank 0
writes OUT_DIR/<design>.pt: one launch serves every design (a torchrun start-up costs seconds of the CI's 2 cores).
test_distributed reads them from tests/_gloo_checks_worker.py's shared launch (``write``: STEPS steps).

Run with 2 processes, rank r accumulates micro-batches 2r and 2r+1 (loss / 2 each) and ``optimizer.step()``
averages the two ranks' gradients. Run with 1 process (``train`` imported into the test process, at 1 thread as a
torchrun worker), the reference accumulates the same two pairs separately and averages them itself,
(pair0 + pair1) / 2: the gradient of the same global batch, summed in the association the 2-process step uses,
so the two runs are equal bit for bit (see test_distributed).
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nanochat.common import compute_cleanup, compute_init
from nanochat.gpt import GPTConfig, build_model
from nanochat.optim import build_optimizer

DESIGNS = ("base", "mome_bigram_shared")
STEPS = 3  # test_distributed's (its 1-process reference takes as many)


def train(memory: str, steps: int, rank: int, world_size: int) -> dict:
    """``steps`` optimizer steps of one design; returns its parameters before and after."""
    assert world_size in (1, 2), "the worker splits 4 micro-batches into 2 pairs: run it on 1 or 2 processes"
    assert memory in DESIGNS, memory
    # the bigram-indexed MoME table is shared by both memory layers: its sparse gradient must be densified before
    # the all-reduce
    mem = {} if memory == "base" else dict(memory="mome", memory_layers=(0, 1),
                                           memory_options={"slots": 4, "topk": 2, "index": "bigram",
                                                           "bigram_factor": 2})
    cfg = GPTConfig(sequence_len=16, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=128, **mem)
    model = build_model(cfg, seed=0)
    if memory != "base":  # random routers: zero-init ones tie and every slot would get the same score
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for router in model.memory.routers:
                router.weight.copy_(torch.randn(router.weight.shape, generator=g))
            for block in model.blocks:  # non-zero output projections: the memory table gets gradient at step 1
                block.attn.c_proj.weight.copy_(0.02 * torch.randn(block.attn.c_proj.weight.shape, generator=g))
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = build_optimizer(model)
    g = torch.Generator().manual_seed(123)

    def accumulate_pair(micro_pair: torch.Tensor) -> None:
        """Backward of 2 micro-batches (2, rows, T+1), each loss / 2, accumulated in .grad as a rank does."""
        for micro in micro_pair:
            (model(micro[:, :-1], micro[:, 1:]) / 2).backward()

    for _ in range(steps):
        pairs = torch.randint(0, 256, (8, 17), generator=g).view(2, 2, 2, 17)  # (pair = rank, micro, rows, T+1)
        if world_size == 2:
            accumulate_pair(pairs[rank])
        else:
            accumulate_pair(pairs[0])
            first = [None if p.grad is None else p.grad.to_dense() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            accumulate_pair(pairs[1])
            with torch.no_grad():
                for p, a in zip(model.parameters(), first):
                    if a is not None or p.grad is not None:
                        b = torch.zeros_like(p) if p.grad is None else p.grad.to_dense()
                        p.grad = ((torch.zeros_like(p) if a is None else a) + b).div_(2)
        opt.step()
        model.zero_grad(set_to_none=True)
    return {"initial": initial, "final": {k: v.detach().clone() for k, v in model.named_parameters()}}


def write(prefix: str, rank: int, world: int) -> None:
    """Every design for STEPS steps, in an initialized process group; rank 0 writes PREFIX.<design>.pt
    (tests/_gloo_checks_worker.py runs it in a shared launch)."""
    for memory in DESIGNS:
        result = train(memory, STEPS, rank, world)
        if rank == 0:
            torch.save(result, f"{prefix}.{memory}.pt")


def main(out_dir: str, steps: int, designs: list[str]) -> None:
    info, _ = compute_init("cpu")
    for memory in designs:
        result = train(memory, steps, info.rank, info.world_size)
        if info.rank == 0:
            torch.save(result, Path(out_dir) / f"{memory}.pt")
    if dist.is_initialized():
        dist.barrier()
    compute_cleanup()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","))
