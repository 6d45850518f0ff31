"""Memory-block float flags must be finite numbers: nan/inf (and a bool from a config file) were accepted and
trained into NaN routing biases or a NaN loss, or silently switched the memory off."""
import pytest

from nanochat.memory.jtok import JTokMOptions, JTokOptions
from nanochat.memory.mome_options import MoMEOptions

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("options,flag", [
    (lambda v: MoMEOptions(balance="bias", balance_lr=v), "--mome-balance-lr"),  # inf: NaN biases after one update
    (lambda v: JTokMOptions(aux_weight=v), "--jtokm-aux-weight"),  # nan/inf: a NaN/inf training loss
    (lambda v: JTokOptions(eps=v), "--jtok-eps"),  # inf: Norm(u) = 0, JTok silently an identity
    (lambda v: JTokMOptions(eps=v), "--jtokm-eps"),
])
@pytest.mark.parametrize("value", [INF, NAN, True])
def test_non_finite_or_bool_float_flags_are_refused_by_name(options, flag, value):
    with pytest.raises(ValueError, match=flag):
        options(value)


def test_finite_values_still_pass():
    assert MoMEOptions(balance="bias", balance_lr=0).balance_lr == 0  # 0: counts only, the bias never moves
    assert MoMEOptions(balance="bias", balance_lr=0.5).balance_lr == 0.5
    assert JTokMOptions(aux_weight=0, eps=1e-3).aux_weight == 0
    assert JTokOptions(eps=2).eps == 2
