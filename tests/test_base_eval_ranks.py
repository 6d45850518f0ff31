"""base_eval under torchrun (2 gloo ranks): a signal, a stop vote, one rank's bad data or full disk stop every
rank at the same point with one line, and an interrupted evaluation continues on both ranks."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import base_eval_fixtures  # noqa: E402

tiny_run = base_eval_fixtures.tiny_run  # the fixture (module scope: one tiny trained run for this file)


@pytest.mark.slow
@pytest.mark.parametrize("signalled", ["0,1", "1"])
def test_two_ranks_continue_an_interrupted_eval(tiny_run, tmp_path, signalled):
    """Under torchrun (2 gloo ranks) SIGTERM on every rank, or on rank 1 alone, during the second CORE task: every
    rank stops at the same point (once the task's examples are prepared, a set-up step), exit with one line (rank
    0's, with the signal rank 1 got), the first task kept; the rerun reuses it on both ranks (rank 0 decides) and
    finishes. Slow: two torchrun launches, ~30 s on 2 cores."""
    from conftest import run_torchrun

    root, _, _, bundle = tiny_run
    worker = Path(__file__).parent / "_base_eval_worker.py"
    args = ["--run-dir", str(root / "run"), "--bundle", str(bundle), "--eval", "core", "--no-progress",
            "--device-type", "cpu", "--out-dir", str(tmp_path / "o")]
    res = run_torchrun(worker, 2, ["--sigterm-at-task", "1", signalled, *args])
    assert res.returncode != 0 and res.stderr.count("base_eval: interrupted (SIGTERM)") == 1, res.stderr[-3000:]
    assert "exitcode  : 143" in res.stderr and "exitcode  : 1 " not in res.stderr, res.stderr[-3000:]
    saved = json.loads((tmp_path / "o" / "core.partial.json").read_text())
    assert list(saved["items"]) == ["mc"] and saved["settings"]["world_size"] == 2
    res = run_torchrun(worker, 2, args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "CORE tasks: 1 of 2 reused from" in res.stdout, res.stdout + res.stderr
    core = json.loads((tmp_path / "o" / "core.json").read_text())
    assert (core["tasks"]["mc"]["n"], core["tasks"]["lm"]["n"]) == (4, 3)
    assert not (tmp_path / "o" / "core.partial.json").exists()


def test_the_stop_vote_stops_every_rank_at_the_same_batch(gloo_checks):
    """nanochat.eval_resume.stop_voted on 2 gloo ranks: ranks with different batch counts (one with none) all see
    their own batches and finish together; a SIGTERM latched on one rank (between two votes, or after that rank's
    last batch) ends the loop on both at the next vote, with the same Interrupted. _stop_vote_worker.py's
    scenarios, in the session's shared 2-rank launch (conftest.gloo_checks)."""
    assert json.loads((gloo_checks / "eval_stop_votes.json").read_text()) == {
        "uneven, no signal": [[[0, 1, 2, 3, 4], "finished"], [[0, 1, 2], "finished"]],
        "one rank empty": [[[], "finished"], [[0, 1], "finished"]],
        # votes before batches 0 and 2 (every 2nd): the signal during batch 1 stops both before batch 2
        "rank 1 signalled between votes": [[[0, 1], "SIGTERM"], [[0, 1], "SIGTERM"]],
        "rank 0 signalled after its last batch": [[[0, 1], "SIGTERM"], [[0, 1], "SIGTERM"]],
    }


def test_a_signal_during_set_up_stops_every_rank_right_after_that_step(gloo_checks):
    """Set-up steps of an evaluation (every_rank_ok, rank0_decides) on 2 gloo ranks under interrupts_raise: a signal
    latched on one rank during a step (or, for rank0_decides, on a rank that does not run fn) ends the evaluation on
    every rank right after that step, with the same Interrupted (the larger signal number when ranks got different
    ones, as the stop vote), not at the first batch's vote. An error in fn is raised first (the signal stays latched
    and stops the next step). Without a signal the results are those of today; in training's set-up (StopSignal,
    no interrupts_raise) a signal changes nothing there, in its final evaluation (StopSignal.interrupts) it stops
    every rank as in base_eval. _setup_stop_worker.py's scenarios, in the session's shared 2-rank launch
    (conftest.gloo_checks)."""
    stopped_after_step = [["step done"], "SIGTERM"]
    assert json.loads((gloo_checks / "eval_setup_stops.json").read_text()) == {
        "no signal": [[[0, "rank 0's choice", True], "finished"], [[10, "rank 0's choice", False], "finished"]],
        "every_rank_ok, rank 1 signalled": [stopped_after_step, stopped_after_step],
        "every_rank_ok, rank 0 signalled": [stopped_after_step, stopped_after_step],
        "rank0_decides, rank 0 signalled in fn": [stopped_after_step, [[], "SIGTERM"]],
        "rank0_decides, rank 1 signalled before": [[[], "SIGTERM"], [[], "SIGTERM"]],
        "different signals": [stopped_after_step, stopped_after_step],  # SIGINT on rank 0, SIGTERM on rank 1
        "every_rank_ok error and a signal": [[["FileNotFoundError: rank 0 of 2: gone"], "SIGTERM"]] * 2,
        "rank0_decides error and a signal": [[["FileNotFoundError: gone"], "SIGTERM"]] * 2,
        "a later signal changes nothing": [[["step done", "stopped (SIGTERM); latched 15", "SIGINT ignored"],
                                            "SIGTERM"]] * 2,
        "training set-up, rank 1 signalled": [[["step done", 0, "rank 0's choice"], "received None"],
                                              [["step done", 10, "rank 0's choice"], "received SIGTERM"]],
        "training's final evaluation, rank 1 signalled": [[["step done"], "SIGTERM; received None"],
                                                          [["step done"], "SIGTERM; received SIGTERM"]],
    }


def test_a_signal_during_set_up_in_one_process_raises_at_once():
    """One process (no torch.distributed): every_rank_ok and rank0_decides are fn itself, so the signal raises in
    fn, where it arrives, as before."""
    import os
    import signal

    from nanochat.common import every_rank_ok, rank0_decides
    from nanochat.eval_resume import Interrupted, interrupts_raise

    for helper in (every_rank_ok, rank0_decides):
        seen = []

        def step():
            os.kill(os.getpid(), signal.SIGTERM)
            seen.append("after the signal")

        with interrupts_raise(), pytest.raises(Interrupted, match="SIGTERM"):
            helper(step)
        assert seen == [], helper


@pytest.mark.slow
@pytest.mark.parametrize("step,signalled", [("scripts.base_eval:load_chosen_checkpoint", "1"),
                                            ("nanochat.run_dir:RunDirLock.acquire", "0")])
def test_two_ranks_stop_after_the_set_up_step_a_signal_came_in(tiny_run, tmp_path, step, signalled):
    """Under torchrun (2 gloo ranks) SIGTERM on one rank while it loads the checkpoint (every_rank_ok), or on rank 0
    while it takes the output directory's lock (rank0_decides): every rank stops right after that step, before the
    first CORE task, with one line (rank 0's) and exit code 143 on both; the lock is released. Slow: two torchrun
    launches, ~13 s on 2 cores."""
    from conftest import run_torchrun

    from nanochat.run_dir import LOCK_FILE

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"
    res = run_torchrun(Path(__file__).parent / "_base_eval_worker.py", 2,
                       ["--sigterm-in", step, signalled, "--run-dir", str(root / "run"), "--bundle", str(bundle),
                        "--eval", "core", "--no-progress", "--device-type", "cpu", "--out-dir", str(out)])
    assert res.returncode != 0, res.stderr[-3000:]
    assert res.stderr.count("base_eval: interrupted (SIGTERM) before anything was evaluated") == 1, res.stderr[-3000:]
    assert res.stderr.count("base_eval: interrupted") == 1, res.stderr[-3000:]
    assert "exitcode  : 143" in res.stderr and "exitcode  : 1 " not in res.stderr, res.stderr[-3000:]
    # torchrun ends a rank still exiting when the other one has exited (-15); none may die of SIGABRT at its exit
    assert "SIGABRT" not in res.stderr and "terminate called" not in res.stderr, res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == []  # no partial results, no lock left behind
    assert not (out / LOCK_FILE).exists()


def test_a_data_shard_one_rank_cannot_read_stops_every_rank_with_its_error(tiny_run, tmp_path):
    """Under torchrun (2 gloo ranks) rank 1 alone reads a truncated copy of the val shard (a node's corrupt local
    data) while the bpb rows are tokenized: every rank stops with rank 1's DataError naming the file, exit 2, no
    traceback. Before: rank 1 died with a traceback and rank 0 crashed in the next exchange ('Connection closed by
    peer'; under NCCL a hang until the timeout). One torchrun, ~5 s."""
    from conftest import run_torchrun

    from nanochat.run_dir import LOCK_FILE

    root, _, _, _ = tiny_run
    out = tmp_path / "o"
    res = run_torchrun(Path(__file__).parent / "_base_eval_worker.py", 2,
                       ["--truncated-shard-on", "1", "--run-dir", str(root / "run"), "--eval", "bpb", "--splits", "val",
                        "--eval-tokens", "256", "--no-progress", "--device-type", "cpu", "--out-dir", str(out)])
    assert res.returncode != 0, res.stderr[-3000:]
    assert "error: rank 1 of 2: " in res.stderr and "val_000.parquet is not a readable parquet file" in res.stderr, \
        res.stderr[-3000:]
    # every rank raised rank 1's error together (every_rank_ok): rank 0 alone prints it
    assert res.stderr.count("val_000.parquet is not a readable parquet file") == 1, res.stderr[-3000:]
    # (torchrun ends a rank still exiting when the other one has exited: -15)
    assert "exitcode  : 2" in res.stderr and "exitcode  : 1 " not in res.stderr, res.stderr[-3000:]
    assert "Connection closed by peer" not in res.stderr and "]: Traceback" not in res.stderr, res.stderr[-3000:]
    assert not (out / LOCK_FILE).exists() and not (out / "bpb.json").exists()


FULL_DISK_CASES = [("core.partial.json", None), ("bpb.json", "2 core, 1 bpb")]


# "bpb.json" is slow: the ranks stop alike whichever file rank 0 fails to write ("core.partial.json" keeps the launch:
# exit 2, no broken connection, no traceback); what it adds, the kept line counting only what reached the disk, is
# rank 0's alone, checked in one process for both files by test_a_full_disk_under_out_dir_in_one_process_...
@pytest.mark.parametrize("name,kept", [FULL_DISK_CASES[0], pytest.param(*FULL_DISK_CASES[1], marks=pytest.mark.slow)])
def test_a_full_disk_under_out_dir_stops_every_rank_with_one_error(tiny_run, tmp_path, name, kept):
    """Under torchrun (2 gloo ranks) rank 0's disk fills up while it writes the first finished CORE task, or the
    last report (bpb.json): every rank stops with one error naming the file and the OSError, exit 2; no temp file
    is left and a line on what was kept counts only what reached the disk. Before: an OSError traceback on rank 0 and
    'Connection closed by peer' on rank 1 (NCCL: a hang), or rank 1 exiting 0; a torn .tmp left behind; "1 core"
    said kept when nothing was. ~5 s each."""
    from conftest import run_torchrun

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"
    res = run_torchrun(Path(__file__).parent / "_base_eval_worker.py", 2,
                       ["--enospc-writing", name, "--run-dir", str(root / "run"), "--bundle", str(bundle),
                        "--splits", "val", "--eval-tokens", "256", "--no-progress", "--device-type", "cpu",
                        "--out-dir", str(out)])
    assert res.returncode != 0, res.stderr[-3000:]
    assert f"{out / name}" in res.stderr and "No space left on device" in res.stderr, res.stderr[-3000:]
    # (torchrun ends a rank still exiting when the other one has exited: -15)
    assert "exitcode  : 2" in res.stderr and "exitcode  : 1 " not in res.stderr, res.stderr[-3000:]
    assert "Connection closed by peer" not in res.stderr and "]: Traceback" not in res.stderr, res.stderr[-3000:]
    if kept:
        assert f"finished results ({kept}) are kept" in res.stderr, res.stderr[-3000:]
    else:  # nothing reached the disk: no line says otherwise
        assert "are kept" not in res.stderr and not (out / name).exists(), res.stderr[-3000:]
    assert not list(out.glob("*.tmp"))


@pytest.mark.parametrize("name,kept", FULL_DISK_CASES)
def test_a_full_disk_under_out_dir_in_one_process_keeps_and_says_only_what_reached_the_disk(tiny_run, tmp_path,
                                                                                           monkeypatch, capsys, name,
                                                                                           kept):
    """test_a_full_disk_under_out_dir_stops_every_rank_with_one_error's disk in one process (the kept line is rank
    0's): the disk fills up while the first finished CORE task or the last report (bpb.json) is written (half of it
    to the temp name, then ENOSPC, as _base_eval_worker --enospc-writing): exit 2, one error naming the file and the
    OSError, no traceback, no temp file left, and the line on what was kept counts only what reached the disk."""
    import errno
    import os

    from nanochat.jsonfile import is_temp_for
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"
    real = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name == name or is_temp_for(self.with_name(name), self):
            real(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    code = main(["--run-dir", str(root / "run"), "--bundle", str(bundle), "--splits", "val", "--eval-tokens", "256",
                 "--no-progress", "--device-type", "cpu", "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert f"{out / name}" in err and "No space left on device" in err and "Traceback" not in err, err[-3000:]
    if kept:
        assert f"finished results ({kept}) are kept" in err, err[-3000:]
    else:  # nothing reached the disk: no line says otherwise
        assert "are kept" not in err and not (out / name).exists(), err[-3000:]
    assert not list(out.glob("*.tmp"))
