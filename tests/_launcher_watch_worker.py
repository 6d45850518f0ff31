"""Fake launcher and worker for test_launcher_watch.

    python tests/_launcher_watch_worker.py launcher DIR [watch]   # starts the worker, prints its pid, sleeps
    python tests/_launcher_watch_worker.py worker DIR              # what a torchrun worker does at its start

With ``watch`` the launcher sets LAUNCHER_ENV for the worker, as torchrun does. The worker writes DIR/ready once
its watcher runs, and DIR/stopped (then exits 0) when a SIGTERM reaches it; its stderr goes to DIR/worker.err."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nanochat.launcher_watch import LAUNCHER_ENV, watch_launcher

POLL_S = 0.05


def launcher(out: Path, watch: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_ENV}
    if watch:
        env[LAUNCHER_ENV] = "test"
    with open(out / "worker.err", "w") as err:
        # a session of its own, as torchrun's workers: the test's kill of the launcher reaches the launcher alone
        worker = subprocess.Popen([sys.executable, __file__, "worker", str(out)], env=env, stderr=err,
                                  start_new_session=True)
    print(worker.pid, flush=True)
    time.sleep(600)


def worker(out: Path) -> None:
    def stopped(signum, frame):
        (out / "stopped").write_text(signal.Signals(signum).name)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stopped)
    watch_launcher(POLL_S)
    # whole or absent (a rename): the test reads it as soon as it exists, and a file opened but not yet written
    # read as '' under load
    (out / "ready.tmp").write_text(str(os.getppid()))
    (out / "ready.tmp").replace(out / "ready")
    time.sleep(600)


if __name__ == "__main__":
    if sys.argv[1] == "launcher":
        launcher(Path(sys.argv[2]), sys.argv[3:] == ["watch"])
    else:
        worker(Path(sys.argv[2]))
