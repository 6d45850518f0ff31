"""scripts.base_train where a stop signal lands in the middle of a known optimizer step: the ranks named by
``--kill-ranks R[,R...]`` send themselves ``--kill-with`` (SIGINT or SIGTERM) while step ``--kill-step K``
(1-based) reads its first micro-batch: after the loop started the step, before the step's stop vote. The first six
arguments are these three flags; the rest go to base_train. Run under torchrun (gloo), or import
``signal_during_step`` in process."""

import os
import signal
import sys

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


def main(argv: list[str]) -> int:
    assert argv[0:5:2] == ["--kill-step", "--kill-ranks", "--kill-with"], argv
    step, ranks, sig = int(argv[1]), {int(r) for r in argv[3].split(",") if r}, signal.Signals[argv[5]]
    if int(os.environ.get("RANK", "0")) in ranks:
        base_train.train_step = signal_during_step(base_train.train_step, step, sig)
    return base_train.main(argv[6:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
