import pytest

from conftest import tiny_config
from nanochat.gpt import build_model
from nanochat.optim import MuonAdamW, OptimConfig, build_param_groups
from nanochat.schedules import (ScheduleConfig, apply_schedules, init_schedule_state, lr_multiplier, muon_momentum,
                                weight_decay_multiplier)


def test_lr_multiplier_paper_recipe_d12():
    sc = ScheduleConfig(num_iterations=6450)  # no warmup, warmdown 0.4 -> 2580 steps, final 0
    assert sc.warmdown_iters == 2580
    assert lr_multiplier(0, sc) == 1.0
    assert lr_multiplier(3870, sc) == 1.0  # it <= N - W is still flat
    assert lr_multiplier(3871, sc) == pytest.approx(2579 / 2580)
    assert lr_multiplier(5160, sc) == pytest.approx(0.5)
    assert lr_multiplier(6449, sc) == pytest.approx(1 / 2580)  # the last step run is N-1: not exactly 0


def test_lr_multiplier_warmup_and_final_frac():
    sc = ScheduleConfig(num_iterations=100, warmup_ratio=0.1, warmdown_ratio=0.4, final_lr_frac=0.1)
    assert [lr_multiplier(i, sc) for i in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_multiplier(10, sc) == 1.0 and lr_multiplier(60, sc) == 1.0
    assert lr_multiplier(80, sc) == pytest.approx(0.5 + 0.5 * 0.1)
    assert lr_multiplier(99, sc) == pytest.approx(1 / 40 + (1 - 1 / 40) * 0.1)


def test_momentum_ramp_and_weight_decay():
    sc = ScheduleConfig(num_iterations=1000)
    assert [muon_momentum(i, sc) for i in (0, 150, 300, 999)] == pytest.approx([0.85, 0.90, 0.95, 0.95])
    assert [weight_decay_multiplier(i, sc) for i in (0, 250, 500, 999)] == pytest.approx([1.0, 0.75, 0.5, 0.001])


@pytest.mark.parametrize("kw, flag", [(dict(warmup_ratio=-0.1), "--warmup-ratio"),
                                      (dict(warmdown_ratio=1.5), "--warmdown-ratio"),
                                      (dict(warmup_ratio=0.7, warmdown_ratio=0.4), "--warmup-ratio + --warmdown-ratio"),
                                      (dict(final_lr_frac=2.0), "--final-lr-frac")])
def test_bad_schedule_values_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag.replace("+", r"\+")):
        ScheduleConfig(num_iterations=10, **kw)


def test_apply_schedules_sets_groups_without_compounding():
    model = build_model(tiny_config(n_layer=3), seed=0)
    opt = MuonAdamW(build_param_groups(model, OptimConfig()))
    init_schedule_state(opt)
    muon = [g for g in opt.param_groups if g["kind"] == "muon"]
    wd0 = 0.2 * (12 / 3) ** 2
    assert all(g["initial_weight_decay"] == pytest.approx(wd0) for g in muon)
    sc = ScheduleConfig(num_iterations=10)
    for _ in range(3):  # applying the same step repeatedly must give the same values
        vals = apply_schedules(opt, 8, sc)
    assert vals["lrm"] == pytest.approx(0.5)
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(g["initial_lr"] * 0.5)
    for g in muon:
        assert g["weight_decay"] == pytest.approx(wd0 * 0.2)
        assert g["momentum"] == pytest.approx(0.85 + 0.1 * 8 / 300)
    init_schedule_state(opt)  # idempotent: does not capture the already-scheduled decay
    assert all(g["initial_weight_decay"] == pytest.approx(wd0) for g in muon)
