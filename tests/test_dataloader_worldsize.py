"""PackedDataLoader after --resume-new-world-size: what it reports (the unit accounting of repartition() is in
test_dataloader.py)."""

import pytest

import test_dataloader
from test_dataloader import loader, take

synthetic_dir = test_dataloader.synthetic_dir  # the fixture: 12 units of 8 documents


@pytest.mark.parametrize("new_world", [1, 3])
def test_passes_continue_across_a_world_size_change(new_world, synthetic_dir, tiny_tokenizer):
    """data_passes is a fraction of the epoch: 4 of the 12 units read by 2 ranks stay read on 1 or 3 ranks, so
    the count neither restarts at 0 nor jumps ahead (it counted through the rest only: 0 after 2 -> 1), and it
    reaches the next epoch as 1.0 without going backwards."""
    old = [loader(synthetic_dir, tiny_tokenizer, rank=r, world_size=2, seed=7) for r in range(2)]
    for dl in old:
        dl.cursor = (0, 2, 0)  # 2 of its 6 units read: a third of the epoch
        assert dl.passes() == pytest.approx(1 / 3)
    states = [dl.state_dict() for dl in old]
    for rank in range(new_world):
        dl = loader(synthetic_dir, tiny_tokenizer, rank=rank, world_size=new_world, seed=7)
        dl.repartition(states)
        seen = [dl.passes()]
        assert seen[0] == pytest.approx(1 / 3)
        while dl.cursor[0] == 0:
            take(dl, 1)
            seen.append(dl.passes())
        dl.close()
        assert seen == sorted(seen) and 1 <= seen[-1] < 2, seen


def test_repartition_says_what_is_left_in_words(synthetic_dir, tiny_tokenizer):
    """base_train prints repartition()'s summary after "data order re-partitioned": a sentence, not a dict. 2 ranks
    that each read 2 of their 6 units leave 8 of the 12 units of epoch 0, none carried from an earlier epoch."""
    old = [loader(synthetic_dir, tiny_tokenizer, rank=r, world_size=2, seed=7) for r in range(2)]
    for dl in old:
        dl.cursor = (0, 2, 0)
    dl = loader(synthetic_dir, tiny_tokenizer, rank=0, world_size=1, seed=7)
    assert dl.repartition([o.state_dict() for o in old]) == "epoch 0, 8 units left to read (0 carried over from " \
                                                             "earlier epochs)"
    dl.close()


def test_synthetic_repartition_says_where_it_continues():
    from nanochat.train_loop import SyntheticLoader
    old = SyntheticLoader(256, 4, 8, seed=3, rank=0, world_size=2)
    old.count = 5  # 5 batches of 4 rows on each of 2 ranks: 40 rows read
    new = SyntheticLoader(256, 4, 8, seed=3, rank=0, world_size=1)
    assert new.repartition([old.state_dict()]) == "40 rows already read; continuing at batch 10"
