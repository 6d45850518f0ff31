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


def test_shared_bigram_table_sparse_grad_trains_like_dense():
    cfg = tiny_config(memory="mome", n_layer=4, memory_options={"slots": 4, "topk": 2, "index": "bigram",
                                                                 "bigram_factor": 2})
    models = [build_model(cfg, seed=0), build_model(cfg, seed=0)]
    models[1].memory.sparse_shared_grad = False  # the dense reference
    for model in models:  # random routers: zero-init ones tie, and 1e-7 differences would flip the top-K choice
        with torch.no_grad():
            for router in model.memory.routers:
                router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(1)))
    opts = [build_optimizer(m) for m in models]
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (2, 33), generator=g) for _ in range(3)]
    for batch in batches:
        for model, opt in zip(models, opts):
            model(batch[:, :-1], batch[:, 1:]).backward()
            assert model.memory.table.weight.grad.is_sparse == model.memory.sparse_shared_grad
            opt.step()
            assert not model.memory.table.weight.grad.is_sparse  # densified once by the optimizer
            model.zero_grad(set_to_none=True)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5, msg=name)  # summation order only
