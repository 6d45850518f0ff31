"""common.print_error: an error every rank raised together is printed once per job (by rank 0), any other error
by the rank that raised it. The torchrun case: test_train_dist.test_a_set_up_error_every_rank_raises_is_printed_once."""

import pytest

from nanochat import common


@pytest.fixture
def rank(monkeypatch):
    """Sets this process's rank in a (pretended) 2-rank process group; returns the barriers entered."""
    barriers = []
    monkeypatch.setattr(common, "is_dist", lambda: True)
    monkeypatch.setattr(common.dist, "barrier", lambda: barriers.append("barrier"))

    def set_rank(r):
        monkeypatch.setattr(common.dist, "get_rank", lambda: r)
        return barriers
    return set_rank


def shared_error(rank_failed: int) -> ValueError:
    """What raise_lowest_rank_error raises when ``rank_failed`` alone failed."""
    errors = [None, None]
    errors[rank_failed] = ValueError("no tokenizer in tok/")
    with pytest.raises(ValueError) as info:
        common.raise_lowest_rank_error(errors)
    return info.value


@pytest.mark.parametrize("rank_failed", [0, 1])
def test_an_error_every_rank_raised_is_printed_by_rank_0_alone_after_which_every_rank_waits(rank, capsys,
                                                                                          rank_failed):
    for r, printed in ((0, f"error: rank {rank_failed} of 2: no tokenizer in tok/\n"), (1, "")):
        barriers = rank(r)
        common.print_error(shared_error(rank_failed))
        assert capsys.readouterr().err == printed and barriers == ["barrier"]
        barriers.clear()


def test_an_error_of_one_rank_is_printed_by_that_rank_with_no_barrier(rank, capsys):
    barriers = rank(1)
    common.print_error(FileNotFoundError("run.lock"))
    assert capsys.readouterr().err == "error: run.lock\n" and barriers == []


def test_without_a_process_group_every_error_is_printed(capsys):
    common.print_error(common.raised_on_every_rank(ValueError("bad flag")))
    assert capsys.readouterr().err == "error: bad flag\n"
