"""torchrun worker for test_base_eval_ranks: scripts.base_eval under gloo. ``--sigterm-at-task K R[,R...]`` first: the
ranks R send themselves SIGTERM when they start CORE task K (0-based): every rank, as a Slurm time limit reaches
them, or one alone. ``--sigterm-in MODULE:NAME R[,R...]`` first: the ranks R send themselves SIGTERM when they
call MODULE.NAME (a set-up step, e.g. scripts.base_eval:load_chosen_checkpoint or
nanochat.run_dir:RunDirLock.acquire). ``--truncated-shard-on R[,R...]`` first: the ranks R read every data shard as a
truncated copy (a node whose local copy of the data is corrupt). ``--enospc-writing NAME`` first: rank 0's disk is
full when it writes the file NAME (half of it is written to the temp name, then ENOSPC)."""

import functools
import importlib
import os
import signal
import sys

import torch

from nanochat import core_eval
from scripts.base_eval import main


def sigterm_at_task(k: int, ranks: set[int]) -> None:
    real, calls = core_eval.evaluate_task, []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) > k and int(os.environ["RANK"]) in ranks:
            os.kill(os.getpid(), signal.SIGTERM)  # latched: every rank stops once the task's examples are prepared
        return real(*args, **kwargs)

    core_eval.evaluate_task = wrapped


def sigterm_in(where: str, ranks: set[int]) -> None:
    module, _, name = where.partition(":")
    *owners, attr = name.split(".")
    owner = functools.reduce(getattr, owners, importlib.import_module(module))
    real = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        if int(os.environ["RANK"]) in ranks:
            os.kill(os.getpid(), signal.SIGTERM)  # latched: every rank stops once this set-up step is done
        return real(*args, **kwargs)

    setattr(owner, attr, wrapped)


def truncated_shard_on(ranks: set[int]) -> None:
    import tempfile
    from pathlib import Path

    from nanochat import dataset

    real = dataset.split_files

    def wrapped(data_dir, split):
        files = real(data_dir, split)
        if int(os.environ["RANK"]) not in ranks:
            return files
        copies = Path(tempfile.mkdtemp(prefix="truncated_shards_"))
        for f in files:
            (copies / f.name).write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        return [copies / f.name for f in files]

    dataset.split_files = wrapped


def enospc_writing(name: str) -> None:
    import errno
    from pathlib import Path

    from nanochat.jsonfile import is_temp_for

    real = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if int(os.environ["RANK"]) == 0 and (self.name == name or is_temp_for(self.with_name(name), self)):
            real(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, data, *args, **kwargs)

    Path.write_text = write_text


if __name__ == "__main__":
    torch.set_num_threads(1)
    argv = sys.argv[1:]
    if argv[:1] == ["--sigterm-at-task"]:
        sigterm_at_task(int(argv[1]), {int(r) for r in argv[2].split(",")})
        argv = argv[3:]
    if argv[:1] == ["--sigterm-in"]:
        sigterm_in(argv[1], {int(r) for r in argv[2].split(",")})
        argv = argv[3:]
    if argv[:1] == ["--truncated-shard-on"]:
        truncated_shard_on({int(r) for r in argv[1].split(",")})
        argv = argv[2:]
    if argv[:1] == ["--enospc-writing"]:
        enospc_writing(argv[1])
        argv = argv[2:]
    sys.exit(main(argv))
