"""Run-control edges found in session 33's review of launching, signals and run directories: the row runner and
a byte of its child's output that is not text, and the run-dir lock's stale record after a reboot."""

import json
import sys

from scripts.run import run_one

# a stand-in for base_train: a line that is not UTF-8 (a C library's or a compiler's message naming a Latin-1 path),
# then more output, then the completed run's summary
_NOT_UTF8_THEN_FINISH = r"""
import pathlib, sys
sys.stdout.buffer.write(b"note: /data/caf\xe9/shard_000.bin\n")
sys.stdout.flush()
print("step 9/9 done", flush=True)
pathlib.Path(sys.argv[1]).write_text(sys.argv[2])
"""


def test_the_row_runner_survives_a_child_line_that_is_not_utf8(tmp_path, capsys):
    """scripts.run reads base_train's output as text: one byte that does not decode raised UnicodeDecodeError in
    the runner, which died mid-seed (and its death SIGTERMs the child, PR_SET_PDEATHSIG: the run stopped). The
    line must reach the log and the terminal with the byte replaced, and the seed finish. ~0.1 s."""
    run = tmp_path / "seed42"
    done = json.dumps({"stop_reason": "completed", "step": 9, "num_iterations": 9})
    run_one(42, run, [sys.executable, "-c", _NOT_UTF8_THEN_FINISH, str(run / "summary.json"), done])
    log = (run / "train.log").read_text(encoding="utf-8")
    assert log == "note: /data/caf\ufffd/shard_000.bin\nstep 9/9 done\n"
    assert "step 9/9 done" in capsys.readouterr().out
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "completed"
