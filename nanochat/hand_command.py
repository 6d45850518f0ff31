"""The base_train command a user runs by hand where a wrapper (speedrun.sh) ran it for them and cannot pass the
flags that go on: after a non-finite stop (train_end) and a refused resume (train_resume)."""

import os
import shlex
import sys
from pathlib import Path


def hand_command(world: int, way: list[str], values: dict[str, str]) -> str | None:
    """This process's base_train command (``world`` processes), shell-quoted, with ``way`` and ``values`` ({flag:
    value}: half the LRs after a non-finite stop, the checkpoint's values after a refused resume) in place of its
    --resume, --overwrite, --resume-override-lr and those flags (``way`` and ``values`` come last, so they win over a
    --config file's keys too). base_train's flags are sys.argv's (``python -m scripts.base_train``, or a torchrun
    worker's: torchrun's own flags are not in it); its launcher is told from the environment: torchrun on one node
    (LOCAL_WORLD_SIZE, as speedrun.sh starts it), else a single process. None where that cannot be told:
    base_train.main called in another program's process, or several nodes (each node's torchrun command)."""
    if Path(sys.argv[0]).name != "base_train.py":
        return None
    local = os.environ.get("LOCAL_WORLD_SIZE")
    python = Path(sys.executable)
    if local is None and world == 1:
        launcher = [from_here(python), "-m", "scripts.base_train"]
    elif local is not None and int(local) == world:
        torchrun = python.with_name("torchrun")  # the environment's own, as `python` is
        launcher = [from_here(torchrun) if torchrun.exists() else "torchrun", "--standalone",
                    f"--nproc_per_node={local}", "-m", "scripts.base_train"]
    else:
        return None
    return shlex.join(launcher + without_flags(sys.argv[1:], set(values)) + way
                      + [token for flag, value in values.items() for token in (flag, value)])


def without_flags(argv: list[str], valued: set[str]) -> list[str]:
    """``argv`` less --resume (its value is optional: ``resume_value_at``), --overwrite, --resume-override-lr and the
    ``valued`` flags (``--flag V`` or ``--flag=V``)."""
    kept, i = [], 0
    while i < len(argv):
        token, i = argv[i], i + 1
        name = token.split("=", 1)[0]
        if token in ("--overwrite", "--resume-override-lr"):
            continue
        if name in valued or name == "--resume":
            if "=" not in token and (name in valued and i < len(argv) or resume_value_at(argv, i)):
                i += 1  # its value
            continue
        kept.append(token)
    return kept


def resume_value_at(argv: list[str], i: int) -> bool:
    """Whether ``argv[i]`` is the value of a bare --resume before it: base_train's --resume takes one optionally
    (none: latest), and argparse reads the next token as it unless that starts with ``-`` (the next flag)."""
    return 0 < i < len(argv) and argv[i - 1] == "--resume" and not argv[i].startswith("-")


def from_here(path: Path) -> str:
    """``path`` relative to the working directory where it lies under it (.venv/bin/python), else absolute."""
    absolute, here = os.path.abspath(path), os.getcwd()
    return os.path.relpath(absolute, here) if absolute.startswith(here + os.sep) else absolute
