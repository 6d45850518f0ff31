import torch

from conftest import tiny_config
from nanochat.gpt import build_model
from nanochat.optim import build_optimizer
from nanochat.train_loop import train_step


def test_train_step_applies_mome_balancing_bias():
    cfg = tiny_config(memory="mome", memory_options={"slots": 4, "topk": 2, "balance": "bias", "balance_lr": 0.01})
    model = build_model(cfg, seed=0)
    opt = build_optimizer(model)
    data = iter([(torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32)))] * 2)
    assert torch.all(model.memory.router_bias == 0)
    train_step(model, opt, data, grad_accum=2, autocast_ctx=torch.autocast("cpu", enabled=False), device="cpu")
    bias = model.memory.router_bias
    # zero-init routers tie, so the selected slots are over-loaded and the rest under-loaded: +-lr everywhere visited
    assert bias.abs().max().item() == torch.tensor(0.01).item()
    assert (bias > 0).any() and (bias < 0).any()
    assert torch.all(model.memory.balance_counts == 0)  # consumed by the update
