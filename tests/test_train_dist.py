"""Trainer under torchrun (gloo) and under signals; subprocess tests."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import torchrun_forked
from conftest import REPO, kill_tree, run_torchrun, torchrun_env
from nanochat import checkpoint as ckpt
from nanochat import optim_shard
from scripts import base_train
from test_train_e2e import TINY, losses

BATCH = ["--device-batch-size", "2", "--total-batch-size", "256"]


SCRIPT = REPO / "scripts" / "base_train.py"
# MoME with a table just large enough for the row-sharded (ZeRO-2) AdamW path (2048 x 32 = SHARD_MIN_NUMEL), so
# that it and the stacked Muon path both run
MOME = ["--memory", "mome", "--mome-slots", "8", "--mome-topk", "2"]


def assert_losses_close(a: dict, b: dict, steps: set) -> None:
    # Same rows per step by construction (SyntheticLoader); only the fp32 summation order of the gradient
    # average differs (micro-batch accumulation vs reduce-scatter, and the 1-process runs here use the test
    # process's 2 threads where torchrun's workers use 1), a ~1e-7 relative effect on the losses.
    # Not bit for bit by construction (test_distributed is, with a matching association): Adam/NorMuon amplify
    # last-bit differences of near-zero gradient elements, which a mean loss over 256 tokens barely feels.
    assert a.keys() == b.keys() == steps
    for s in a:
        assert abs(a[s] - b[s]) < 1e-5, (s, a[s], b[s])


MOE = ["--mlp", "moe", "--moe-experts", "4", "--moe-topk", "2"]
# Only MoME runs in the default suite (its time budget): VE's optimizer, data and checkpoint paths are MoME's;
# the appendix designs (checked by hand on 2026-11-23: 1 vs 2 processes within 3e-7) run with RUN_SLOW=1
SLOW_DESIGNS = {"ve": ["--memory", "ve"], "jtokm+moe": ["--memory", "jtokm", *MOE],
                "engram": ["--memory", "engram", "--engram-first-prime", "1000", "--engram-heads", "2",
                           "--engram-compression", "identity"],
                "move_input": ["--memory", "move_input"]}


def assert_weights_close(run_a, run_b, step: int) -> None:
    # Catches what the mean losses of a tiny model do not feel: a 1e-5 offset on one bucket's averaged gradient
    # moves 20% of the weights by more than 1e-5 after 1 step and 80% after 10 (measured), and leaves the losses
    # within 4e-6. Counted, not max: an element whose update sits on a threshold (cautious weight decay's sign
    # mask, e.g.) flips with the summation order of its gradient and then differs by ~3e-4 for good: 6 of 164k
    # elements after 10 steps, 2 vs 1 threads or processes (measured on AMD EPYC).
    a, b = (torch.load(ckpt.step_dir(r, step) / "model.pt") for r in (run_a, run_b))
    assert a.keys() == b.keys()
    moved = {k: int(((a[k].float() - b[k].float()).abs() > 1e-5).sum()) for k in a}
    total = sum(v.numel() for v in a.values())
    assert sum(moved.values()) < total / 1000, {k: v for k, v in moved.items() if v}


@pytest.mark.parametrize("memory", [*(pytest.param(v, marks=pytest.mark.slow, id=k) for k, v in SLOW_DESIGNS.items()),
                                    pytest.param(MOME, id="mome")])
def test_two_and_four_process_torchrun_match_one_process(tmp_path, memory):
    args = [*TINY, *BATCH, "--num-iterations", "10", *memory]  # 10 steps: issue 14's criterion
    runs = {}
    for nproc in (1, 2, 4):
        if nproc == 1:  # the reference, in this process: a torchrun start-up costs ~8 s of the 2 CI cores
            assert base_train.main([*args, "--run-dir", str(tmp_path / "w1")]) == 0
        else:
            r = run_torchrun(SCRIPT, nproc, [*args, "--run-dir", str(tmp_path / f"w{nproc}")])
            assert r.returncode == 0, r.stderr[-3000:]
        runs[nproc] = losses(tmp_path / f"w{nproc}")
        plan = json.loads((tmp_path / f"w{nproc}" / "plan.json").read_text())
        assert plan["world_size"] == nproc and plan["grad_accum_steps"] == 4 // nproc
    if memory is MOME:  # the table takes the row-sharded path (smaller ones join the all-reduced bucket)
        table = torch.load(ckpt.step_dir(tmp_path / "w1", 10) / "model.pt")["memory.tables.0.weight"]
        assert table.numel() >= optim_shard.SHARD_MIN_NUMEL and table.shape[0] >= 4
    for nproc in (2, 4):
        assert_losses_close(runs[1], runs[nproc], set(range(1, 11)))
        assert_weights_close(tmp_path / "w1", tmp_path / f"w{nproc}", 10)


def test_two_process_kill_and_resume_matches_one_process(tmp_path, capsys):
    """SIGKILL the whole 2-process job after a checkpoint, resume it: losses equal the 1-process run, and the
    sharded optimizer state saved by 2 ranks resumes on 1 rank only with --resume-new-world-size. With an MoE FFN:
    its balancing bias and load counters are state outside the parameters too. The 1-process runs run in this
    process (world size 1 as under a 1-process torchrun, without its ~8 s start-up)."""
    flags = [*TINY, *BATCH, *MOME, *MOE, "--num-iterations", "8", "--save-every", "2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert base_train.main([*flags, "--run-dir", str(ref)]) == 0
    env = torchrun_env()
    with open(os.devnull, "w") as devnull:
        proc = torchrun_forked.Launch(["--standalone", "--nproc_per_node=2", str(SCRIPT), *flags, "--run-dir",
                                       str(run)], cwd=REPO, env=env, stdout=devnull)
    deadline = time.time() + 300
    while time.time() < deadline and not (run / "checkpoints" / "step_000004").exists() and proc.poll() is None:
        time.sleep(0.05)
    # the launcher and both workers, mid-run: a killpg of the launcher's session missed the workers (torchrun starts
    # each in a session of its own), which then stopped by nanochat.launcher_watch, saving as on SIGTERM
    kill_tree(proc.pid)
    proc.wait(timeout=30)
    assert (run / "checkpoints" / "step_000004").exists()
    assert not (run / "summary.json").exists()  # really killed before the end
    # every rank is seeded with --seed and none draws alone, so the ranks' RNG states agree: the one a
    # --resume-new-world-size gives a new rank (old rank r mod old world size) is its peers' (train_resume.py)
    rng = ckpt.load_training_state(run, 4)["rng"]
    assert len(rng) == 2 and rng[0]["python"] == rng[1]["python"] and torch.equal(rng[0]["torch"], rng[1]["torch"])
    r = run_torchrun(SCRIPT, 2, [*flags, "--run-dir", str(run), "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert_losses_close(losses(run), losses(ref), set(range(1, 9)))
    # another world size: refused without the flag (exit 2, nothing trained), continues with it
    more = [*TINY, *BATCH, *MOME, *MOE, "--num-iterations", "8", "--run-dir", str(run)]
    capsys.readouterr()
    assert base_train.main([*more, "--resume", "6"]) != 0
    assert "--resume-new-world-size" in capsys.readouterr().err
    assert base_train.main([*more, "--resume", "6", "--resume-new-world-size"]) == 0
    assert "data order re-partitioned" in capsys.readouterr().out
    # the move is recorded: config.json says the world size of the last session, so it alone would hide it
    change = [{"step": 6, "checkpoint": 2, "now": 1}]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"kind": "resume", "step": 6, "world_size": {"checkpoint": 2, "now": 1}} in recs
    assert json.loads((run / "config.json").read_text())["world_size_changes"] == change
    assert json.loads((ckpt.step_dir(run, 8) / "meta.json").read_text())["config"]["world_size_changes"] == change
    # the model and optimizer continue exactly; the synthetic rows after the resume are the same ones here
    assert_losses_close(losses(run), losses(ref), set(range(1, 9)))


def test_sigterm_saves_and_resume_continues_exactly(tmp_path):
    run, ref = tmp_path / "sig", tmp_path / "ref"
    flags = [*TINY, *BATCH, "--num-iterations", "40"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "scripts.base_train", *flags, "--run-dir", str(run)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and 3 <= summary["step"] < 40, summary
    assert f"step_{summary['step']:06d}" in out and "continue with --resume" in out
    r = subprocess.run([*cmd, "--resume"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "scripts.base_train", *flags, "--run-dir", str(ref)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # interrupted + resumed == uninterrupted, bit for bit: both runs are one process with 1 thread on the same
    # machine, and the resume restores weights, optimizer state, RNG and loader position, so it replays the same
    # kernels on the same inputs (deterministic for a fixed thread count)
    assert losses(run) == losses(ref)
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "completed"


# the runs of nonfinite_runs' one launch, in order: _nonfinite_worker's leading flags for each
NONFINITE_RUNS = {"weights": [], "optimizer_state": ["--poison-optimizer"]}


@pytest.fixture(scope="module")
def nonfinite_runs(tmp_path_factory):
    """The NONFINITE_RUNS of _nonfinite_worker on 2 gloo ranks, both in one launch (--runs-out; each run whatever the
    other's code: every_run), where each had a launch of its own (~6 s of the CI's 2 cores apiece).
    {name: (its run dir, {rank: its exit code}, both ranks' output)}."""
    tmp = tmp_path_factory.mktemp("nonfinite")
    out = tmp / "out"
    out.mkdir()
    runs = [[*flags, *TINY, *BATCH, "--num-iterations", "4", "--save-every", "2", "--run-dir", str(tmp / name)]
            for name, flags in NONFINITE_RUNS.items()]
    argv = [arg for i, run in enumerate(runs) for arg in (["--next-run"] if i else []) + run]
    r = run_torchrun(REPO / "tests" / "_nonfinite_worker.py", 2, ["--runs-out", str(out), *argv])
    said = "".join(f"{p.name}:\n{p.read_text()[-2000:]}" for p in sorted(out.glob("*.out")))
    assert r.returncode == 0, said + r.stdout[-3000:] + r.stderr[-3000:]
    return {name: (tmp / name, {rank: int((out / f"run{n}.rank{rank}.code").read_text()) for rank in (0, 1)},
                   "".join((out / f"run{n}.rank{rank}.out").read_text() for rank in (0, 1)))
            for n, name in enumerate(NONFINITE_RUNS)}


def test_nonfinite_weights_on_one_rank_stop_every_rank_without_saving(nonfinite_runs):
    """The finite check at save time is all-reduced: rank 1's non-finite weights stop rank 0 too (no hang, no
    checkpoint written from rank 0's finite view)."""
    run, codes, out = nonfinite_runs["weights"]
    assert codes[0] != 0 and codes[1] != 0, (codes, out[-3000:])
    assert "non-finite values after step 2 in another rank" in out, out[-3000:]
    assert "No checkpoint was saved before it" in out
    assert ckpt.list_steps(run) == []
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "nonfinite_params"


def test_nonfinite_optimizer_state_in_one_ranks_shard_stops_every_rank_without_saving(nonfinite_runs):
    """Every rank checks its own optimizer shards at a save (rank 0 no longer gathers the whole state to check
    it): a NaN in a Muon matrix only rank 1 holds state for stops both ranks, rank 0 saying another rank."""
    run, codes, out = nonfinite_runs["optimizer_state"]
    assert codes[0] != 0 and codes[1] != 0, (codes, out[-3000:])
    assert "non-finite values after step 2 in another rank" in out, out[-3000:]
    assert ckpt.list_steps(run) == []
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "nonfinite_params"


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_stop_signal_repeated_sigterm_still_saves():
    """A scheduler's cancel reaches a worker twice within milliseconds (its own SIGTERM and torchrun's forwarded
    one): the latch keeps the request to save; only a later Ctrl-C aborts at once."""
    from nanochat.train_loop import StopSignal

    clock = _Clock()
    stop = StopSignal(clock)
    stop._handle(signal.SIGTERM, None)
    clock.now += 0.01
    stop._handle(signal.SIGTERM, None)
    clock.now += 30.0
    stop._handle(signal.SIGTERM, None)  # repeated SIGTERMs never abort: the scheduler's SIGKILL is the deadline
    assert stop.received == "SIGTERM"
    stop = StopSignal(clock)
    stop._handle(signal.SIGINT, None)
    stop._handle(signal.SIGINT, None)  # the same Ctrl-C delivered twice (terminal + launcher): not an abort
    assert stop.received == "SIGINT"
    clock.now += stop.abort_after_s
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)  # a second, later Ctrl-C


def test_sigterm_to_launcher_and_workers_saves(tmp_path):
    """Slurm's scancel / time limit: SIGTERM to torchrun and to every worker (each process of the job; torchrun
    starts its workers in sessions of their own, so a process-group kill would miss them), and torchrun forwards
    one more, so each worker gets two SIGTERMs. The run still saves a checkpoint and a resumable summary."""
    run = tmp_path / "r"
    env = torchrun_env()
    log = tmp_path / "torchrun.log"
    with open(log, "w") as f:
        proc = torchrun_forked.Launch(["--standalone", "--nproc_per_node=2", str(SCRIPT), *TINY, *BATCH,
                                       "--num-iterations", "400", "--run-dir", str(run)], cwd=REPO, env=env, stdout=f)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    for pid in [proc.pid, *map(int, workers)]:
        os.kill(pid, signal.SIGTERM)
    proc.wait(timeout=300)
    out = log.read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and 3 <= summary["step"] < 400, out[-3000:]
    assert ckpt.list_steps(run) == [summary["step"]], out[-3000:]
    assert "KeyboardInterrupt" not in out


# The runs of _final_eval_signal_worker that end well, in the module's one launch (final_eval_signal_runs): SIGTERM on
# these ranks in the final evaluation's val bpb, or in its CORE task a (each then followed by its --resume), or after
# the last step (--after-last-step)
VAL_BPB_SIGNAL_RANKS = ("1", "0,1")
CORE_SIGNAL_RANKS = ("1", "0,1")
LAST_STEP_SIGNAL_RANKS = ("1",)
WHERE_FLAGS = {"val_bpb": [], "core": ["--in-core"], "last_step": ["--after-last-step"]}  # the worker's, per part


@pytest.fixture(scope="module")
def final_eval_signal_runs(tmp_path_factory):
    """The runs of VAL_BPB_SIGNAL_RANKS, LAST_STEP_SIGNAL_RANKS and CORE_SIGNAL_RANKS
    (test_a_signal_at_the_final_evaluation_..., and test_a_resume_on_two_ranks_reuses_...), all in one launch
    (_final_eval_signal_worker --runs-out), where each had a launch of its own (~4 s of the CI's 2 cores apiece).
    {(part, ranks): (run dir, [for each of its runs, a copy of the run dir as that run left it])}; each run's output
    is beside its copy (output_of)."""
    tmp = tmp_path_factory.mktemp("final_eval_signal")
    out, each_run, runs = tmp / "out", [], {}
    out.mkdir()
    for part, ranks in [*(("val_bpb", r) for r in VAL_BPB_SIGNAL_RANKS), *(("core", r) for r in CORE_SIGNAL_RANKS),
                        *(("last_step", r) for r in LAST_STEP_SIGNAL_RANKS)]:
        run = tmp / f"{part}_{ranks}"
        args = [*TINY, *BATCH, "--num-iterations", "3", *(["--final-core"] if part == "core" else []),
                "--run-dir", str(run)]
        these = [["--sigterm-ranks", ranks, *WHERE_FLAGS[part], *args]]
        if part == "core":
            these.append(["--sigterm-ranks", "", "--in-core", *args, "--resume"])
        runs[part, ranks] = (run, [out / f"run{len(each_run) + i}" for i in range(len(these))])
        each_run += these
    argv = [arg for i, one in enumerate(each_run) for arg in (["--next-run"] if i else []) + one]
    r = run_torchrun(REPO / "tests" / "_final_eval_signal_worker.py", 2, ["--runs-out", str(out), *argv])
    outputs = "".join(f"{p.name}:\n{p.read_text()[-2000:]}" for p in sorted(out.glob("*.out")))
    assert r.returncode == 0, outputs + r.stderr[-3000:]
    return runs


def output_of(kept) -> str:
    """Both ranks' output of one run of final_eval_signal_runs (rank 0's, then rank 1's)."""
    return "".join((kept.parent / f"{kept.name}.rank{rank}.out").read_text() for rank in (0, 1))


@pytest.mark.parametrize("part, ranks", [("val_bpb", "1"),
                                         # slow: the vote (an all-reduce MAX of the ranks' latched signals) is the
                                         # same on every rank; a rank learning the signal from the vote is covered
                                         # by "val_bpb-1" (rank 0, the writer, at that), rank 0's own signal by "0,1"
                                         pytest.param("val_bpb", "0", marks=pytest.mark.slow),
                                         ("val_bpb", "0,1"), ("last_step", "1")])
def test_a_signal_at_the_final_evaluation_on_two_ranks_writes_the_summary(tmp_path, request, part, ranks):
    """_final_eval_signal_worker: SIGTERM reaches one rank (either) or both during the final evaluation's val bpb.
    Every rank must take the same branch (one that leaves while the other waits in the evaluation's collectives
    fails under gloo and hangs under NCCL): the ranks vote at each batch and stop at the same one.
    --after-last-step (last_step): SIGTERM reaches rank 1 only, after the last step's stop vote; the vote before the
    final evaluation skips it on every rank. Either way summary.json says so, with the signal even where rank 0
    (which writes it) got none, the checkpoint is whole, and every worker exits 0 (final_eval_signal_runs' launch
    ends 0 only if each of its runs did)."""
    if ranks in {"val_bpb": VAL_BPB_SIGNAL_RANKS, "last_step": LAST_STEP_SIGNAL_RANKS}[part]:
        run, (kept,) = request.getfixturevalue("final_eval_signal_runs")[part, ranks]
        stdout = output_of(kept)
    else:
        run = tmp_path / "r"
        r = run_torchrun(REPO / "tests" / "_final_eval_signal_worker.py", 2,
                         ["--sigterm-ranks", ranks, *WHERE_FLAGS[part], *TINY, *BATCH, "--num-iterations", "3",
                          "--run-dir", str(run)])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        stdout = r.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["interrupted_during"], summary["training_stop_reason"],
            summary["signal"]) == ("interrupted", "final_eval", "completed", "SIGTERM"), summary
    assert "val_bpb" not in summary and ckpt.list_steps(run) == [3]
    stops = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "stop"]
    assert stops == [{"kind": "stop", "step": 3, "reason": "interrupted", "during": "final_eval",
                      "signal": "SIGTERM"}]
    assert "interrupted (SIGTERM) during the final evaluation of step 3" in stdout
    model, meta = ckpt.load_model(run, 3)  # the final checkpoint is whole: it loads, strictly, and is finite
    assert meta["step"] == 3 and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("ranks", CORE_SIGNAL_RANKS)
def test_a_resume_on_two_ranks_reuses_the_finished_parts_of_the_final_evaluation(final_eval_signal_runs, ranks):
    """_final_eval_signal_worker --in-core: SIGTERM (rank 1 alone, or both) in the final evaluation's second part
    (a stand-in CORE task a, after the val bpb). Every rank stops once task a is kept; a --resume on two ranks
    reuses the val bpb and task a on every rank alike (rank 0 decides, broadcast: a rank that computed a part alone
    would wait in its all-reduce) and computes task b, then deletes the partial file."""
    run, (stopped, resumed) = final_eval_signal_runs["core", ranks]
    first = json.loads((stopped / "summary.json").read_text())
    assert (first["interrupted_during"], first["signal"]) == ("final_eval", "SIGTERM") and "core" not in first
    assert sorted(json.loads((stopped / "final_eval.partial.json").read_text())["items"]) == ["a", "split val"]
    out = output_of(resumed)
    assert sorted(re.findall(r"rank \d scores task \w", out)) == ["rank 0 scores task b", "rank 1 scores task b"]
    assert out.count("reused from") == 1 and "final evaluation parts: 2 of 3 reused" in out
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["val_bpb"]) == ("completed", first["val_bpb"])
    assert (summary["core"], summary["core_tasks"]) == (0.75, {"a": {"accuracy": 0.75}, "b": {"accuracy": 0.75}})
    assert not (run / "final_eval.partial.json").exists()


def test_a_full_disk_in_the_final_evaluation_stops_both_ranks_alike_with_a_signal_on_one(tmp_path, monkeypatch):
    """_final_eval_signal_worker --in-core, FULL_DISK_IN_TASK_A: SIGTERM reaches rank 1 in task a, and rank 0's
    write that keeps task a fails (a full disk). The write error is raised on every rank together (rank0_decides):
    every rank must stop with it, exit 2 and final_eval_write_error, not rank 1 alone take the signal's branch
    (exit 0) while rank 0 waits for it in the error's barrier."""
    monkeypatch.setenv("FULL_DISK_IN_TASK_A", "1")
    run = tmp_path / "r"
    r = run_torchrun(REPO / "tests" / "_final_eval_signal_worker.py", 2,
                     ["--sigterm-ranks", "1", "--in-core", *TINY, *BATCH, "--num-iterations", "3", "--final-core",
                      "--run-dir", str(run)])
    out = r.stdout + r.stderr
    assert r.returncode != 0
    # no worker traceback (torchrun prints its own ChildFailedError one for any failed worker)
    assert "]: Traceback" not in out and "in evaluate_at_the_end" not in out, out[-3000:]
    assert "exitcode  : 2 " in r.stderr and "exitcode  : 1 " not in r.stderr, out[-3000:]
    assert out.count("No space left on device") == 1 and "continue with --resume" in out, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "final_eval_write_error" and "val_bpb" in summary, summary
    assert sorted(json.loads((run / "final_eval.partial.json").read_text())["items"]) == ["split val"]


# "last-micro-step" and "both-ranks" are slow: the processes stop alike in every case ("first-micro-step" keeps the
# launch: exit 2, the summary, the checkpoints), and what the two add (the stand-in batch in the micro-step whose
# backward launches the gradient hooks' collectives; the lowest failing rank named) is train_step's collective
# logic, checked on 2 thread ranks by test_a_data_error_in_any_micro_step_of_any_rank_is_raised_on_every_rank
@pytest.mark.parametrize("fail_at, fail_ranks, named", [(4, "1", 1), pytest.param(5, "1", 1, marks=pytest.mark.slow),
                                                        pytest.param(4, "0,1", 0, marks=pytest.mark.slow)],
                         ids=["first-micro-step", "last-micro-step", "both-ranks"])
def test_a_data_error_on_one_rank_stops_every_rank_with_data_error(tmp_path, monkeypatch, fail_at, fail_ranks, named):
    """A data file only rank 1 reads fails mid-step (each rank reads its own row groups): the other rank, already in
    that step's collectives, must not crash on a closed connection (or hang, under NCCL). Every rank stops at the same
    step, exit 2, rank 0 names rank 1's file, summary.json says data_error and no checkpoint of the broken step. The
    same in the step's last micro-step (the gradient hooks are armed right after the stand-in batch), and when both
    ranks fail (the lowest rank's error is named)."""
    monkeypatch.setenv("FAIL_AT", str(fail_at))
    monkeypatch.setenv("FAIL_RANKS", fail_ranks)
    run = tmp_path / "r"
    r = run_torchrun(REPO / "tests" / "_one_rank_data_error_worker.py", 2,
                     [*TINY, *BATCH, "--num-iterations", "6", "--save-every", "2", "--run-dir", str(run)])
    out = r.stdout + r.stderr
    assert r.returncode != 0
    # no worker traceback (torchrun prints its own ChildFailedError one for any failed worker)
    assert "Connection closed by peer" not in out and "]: Traceback" not in out, out[-3000:]
    assert "exitcode  : 2 " in r.stderr and "exitcode  : 1 " not in r.stderr, out[-3000:]
    assert f"rank {named} of 2: /data/train_00042.parquet: row group 7 cannot be read" in r.stderr, out[-3000:]
    assert "training stopped during step 3; last checkpoint: step 2" in r.stderr, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["step"]) == ("data_error", 2), summary
    assert ckpt.list_steps(run) == [2]


@pytest.mark.parametrize("fail_micro, fail_ranks, named", [(0, (1,), 1), (1, (1,), 1), (0, (0, 1), 0), (1, (0, 1), 0)],
                         ids=["first-micro-step", "last-micro-step", "both-ranks", "both-ranks-last-micro-step"])
def test_a_data_error_in_any_micro_step_of_any_rank_is_raised_on_every_rank(fail_micro, fail_ranks, named):
    """train_step on 2 thread ranks (tests/_thread_ranks.py), 2 micro-steps, a loader that raises DataError in the
    second step's micro-step ``fail_micro`` on ``fail_ranks``: the failing rank finishes the step on the stand-in
    batch, in the first micro-step or in the last (whose backward launches the gradient hooks' collectives), no rank
    hangs, and every rank raises the lowest failing rank's DataError, named. The collective logic of
    test_a_data_error_on_one_rank_stops_every_rank_with_data_error's cases, without a launch each."""
    from contextlib import nullcontext

    from _thread_ranks import BUILD_LOCK, run_ranks
    from conftest import tiny_config
    from nanochat.dataset import DataError
    from nanochat.gpt import build_model
    from nanochat.optim import build_optimizer
    from nanochat.train_loop import SyntheticLoader, train_step

    def rank_main(rank: int, world: int) -> str:
        with BUILD_LOCK:  # one global RNG for every thread
            model = build_model(tiny_config(sequence_len=16, vocab_size=256, n_embd=64), seed=0)
        optimizer = build_optimizer(model)
        loader = SyntheticLoader(256, 2, 16, rank=rank, world_size=world)

        def batches():
            for count in range(4):
                if count == 2 + fail_micro and rank in fail_ranks:
                    raise DataError(f"/data/train_0004{rank}.parquet: row group 7 cannot be read")
                yield next(loader)

        batch = batches()
        train_step(model, optimizer, batch, 2, nullcontext(), "cpu", batch_shape=(2, 16))  # the first step reads well
        with pytest.raises(DataError) as raised:
            train_step(model, optimizer, batch, 2, nullcontext(), "cpu", batch_shape=(2, 16))
        return str(raised.value)

    said = run_ranks(2, rank_main)
    assert said == [f"rank {named} of 2: /data/train_0004{named}.parquet: row group 7 cannot be read"] * 2, said


def test_a_checkpoint_write_error_on_rank0_stops_every_rank_with_checkpoint_error(tmp_path):
    """Rank 0 writes checkpoints alone; a write that fails (full disk) stops every rank together: exit 2 with the
    error, summary.json says checkpoint_error at that step, the last whole checkpoint stays and the half-written one
    is removed at once (on a full disk its bytes would keep summary.json from being written)."""
    run = tmp_path / "r"
    flags = [*TINY, *BATCH, "--num-iterations", "6", "--save-every", "2", "--run-dir", str(run)]
    r = run_torchrun(REPO / "tests" / "_checkpoint_write_error_worker.py", 2, flags)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "Connection closed by peer" not in out and "]: Traceback" not in out, out[-3000:]
    assert "exitcode  : 2 " in r.stderr and "exitcode  : 1 " not in r.stderr, out[-3000:]
    assert "could not write checkpoint step 4" in r.stderr and "No space left on device" in r.stderr, out[-3000:]
    assert "last checkpoint: step 2" in r.stderr, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["step"]) == ("checkpoint_error", 4), summary
    assert ckpt.list_steps(run) == [2] and ckpt.sweep_leftovers(run) == []


def test_the_stand_in_batch_keeps_the_compiled_model_from_recompiling(monkeypatch):
    """A rank whose loader failed finishes the step on a stand-in batch while the other ranks wait in its collectives:
    inputs and targets must be two tensors, as real batches are (one tensor as both would fail dynamo's guard on
    aliased inputs and recompile the model on that rank alone, mid-step)."""
    from torch._dynamo.testing import CompileCounter

    from nanochat import train_loop
    from nanochat.dataset import DataError

    def broken_loader():
        raise DataError("/data/train_00042.parquet: cannot be read")
        yield

    torch._dynamo.reset()
    counter = CompileCounter()
    model = torch.compile(lambda x, y: (x * 2 + y).sum(), backend=counter, dynamic=False)
    model(torch.randint(0, 9, (2, 8)), torch.randint(0, 9, (2, 8)))
    monkeypatch.setattr(train_loop, "is_dist", lambda: True)
    failed = []
    x, y = train_loop._batch_or_stand_in(broken_loader(), (2, 8), "cpu", failed)
    assert [type(e) for e in failed] == [DataError]
    assert x.shape == y.shape == (2, 8) and x.dtype == y.dtype == torch.long and not (x.any() or y.any())
    model(x, y)
    assert counter.frame_count == 1


def test_a_set_up_error_every_rank_raises_is_printed_once(tmp_path):
    """No tokenizer under torchrun (2 gloo ranks): every rank raises rank 0's error together (every_rank_ok); rank 0
    alone prints it, every rank exits 2 and none hangs. Before: one copy of the line per rank."""
    (tmp_path / "tok").mkdir()
    real_data = [flag for flag in TINY if flag != "--synthetic-data"]
    r = run_torchrun(SCRIPT, 2, [*real_data, *BATCH, "--tokenizer-dir", str(tmp_path / "tok"),
                                 "--data-dir", str(tmp_path / "data"), "--run-dir", str(tmp_path / "r")])
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert out.count("no tokenizer in") == 1 and f"error: rank 0 of 2: no tokenizer in {tmp_path / 'tok'}" in r.stderr, \
        out[-3000:]
    assert "exitcode  : 2 " in r.stderr and "exitcode  : 1 " not in r.stderr, out[-3000:]
    assert "]: Traceback" not in out, out[-3000:]
