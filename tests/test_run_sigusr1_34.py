"""scripts.run under Slurm's pre-emption notice (`sbatch --signal=USR1@90`): SIGUSR1 to the runner must reach its
child as a stop (SIGTERM: torchrun forwards SIGTERM to its workers, which save; a SIGUSR1 would kill torchrun, which
handles only SIGTERM/SIGINT/SIGHUP/SIGQUIT by default), and the runner must stop with its resumable message instead
of dying of the signal's default action. ~1 s."""

import os
import signal
import sys

from test_run_dir import _SIGNAL_THEN_TALK, start_runner


def test_runner_turns_sigusr1_into_one_sigterm_for_its_child(tmp_path):
    run = tmp_path / "seed42"
    child = [sys.executable, "-c", _SIGNAL_THEN_TALK.replace("signal.SIGTERM)", "signal.SIGTERM, signal.SIGUSR1)")]
    proc = start_runner(run, child)
    os.kill(proc.pid, signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    text = (run / "train.log").read_text()
    assert "child got ['SIGTERM']" in text and "saving line 199" in text, text[-2000:] + err
    assert proc.returncode == 1 and "interrupted" in err and "resumed by re-running" in err, err
