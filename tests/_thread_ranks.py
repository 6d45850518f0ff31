"""W ranks as W threads of this process (torch's threaded test process group): the sharded optimizer's collectives,
checked in-process without a torchrun start-up (~1 s instead of ~5-17 s). Its collectives are synchronous and copy
tensors between the threads, so what it checks is which rank sends what where (shard bounds, launch order, state
layout), not overlap. Every rank must build its tensors under ``BUILD_LOCK``: torch's global RNG is one for all the
threads, so a seeded build racing another thread's draws would give each rank other weights."""

import threading

import pytest
import torch
import torch.distributed as dist

BUILD_LOCK = threading.Lock()


def run_ranks(world: int, fn) -> list:
    """[fn(rank, world) for every rank], each called in its own thread inside a ``world``-rank process group, with
    one intra-op thread (the ranks are the parallelism; the process's thread count is restored after); the first
    rank's exception is raised here."""
    threaded = pytest.importorskip("torch.testing._internal.distributed.multi_threaded_pg")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    threaded._install_threaded_pg()
    store = dist.HashStore()
    results, errors = [None] * world, [None] * world

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            results[rank] = fn(rank, world)
        except BaseException as e:  # noqa: BLE001 - raised in the caller
            errors[rank] = e
            threaded.ProcessLocalGroup.exception_handle(e)  # wakes the ranks waiting in a collective
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    try:
        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a rank hangs in a collective"
    finally:
        threaded.ProcessLocalGroup.reset()
        threaded._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        torch.set_num_threads(threads_before)
    for e in errors:
        if e is not None and not isinstance(e, SystemExit):  # SystemExit: a rank stopped by another's error
            raise e
    return results
