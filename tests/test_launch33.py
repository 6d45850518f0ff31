"""Run-control edges found in session 33's review of launching, signals and run directories: the row runner and
a byte of its child's output that is not text, an uncommitted edit that is not UTF-8 in the evaluations' code
version, and the run-dir lock's stale record after a reboot."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
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


def _git(repo, *args) -> bytes:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True).stdout


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_code_version_of_an_edit_that_is_not_utf8(tmp_path):
    """Every evaluation's fingerprint (final_eval.partial.json, base_eval's partial reports) holds code_version(),
    a hash of `git diff HEAD -- nanochat scripts`. An uncommitted edit with a byte that is not UTF-8 (a Latin-1
    comment) raised UnicodeDecodeError there: every final evaluation of every run failed after its training, and
    every --resume again. The hash is of the diff's bytes, as for a UTF-8 diff. ~0.1 s."""
    from nanochat.report import code_version

    for folder in ("nanochat", "scripts"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.py").write_text("x = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "init")
    versions = []
    for edit in (b"# caf\xe9\nx = 2\n", b"# caf\xe8\nx = 2\n", "# café\nx = 2\n".encode()):
        (tmp_path / "nanochat" / "a.py").write_bytes(edit)
        version = code_version(tmp_path)
        diff = _git(tmp_path, "diff", "HEAD", "--", "nanochat", "scripts")
        assert version["trees"] is not None and len(version["trees"]) == 2
        assert version["diff_sha256"] == hashlib.sha256(diff.strip()).hexdigest()
        versions.append(version["diff_sha256"])
    assert len(set(versions)) == 3  # two edits that differ only in a non-UTF-8 byte are two versions


_HOLD_WITHOUT_FLOCK = ("import sys, time; import nanochat.run_dir as r; r.try_flock = lambda fd, blocking=False: None; "
                       "r.RunDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)")


def test_a_lock_record_of_a_run_before_a_reboot_is_stale_without_flock(tmp_path, monkeypatch):
    """On a file system without flock (Lustre without -o flock, some NFS) run.lock's record alone decides: a live
    pid on this host is refused. A run killed with its node (a power cut, a crash) leaves its record, and after the
    reboot its pid is soon another process's (pids count up from boot alike): its --resume was refused "in use by
    another run" for good, naming a dead run, until the user deleted run.lock. A record of another boot (the
    kernel's boot id) names no process of this one: it is a stale lock, taken over with a note. ~0.3 s."""
    import nanochat.run_dir as run_dir

    owner = subprocess.Popen([sys.executable, "-c", _HOLD_WITHOUT_FLOCK, str(tmp_path)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert owner.stdout.readline().strip() == "held"
    owner.kill()  # dies holding the directory: its record stays
    owner.wait(timeout=60)
    monkeypatch.setattr(run_dir, "try_flock", lambda fd, blocking=False: None)
    monkeypatch.setattr(run_dir, "pid_alive", lambda pid: True)  # its pid, reused by another process
    with pytest.raises(run_dir.RunDirBusy, match=f"in use by another run: pid {owner.pid} "):
        run_dir.RunDirLock(tmp_path).acquire()  # this boot: the pid may be the owner's, as before
    monkeypatch.setattr(run_dir, "boot_id", lambda: "a boot after the owner's", raising=False)
    lock = run_dir.RunDirLock(tmp_path).acquire()
    try:
        assert lock.stale["pid"] == owner.pid
        assert json.loads((tmp_path / run_dir.LOCK_FILE).read_text())["boot"] == "a boot after the owner's"
    finally:
        lock.release()


@pytest.mark.parametrize("flag,value", [("--save-at-flops", "1e400"), ("--eval-every-flops", "1e400"),
                                        ("--eval-every-flops", "1e6,1e400")])
def test_a_flop_target_past_any_float_is_refused_by_name(flag, value, capsys):
    """--save-at-flops / --eval-every-flops are read exactly (a Fraction), then compared with the run's horizon as
    floats and printed as one: a count past the float range (1e400, a typo of 1e40) raised OverflowError, a
    traceback, where any other out-of-reach target is refused naming the flag (exit 2). ~0.1 s each."""
    from scripts import base_train

    try:
        rc = base_train.main(["--depth", "2", "--synthetic-data", "--vocab-size", "256", "--num-iterations", "5",
                              flag, value, "--dry-run"])
    except SystemExit as e:  # the flag checks of the parser
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and f"{flag}: 1e400 is beyond any run" in err and "Traceback" not in err


_PROGRESS_BAR = r"""
import pathlib, sys
for done in range(4):  # a progress bar (tqdm, on stderr): each refresh goes back to the line's start
    sys.stderr.write(f"\rtrain: {done}/3")
    sys.stderr.flush()
print("", file=sys.stderr)
print("step 3 | loss 1.0", flush=True)
pathlib.Path(sys.argv[1]).write_text(sys.argv[2])
"""


def test_the_row_runner_passes_a_progress_bar_on_as_a_bar(tmp_path, capsys):
    """base_train's tqdm bar redraws its line with a carriage return. scripts.run read its child's output in
    universal-newline mode, which turned every "\\r" into a line end: on the terminal and in train.log each refresh
    of the bar (up to 10 a second, for hours) was a line of its own, burying the step lines. The runner passes the
    output on as written (a terminal redraws the bar; `tail -f train.log` too). ~0.1 s."""
    run = tmp_path / "seed42"
    done = json.dumps({"stop_reason": "completed", "step": 3, "num_iterations": 3})
    run_one(42, run, [sys.executable, "-c", _PROGRESS_BAR, str(run / "summary.json"), done])
    output = "\rtrain: 0/3\rtrain: 1/3\rtrain: 2/3\rtrain: 3/3\nstep 3 | loss 1.0\n"
    with open(run / "train.log", encoding="utf-8", newline="") as log:
        assert log.read() == output
    assert output in capsys.readouterr().out


def test_run_lock_has_the_mode_a_plain_open_gives(tmp_path):
    """run.lock was created 0o644 whatever the umask: in a run directory a group shares (umask 002, every other
    run file group-writable), a member's --resume of a run another member started failed to open it for writing
    ("cannot create run.lock: Permission denied") once the first run had ended. It takes the umask, as the run's
    other files (jsonfile.write_atomic) do. ~0.01 s."""
    from nanochat.run_dir import LOCK_FILE, RunDirLock

    old = os.umask(0o002)
    try:
        lock = RunDirLock(tmp_path / "run").acquire()
    finally:
        os.umask(old)
    try:
        assert (tmp_path / "run" / LOCK_FILE).stat().st_mode & 0o777 == 0o664
    finally:
        lock.release()


@pytest.mark.slow  # three in-process runs: ~3 s on an idle 2-core machine, more than the suite's budget allows
def test_a_rewind_killed_in_its_set_up_leaves_metrics_that_match_the_checkpoints(tmp_path, monkeypatch):
    """--resume K below the latest checkpoint drops metrics.jsonl's records after K and sets the later checkpoints
    aside: two steps, before the signal handler is installed (a SIGTERM kills at once) or in which a Ctrl-C raises.
    Killed between them, whichever comes first, the next --resume (scripts.run's --resume auto) must go on from a
    checkpoint whose records metrics.jsonl holds. Before: the records went first, so it went on from the latest
    checkpoint with its steps' records gone for good."""
    from nanochat import checkpoint as ckpt
    from scripts import base_train
    from test_train_e2e import losses, train

    run = tmp_path / "r"
    assert train(run, "--num-iterations", "4", "--save-every", "2") == 0
    assert ckpt.list_steps(run) == [2, 4]
    done = []

    def killed_after_the_first(real):
        def step(*args, **kwargs):
            if done:
                raise KeyboardInterrupt  # the kill, after the other step finished
            done.append(real.__name__)
            return real(*args, **kwargs)
        return step

    monkeypatch.setattr(base_train, "truncate_metrics", killed_after_the_first(base_train.truncate_metrics))
    monkeypatch.setattr(ckpt, "set_aside_later", killed_after_the_first(ckpt.set_aside_later))
    with pytest.raises(KeyboardInterrupt):
        train(run, "--num-iterations", "4", "--save-every", "2", "--resume", "2")
    monkeypatch.undo()
    assert train(run, "--num-iterations", "4", "--save-every", "2", "--resume") == 0
    assert sorted(losses(run)) == [1, 2, 3, 4]


_WRITE_BOTH = ("import sys; from tqdm import tqdm; from nanochat.lost_output import keep_running_without_output; "
               "keep_running_without_output(); print('a line'); print('an error line', file=sys.stderr); "
               "tqdm.write('a step line', file=sys.stdout); sys.stdout.flush(); sys.stderr.flush(); "
               "open(sys.argv[1], 'w').write('went on')")


@pytest.mark.parametrize("closed", [1, 2])
def test_a_run_started_with_its_output_closed_goes_on(tmp_path, closed):
    """A process started with stdout or stderr closed (`>&-`, `2>&-`; a launcher that closes them) has
    sys.stdout/sys.stderr None, which print() skips. base_train's keep_running_without_output wrapped the None:
    its first print raised AttributeError, and `python -m scripts.base_train ... --dry-run >&-` died at its first
    line (a tqdm.write(file=sys.stdout), base_train's step line, fails on None even unwrapped). A closed stream is
    now /dev/null: the run goes on. ~0.2 s each."""
    mark = tmp_path / "mark"
    proc = subprocess.run([sys.executable, "-c", _WRITE_BOTH, str(mark)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=lambda: os.close(closed),
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert mark.read_text() == "went on"
    open_output = proc.stderr if closed == 1 else proc.stdout
    assert open_output == ("an error line\n" if closed == 1 else "a line\na step line\n")


def test_the_row_runner_started_with_its_stdout_closed_goes_on(monkeypatch):
    """scripts.run started with stdout closed (`>&-`: sys.stdout is None) raised AttributeError at its first line
    (say), before the first seed; a stdout that is gone later was already skipped (EPIPE, EIO). ~0 s."""
    from scripts.run import say

    monkeypatch.setattr(sys, "stdout", None)
    say("[run] seed 42: ...\n")
