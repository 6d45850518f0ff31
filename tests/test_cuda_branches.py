"""The CUDA-only branches whose logic is device-independent, run on the CPU (the GPU itself: tests/test_gpu.py).

Each test forces the CUDA choice on the CPU: through the function's own parameter, or by monkeypatching the
``torch.cuda`` calls the branch makes (no CUDA build is needed), so a regression fails here, not on a GPU.
"""

import datetime
import os
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nanochat import checkpoint as ckpt
from nanochat.common import autocast_context, compute_init, resolve_dtype
from nanochat.optim import polar_express


class _FakeGenerator:
    def __init__(self):
        self.state = None

    def set_state(self, state):
        self.state = state


def test_cuda_rng_states_of_more_gpus_than_visible_restore_the_visible_ones(monkeypatch):
    """A checkpoint's per-rank RNG state holds one CUDA state per GPU its process saw; a resume that sees fewer
    (--resume-new-world-size onto a smaller node, another CUDA_VISIBLE_DEVICES layout) restores those it has a
    device for. torch's own set_rng_state_all indexes torch.cuda.default_generators and raised IndexError."""
    gens = (_FakeGenerator(), _FakeGenerator())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # torch.cuda._lazy_call runs the setter now
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gens))
    monkeypatch.setattr(torch.cuda, "default_generators", gens)
    saved = [torch.full((16,), i, dtype=torch.uint8) for i in range(4)]  # written by a process with 4 GPUs
    ckpt.set_rng_state({"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": saved})
    assert [int(g.state[0]) for g in gens] == [0, 1]
    fewer = [torch.full((16,), 7, dtype=torch.uint8)]  # and from a process that saw one GPU
    ckpt.set_rng_state({"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": fewer})
    assert [int(g.state[0]) for g in gens] == [7, 1]


def _fake_cuda(monkeypatch, calls: list):
    """torch.cuda / torch.backends as compute_init's CUDA branch uses them, recording the order of the calls."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(
        ("set_device", device, os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))))
    # not the real flags: on a CPU build they are global state (and change torch.get_float32_matmul_precision)
    monkeypatch.setattr(torch.backends, "cuda", SimpleNamespace(matmul=SimpleNamespace(allow_tf32=False)))
    monkeypatch.setattr(torch.backends, "cudnn", SimpleNamespace(allow_tf32=False))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init_process_group", kw)))
    monkeypatch.setattr(dist, "barrier", lambda: calls.append(("barrier",)))


# Every rank waits up to 30 min in a collective, nccl as gloo: nccl's own default (10 min) killed every rank while
# rank 0 alone did longer work they wait for (a CORE bundle download on a slow link, a d24 checkpoint on slow storage)
THIRTY_MIN = datetime.timedelta(minutes=30)


@pytest.mark.parametrize("preset", [None, "expandable_segments:False"])
def test_compute_init_cuda_branch(monkeypatch, preset):
    """Under torchrun on CUDA: the allocator setting is in the environment before the first CUDA call (it is read
    when the allocator starts, later it has no effect; a user's own value is kept), this rank's GPU is
    cuda:LOCAL_RANK and current before NCCL starts, the process group is nccl bound to that device, TF32 on."""
    calls = []
    _fake_cuda(monkeypatch, calls)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "placeholder")
    if preset is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", preset)
    for key, value in (("RANK", "3"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "4")):
        monkeypatch.setenv(key, value)
    info, device = compute_init("cuda")
    assert (info.rank, info.local_rank, info.world_size) == (3, 1, 4) and device == torch.device("cuda", 1)
    assert calls == [("set_device", device, preset or "expandable_segments:True"),
                     ("init_process_group", {"backend": "nccl", "device_id": device, "timeout": THIRTY_MIN}),
                     ("barrier",)]
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize("visible", [None, "0,1"])
def test_compute_init_refuses_a_local_rank_past_the_visible_gpus(monkeypatch, visible):
    """torchrun --nproc_per_node=4 on a node (or a CUDA_VISIBLE_DEVICES) with 2 GPUs: ranks 2 and 3 asked
    torch.cuda.set_device for cuda:2 / cuda:3 and died in a CUDA traceback ("invalid device ordinal"). Now one
    error line that names LOCAL_RANK, the GPUs this process sees and what to change, before any CUDA call."""
    calls = []
    _fake_cuda(monkeypatch, calls)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    for key, value in (("RANK", "3"), ("LOCAL_RANK", "3"), ("WORLD_SIZE", "4")):
        monkeypatch.setenv(key, value)
    shown = "unset" if visible is None else repr(visible)
    with pytest.raises(SystemExit, match=rf"^error: LOCAL_RANK 3 needs cuda:3, but this process sees 2 GPU\(s\) "
                                         rf"\(CUDA_VISIBLE_DEVICES {shown}\): launch at most 2 processes per node "
                                         r"\(torchrun --nproc_per_node\)"):
        compute_init("cuda")
    assert calls == []


def test_compute_init_cpu_branch_leaves_cuda_alone(monkeypatch):
    calls = []
    _fake_cuda(monkeypatch, calls)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "placeholder")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    _, device = compute_init("cpu")
    assert device == torch.device("cpu")
    assert calls == [("init_process_group", {"backend": "gloo", "device_id": None, "timeout": THIRTY_MIN}),
                     ("barrier",)]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and not torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize("device_type", ["cuda:1", "gpu"])
def test_compute_init_refuses_a_device_that_is_not_a_kind(monkeypatch, device_type):
    """base_eval passes --device-type as typed. "cuda:1" used to skip the CUDA branch (no allocator setting, no
    TF32, gloo instead of nccl under torchrun, every rank on GPU 1); "gpu" was a torch traceback."""
    calls = []
    _fake_cuda(monkeypatch, calls)
    with pytest.raises(SystemExit, match=f"'{device_type}' is not one of cuda, cpu, mps.*CUDA_VISIBLE_DEVICES"):
        compute_init(device_type)
    assert calls == []


def test_dtype_defaults_per_device():
    assert resolve_dtype("cuda") == "bfloat16" and resolve_dtype("cpu") == resolve_dtype("mps") == "float32"
    assert resolve_dtype("cuda", "float32") == "float32" and resolve_dtype("cpu", "bfloat16") == "bfloat16"
    with autocast_context("cpu"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast_context("cpu", "bfloat16"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")


def test_polar_express_bf16_branch_on_the_cpu():
    """The Muon orthogonalisation as it runs on CUDA (bf16 iterations), forced on the CPU: bf16 out, and the same
    polar factor as the fp32 iterations to bf16 accuracy (singular values in the same band, aligned with U V^T).
    The CPU default stays fp32."""
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 64, 32), (2, 32, 96), (2, 48, 48)]:
        G = torch.randn(*shape, generator=g)
        ref = polar_express(G)
        got = polar_express(G, dtype=torch.bfloat16)
        assert ref.dtype == torch.float32 and got.dtype == torch.bfloat16
        X = got.float()
        sv = torch.linalg.svdvals(X)
        assert sv.max() < 1.2 and sv.min() > 0.8, (shape, sv.min(), sv.max())
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)
        align = (X * (U @ Vh)).sum(dim=(-2, -1)) / min(shape[-2:])
        assert ((0.95 < align) & (align < 1.05)).all(), align
        assert (X - ref).norm() / ref.norm() < 0.1  # measured 0.03-0.05: bf16 rounding through 5 iterations


def test_cuda_device_name_branches(monkeypatch):
    """MFU's peak, the evaluation fingerprint and the run's environment record read the GPU's name on CUDA."""
    from nanochat import report
    from nanochat.eval_resume import device_fingerprint
    from nanochat.metrics import peak_flops

    name = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(report, "nvidia_driver_version", lambda: "580.159.04")
    device = torch.device("cuda", 3)
    assert peak_flops(device) == 989e12 and peak_flops(torch.device("cpu")) is None
    assert device_fingerprint(device) == f"cuda ({name})"
    env = report.environment(device, world_size=8)
    assert (env["device_type"], env["device_name"], env["device_count"], env["driver"]) == ("cuda", name, 8,
                                                                                            "580.159.04")
    assert report.fmt_hardware(env) == f"8 x {name} visible"
