"""CUDA-only branches of the benches traced on the CPU (session 34, helper cudareview34): torch.cuda faked, so no
CUDA build is needed."""

import pytest
import torch

from conftest import load_bench


class _CurrentDeviceSet(Exception):
    """Raised by the fake set_device: the test stops the bench there, before any CUDA work a CPU build lacks."""


def test_mome_ops_times_the_gpu_it_was_given(monkeypatch):
    """bench/mome_ops.py takes cuda:N, but its timers read the CURRENT CUDA device: torch.cuda.synchronize(),
    torch.cuda.Event.record() and triton's do_bench (its events and its synchronize) all act on it. With
    --device cuda:1 and no set_device, the kernels ran on GPU 1 and the events timed GPU 0's idle stream: times
    near zero, silently. The bench now makes the given GPU the current one before anything else touches CUDA."""
    bench = load_bench("mome_ops")
    calls = []

    def set_device(device):
        calls.append(torch.device(device))
        raise _CurrentDeviceSet

    def cuda_call(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"torch.cuda.{name} before the current device was set")
        return call

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    for name in ("get_device_name", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, cuda_call(name))
    with pytest.raises(_CurrentDeviceSet):
        bench.main(["--device", "cuda:1", "--small", "--bw", "1e12"])
    assert calls == [torch.device("cuda", 1)]
