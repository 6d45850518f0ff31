"""scripts.base_train where a stop signal lands in the middle of a known optimizer step or periodic val-bpb eval:
the ranks named by ``--kill-ranks R[,R...]`` send themselves ``--kill-with`` (SIGINT or SIGTERM) while call
``--kill-step K`` (1-based) of ``--kill-in`` (``step``: base_train.train_step, the default; ``eval``:
base_train.run_split_bpb, whose first call is step 0's eval) is under way: a step reads its first micro-batch (after
the loop started the step, before the step's stop vote); an eval has not begun (its collectives follow). The first
six arguments are the first three flags, then optionally ``--kill-in``; the rest go to base_train. Run under torchrun
(gloo), or import ``signal_during_step`` / ``signal_during_call`` in process. With ``--runs-out DIR`` first, several
runs in one launch, separated by ``--next-run``, each with its own first flags (tests/_train_runs_worker.run_each: run
N's output in DIR/runN.rank<r>.out, its run dir as it left it in DIR/runN)."""

import os
import signal
import sys
from pathlib import Path

from scripts import base_train


class SignallingLoader:
    """The step's loader, sending ``sig`` to this process when the first micro-batch is read."""

    def __init__(self, loader, sig: signal.Signals):
        self.loader, self.sig, self.sent = loader, sig, False

    def __iter__(self):
        return self

    def __next__(self):
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.sig)
        return next(self.loader)


def signal_during_step(real_step, step: int, sig: signal.Signals):
    """A stand-in for base_train.train_step whose call number ``step`` (1-based) gets ``sig`` mid-step."""
    calls = []

    def train_step(model, optimizer, loader, *args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            loader = SignallingLoader(loader, sig)
        return real_step(model, optimizer, loader, *args, **kwargs)

    return train_step


def signal_during_call(real, call: int, sig: signal.Signals):
    """A stand-in for ``real`` (e.g. an eval) that sends ``sig`` to this process as its call ``call`` (1-based)
    starts, then runs it whole: the signal lands inside the work, as a scheduler's would."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    return wrapped


def main(argv: list[str]) -> int:
    assert argv[0:5:2] == ["--kill-step", "--kill-ranks", "--kill-with"], argv
    step, ranks, sig = int(argv[1]), {int(r) for r in argv[3].split(",") if r}, signal.Signals[argv[5]]
    where, rest = (argv[7], argv[8:]) if argv[6:7] == ["--kill-in"] else ("step", argv[6:])
    if int(os.environ.get("RANK", "0")) in ranks:
        if where == "step":
            base_train.train_step = signal_during_step(base_train.train_step, step, sig)
        else:
            assert where == "eval", where
            base_train.run_split_bpb = signal_during_call(base_train.run_split_bpb, step, sig)
    return base_train.main(rest)


if __name__ == "__main__":
    if sys.argv[1] == "--runs-out":
        from _train_runs_worker import run_each  # reads torchrun's environment on import

        sys.exit(run_each(sys.argv[3:], main, Path(sys.argv[2]),
                          stand_ins=[(base_train, "train_step"), (base_train, "run_split_bpb")]))
    sys.exit(main(sys.argv[1:]))
