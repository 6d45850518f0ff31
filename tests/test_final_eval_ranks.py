"""The final evaluation failing under torchrun (gloo, 2 ranks) with a signal latched on some rank: every rank takes
the same branch (nanochat.final_eval.agreed_failure_branch), and an error on one rank still ends the job at once. An
error's branch writes summary.json (final_eval_error, from rank 0) without a collective, whichever rank failed."""

import json
import re
import time

import pytest

from conftest import REPO, run_torchrun
from test_train_dist import BATCH
from test_train_e2e import TINY

WORKER = REPO / "tests" / "_final_eval_error_worker.py"


def run_worker(tmp_path, monkeypatch, fail: str, sigterm: str, **env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    run = tmp_path / "r"
    started = time.monotonic()
    r = run_torchrun(WORKER, 2, ["--fail-ranks", fail, "--sigterm-ranks", sigterm, *TINY, *BATCH,
                                 "--num-iterations", "3", "--run-dir", str(run)])
    # findall, not lines, and the worker's ';' ends each branch: two ranks' lines may still run together
    branches = dict(re.findall(r"rank (\d) final evaluation: ((?:raised|returned) \w+);", r.stdout))
    return r, run, branches, time.monotonic() - started


# "0" is slow: agreed_failure_branch does not depend on the rank; a rank without a signal deciding "failed" at once
# while the other (with one) waits for every rank's post is covered by "1", rank 0 holding a signal (its summary
# without it) by "0,1"
@pytest.mark.parametrize("sigterm", ["1", pytest.param("0", marks=pytest.mark.slow), "0,1"])
def test_an_error_on_every_rank_fails_every_rank_whichever_has_a_signal(tmp_path, monkeypatch, sigterm):
    """A broken eval bundle raises on both ranks at the same point, while SIGTERM is latched on one rank (either) or
    both. Each rank used to pick its branch by its own signal: the rank with one reported "interrupted" (rank 0:
    summary.json said so, exit 0), the other raised (exit 1), and torchrun killed whichever was left. Every rank
    must raise the error: it is what a --resume would meet again."""
    # a wait of 100 s, not the product's 10 s: a rank lagging > 10 s on a loaded machine would take the signal's
    # branch by design; the wait ends as soon as the other rank's word arrives, so the normal case is not slower
    r, run, branches, _ = run_worker(tmp_path, monkeypatch, "0,1", sigterm, BRANCH_BARRIER="1", AGREEMENT_WAIT_S="100")
    out = r.stdout + r.stderr
    assert branches == {"0": "raised FinalEvalError", "1": "raised FinalEvalError"}, out[-3000:]
    assert r.returncode != 0 and "the eval bundle is broken (rank 0)" in out, out[-3000:]
    assert "interrupted" not in r.stdout, out[-3000:]
    # every rank posted its error before it reported its branch, so rank 0's summary has both
    summary = final_eval_error_summary(run, out)
    assert summary["errors_by_rank"] == {str(k): f"RuntimeError: the eval bundle is broken (rank {k})" for k in (0, 1)}
    assert summary["error"] == summary["errors_by_rank"][str(summary["error_rank"])], summary


def final_eval_error_summary(run, out: str) -> dict:
    """summary.json of a final evaluation stopped by an error (training completed the 3 steps), and rank 0's
    message; the fields every such summary has."""
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["step"], summary["last_checkpoint"]) == ("final_eval_error", 3, 3), summary
    assert summary["training_stop_reason"] == "completed" and "signal" not in summary, summary
    assert "the final evaluation of step 3 failed (training completed); the checkpoint of step 3 is saved; " \
           "--resume reruns the final evaluation" in out, out[-3000:]
    return summary


def test_an_error_on_the_rank_with_the_signal_interrupts_every_rank(tmp_path, monkeypatch):
    """The error on rank 1 alone, with its SIGTERM latched (the case the signal's branch is for: e.g. a collective
    that broke as the scheduler killed another rank): rank 1 waits AGREEMENT_WAIT_S for the others' word, then
    takes the signal's branch; rank 0, whose collective breaks as rank 1 exits, takes it too (it used to raise the
    broken connection, exit 1). Both exit 0; summary.json, from rank 0, says interrupted by SIGTERM."""
    r, run, branches, _ = run_worker(tmp_path, monkeypatch, "1", "1", AGREEMENT_WAIT_S="2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert branches == {"0": "returned interrupted", "1": "returned interrupted"}, r.stdout[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["interrupted_during"], summary["signal"]) == (
        "interrupted", "final_eval", "SIGTERM"), summary


def test_an_error_on_one_rank_without_a_signal_ends_the_job_at_once(tmp_path, monkeypatch):
    """The error on rank 0 alone, no signal there, while rank 1 has SIGTERM latched and waits in the val bpb's
    collective: rank 0 decides "failed" without waiting, so the job ends as soon as before (no AGREEMENT_WAIT_S: set
    long here, a wait on either rank would show), and rank 1, whose collective breaks, fails too (its signal explains
    no error; it used to report "interrupted" and exit 0 beside rank 0's exit 1)."""
    # ~10 s on a 2-core machine, 5x that loaded: a wait of 900 s shows as elapsed >= 250 s (or as run_torchrun's
    # 300 s timeout), a bound a slow machine does not reach (it was 60 s against a 60 s wait)
    r, run, _, elapsed = run_worker(tmp_path, monkeypatch, "0", "1", AGREEMENT_WAIT_S="900")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "the eval bundle is broken (rank 0)" in out, out[-3000:]
    assert "interrupted" not in r.stdout, out[-3000:]
    assert final_eval_error_summary(run, out)["error"] == "RuntimeError: the eval bundle is broken (rank 0)"
    assert elapsed < 250, elapsed


def test_an_error_on_rank_1_alone_is_in_rank_0s_summary(tmp_path, monkeypatch):
    """The error on rank 1 alone, no signal anywhere, while rank 0 waits in the val bpb's collective: the error used
    to be raised (exit 1, no summary.json). Rank 1 waits AGREEMENT_WAIT_S for rank 0's word (none: rank 0 is stuck),
    then exits; rank 0's collective breaks, it fails too and writes summary.json, whose error is rank 1's, the
    first to fail (rank 0's own, a broken connection, is beside it)."""
    r, run, branches, elapsed = run_worker(tmp_path, monkeypatch, "1", "", AGREEMENT_WAIT_S="2")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and branches == {"0": "raised FinalEvalError", "1": "raised FinalEvalError"}, out[-3000:]
    assert "rank 1: no word of summary.json from rank 0" in r.stdout, out[-3000:]
    summary = final_eval_error_summary(run, out)
    assert (summary["error"], summary["error_rank"]) == ("RuntimeError: the eval bundle is broken (rank 1)", 1)
    assert sorted(summary["errors_by_rank"]) == ["0", "1"], summary
    assert "error: RuntimeError: the eval bundle is broken (rank 1) (rank 1; the errors of every rank" in out
    assert elapsed < 100, elapsed


def test_one_rank_in_a_process_group_takes_its_own_branch(tmp_path):
    """A process group of one (torchrun --nproc-per-node 1 where something initialized it, or a launcher that
    always does): the same branch as without one, the signal's. Before: the one rank had "posted a failure on every
    rank", so the error was raised (exit 1) where a plain run of the same job reported "interrupted"."""
    import torch.distributed as dist

    from nanochat.final_eval import agreed_failure_branch

    assert agreed_failure_branch("SIGTERM", 0) == "SIGTERM" and agreed_failure_branch(None, 0) is None  # no group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert agreed_failure_branch("SIGTERM", 0) == "SIGTERM"
        assert agreed_failure_branch(None, 1) is None
    finally:
        dist.destroy_process_group()


class FakeGroup:
    """One process playing the ranks of a 2-rank group in turn, against a real c10d store (what the function reads
    of torch.distributed: is_dist, rank, world size, the default store)."""

    def __init__(self, monkeypatch):
        import torch.distributed as dist

        from nanochat import final_eval

        self.rank = 0
        store = dist.HashStore()
        monkeypatch.setattr(final_eval, "is_dist", lambda: True)
        monkeypatch.setattr(final_eval, "AGREEMENT_WAIT_S", 0.2)
        monkeypatch.setattr(dist, "get_rank", lambda: self.rank)
        monkeypatch.setattr(dist, "get_world_size", lambda: 2)
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)

    def branch(self, rank: int, own_signal, evaluation: int):
        from nanochat.final_eval import agreed_failure_branch

        self.rank = rank
        return agreed_failure_branch(own_signal, evaluation)


def test_a_second_failed_final_evaluation_agrees_afresh(monkeypatch):
    """The keys were fixed: the second failure in one process group read the first one's decision ("failed", the
    error raised) where rank 1, alone with its signal, must take the signal's branch after the wait."""
    group = FakeGroup(monkeypatch)
    assert group.branch(0, None, evaluation=0) is None  # no signal: "failed" at once
    assert group.branch(1, "SIGTERM", evaluation=0) is None  # every rank failed: the error, not the signal
    started = time.monotonic()
    assert group.branch(1, "SIGTERM", evaluation=1) == "SIGTERM"  # alone: the wait, then its signal
    assert time.monotonic() - started >= 0.2
    assert group.branch(0, None, evaluation=1) == "SIGTERM"  # a later failure takes the decided branch


def test_each_final_evaluation_of_a_process_agrees_under_its_own_number(monkeypatch):
    """evaluate_at_the_end numbers its calls: every rank makes each call (its first step is a collective), so the
    numbers are the same on every rank."""
    from nanochat import final_eval
    from nanochat.train_loop import StopSignal

    def broken(run, evals):
        raise RuntimeError("broken bundle")

    numbers = []
    monkeypatch.setattr(final_eval, "final_eval", broken)
    monkeypatch.setattr(final_eval, "agreed_failure_branch",
                        lambda own, evaluation, error: numbers.append(evaluation))
    for _ in range(2):
        with pytest.raises(final_eval.FinalEvalError, match="RuntimeError: broken bundle") as raised:
            final_eval.evaluate_at_the_end(None, "completed", StopSignal(), {})
        assert (raised.value.evaluation, raised.value.training_stop) == (numbers[-1], "completed")
    assert len(numbers) == 2 and numbers[1] == numbers[0] + 1, numbers
