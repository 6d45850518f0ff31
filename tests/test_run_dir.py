"""No run can destroy another: the run-dir lock (two processes, stale locks), the fresh-run refusal and
--overwrite, output directories checked writable before any work, crash-safe checkpoint pruning and the sweep
of what an interrupted save/prune/overwrite leaves behind."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from nanochat import checkpoint as ckpt
from nanochat.run_dir import LOCK_FILE, RunDirBusy, RunDirLock, ensure_writable, pid_alive
from scripts import base_train
from test_train_e2e import TINY, train

HOLD_LOCK = "import sys, time; from nanochat.run_dir import RunDirLock; RunDirLock(sys.argv[1]).acquire(); " \
            "print('held', flush=True); time.sleep(120)"


def hold_lock_in_child(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_process_is_refused_and_a_dead_owner_is_reported(tmp_path, capsys):
    run = tmp_path / "r"
    owner = hold_lock_in_child(run)
    try:
        assert train(run, "--num-iterations", "2", "--resume", "auto") == 2
        err = capsys.readouterr().err
        assert f"--run-dir {run} is in use by another run: pid {owner.pid} on host" in err
        assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()  # nothing touched
    finally:
        owner.send_signal(signal.SIGKILL)  # dies holding it: the record stays, the kernel drops the flock
        owner.wait(timeout=30)
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == owner.pid
    assert train(run, "--num-iterations", "2", "--resume", "auto") == 0
    out = capsys.readouterr().out
    assert f"was left by pid {owner.pid} on host" in out and "ended without releasing it" in out
    assert (run / LOCK_FILE).read_text() == ""  # released cleanly at the end of the run
    RunDirLock(run).acquire().release()  # and really unlocked


def test_training_holds_the_lock_until_it_ends(tmp_path, capsys):
    """A second base_train (this process) on the directory of a live training (a subprocess) is refused, whatever
    its flags; the first run is untouched."""
    run = tmp_path / "r"
    flags = [*TINY, "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "400",
             "--run-dir", str(run)]
    first = subprocess.Popen([sys.executable, "-m", "scripts.base_train", *flags], cwd=REPO,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        metrics = run / "metrics.jsonl"
        deadline = time.time() + 60
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.05)
        for extra in ([], ["--resume", "auto"], ["--overwrite"]):
            assert base_train.main([*flags, *extra]) == 2, extra
            assert f"is in use by another run: pid {first.pid}" in capsys.readouterr().err, extra
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, summary["step"] + 1))  # the first run's metrics, whole


def test_fresh_run_into_a_run_dir_is_refused_unless_overwrite(tmp_path, capsys):
    run = tmp_path / "r"
    assert train(run, "--num-iterations", "2") == 0
    before = {p: p.read_bytes() for p in [run / "metrics.jsonl", run / "config.json",
                                           ckpt.step_dir(run, 2) / "model.pt"]}
    assert train(run, "--num-iterations", "3") == 2
    err = capsys.readouterr().err
    assert f"--run-dir {run} already holds a run (config.json, metrics.jsonl" in err and "--overwrite" in err
    assert all(p.read_bytes() == b for p, b in before.items()) and ckpt.list_steps(run) == [2]
    (run / "eval").mkdir()  # an evaluation of the old run goes with it
    (run / "final_eval.partial.json").write_text("{}")  # and the finished parts of its interrupted final evaluation
    assert train(run, "--num-iterations", "3", "--overwrite") == 0
    out = capsys.readouterr().out
    assert "--overwrite: deleted the previous run" in out
    assert "final_eval.partial.json is unreadable" not in out  # deleted with the run it belongs to
    assert ckpt.list_steps(run) == [3] and not (run / "eval").exists()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 3]
    with pytest.raises(SystemExit):  # contradictory flags
        train(run, "--num-iterations", "3", "--overwrite", "--resume")
    # a dry run's plan.json alone is not a run: a fresh start there is fine
    assert base_train.main([*TINY, "--run-dir", str(tmp_path / "d"), "--num-iterations", "2", "--dry-run"]) == 0
    assert train(tmp_path / "d", "--num-iterations", "2") == 0


def blocked_path(tmp_path):
    """A directory path under a regular file: not creatable even by root (chmod cannot show this as root)."""
    (tmp_path / "file").write_text("x")
    return tmp_path / "file" / "out"


def test_unwritable_outputs_fail_before_any_work(tmp_path, capsys, monkeypatch):
    from nanochat import tokenizer as tokmod
    from scripts import base_eval, prepare_data, tok_train

    def no_work(*a, **k):
        raise AssertionError("the expensive work started before the output check")

    bad = blocked_path(tmp_path)
    monkeypatch.setattr(base_train, "load_run_data", no_work)
    assert train(bad, "--num-iterations", "2") == 2
    assert f"--run-dir {bad} is not a writable directory" in capsys.readouterr().err

    monkeypatch.setattr(prepare_data, "embedded_sources", no_work)
    monkeypatch.setattr(prepare_data, "download_remote_shards", no_work)
    # exit 2 like the others here (prepare_data and tok_train exited 1 before session 20)
    assert prepare_data.main(["--dataset", "embedded", "--data-dir", str(bad), "--no-progress"]) == 2
    assert f"--data-dir {bad} is not a writable directory" in capsys.readouterr().err

    monkeypatch.setattr(tokmod.Tokenizer, "train_from_iterator", no_work)
    assert tok_train.main(["--data-dir", str(tmp_path), "--output-dir", str(bad)]) == 2
    assert f"--output-dir {bad} is not a writable directory" in capsys.readouterr().err

    run = tmp_path / "run"
    from conftest import tiny_config
    from nanochat.gpt import build_model
    ckpt.save_checkpoint(run, 1, build_model(tiny_config(), seed=0), {})
    monkeypatch.setattr(base_eval, "load_model", no_work)
    assert base_eval.main(["--run", str(run), "--out-dir", str(bad), "--device-type", "cpu"]) == 2
    assert f"--out-dir {bad} is not a writable directory" in capsys.readouterr().err


def test_ensure_writable_creates_the_directory(tmp_path):
    assert ensure_writable(tmp_path / "a" / "b", "--x").is_dir()
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the probe file is gone


def test_lock_in_the_same_process_is_exclusive_and_removes_a_directory_it_created(tmp_path):
    first = RunDirLock(tmp_path / "new").acquire()
    with pytest.raises(RunDirBusy, match="is in use by another run"):
        RunDirLock(tmp_path / "new").acquire()
    first.release()
    assert not (tmp_path / "new").exists()  # nothing but the lock was written: no empty run dir left behind
    (tmp_path / "old").mkdir()
    RunDirLock(tmp_path / "old").acquire().release()
    assert (tmp_path / "old" / LOCK_FILE).read_text() == ""


def held_lock_file(run_dir, record: str):
    """Another open file of run.lock holding its flock (another process as the kernel sees it), with ``record``."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode(), 0)
    return fd


def later(seconds, fn):
    import threading

    t = threading.Timer(seconds, fn)
    t.start()
    return t


OWNER = {"pid": os.getpid(), "host": __import__("socket").gethostname(), "started": "2026-11-26 20:00:00 UTC",
         "command": "python -m scripts.prepare_data --dataset embedded"}


@pytest.mark.parametrize("left", ["", "dead owner"], ids=["empty", "dead-owner-record"])
def test_a_refusal_names_an_owner_that_has_just_taken_the_lock(tmp_path, left, monkeypatch):
    """The owner writes its record just after its flock: a process refused in between read an empty record (or the
    record of the dead owner taken over) and named nobody ("pid ? on host ?"). It waits for the record. ~0.3 s."""
    from nanochat import run_dir

    # the wait ends when the record comes: a long one costs nothing, and a loaded machine may run the timer late
    monkeypatch.setattr(run_dir, "RECORD_WAIT_S", 60.0)
    run = tmp_path / "r"
    if left:
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        left = json.dumps({**OWNER, "pid": int(gone.stdout), "command": "the dead one"})
    fd = held_lock_file(run, left)
    writer = later(0.3, lambda: (os.ftruncate(fd, 0), os.pwrite(fd, json.dumps(OWNER).encode(), 0)))
    try:
        with pytest.raises(RunDirBusy) as refused:
            RunDirLock(run).acquire("--data-dir")
        assert (f"--data-dir {run} is in use by another run: pid {os.getpid()} on host {OWNER['host']} "
                f"(started 2026-11-26 20:00:00 UTC: python -m scripts.prepare_data --dataset embedded)"
                in str(refused.value))
    finally:
        writer.join()
        os.close(fd)


@pytest.mark.parametrize("pid", [2 ** 70, "12x", None, -1, 0])
def test_a_held_lock_whose_record_names_no_valid_pid_is_a_refusal(tmp_path, pid):
    """A record that names no process (a pid past the C long: OverflowError before, a traceback; text; none; 0 and
    negatives, which kill() reads as process groups) under a held flock: refused, naming what the record says."""
    run = tmp_path / "r"
    fd = held_lock_file(run, json.dumps({**OWNER, "pid": pid}))
    try:
        with pytest.raises(RunDirBusy) as refused:
            RunDirLock(run).acquire()
        assert f"in use by another run: pid {pid} on host {OWNER['host']}" in str(refused.value)
    finally:
        os.close(fd)


def test_pid_alive_is_false_only_for_a_pid_no_process_has():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not pid_alive(gone.pid) and pid_alive(os.getpid()) and pid_alive(1)  # 1: init, another user's maybe
    assert all(pid_alive(p) for p in (2 ** 70, "x", None, 0, -1))  # no valid pid: kept, as a live owner's


def test_an_owner_releasing_while_another_asks_is_no_refusal(tmp_path, monkeypatch):
    """release() clears the record, then unlocks: a process asking in between is not refused by nobody, it gets
    the directory. ~0.2 s."""
    import fcntl

    from nanochat import run_dir

    monkeypatch.setattr(run_dir, "RECORD_WAIT_S", 60.0)  # ends at the unlock; the timer may run late under load
    run = tmp_path / "r"
    fd = held_lock_file(run, "")
    unlock = later(0.2, lambda: fcntl.flock(fd, fcntl.LOCK_UN))
    try:
        lock = RunDirLock(run).acquire()
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid() and lock.stale is None
        lock.release()
    finally:
        unlock.join()
        os.close(fd)


def test_an_owner_that_never_writes_its_record_is_still_refused(tmp_path, monkeypatch):
    """A lock held with an empty record past the wait: refused, saying so, not "pid ?"."""
    from nanochat import run_dir

    monkeypatch.setattr(run_dir, "RECORD_WAIT_S", 0.1)
    run = tmp_path / "r"
    fd = held_lock_file(run, "")
    try:
        with pytest.raises(RunDirBusy, match=f"is in use by another process, which has not written its owner "
                                             f"record into {run / LOCK_FILE}") as refused:
            RunDirLock(run).acquire()
        assert "pid ?" not in str(refused.value)
    finally:
        os.close(fd)


def save_steps(run, steps, keep_last=0):
    from conftest import tiny_config
    from nanochat.gpt import build_model

    model = build_model(tiny_config(), seed=0)
    for s in steps:
        ckpt.save_checkpoint(run, s, model, {}, keep_last=keep_last)


def test_pruning_is_crash_safe(tmp_path, monkeypatch):
    """A kill while an old checkpoint is deleted must not leave a half-deleted step_N that looks like a checkpoint
    directory; what it leaves is swept on the next start."""
    run = tmp_path / "r"
    save_steps(run, [1, 2])
    real_rmtree = ckpt.shutil.rmtree

    def killed_midway(path, *a, **k):  # deletes meta.json, then the process "dies"
        (path / "meta.json").unlink(missing_ok=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save_steps(run, [3], keep_last=1)
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    root = run / ckpt.CKPT_DIR
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_000003"]
    assert ckpt.list_steps(run) == [3]
    assert ckpt.sweep_leftovers(run) == [".prune-step_000001", ".prune-step_000002"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000003"]


def test_a_full_disk_mid_save_raises_a_checkpoint_write_error_and_frees_the_space(tmp_path, monkeypatch):
    """ENOSPC in the middle of torch.save (which turns its file's OSError into a RuntimeError): one error type for
    the trainer to share with every rank, the earlier checkpoint intact, and the unfinished copy removed at once (its
    bytes filled the disk: summary.json is written next)."""
    import io

    run = tmp_path / "r"
    save_steps(run, [1])

    class FullDisk(io.RawIOBase):  # takes 1000 bytes, then the device is full
        def __init__(self, real):
            self.real, self.left = real, 1000

        def writable(self):
            return True

        def write(self, b):
            if len(b) > self.left:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.left -= len(b)
            return self.real.write(b)

    real_write_file = ckpt._write_file
    monkeypatch.setattr(ckpt, "_write_file", lambda path, fn: real_write_file(path, lambda f: fn(FullDisk(f))))
    with pytest.raises(ckpt.CheckpointWriteError, match=r"could not write checkpoint step 2 in .*checkpoints: \[Errno 28\] No space"):
        save_steps(run, [2])
    assert ckpt.list_steps(run) == [1]
    assert sorted(p.name for p in (run / ckpt.CKPT_DIR).iterdir()) == ["step_000001"]


def test_an_error_of_the_save_that_is_not_the_file_system_stays_itself(tmp_path, monkeypatch):
    """Only the file system's errors become CheckpointWriteError (exit 2, "free space"): another RuntimeError (a CUDA
    error while the state is copied to the CPU, a bug) keeps its type and traceback; the unfinished copy goes."""
    run = tmp_path / "r"

    def cuda_error(path, write_fn):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(ckpt, "_write_file", cuda_error)
    with pytest.raises(RuntimeError, match="illegal memory access") as caught:
        save_steps(run, [1])
    assert type(caught.value) is RuntimeError
    assert ckpt.list_steps(run) == [] and list((run / ckpt.CKPT_DIR).iterdir()) == []


def test_a_prune_that_fails_keeps_the_saved_checkpoint_and_warns(tmp_path, monkeypatch, capsys):
    """The new checkpoint is whole once renamed into place: an old one that cannot be deleted is reported, not
    raised as a failed save."""
    run = tmp_path / "r"
    save_steps(run, [1])

    def no_permission(run_dir, keep_last):
        raise PermissionError(errno.EACCES, "Permission denied", "step_000001")

    monkeypatch.setattr(ckpt, "prune_checkpoints", no_permission)
    save_steps(run, [2], keep_last=1)
    assert ckpt.list_steps(run) == [1, 2]
    assert "warning: checkpoint step 2 is saved, but older ones could not be pruned" in capsys.readouterr().err


def test_leftovers_are_swept_when_a_run_starts(tmp_path, capsys):
    run = tmp_path / "r"
    assert train(run, "--num-iterations", "4", "--save-every", "2", "--keep-last", "0") == 0
    root = run / ckpt.CKPT_DIR
    os.replace(ckpt.step_dir(run, 4), root / ".old-step_000004")  # killed while re-saving step 4
    (root / ".tmp-step_000004").mkdir()
    (root / ".tmp-step_000004" / "model.pt").write_bytes(b"half")
    (root / "step_000001").mkdir()  # half deleted by an older version's pruning
    (root / ".prune-step_000000").mkdir()
    (run / ".trash-0123abcd" / "checkpoints").mkdir(parents=True)  # an interrupted --overwrite
    assert train(run, "--num-iterations", "4", "--save-every", "2", "--keep-last", "0", "--resume") == 0
    out = capsys.readouterr().out
    assert "removed what an interrupted save, prune or --overwrite left" in out
    assert ".old-step_000004 (restored as step_000004)" in out and "step_000001" in out
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000004"]
    assert not (run / ".trash-0123abcd").exists()
    assert "resumed from" in out and "step 4/4" in out


def test_row_runner_continues_an_interrupted_run_and_skips_a_completed_one(tmp_path, capsys):
    """scripts.run: an interrupted run has a summary.json too; it must be continued (--resume auto), not skipped
    as finished, and a run dir without checkpoints must not be started fresh over (base_train would refuse)."""
    from scripts.run import run_one

    run = tmp_path / "seed42"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"stop_reason": "interrupted", "step": 3, "num_iterations": 9}))
    # build_commands' tail; the stand-in for base_train finishes the run, as base_train would
    done = json.dumps({"stop_reason": "completed", "step": 9, "num_iterations": 9})
    echo = [sys.executable, "-c", f"import pathlib, sys; print('argv', sys.argv[1:]); "
            f"pathlib.Path({str(run / 'summary.json')!r}).write_text({done!r})", "--resume", "auto"]
    run_one(42, run, echo)
    out = capsys.readouterr().out
    assert "continuing the unfinished run" in out and "argv ['--resume', 'auto']" in out
    run_one(42, run, echo)
    assert "not overwriting" in capsys.readouterr().out


def test_row_runner_stops_after_a_wall_time_stop(tmp_path):
    """base_train exits 0 when --max-wall-time-seconds stops it (checkpoint saved, final eval run), but the seed
    is not finished: the runner must stop with a resumable message, not go on to the next seed. So must it after
    any other unfinished summary of an exit 0."""
    from scripts.run import run_one

    run = tmp_path / "seed42"
    summary = {"stop_reason": "wall_time_limit", "step": 3, "num_iterations": 9}
    child = [sys.executable, "-c", f"import pathlib, sys; pathlib.Path(sys.argv[1]).write_text({json.dumps(summary)!r})",
             str(run / "summary.json")]
    with pytest.raises(SystemExit, match="seed 42 stopped at its wall-time limit .*step 3 of 9.*re-running"):
        run_one(42, run, child)
    # a signal that reached base_train alone (not the runner): it saved and exited 0, the seed is not finished
    child[2] = child[2].replace("wall_time_limit", "interrupted")
    with pytest.raises(SystemExit, match=r"seed 42 is not finished \(.*step 3 of 9 \(stop reason: interrupted\)\).*"
                                         "re-running"):
        run_one(42, run, child)


def start_runner(run, child: list[str], **popen) -> subprocess.Popen:
    """scripts.run's run_one of ``child`` for seed 42 into ``run``, in a process group of its own (a terminal's
    foreground job, SIGHUP at its default even when the suite itself runs under nohup), once the child has printed
    "ready" (to train.log, through the runner)."""
    popen.setdefault("preexec_fn", lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    runner = [sys.executable, "-c", f"from pathlib import Path; from scripts.run import run_one; "
                                    f"run_one(42, Path({str(run)!r}), {child!r})"]
    proc = subprocess.Popen(runner, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)
    log = run / "train.log"
    deadline = time.time() + 60
    while time.time() < deadline and "ready" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.02)
    return proc


_SIGNAL_COUNTER = r"""
import signal, sys, time
got = []
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
print("ready", flush=True)
while not got:
    time.sleep(0.01)
time.sleep(0.5)  # any further signal of the same Ctrl-C arrives meanwhile
print("child got", got, flush=True)
"""


def test_row_runner_forwards_one_ctrl_c_to_its_child(tmp_path):
    """A terminal's Ctrl-C goes to the runner's whole process group. The child (base_train) must see it once: a
    second signal right after the first would be indistinguishable from "abort now". The runner then stops with
    a resumable message and does not go on to the next seed."""
    run = tmp_path / "seed42"
    child = [sys.executable, "-c", _SIGNAL_COUNTER]
    proc = start_runner(run, child)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert "child got ['SIGINT']" in out, out + err
    assert proc.returncode == 1 and "interrupted" in err and "resumed by re-running" in err


_SIGNAL_THEN_TALK = r"""
import signal, sys, time
got = []
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
print("ready", flush=True)
deadline = time.time() + 15  # bounded: a runner that never forwards anything must not leave it behind forever
while not got and time.time() < deadline:
    time.sleep(0.01)
for i in range(200):  # base_train's lines while it saves (the runner's terminal is gone by now)
    print(f"saving line {i}", flush=True)
print("child got", got, flush=True)
"""


def test_row_runner_whose_terminal_hangs_up_lets_its_child_save(tmp_path):
    """The terminal (an ssh session) closes: the runner gets SIGHUP and its stdout is gone. Its child (base_train)
    runs in a session of its own, so only the runner can tell it: it must get a SIGTERM (it saves and exits) and
    its output must still reach train.log, not kill it through a broken pipe. Before: the runner died of the
    SIGHUP, the child was not told and died at its next line with a BrokenPipeError (the steps since the last
    checkpoint lost, summary.json stale). ~1 s."""
    run = tmp_path / "seed42"
    child = [sys.executable, "-c", _SIGNAL_THEN_TALK]
    proc, log = start_runner(run, child), run / "train.log"
    proc.stdout.close()  # the terminal is gone: the runner's next line to it fails
    os.kill(proc.pid, signal.SIGHUP)
    err = proc.stderr.read()
    proc.wait(timeout=60)
    deadline = time.time() + 30  # (before the fix the child outlived the runner)
    while time.time() < deadline and "child got" not in log.read_text():
        time.sleep(0.05)
    text = log.read_text()
    assert "child got ['SIGTERM']" in text and "saving line 199" in text, text[-2000:] + err
    assert proc.returncode == 1 and "interrupted" in err and "resumed by re-running" in err, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_row_runner_under_nohup_keeps_training_when_its_terminal_closes(tmp_path):
    """`nohup python -m scripts.run ... &` ignores SIGHUP so the run outlives the terminal: the runner must not
    turn the hang-up into a SIGTERM for its child (it would stop training at the next step). ~2 s."""
    run = tmp_path / "seed42"
    child = [sys.executable, "-c", _SIGNAL_THEN_TALK.replace("time.time() + 15", "time.time() + 1.5")]
    proc = start_runner(run, child, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    log = run / "train.log"
    os.kill(proc.pid, signal.SIGHUP)
    out, err = proc.communicate(timeout=60)
    assert "child got []" in log.read_text() and proc.returncode == 0, log.read_text()[-500:] + err


_TALK_THEN_FINISH = r"""
import json, os, pathlib, sys, time
summary, closed = sys.argv[1:]
deadline = time.time() + 15  # bounded: until the runner's stdout is gone
while not os.path.exists(closed) and time.time() < deadline:
    time.sleep(0.01)
for i in range(200):
    print(f"step line {i}", flush=True)
pathlib.Path(summary).write_text(json.dumps({"stop_reason": "completed", "step": 9, "num_iterations": 9}))
"""


def test_row_runner_goes_on_to_the_next_seed_when_its_stdout_is_gone(tmp_path):
    """`python -m scripts.run ... | tee log` and tee is killed during the first seed (no hang-up): the runner's own
    lines (the next seed's, "done") must not kill it with a BrokenPipeError between seeds, nor its last flush print
    "Exception ignored". Both seeds run, exit 0, logs whole. Before: the next seed's line raised. ~1 s."""
    closed = tmp_path / "stdout-closed"
    runs = {seed: tmp_path / f"seed{seed}" for seed in (42, 43)}
    commands = [(seed, run, [sys.executable, "-c", _TALK_THEN_FINISH, str(run / "summary.json"), str(closed)])
                for seed, run in runs.items()]
    runner = [sys.executable, "-c", "import json, sys; from pathlib import Path; import scripts.run as r; "
              "r.build_commands = lambda *a: [(s, Path(d), c) for s, d, c in json.loads(sys.argv[1])]; "
              "r.check_train_flags = lambda commands: None; "  # the stand-ins are no base_train commands
              "r.main(['configs/mini/base.toml', '--seeds', '42,43', '--runs-root', sys.argv[2]])",
              json.dumps([(seed, str(run), cmd) for seed, run, cmd in commands]), str(tmp_path)]
    proc = subprocess.Popen(runner, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().startswith("[run] seed 42: ")
    proc.stdout.close()  # tee is gone
    closed.touch()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err
    for run in runs.values():
        assert (run / "train.log").read_text() == "".join(f"step line {i}\n" for i in range(200))
        assert json.loads((run / "summary.json").read_text())["stop_reason"] == "completed"


_RECORD_SIGTERM = r"""
import pathlib, signal, sys, time
mark = pathlib.Path(sys.argv[1])
# whole or absent (a rename): the test reads it as soon as it exists (an opened, unwritten file read as '' under
# xdist's load)
tmp = mark.with_suffix(".tmp")
signal.signal(signal.SIGTERM, lambda s, f: (tmp.write_text("SIGTERM"), tmp.replace(mark), sys.exit(0)))
print("ready", flush=True)
time.sleep(30)  # bounded: a runner that never tells it must not leave it behind for long
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_row_runner_killed_by_sigkill_stops_its_child(tmp_path):
    """A SIGKILLed runner runs no handler, so it cannot forward anything: the kernel must send the child (in a
    session of its own, so no process-group signal reaches it either) a SIGTERM, so base_train saves and stops
    instead of training on unseen until its next line hits the dead pipe. Before: the child slept its 30 s. ~1 s."""
    run, mark = tmp_path / "seed42", tmp_path / "child-got"
    proc = start_runner(run, [sys.executable, "-c", _RECORD_SIGTERM, str(mark)])
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.time() + 10
    while time.time() < deadline and not mark.exists():
        time.sleep(0.02)
    assert mark.exists() and mark.read_text() == "SIGTERM"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_whose_runner_died_before_it_could_ask_for_the_signal_stops(monkeypatch):
    """The runner can die between the fork and the child's prctl; the kernel then sends nothing, ever. The child
    sees a parent that is not the runner and stops before exec, as the SIGTERM would have stopped it."""
    from scripts.run import die_with_parent

    monkeypatch.setattr(os, "getpid", lambda: 1)  # "the runner" is a process that is not the child's parent
    preexec = die_with_parent()
    proc = subprocess.Popen([sys.executable, "-c", "print('ran')"], stdout=subprocess.PIPE, text=True,
                            preexec_fn=preexec)
    assert proc.communicate(timeout=60)[0] == "" and proc.returncode == 128 + signal.SIGTERM
