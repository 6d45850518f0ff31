"""scripts.run's main(argv) in the test's own process, read back as `python -m scripts.run argv` would end.

The runner's decisions (which flags base_train gets, the advice it prints, the exit it takes) are the same in this
process; base_train still runs as the runner's child process, as it does for a user. What this saves is the
runner's own Python start (a torch import: 2-3 s of CPU on this session's 2-core box). The tests of the runner's
process handling (signals, nohup, a dead terminal) keep their `python -m scripts.run`.
"""

import subprocess
import sys


def run_main(argv: list[str], capsys, monkeypatch, cwd, omp_threads: str = "1") -> subprocess.CompletedProcess:
    """``scripts.run.main(argv)`` run from ``cwd`` with OMP_NUM_THREADS=``omp_threads`` and WANDB_MODE=disabled (the
    environment the subprocess tests gave the runner, which passes it on to base_train): its stdout and stderr as
    captured, and the exit status its process would have: 0 for a return or SystemExit(None or 0), the code of an
    integer SystemExit (argparse's 2), and 1 for a SystemExit with a message, which goes to stderr as the
    interpreter prints it. Any other exception propagates (the test fails with its traceback)."""
    from scripts import run

    monkeypatch.chdir(cwd)
    monkeypatch.setenv("OMP_NUM_THREADS", omp_threads)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    capsys.readouterr()  # what came before is no part of this run's output
    code = 0
    try:
        run.main(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([sys.executable, "-m", "scripts.run", *argv], code, out, err)
