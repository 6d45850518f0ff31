"""--mome-balance trust-region: the authors' trust-region rule for the loss-free selection bias (reference notes
§3.9), against a per-(row, head, slot) Python loop of the spec's rule."""
import argparse
import math
import re

import pytest
import torch

from conftest import tiny_config
from nanochat.balance import power_law_band, trust_region_bias_update
from nanochat.gpt import build_model
from nanochat.memory import add_memory_args, memory_config_from_args
from nanochat.memory.mome import MoMEOptions
from nanochat.train_loop import after_optimizer_step

LR = 2.0 ** -6  # dyadic: b +- lr rounds the same in fp32 and in Python floats, so results compare exactly


def naive_trust_region(bias, counts, lr, n, min_visits):
    """The spec's rule, one (row, head) site and one slot at a time: (new bias, {case: number of slots})."""
    M = counts.shape[-1]
    shares = [n ** -r / sum(n ** -k for k in range(M)) for r in range(M)]
    q_min, q_max = shares[-1], shares[0]
    b_rows, c_rows = bias.reshape(-1, M).tolist(), counts.reshape(-1, M).tolist()
    cases = dict.fromkeys(("unvisited", "ineligible", "below", "above", "inside_small", "inside_large"), 0)
    for b, c in zip(b_rows, c_rows):
        total = sum(c)
        if total == 0 or total < (min_visits if min_visits > 0 else M):
            cases["unvisited" if total == 0 else "ineligible"] += M
            continue
        for e in range(M):
            if c[e] < total * q_min:
                b[e], case = b[e] + lr, "below"
            elif c[e] > total * q_max:
                b[e], case = b[e] - lr, "above"
            else:
                case = "inside_small" if abs(b[e]) < lr else "inside_large"
                b[e] -= math.copysign(min(abs(b[e]), lr), b[e])
            cases[case] += 1
    return torch.tensor(b_rows, dtype=torch.float32).view(bias.shape), cases


def test_power_law_band_is_the_specs():
    # reference notes §3.9: n = 1.4 gives [0.0613, 0.329] for M = 6 and [0.0072, 0.291] for M = 12
    for slots, (q_min, q_max) in ((6, (0.0613, 0.329)), (12, (0.0072, 0.291))):
        got = power_law_band(1.4, slots)
        assert (round(got[0], 4), round(got[1], 3)) == (q_min, q_max)
    assert power_law_band(1.0, 6) == pytest.approx((1 / 6, 1 / 6))  # n = 1: M equal shares


@pytest.mark.parametrize("slots,n,min_visits", [(6, 1.4, 0), (12, 1.4, 0), (6, 1.2, 25), (6, 1.0, 0)])
def test_update_equals_a_per_slot_loop_of_the_rule(slots, n, min_visits):
    g = torch.Generator().manual_seed(slots)
    shape = (2, 40, 3, slots)  # (layer, row, head, slot)
    counts = (torch.rand(shape, generator=g) ** 3 * 12).floor()  # skewed: slots below, inside and above the band
    counts[:, :4] = 0  # never visited
    counts[:, 4:8] = 0
    counts[:, 4:8, :, 0] = 3  # visited, but fewer visits than M (and than 25)
    counts[:, 8] = 0
    counts[:, 8, :, 0] = min_visits or slots  # just enough visits to be eligible
    counts[:, 9] = 5  # equal loads: inside the band, on both of its bounds when n = 1
    bias = torch.randn(shape, generator=g) * 2 * LR  # |b| below and above lr
    want, cases = naive_trust_region(bias, counts, LR, n, min_visits)
    assert all(cases.values()), cases  # every branch of the rule is exercised
    got, c = bias.clone(), counts.clone()
    trust_region_bias_update(got, c, LR, n, min_visits)
    assert torch.equal(got, want) and c.sum() == 0  # counts reset for the next window of optimizer steps
    assert torch.equal(got[:, :8], bias[:, :8])  # unvisited and ineligible rows keep their bias
    assert not torch.equal(got[:, 8], bias[:, 8])


def _trust_region_model(**opts):
    model = build_model(tiny_config(memory="mome", memory_options=dict(balance="trust-region", balance_lr=LR,
                                                                      **opts)), seed=0)
    with torch.no_grad():  # memory and attention output off their zero init: the routing depends on the context
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if name.startswith("memory.") or "c_proj" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
        model.memory.router_bias.copy_(torch.randn(model.memory.router_bias.shape, generator=g) * 2 * LR)
    return model


def test_mome_step_applies_the_rule_to_the_counts_of_all_micro_steps():
    model = _trust_region_model(balance_band=1.3)
    mem = model.memory
    before = mem.router_bias.clone()
    g = torch.Generator().manual_seed(2)
    for _ in range(2):  # two micro-steps, few distinct tokens: rows are revisited (totals >= M)
        model(torch.randint(0, 4, (2, 16), generator=g))
    counts = mem.balance_counts.clone()
    assert counts.sum() == 2 * 2 * 16 * 2 * 2  # micro-steps * B*T*H*K assignments
    after_optimizer_step(model)  # what the trainer calls after optimizer.step()
    want, cases = naive_trust_region(before, counts, LR, 1.3, 0)
    assert cases["below"] and cases["above"] and cases["inside_large"]
    assert torch.equal(mem.router_bias, want) and mem.balance_counts.sum() == 0
    assert mem.router_bias.dtype == torch.float32 and "memory.router_bias" in model.state_dict()  # saved


def test_rows_with_fewer_visits_than_min_visits_keep_their_bias():
    model = _trust_region_model(balance_min_visits=10 ** 6)
    before = model.memory.router_bias.clone()
    model(torch.randint(0, 4, (2, 16)))
    after_optimizer_step(model)
    assert torch.equal(model.memory.router_bias, before)


def _args(*argv):
    p = argparse.ArgumentParser()
    add_memory_args(p)
    return p.parse_args(list(argv))


def test_flags_and_their_errors():
    opts = memory_config_from_args(_args("--memory", "mome", "--mome-balance", "trust-region", "--mome-balance-lr",
                                         "0.01", "--mome-balance-band", "1.2", "--mome-balance-min-visits", "32"))
    assert {k: opts["memory_options"][k] for k in ("balance", "balance_lr", "balance_band", "balance_min_visits")} \
        == {"balance": "trust-region", "balance_lr": 0.01, "balance_band": 1.2, "balance_min_visits": 32}
    defaults = memory_config_from_args(_args("--memory", "mome"))["memory_options"]
    assert (defaults["balance_band"], defaults["balance_min_visits"]) == (1.4, 0)  # the authors' defaults
    for argv, needle in ((("--mome-balance-band", "1.2"), "--mome-balance-band 1.2 only applies with --mome-balance "
                                                          "trust-region (got --mome-balance none)"),
                         (("--mome-balance", "bias", "--mome-balance-min-visits", "8"), "--mome-balance-min-visits 8 "
                          "only applies with --mome-balance trust-region (got --mome-balance bias)"),
                         (("--mome-balance-lr", "0.01"), "--mome-balance-lr 0.01 only applies with --mome-balance "
                          "bias or trust-region")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            memory_config_from_args(_args("--memory", "mome", *argv))
    for bad, flag in ((dict(balance_band=0.9), "--mome-balance-band"), (dict(balance_band=float("nan")),
                      "--mome-balance-band"), (dict(balance_min_visits=-1), "--mome-balance-min-visits"),
                      (dict(topk=6), "--mome-balance trust-region needs a learned top-K"),
                      (dict(balance="trust_region"), "--mome-balance 'trust_region' is unknown; allowed: none, bias, "
                                                     "trust-region")):
        with pytest.raises(ValueError, match=re.escape(flag)):
            MoMEOptions(**{"balance": "trust-region", **bad})


def test_bias_identical_on_two_gloo_ranks_and_equal_to_the_update_on_global_counts(gloo_checks):
    # tests/_mome_trust_region_worker.py, in the session's shared 2-rank launch (conftest.gloo_checks)
    ranks = [torch.load(gloo_checks / f"mome_trust_region.rank{i}.pt") for i in range(2)]
    c0, c1 = ranks[0]["counts"], ranks[1]["counts"]
    assert not torch.equal(c0, c1)  # different rows per rank: the all-reduce matters
    want, _ = naive_trust_region(ranks[0]["before"], c0 + c1, 2.0 ** -6, 1.4, 0)
    assert torch.equal(ranks[0]["bias"], want) and torch.equal(ranks[1]["bias"], want)
    alone, _ = naive_trust_region(ranks[0]["before"], c0, 2.0 ** -6, 1.4, 0)
    assert not torch.equal(want, alone)  # rank 0's counts alone would have moved it differently
    assert ranks[0]["counts_after"].sum() == 0


# -- the authors' format: their bias is not in their checkpoints, and their evaluation routes without it ---------
THEIR_MOME = {"n_layer": 4, "n_head": 4, "n_kv_head": 4, "n_embd": 64, "vocab_size": 512, "window_pattern": "L",
              "moe_ve_enabled": True, "moe_ve_setting": "0_2_6", "value_embeds_layers": [1, 3]}


def test_their_trust_region_imports_where_the_sign_rule_does():
    from nanochat.reference_format import ReferenceFormatError, config_from_reference, reference_from_config

    for update in ("none", "deepseek_moe", "trust_region"):  # lr 0 (every paper run): inert, the forward is exact
        cfg = config_from_reference("gpt", {**THEIR_MOME, "moe_ve_bias_update": update, "moe_ve_balance_lr": 0.0,
                                            "moe_ve_bias_powerlaw_n": 1.2, "moe_ve_bias_min_visits": 32})
        assert cfg.memory_options.get("balance", "none") == "none"
    for update in ("deepseek_moe", "trust_region"):  # a moving bias: not saved, and their eval routes without it
        cfg = config_from_reference("gpt", {**THEIR_MOME, "moe_ve_bias_update": update, "moe_ve_balance_lr": 0.001})
        assert cfg.memory_options.get("balance", "none") == "none"  # (the import's note: tests/test_interop33.py)
    with pytest.raises(ReferenceFormatError, match="moe_ve_bias_update='trust-region': expected one of none, "):
        config_from_reference("gpt", {**THEIR_MOME, "moe_ve_bias_update": "trust-region", "moe_ve_balance_lr": 0.0})
    # export: ours routes with the saved bias in eval too, theirs without any: no exact counterpart
    ours = tiny_config(memory="mome", memory_options={"balance": "trust-region"})
    with pytest.raises(ReferenceFormatError, match="--mome-balance trust-region has no counterpart"):
        reference_from_config(ours)
