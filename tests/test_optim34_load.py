"""Loading an optimizer state whose parameter groups are other groups (a checkpoint of code whose groups came in
another order, or were renamed) must be refused, naming both groups: before, only the group and parameter counts
were compared, so two groups of the same sizes (e.g. lm_head's and wte's, both V x D) took each other's moments and
hyperparameters (lr, betas) without a word (optimreview34's finding)."""

import pytest
import torch
from torch import nn

from nanochat.optim import MuonAdamW


def _optimizer():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(8, 4))
    groups = [dict(kind="adamw", name="lm_head", params=[a], lr=0.004, betas=(0.8, 0.95), eps=1e-10,
                   weight_decay=0.0),
              dict(kind="adamw", name="wte", params=[b], lr=0.3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)]
    opt = MuonAdamW(groups)
    for p in (a, b):
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def test_same_groups_load_back():
    opt = _optimizer()
    state = opt.state_dict()
    opt.load_state_dict(state)
    assert [g["name"] for g in opt.param_groups] == ["lm_head", "wte"]


def test_groups_of_another_order_are_refused():
    opt = _optimizer()
    state = opt.state_dict()
    state["param_groups"] = [state["param_groups"][1], state["param_groups"][0]]
    with pytest.raises(ValueError, match=r"optimizer group 0 is 'lm_head' here but 'wte' in the saved state"):
        opt.load_state_dict(state)
