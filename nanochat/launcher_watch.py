"""A torchrun worker whose launcher dies without a word (kill -9, the OOM killer) stops as on SIGTERM.

torchrun starts each worker in a session of its own and forwards a SIGTERM it gets, but a SIGKILLed torchrun
forwards nothing: its workers, re-parented, went on training (measured: 900+ more steps in 20 s on CPU), holding the
GPUs, writing to the run dir and its run.lock while the user took the job for dead. A daemon thread here polls the
parent's pid; once it changes, it sends this process SIGTERM, so a trainer saves its checkpoint at the step boundary
and writes summary.json (stop_reason "interrupted"), and an evaluation stops with what it finished, as today on a
SIGTERM. The ranks notice at different moments (up to one poll apart): the stop vote of each step, the path of a
SIGTERM that reaches one rank only, makes them stop together.

Why polling and not prctl(PR_SET_PDEATHSIG): that signal fires when the parent *thread* that forked the worker
exits, and which thread of torch's elastic agent calls Popen is torch's business (the main thread in torch 2.13, a
thread pool is a refactor away); it is Linux-only and misses a launcher that died before the call. A poll of
os.getppid() sees any exit of the process, on any POSIX system.
"""

import os
import signal
import sys
import threading
import time

LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun for its workers; never by a shell (unlike LOCAL_RANK)
POLL_S = 1.0

_watcher: threading.Thread | None = None  # one per process: a test's worker may call main() several times


def watch_launcher(poll_s: float = POLL_S, environ=os.environ) -> threading.Thread | None:
    """Under torchrun, start (once per process) the daemon thread that SIGTERMs this process when its launcher
    exits; returns it. A plain ``python -m ...`` run (no LAUNCHER_ENV) is left alone: its parent is a shell, whose
    exit the terminal's SIGHUP already reports, and a run under nohup must outlive it."""
    global _watcher
    if LAUNCHER_ENV not in environ:
        return None
    if _watcher is None:
        _watcher = threading.Thread(target=_watch, args=(os.getppid(), poll_s), name="launcher-watch", daemon=True)
        _watcher.start()
    return _watcher


def _watch(launcher: int, poll_s: float) -> None:
    # A launcher that exited before this thread began is missed: the worker's new parent (init, a subreaper)
    # cannot be told from a launcher (torchrun is pid 1 itself as a container's command); that window, during the
    # worker's imports, stays open.
    while os.getppid() == launcher:
        time.sleep(poll_s)
    try:
        print(f"launcher (pid {launcher}) exited: stopping this worker (pid {os.getpid()}) as on SIGTERM",
              file=sys.stderr, flush=True)
    except (OSError, ValueError):  # its reader may have gone with it: the signal must still be sent
        pass
    os.kill(os.getpid(), signal.SIGTERM)
