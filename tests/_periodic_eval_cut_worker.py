"""scripts.base_train with a periodic CORE that a stop signal cuts short from inside its scoring loop.

--synthetic-data has no tokenizer and no CORE, so ``with_tiny_core`` stands one in: the real
nanochat.core_eval.evaluate_core on a hand-made bundle (``write_tiny_bundle``) with the character tokenizer of the
evaluator tests, whose ids fit the synthetic vocab. ``signal_in_core_batch`` sends the process a signal as CORE
scores its batch number K (1-based, counted over the process): inside the loop, between the ranks' stop votes.

Under torchrun: ``--bundle-dir D --signal-ranks R[,R...] --signal-at-batch K`` (the first six arguments; "" names
no rank), the rest go to base_train. With ``--runs-out DIR`` first, several runs in one launch, separated by
``--next-run``, each with its own first six arguments (tests/_train_runs_worker.run_each: run N's output in
DIR/runN.rank<r>.out, its run dir as it left it in DIR/runN)."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _eval_helpers import MC_ROWS, LM_ROWS, CharTok, write_bundle  # noqa: E402

from nanochat import core_eval  # noqa: E402
from scripts import base_train  # noqa: E402


def write_tiny_bundle(root: Path) -> Path:
    """Two tasks: "mc" (3 examples of 2 or 3 rows: at 2 rows a forward, one forward each; of 2 processes, rank 0
    scores 2 and rank 1 one: unequal shares) then "lm" (3 examples)."""
    return write_bundle(root, {"mc": ("multiple_choice", 1, " ", MC_ROWS[:3]),
                               "lm": ("language_modeling", 0, "\nAnswer: ", LM_ROWS)}, {"mc": 25, "lm": 0})


def with_tiny_core(bundle: Path, patch=setattr) -> None:
    """base_train resolves ``bundle`` and scores CORE on it with CharTok. ``patch``: setattr, or a pytest
    monkeypatch's."""
    def run_core(model, data, args, device, autocast_ctx, finished=None):
        return core_eval.evaluate_core(model, CharTok(), data.bundle, max_per_task=args.core_max_per_task,
                                       batch_size=args.eval_batch_size or args.device_batch_size, device=device,
                                       autocast_ctx=autocast_ctx, progress=False, finished=finished)

    patch(base_train, "resolve_bundle", lambda args: bundle)
    patch(base_train, "run_core", run_core)


def signal_in_core_batch(batch: int, sig: signal.Signals, patch=setattr) -> list:
    """CORE's batch number ``batch`` (1-based) sends ``sig`` to this process once it is scored. Returns the list of
    the batches scored (one entry each), for the caller's checks."""
    real, scored = core_eval._score_batch, []

    def score_batch(*args, **kwargs):
        out = real(*args, **kwargs)
        scored.append(1)
        if len(scored) == batch:
            os.kill(os.getpid(), sig)
        return out

    patch(core_eval, "_score_batch", score_batch)
    return scored


def main(argv: list[str]) -> int:
    assert argv[0:5:2] == ["--bundle-dir", "--signal-ranks", "--signal-at-batch"], argv
    with_tiny_core(Path(argv[1]))
    if int(os.environ.get("RANK", "0")) in {int(r) for r in argv[3].split(",") if r}:
        signal_in_core_batch(int(argv[5]), signal.SIGTERM)
    return base_train.main(argv[6:])


if __name__ == "__main__":
    if sys.argv[1] == "--runs-out":
        from _train_runs_worker import run_each  # reads torchrun's environment on import

        sys.exit(run_each(sys.argv[3:], main, Path(sys.argv[2]), stand_ins=[
            (base_train, "resolve_bundle"), (base_train, "run_core"), (core_eval, "_score_batch")]))
    sys.exit(main(sys.argv[1:]))
