"""One process: a Muon matrix that got no gradient in a step keeps its value AND its optimizer state (momentum,
NorMuon second moment), as AdamW skips such a parameter; the group's other matrices are updated as they would be
had it had a gradient (every Muon operation is per matrix)."""

import torch

from nanochat.optim import MuonAdamW


def make(seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(8, 6)) for _ in range(2)]
    group = dict(kind="muon", name="muon_8x6", params=params, lr=0.02, momentum=0.95, beta2=0.95,
                 weight_decay=0.2, ns_steps=5)
    return params, MuonAdamW([group])


def state_of(opt, params):
    st = opt.state[params[0]]  # the group's state, stacked (K, ...), keyed by its first matrix
    return {k: v.clone() for k, v in st.items()}


def step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()
    opt.step()


def test_a_matrix_without_gradient_keeps_its_state():
    torch.manual_seed(1)
    g1 = [torch.randn(8, 6), torch.randn(8, 6)]
    g2 = torch.randn(8, 6)
    params, opt = make()
    ref_params, ref_opt = make()
    step(opt, params, g1)  # both have gradients: a state to keep
    step(ref_opt, ref_params, g1)
    before, p1_before = state_of(opt, params), params[1].detach().clone()
    step(opt, params, [g2, None])
    step(ref_opt, ref_params, [g2, torch.randn(8, 6)])  # the same first matrix, the second with a gradient
    after, ref = state_of(opt, params), state_of(ref_opt, ref_params)
    assert torch.equal(params[1], p1_before)
    for name in ("momentum_buffer", "second_moment"):
        assert torch.equal(after[name][1], before[name][1]), name  # moved before: decayed, lerped
        torch.testing.assert_close(after[name][0], ref[name][0])
        assert not torch.equal(after[name][0], before[name][0])
    torch.testing.assert_close(params[0], ref_params[0])


def test_a_first_step_without_gradient_leaves_zero_state():
    params, opt = make()
    p1 = params[1].detach().clone()
    step(opt, params, [torch.randn(8, 6), None])
    st = state_of(opt, params)
    assert torch.equal(params[1], p1)
    assert not st["momentum_buffer"][1].any() and not st["second_moment"][1].any()
    assert st["momentum_buffer"][0].any()
