"""Training recipe against the reference spec (mome_reference_training.md §1.3-§1.6), checked with naive oracles:
the schedules as the spec writes them, the gradient of the mean loss over a whole step's rows, and flag values that
cannot describe a run (non-finite numbers, a negative ramp) refused as flag errors before any work."""

import math

import pytest
import torch

from conftest import tiny_config
from nanochat.gpt import build_model
from nanochat.schedules import ScheduleConfig, lr_multiplier, muon_momentum, weight_decay_multiplier
from nanochat.train_args import parse_args
from nanochat.train_loop import train_step


# -- schedules: the spec's formulas written out naively --------------------------------------------------------
def spec_lrm(it, n, warmup_ratio, warmdown_ratio, final):
    """§1.5: warmup (it+1)/W_up while it < W_up; 1 while it <= N - W_down; then progress + (1 - progress) * final
    with progress = (N - it) / W_down; both lengths round(ratio * N)."""
    up, down = round(warmup_ratio * n), round(warmdown_ratio * n)
    if it < up:
        return (it + 1) / up
    if it <= n - down:
        return 1.0
    progress = (n - it) / down
    return progress + (1 - progress) * final


@pytest.mark.parametrize("n, up, down, final", [
    (6450, 0.0, 0.4, 0.0),  # the d12 rows
    (38146, 0.01, 0.4, 0.0),  # the Qwen3 rows: 381 warmup steps
    (1, 0.0, 0.4, 0.0),  # round(0.4) = 0: no warmdown at all
    (2, 0.0, 0.4, 0.0),  # round(0.8) = 1: the warmdown branch starts at it > N - 1, never run
    (3, 0.5, 0.5, 0.2),  # round(1.5) = 2 each: warmup and warmdown overlap by rounding (the reference's too)
    (7, 0.3, 0.7, 0.5),
])
def test_schedules_equal_the_spec_formulas_at_every_step(n, up, down, final):
    sc = ScheduleConfig(n, up, down, final)
    edges = {0, 1, 299, 300, 301, sc.warmup_iters - 1, sc.warmup_iters, n - sc.warmdown_iters,
             n - sc.warmdown_iters + 1, n // 2, n - 2, n - 1}
    for it in range(n) if n < 100 else sorted(i for i in edges if 0 <= i < n):
        assert lr_multiplier(it, sc) == spec_lrm(it, n, up, down, final), it
        assert muon_momentum(it, sc) == pytest.approx((1 - min(it / 300, 1)) * 0.85 + min(it / 300, 1) * 0.95)
        assert weight_decay_multiplier(it, sc) == pytest.approx(1 - it / n)
    if n == 38146:
        assert sc.warmup_iters == 381 and lr_multiplier(380, sc) == 1.0 and lr_multiplier(0, sc) == 1 / 381


# -- gradient accumulation: the summed gradient is that of the mean loss over the step's rows --------------------
class _CapturingOptimizer:
    """What train_step needs of MuonAdamW, recording the gradients it is handed (no update)."""

    def __init__(self, model):
        self.model, self.grads, self.armed = model, None, 0
        self.grad_norm = torch.zeros(())

    def arm_grad_hooks(self):
        self.armed += 1

    def step(self):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.grad_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in self.grads.values()))


def test_train_step_gradient_is_the_mean_loss_gradient_of_the_whole_step():
    """Adam (eps 1e-10) and Muon are nearly blind to a gradient's scale, so a loss divided by grad_accum twice (or
    not at all) would leave the trained weights almost alone; the gradient and the logged grad norm would not."""
    model = build_model(tiny_config(n_layer=1, n_embd=64), seed=0)
    rows = torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(1))
    x, y = rows[:, :-1], rows[:, 1:]
    model.zero_grad(set_to_none=True)
    full = model(x, targets=y)  # the mean over all 4 x 16 tokens of the step
    full.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want_norm = math.sqrt(sum((g.double() ** 2).sum().item() for g in want.values()))
    for accum in (1, 2, 4):
        model.zero_grad(set_to_none=True)
        b = 4 // accum
        batches = iter([(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(accum)])
        opt = _CapturingOptimizer(model)
        loss, gnorm, _, aux = train_step(model, opt, batches, accum, torch.autocast("cpu", enabled=False), "cpu")
        assert opt.armed == 1 and aux == 0.0, accum  # the hooks armed once, before the last micro-step
        assert loss == pytest.approx(full.item(), rel=1e-6), accum
        assert opt.grads.keys() == want.keys(), accum
        for name, g in want.items():
            torch.testing.assert_close(opt.grads[name], g, rtol=1e-5, atol=1e-7, msg=f"{name}, accum {accum}")
        assert gnorm == pytest.approx(want_norm, rel=1e-5), accum
        assert all(p.grad is None for p in model.parameters()), accum  # zeroed for the next step


# -- flags whose values cannot describe a run: refused at parsing (exit 2), naming the flag ------------------------
@pytest.mark.parametrize("flag, value", [
    ("--target-flops", "inf"),  # was an OverflowError traceback from round(inf) in the plan
    ("--target-param-data-ratio", "inf"),  # likewise from int(inf)
    ("--matrix-lr", "nan"),  # was accepted: NaN weights after the first step (exit 3)
    ("--embedding-lr", "inf"),  # was "no optimizer group of this model uses it"
    ("--scalar-lr", "nan"),
    ("--weight-decay", "inf"),
    ("--memory-wd", "nan"),
    ("--muon-momentum-ramp", "-5"),  # was silently a ramp of 0 steps
])
def test_non_finite_or_negative_recipe_values_are_flag_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--dry-run", "--depth", "2", "--memory", "ve", flag, value])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


# -- the loss: softcapped fp32 logits, targets -1 ignored (in the mean's count too) --------------------------------
@torch.no_grad()
def test_loss_is_the_mean_nll_of_the_softcapped_logits_over_the_targets_not_ignored():
    model = build_model(tiny_config(n_layer=1, n_embd=64), seed=0)
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    targets[0, :5] = -1
    targets[1, -3:] = -1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx)  # (B, T, V), softcapped
        loss = model(idx, targets=targets)
        per_token = model(idx, targets=targets, loss_reduction="none")
    assert logits.dtype == loss.dtype == torch.float32  # the softcap and the cross-entropy in fp32 under autocast
    assert float(logits.abs().max()) <= 15.0
    keep = targets >= 0
    nll = -torch.log_softmax(logits.double(), dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    assert loss.item() == pytest.approx(nll[keep].mean().item(), rel=1e-5)  # 24 tokens counted, not 32
    assert per_token.shape == (32,) and torch.all(per_token.view(2, 16)[~keep] == 0)
