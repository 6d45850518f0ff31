"""Worker for test_distributed: train a tiny model a few steps on a fixed global batch; save params."""
import sys

import torch
import torch.distributed as dist

from nanochat.common import compute_cleanup, compute_init
from nanochat.gpt import GPTConfig, build_model
from nanochat.optim import build_optimizer

out_path, steps = sys.argv[1], int(sys.argv[2])
memory = sys.argv[3] if len(sys.argv) > 3 else "base"
# the bigram-indexed MoME table is shared by both memory layers: its sparse gradient must be densified before
# the all-reduce
mem = {} if memory == "base" else dict(memory="mome", memory_layers=(0, 1),
                                       memory_options={"slots": 4, "topk": 2, "index": "bigram", "bigram_factor": 2})
info, device = compute_init("cpu")
cfg = GPTConfig(sequence_len=16, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=128, **mem)
model = build_model(cfg, seed=0)
if memory != "base":  # random routers: zero-init ones tie, and summation-order noise would flip the top-K choice
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in model.memory.routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        for block in model.blocks:  # non-zero output projections: the memory table gets gradient at step 1
            block.attn.c_proj.weight.copy_(0.02 * torch.randn(block.attn.c_proj.weight.shape, generator=g))
opt = build_optimizer(model)
g = torch.Generator().manual_seed(123)
B_global, accum = 8, 4 // info.world_size  # same global batch: 1 proc x 4 micro or 2 procs x 2 micro
for step in range(steps):
    batch = torch.randint(0, 256, (B_global, 17), generator=g)
    rows = batch.view(4, 2, 17)  # 4 micro-batches of 2 rows
    for m in range(accum):
        micro = rows[info.rank * accum + m]
        loss = model(micro[:, :-1], micro[:, 1:]) / accum
        loss.backward()
    opt.step()
    model.zero_grad(set_to_none=True)
if info.rank == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out_path)
if dist.is_initialized():
    dist.barrier()
compute_cleanup()
