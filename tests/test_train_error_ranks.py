"""An unplanned error during training under torchrun (gloo, 2 ranks), on rank 0 alone, rank 1 alone or both: the job
ends in bounded time with a non-zero exit, and rank 0's summary.json says "error" with the error of the first rank to
fail (nanochat.train_end.stop_by_error), never "interrupted" for the SIGTERM torchrun sends the rank left."""

import json
import time

import pytest

from conftest import REPO, run_torchrun
from test_train_dist import BATCH
from test_train_e2e import TINY

WORKER = REPO / "tests" / "_train_error_worker.py"


def run_worker(tmp_path, monkeypatch, fail: str, sigterm: str = ""):
    monkeypatch.setenv("FAIL_RANKS", fail)
    monkeypatch.setenv("SIGTERM_RANKS", sigterm)
    run = tmp_path / "r"
    started = time.monotonic()
    r = run_torchrun(WORKER, 2, [*TINY, *BATCH, "--num-iterations", "6", "--save-every", "1", "--run-dir", str(run)],
                     timeout=240)  # a hang shows as TimeoutExpired
    return r, run, r.stdout + r.stderr, time.monotonic() - started


def error(rank: int) -> str:
    return f"RuntimeError: simulated out of memory (rank {rank})"


# "both" is slow: two ranks raising at the same batch race, and rank 0 then takes one of errors_of_failing_ranks'
# two branches, each covered by a default case: rank 1's post first (rank 0 reads it at once) by "rank1", rank 0's
# own first (then the bounded wait for rank 1's post) by test_two_ranks_failing_at_once_are_both_in_the_summary
@pytest.mark.parametrize("fail, sigterm", [("0", ""), ("1", ""), pytest.param("0,1", "", marks=pytest.mark.slow),
                                           ("1", "0")],
                         ids=["rank0", "rank1", "both", "rank1-rank0-sigterm"])
def test_an_error_on_any_rank_is_in_rank_0s_summary(tmp_path, monkeypatch, fail, sigterm):
    """rank1-rank0-sigterm: rank 0 has SIGTERM latched (as torchrun sends it once rank 1 has exited) when its
    collective breaks: its summary must still say the error, not "interrupted" by the signal."""
    if fail == "0":
        # rank 0 failed first and waits (bounded) for the other ranks' errors, which rank 1, waiting in the step's
        # collective, never posts: the whole bound passes whatever it is (10 s in the product)
        monkeypatch.setenv("AGREEMENT_WAIT_S", "2")
    r, run, out, elapsed = run_worker(tmp_path, monkeypatch, fail, sigterm)
    assert r.returncode != 0 and "Traceback" in r.stderr, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["step"], summary["last_checkpoint"]) == ("error", 2, 2), summary
    assert "signal" not in summary and "interrupted" not in r.stdout, summary
    if "error_rank" not in summary:  # rank 0 failed first, before any other rank posted an error
        assert fail != "1" and summary["error"] == error(0), summary
    else:  # rank 0 read the errors posted (rank 1's before its exit broke rank 0's collective), in order of failure
        assert fail != "0" and sorted(summary["errors_by_rank"]) == ["0", "1"], summary
        assert summary["errors_by_rank"][str(summary["error_rank"])] == summary["error"], summary
    if fail == "1":  # rank 0's own error is the broken collective: rank 1's is the account
        assert (summary["error"], summary["error_rank"]) == (error(1), 1), summary
    assert f"training stopped by an error after step 2\nlast checkpoint: step 2 in {run / 'checkpoints'}" in out, \
        out[-3000:]
    stops = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"stop"' in line]
    assert [(s["reason"], s["error"]) for s in stops] == [("error", summary["error"])], stops
    assert elapsed < 200, elapsed


def test_two_ranks_failing_at_once_are_both_in_the_summary(tmp_path, monkeypatch):
    """Both ranks raise, rank 1 a moment after rank 0: rank 0 read the posted errors at once and named its own alone.
    It now waits (bounded: AGREEMENT_WAIT_S) for every rank's post once it was the first to fail."""
    monkeypatch.setenv("FAIL_DELAY_S", "1.5")
    r, run, out, elapsed = run_worker(tmp_path, monkeypatch, "0,1")
    assert r.returncode != 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["error"], summary["error_rank"]) == ("error", error(0), 0), summary
    assert summary["errors_by_rank"] == {"0": error(0), "1": error(1)}, summary
    assert elapsed < 200, elapsed


def test_a_set_up_error_of_rank_0_stops_every_rank_with_a_summary(tmp_path, monkeypatch):
    """Rank 0 writes config.json alone; its full disk ended it with a traceback while rank 1 went on to the first
    step's collective, and no summary.json was written. Now every rank takes the error branch together: exit 1 on
    both, one clean error line, and summary.json says error."""
    monkeypatch.setenv("FAIL_WRITE", "config.json")
    r, run, out, elapsed = run_worker(tmp_path, monkeypatch, "")
    assert r.returncode != 0 and "scripts/base_train.py" not in out, out[-3000:]  # no traceback of a worker
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["step"], summary["last_checkpoint"]) == ("error", 0, None), summary
    assert summary["error"] == f"OSError: [Errno 28] No space left on device: '{run / 'config.json'}'", summary
    assert r.stderr.count(f"error: {summary['error']}") == 1, r.stderr[-3000:]
    assert elapsed < 200, elapsed
