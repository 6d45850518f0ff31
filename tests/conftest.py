import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
os.environ.setdefault("WANDB_MODE", "disabled")
# the default tokenizer directory is an empty one, as in a fresh clone: a developer's trained tokenizer/ must not change
# what a test sees (--dry-run plans with the vocab of the tokenizer a run would load)
os.environ["NANOCHAT_TOKENIZER_DIR"] = tempfile.mkdtemp(prefix="no_tokenizer_")
atexit.register(shutil.rmtree, os.environ["NANOCHAT_TOKENIZER_DIR"], ignore_errors=True)
torch.set_num_threads(min(2, os.cpu_count() or 1))
# the session fixtures (prepared data, tiny tokenizer) for every test module: built once per session, where an
# import into each module made one copy per module
pytest_plugins = ["data_fixtures"]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RUN_SLOW") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow end-to-end test: run with RUN_SLOW=1 or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def shared_dir():
    if not SHARED.is_dir():
        pytest.skip(f"../shared not found at {SHARED} (only present on developer/CI machines)")
    return SHARED


def tiny_config(**kw):
    from nanochat.gpt import GPTConfig

    base = dict(sequence_len=32, vocab_size=512, n_layer=2, n_head=2, n_kv_head=2, n_embd=128)
    base.update(kw)
    return GPTConfig(**base)


def load_bench(name: str):
    """Import bench/<name>.py (a script directory, not a package) as a fresh module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sigterm_after(monkeypatch, module, name: str, calls_before: int) -> list:
    """Wrap module.name: the call after ``calls_before`` calls sends this process a real SIGTERM, as a Slurm time
    limit would (the code under test must have turned SIGTERM into something it handles: the default action would
    end pytest). Returns the list of calls made (their positional arguments)."""
    import signal
    import time

    real, calls = getattr(module, name), []

    def wrapped(*args, **kwargs):
        calls.append(args)
        if len(calls) > calls_before:
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN), "SIGTERM is not handled"
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in here
            raise AssertionError(f"SIGTERM did not interrupt {module.__name__}.{name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def run_torchrun(script: Path, nproc: int, args: list[str], timeout: int = 300):
    """Run ``torchrun --standalone --nproc_per_node=nproc script args`` on CPU (gloo) and return the result."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
