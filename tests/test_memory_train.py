"""Every memory block trains a tiny model on CPU (loss decreases with the real optimizer), and a tiny MoME model
compiles with fullgraph=True in training mode (no graph breaks, no host syncs in forward)."""

import pytest
import torch

from conftest import tiny_config
from nanochat.gpt import build_model
from nanochat.optim import build_optimizer

CASES = [
    ("ve", {}),
    ("bigram", {}),
    ("mome", {}),
    ("mome", {"topk": 1, "router_input": "value"}),
    ("mome", {"index": "bigram", "bigram_factor": 2}),
    ("mome", {"index": "headmod", "rows": 100, "dedicated_size": 30}),
    ("mome", {"routing": "token-only"}),
    ("mome", {"routing": "fixed-random"}),
    ("mome", {"balance": "bias"}),
    ("mome", {"router_type": "conv1d"}),
]


@pytest.mark.parametrize("memory,opts", CASES)
def test_block_trains(memory, opts):
    torch.manual_seed(0)
    model = build_model(tiny_config(memory=memory, memory_options=opts, n_layer=2), seed=0)
    opt = build_optimizer(model)
    data = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(1))
    x, y = data[:, :-1], data[:, 1:]
    table = model.memory.memory_tables()[0]
    before = table.detach().clone()
    losses = []
    for _ in range(6):
        loss = model(x, y)
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        if hasattr(model.memory, "update_balance"):
            model.memory.update_balance()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    assert not torch.equal(before, table.detach())  # the memory itself is learning
    assert all(v == v for v in model.memory.stats().values())  # finite, no NaN


@pytest.mark.slow  # ~80 s of compilation on 2 CPU cores
def test_mome_compiles_fullgraph_in_training_mode():
    model = build_model(tiny_config(memory="mome", n_layer=2), seed=0)
    model.train()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    data = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = compiled(data[:, :-1], data[:, 1:])
    loss.backward()
    ref = build_model(tiny_config(memory="mome", n_layer=2), seed=0)
    ref_loss = ref(data[:, :-1], data[:, 1:])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
    assert model.memory.tables[0].weight.grad is not None
    assert model.memory.load_counts.sum() == 2 * 16 * 2 * 2  # in-graph bookkeeping happened once
