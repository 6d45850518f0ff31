"""compute_cleanup really ends the process group: its gloo threads are joined before the interpreter exits.

A process group that outlives ``destroy_process_group`` is torn down by interpreter shutdown, where a joinable gloo
thread was sometimes destroyed first: "terminate called without an active exception", SIGABRT, a failed torchrun
after the work was done (seen in CI: tests/test_train_hooks.py's 2-rank stats job, rank 0).
"""
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO

# One rank of a 1-process gloo job: compute_init, then what a MoE forward or torch.compile does on first use (import
# torch._dynamo, which imports torch.distributed.nn.functional, whose functions take group.WORLD as a default
# argument), then compute_cleanup; prints the names of the threads left.
WORKER = """
import os, sys
from nanochat.common import compute_cleanup, compute_init
compute_init("cpu")
import torch._dynamo  # noqa: F401
compute_cleanup()
print(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the thread names from /proc (Linux)")
def test_cleanup_joins_gloo_threads_after_dynamo_import():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    r = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    threads = r.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads, threads
