"""torchrun worker for test_launcher_watch: scripts.base_eval whose ranks, entering the second CORE task, write
DIR/in_task.RANK and wait there until a stop signal is latched (the launcher watcher's SIGTERM, once the test has
killed torchrun), then go on, so that the launcher dies mid-evaluation on every run.

    python -m torch.distributed.run --nproc_per_node=2 tests/_launcher_watch_eval_worker.py DIR BASE_EVAL_ARGS..."""

import os
import sys
import time
from pathlib import Path

from nanochat import core_eval, eval_resume
from scripts.base_eval import main

WAIT_GUARD_S = 300  # only a watcher that never fires waits this long: the evaluation then finishes, and the test fails


def wait_in_second_task(out: Path) -> None:
    real, calls = core_eval.evaluate_task, []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            (out / f"in_task.{os.environ['RANK']}").touch()
            deadline = time.monotonic() + WAIT_GUARD_S
            while not eval_resume.latched_signal() and time.monotonic() < deadline:
                time.sleep(0.05)
        return real(*args, **kwargs)

    core_eval.evaluate_task = wrapped


if __name__ == "__main__":
    wait_in_second_task(Path(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
