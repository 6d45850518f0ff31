"""`python -m torch.distributed.run ARGV` for the tests, with the launcher forked from a server that imported torchrun
once (multiprocessing's forkserver) instead of started afresh: the launcher's own `import torch` was 2.5-3 s of each
~6 s 2-rank launch on CI's 2 cores (dev/LOG.md, 2026-11-27), and the suite makes ~80 launches.

Only the launcher is forked. It runs torchrun's own main with the test's argv, environment and working directory, and
starts its workers as always: fresh `python` processes with that environment, their parent the launcher. Its exit
status is that of `python -m torch.distributed.run` (0, a SystemExit's code, 1 for an uncaught error with its
traceback on stderr, -N when killed by signal N)."""

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from multiprocessing.reduction import DupFd

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the command a launch stands for, as a result's args
_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["torch.distributed.run"])
    return _context


def _launcher(argv: list[str], env: dict, cwd: str, stdout, stderr) -> None:
    """The forked launcher's body (stdout/stderr: DupFd handles of the caller's files, fds 1 and 2 here)."""
    for handle, fd in ((stdout, 1), (stderr, 2)):
        dup = handle.detach()
        os.dup2(dup, fd)
        os.close(dup)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # the server's import of torchrun fixed it: TMPDIR is the launch's, as in a fresh Python
    import torch.distributed.run as torchrun

    sys.argv = [torchrun.__file__, *argv]
    try:
        torchrun.main()
    except SystemExit:
        raise
    except KeyboardInterrupt:  # as the interpreter ends on one: its traceback, then dead of SIGINT
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - the interpreter's ending on an uncaught error: the traceback, exit 1
        traceback.print_exc()
        sys.exit(1)


class Launch:
    """A Popen-like handle of one launch (pid, poll, wait, kill, send_signal, returncode). ``stdout``/``stderr`` are
    open files (anything with fileno()); ``stderr=subprocess.STDOUT`` writes both to ``stdout``."""

    def __init__(self, argv: list[str], *, env: dict, cwd, stdout, stderr=subprocess.STDOUT):
        err = stdout if stderr == subprocess.STDOUT else stderr
        self.args = [*TORCHRUN, *argv]
        self._process = _forkserver().Process(
            target=_launcher, args=(list(argv), dict(env), str(cwd), DupFd(stdout.fileno()), DupFd(err.fileno())))
        self._process.daemon = True  # ended with the test session, never waited for at its exit
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(argv: list[str], *, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """One launch to its end, its stdout and stderr captured as text. A launch still running after ``timeout`` is
    killed with its workers (which torchrun starts in sessions of their own) and raises subprocess.TimeoutExpired."""
    from conftest import kill_tree

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        launch = Launch(argv, env=env, cwd=cwd, stdout=out, stderr=err)
        try:
            launch.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(launch.pid)
            launch.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(launch.args, launch.returncode, out.read(), err.read())
