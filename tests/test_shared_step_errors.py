"""every_rank_ok's handling of this rank's own error before the exchange that shares it: the failed work's frames
let go (a CUDA OOM's half-built model is freed before all_gather_object allocates), and an exchange that fails
itself names this rank's error as its cause."""

import gc
import traceback
import weakref

import pytest
import torch
import torch.distributed as dist

from nanochat import common


class Model:
    """Stands in for a half-built model, held only by the failing function's frame."""


def fake_world(monkeypatch, all_gather_object):
    monkeypatch.setattr(common, "is_dist", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)


def test_the_failed_work_is_freed_before_the_exchange_and_a_failed_exchange_chains_to_it(monkeypatch):
    alive = []

    def build():
        model = Model()  # noqa: F841 - kept alive by this frame, as by a traceback
        alive.append(weakref.ref(model))
        raise torch.OutOfMemoryError("simulated CUDA out of memory")

    def exchange(out, obj):
        gc.collect()
        assert alive[0]() is None, "the failed work's locals are alive during the exchange"
        raise RuntimeError("simulated exchange failure (a peer gone)")

    fake_world(monkeypatch, exchange)
    with pytest.raises(RuntimeError, match="simulated exchange failure") as raised:
        common.every_rank_ok(build)
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError), raised.value.__cause__
    assert "in build" in "".join(traceback.format_exception(raised.value.__cause__))  # still printable


def test_an_exchange_that_fails_without_an_own_error_is_raised_as_it_is(monkeypatch):
    def exchange(out, obj):
        raise RuntimeError("simulated exchange failure")

    fake_world(monkeypatch, exchange)
    with pytest.raises(RuntimeError, match="simulated exchange failure") as raised:
        common.every_rank_ok(lambda: 1)
    assert raised.value.__cause__ is None


@pytest.mark.parametrize("failing", ["broadcast", "signals"])
def test_rank_0s_own_error_is_the_cause_when_rank0_decides_exchange_fails(monkeypatch, failing):
    """rank0_decides on rank 0: fn raised, then one of its exchanges failed (a peer gone, an OOM in NCCL's buffer);
    the exchange's error must name rank 0's own as its cause, or that error is never printed or recorded."""
    def broken(*args, **kwargs):
        raise RuntimeError("simulated exchange failure")

    fake_world(monkeypatch, broken if failing == "signals" else lambda out, obj: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    if failing == "broadcast":
        monkeypatch.setattr(common, "broadcast_object", broken)
    else:
        monkeypatch.setattr(common, "broadcast_object", lambda obj: obj)

    def decide():
        raise FileNotFoundError("rank 0's own error")

    with pytest.raises(RuntimeError, match="simulated exchange failure") as raised:
        common.rank0_decides(decide)
    assert isinstance(raised.value.__cause__, FileNotFoundError), raised.value.__cause__


@pytest.mark.parametrize("chained", ["cause", "context"])
def test_the_frames_of_a_chained_error_are_freed_too(monkeypatch, chained):
    """An error raised while another was handled (``raise X from e``, or a failure in an except block) holds the first
    one through ``__cause__``/``__context__``, and that one's traceback holds the frames where it was raised: the
    half-built model there must be let go of as well."""
    alive = []

    def forward():
        model = Model()  # noqa: F841 - held only by this frame, which only the first error's traceback reaches
        alive.append(weakref.ref(model))
        raise torch.OutOfMemoryError("simulated CUDA out of memory")

    def step():
        try:
            forward()
        except torch.OutOfMemoryError as e:
            if chained == "cause":
                raise RuntimeError("the step failed") from e
            raise RuntimeError("the handler failed too")

    def exchange(out, obj):
        gc.collect()
        assert alive[0]() is None, "the chained error's frames are alive during the exchange"
        out[:] = [obj, (None, None)]  # rank 1 succeeded

    fake_world(monkeypatch, exchange)
    with pytest.raises(RuntimeError, match="rank 0 of 2: ") as raised:
        common.every_rank_ok(step)
    first = raised.value.own_error.__cause__ if chained == "cause" else raised.value.own_error.__context__
    assert isinstance(first, torch.OutOfMemoryError), first
    assert "in forward" in "".join(traceback.format_exception(first))  # still printable


def test_clearing_the_frames_of_a_cyclic_chain_ends(monkeypatch):
    """A chain that loops (an error set as its own cause's context, by hand or by a library) is walked once."""
    first, second = RuntimeError("first"), RuntimeError("second")
    second.__cause__, first.__context__ = first, second
    assert common.let_go_of_the_failed_work(second) is second


@pytest.mark.parametrize("raised", ["oom", "chained_oom", "other"])
def test_cudas_cache_is_emptied_after_an_oom_in_the_chain(monkeypatch, raised):
    """An OOM caught and raised again as another error (a step's own wrapper) is still an OOM to recover from."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    try:
        try:
            raise torch.OutOfMemoryError("simulated") if raised != "other" else ValueError("not an OOM")
        except Exception as e:
            if raised == "oom":
                raise
            raise RuntimeError("the step failed") from e
    except Exception as error:
        common.let_go_of_the_failed_work(error)
    assert emptied == ([] if raised == "other" else [True])
