"""A --resume may change --device-batch-size (the total batch, a trajectory flag, stays): base_train's preflight says
so when the old one no longer divides the batch. The synthetic stream then continues at the same global row, as
PackedDataLoader's row stream does: the rows of each optimizer step are the same for every device batch."""

import pytest
import torch

from nanochat.train_loop import SyntheticLoader


def step_rows(loaders: list[SyntheticLoader], accum: int) -> list[tuple[int, ...]]:
    """The input rows of one optimizer step over all ranks, sorted (which rank reads a row may change; the set not)."""
    rows = torch.cat([torch.cat([next(ld)[0] for _ in range(accum)]) for ld in loaders])
    return sorted(map(tuple, rows.tolist()))


@pytest.mark.parametrize("world", [1, 2])
def test_a_resume_with_another_device_batch_continues_at_the_same_row(world):
    old = [SyntheticLoader(97, 4, 8, rank=r, world_size=world, seed=3) for r in range(world)]  # accum 2
    step_rows(old, 2)
    saved = [ld.state_dict() for ld in old]
    expected = step_rows(old, 2)  # the uninterrupted run's second step
    new = [SyntheticLoader(97, 2, 8, rank=r, world_size=world, seed=3) for r in range(world)]  # accum 4
    for ld, state in zip(new, saved):
        ld.load_state_dict(state)
    assert step_rows(new, 4) == expected and len(expected) == 8 * world


def test_a_device_batch_that_splits_a_batch_read_is_refused_naming_it():
    old = SyntheticLoader(97, 4, 8, seed=3)
    next(old)
    with pytest.raises(ValueError, match="batch_size=4 .* 3"):
        SyntheticLoader(97, 3, 8, seed=3).load_state_dict(old.state_dict())
