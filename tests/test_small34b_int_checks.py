"""One "integer >= N" check for every flag value that comes from a config file or a dataclass (memory options, MoE
sizes, row configs) and the same words from the argparse type: a bool (a config file's true), a float, a string
or a value below N is refused naming the flag, its bound and the value."""

import argparse

import pytest

from nanochat.cli_types import check_int_at_least, int_at_least
from nanochat.memory.bigram import BigramOptions
from nanochat.memory.engram import EngramOptions
from nanochat.memory.jtok import JTokMOptions
from nanochat.memory.mome_options import MoMEOptions
from nanochat.memory.move_input import MoVEOptions
from nanochat.memory.slot_index import resolve_rows
from nanochat.row_config import _check_count

CASES = [
    ("--bigram-factor", 1, lambda v: BigramOptions(factor=v)),
    ("--move-experts", 1, lambda v: MoVEOptions(experts=v)),
    ("--move-rank", 1, lambda v: MoVEOptions(rank=v)),
    ("--jtokm-experts", 1, lambda v: JTokMOptions(experts=v)),
    ("--engram-max-order", 2, lambda v: EngramOptions(max_order=v)),
    ("--engram-dim", 0, lambda v: EngramOptions(dim=v)),
    ("--mome-slots", 1, lambda v: MoMEOptions(slots=v)),
    ("--mome-slot-factor", 1, lambda v: resolve_rows("mod", 0, v, 512)),
    ("config row.toml: [row] 'nproc_per_node'", 1, lambda v: _check_count("row.toml", "[row] 'nproc_per_node'", v)),
]


@pytest.mark.parametrize("flag,low,build", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("kind", ["bool", "below", "float", "string"])
def test_every_integer_option_refuses_alike(flag, low, build, kind):
    value = {"bool": True, "below": low - 1, "float": float(low) + 0.5, "string": str(low)}[kind]
    with pytest.raises(ValueError) as err:
        build(value)
    assert str(err.value) == f"{flag} must be an integer >= {low} (got {value!r})"


def test_the_shared_check_and_the_argparse_type_say_the_same():
    check_int_at_least("--x", 3, 3)
    check_int_at_least("--x", 0, 0)
    for bad in (2, False, 3.0, None):
        with pytest.raises(ValueError, match=r"^--x must be an integer >= 3 \(got "):
            check_int_at_least("--x", bad, 3)
    assert int_at_least(3)("7") == 7
    for text in ("2", "x", "3.0"):
        with pytest.raises(argparse.ArgumentTypeError) as err:
            int_at_least(3)(text)
        assert str(err.value) == f"must be an integer >= 3 (got {text!r})"
