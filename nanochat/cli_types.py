"""argparse ``type=`` helpers shared by the scripts, so a bad value stops at parse time with the flag's name
(argparse prefixes the message with ``argument --flag:``) instead of failing later inside torch or a loop; the same
integer check for values from config files and option dataclasses (``check_int_at_least``); and ``NodeParser``,
whose errors and --help a torchrun job prints once per node."""

import argparse
import os
import sys

from nanochat.launcher_watch import LAUNCHER_ENV

DEVICE_TYPES = ("cuda", "cpu", "mps")


def flag_name(dest: str) -> str:
    """The long flag of an argparse ``dest`` (a config.json "args" key): ``matrix_lr`` -> ``--matrix-lr``; for the
    messages that name a flag the code holds by its dest."""
    return "--" + dest.replace("_", "-")


def dest_name(flag: str) -> str:
    """The argparse ``dest`` of a long flag, flag_name's inverse: ``--matrix-lr`` -> ``matrix_lr``; for the code
    that holds a flag and reads its value from the parsed args. A string that is not a long flag is refused: a
    config key (``matrix-lr``) would lose its first two letters silently."""
    if not flag.startswith("--") or flag == "--":
        raise ValueError(f"{flag!r} is not a long flag (--name)")
    return flag[2:].replace("-", "_")


class RankLocalError(argparse.ArgumentTypeError):
    """A flag value refused for what this process sees (its devices), which can differ between the ranks of a node:
    NodeParser lets each rank report its own at once."""


class NodeParser(argparse.ArgumentParser):
    """argparse's parser, but under torchrun a parsing error every rank of a node finds alike (flag syntax, choices,
    ranges, this node's files) is printed by local rank 0 alone, with the same usage and error lines and exit code 2:
    the other ranks wait for torchrun to end them (nanochat.common.wait_for_the_node_reporter). A RankLocalError
    (raised by a ``type=``, or being handled where ``error`` is called) is printed by each rank at once. --help is
    printed by local rank 0 alone (every rank exits 0). Outside torchrun it is argparse's parser."""

    explain = None  # message -> message: what a caller adds to each error (where a flag's value came from)

    def print_help(self, file=None):
        # every rank of a node parses the same argv: local rank 0 prints the help and the others exit 0 at once,
        # without a wait: torchrun ends no rank for another's exit 0, so local rank 0 is never cut short
        if not another_rank_reports_for_the_node():
            super().print_help(file)

    def error(self, message: str):
        if not _rank_local(sys.exc_info()[1]):
            from nanochat.common import wait_for_the_node_reporter  # here: nanochat.common imports this module
            wait_for_the_node_reporter()
        super().error(self.explain(message) if self.explain else message)


def another_rank_reports_for_the_node() -> bool:
    """Whether this process is a torchrun worker other than its node's local rank 0, which prints what every rank of
    the node finds alike (--help, flag errors). Only under torchrun (LAUNCHER_ENV, which a shell never sets): a
    LOCAL_RANK exported by hand, or another launcher's, leaves every rank to print its own."""
    return LAUNCHER_ENV in os.environ and int(os.environ.get("LOCAL_RANK", 0)) != 0


def _rank_local(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an exception it was raised from or while handling is a RankLocalError: argparse calls
    ``error`` while handling the ArgumentError it raised while handling the ``type=``'s error."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, RankLocalError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _int_or(text: str, invalid: int) -> int:
    """``int(text)``, or ``invalid`` (a value the caller's range check refuses, naming the text) if it is none."""
    try:
        return int(text)
    except ValueError:
        return invalid


def _not_at_least(value, low: int) -> str:
    return f"must be an integer >= {low} (got {value!r})"


def check_int_at_least(name: str, value, low: int = 1) -> None:
    """The same check for a value that did not come through argparse (a config file's, a dataclass field's): an int
    (not a bool: a config file's true) >= ``low``, else a ValueError "``name`` must be an integer >= low (got ...)";
    ``name`` is the flag, or the config file and key."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} {_not_at_least(value, low)}")


def int_at_least(low: int):
    """argparse ``type=`` for an integer >= ``low``: a negative count stops at its flag instead of reading, later,
    as a missing checkpoint step_-00001, an empty domain or "all"."""
    def parse(text: str) -> int:
        value = _int_or(text, low - 1)
        if value < low:
            raise argparse.ArgumentTypeError(_not_at_least(text, low))
        return value
    return parse


positive_int = int_at_least(1)  # counts, sizes, attempts
checkpoint_step = int_at_least(0)  # --step; its default None (not parsed) stays "the last checkpoint"


def open_fraction(text: str) -> float:
    """argparse ``type=`` for a float strictly between 0 and 1 (a held-out share: 0 or 1 leaves a split empty)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1:  # nan fails this too
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1) (got {text!r})")
    return value


def device_choice(*forms: str, per_rank: bool = False):
    """argparse ``type=`` for a torch device of the given ``forms`` (of auto, cuda, cuda:N, cpu, mps; auto is
    passed on unchecked) that this machine has, checked here: torch's own error is a traceback, and comes only once
    a checkpoint is loaded. Each error lists ``forms`` alone, so a bench that takes cuda or cpu offers no cuda:N.
    ``per_rank``: for scripts under torchrun, where each rank takes cuda:LOCAL_RANK (compute_init refuses an index,
    but only after parsing, exit 1)."""
    listed = ", ".join(forms)

    def parse(text: str) -> str:
        kind, colon, index = text.partition(":")
        if colon and f"{kind}:N" in forms and not index.isdigit():  # "cuda:N" as the help writes it, "cuda:"
            raise argparse.ArgumentTypeError(f"{text!r}: the N of {kind}:N is a GPU index ({kind}:0, {kind}:1, ...); "
                                             f"allowed: {listed}")
        if (f"{kind}:N" if colon and index.isdigit() else text) not in forms:
            if per_rank and colon and kind == "cuda":
                why = (f"{text!r}: no GPU index (each rank uses cuda:LOCAL_RANK; choose the GPUs with "
                       "CUDA_VISIBLE_DEVICES)")
            else:
                why = f"{text!r}: not a device this flag takes" if kind in DEVICE_TYPES else f"{text!r} is not a device"
            raise argparse.ArgumentTypeError(f"{why}; allowed: {listed}")
        missing = _missing_device(kind, int(index or 0))
        if missing:
            raise RankLocalError(f"{text}: no such device here ({missing}); allowed here: "
                                             + ", ".join(_forms_here(forms)))
        return text
    return parse


def _cuda_count() -> int:
    import torch  # here, not at the top: scripts import this module before they need torch (e.g. for --plan)

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _mps_here() -> bool:
    import torch

    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def _missing_device(kind: str, index: int) -> str | None:
    """What torch sees instead, if the device ``kind``:``index`` is not on this machine; else None."""
    if kind == "cuda":
        count = _cuda_count()
        return f"torch sees {count} CUDA device(s)" if index >= count else None
    if kind == "mps" and not _mps_here():
        return "torch sees no MPS device"
    return None


def _forms_here(forms) -> list[str]:
    """The ``forms`` this machine has, cuda:N with its range."""
    count = _cuda_count()
    here = {"cuda": count > 0, "cuda:N": count > 0, "mps": _mps_here(), "cpu": True, "auto": True}
    return [f"cuda:N with N < {count}" if f == "cuda:N" else f for f in forms if here[f]]


device_name = device_choice("cuda", "cuda:N", "cpu", "mps")  # a script run as one process
device_type_name = device_choice("cuda", "cpu", "mps", per_rank=True)  # a script run under torchrun


SEED_MAX = 2**32 - 1  # torch's CPU generator keeps a seed's low 32 bits: 2**32 would repeat seed 0's draws


def is_seed(value: int) -> bool:
    """Whether ``value`` is a seed every entry point takes (``seed_int``; scripts.run's --seeds and config rows)."""
    return 0 <= value <= SEED_MAX


def seed_int(text: str) -> int:
    """argparse ``type=`` for a random seed in [0, SEED_MAX]: torch refused one outside [-2**63, 2**64) only where
    it seeded ("Overflow when unpacking long long", no flag named), numpy's data order refuses a negative one, and
    above 2**32 the CPU generator repeats smaller seeds."""
    value = _int_or(text, -1)
    if not is_seed(value):
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {SEED_MAX}] (got {text!r})")
    return value


def unresumable_seeds(seeds: list[tuple[str, int]]) -> str:
    """Why a run that an older version started with these (flag, seed) pairs above SEED_MAX cannot be continued:
    this version refuses the seeds, and no seed it takes stands in for them."""
    named = ", ".join(f"{flag} {value}" for flag, value in seeds)
    return (f"{named}: outside [0, {SEED_MAX}], the seeds this version takes (torch's CPU generator keeps a seed's "
            "low 32 bits: a larger seed drew a smaller one's CPU numbers); a run an older version recorded with "
            f"{'it' if len(seeds) == 1 else 'them'} cannot be resumed exactly by this one. No seed in range stands "
            "in: the data seed (--data-seed, by default --seed) also orders real data through numpy, which reads "
            "every bit of it, so even its low 32 bits would give other batches after the checkpoint. Finish the run "
            "with the version that started it, or start a new run (--overwrite, or another --run-dir) with seeds in "
            f"[0, {SEED_MAX}]")


def count_or_all(text: str) -> int:
    """argparse ``type=`` for a cap on examples: an integer >= 1, or -1 for no cap. 0 is refused: it read as "all"
    (only a positive cap cuts), so asking for no examples ran the full, slowest evaluation."""
    value = _int_or(text, 0)
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, or -1 for all (got {text!r})")
    return value


def count_or_all_or_run(text: str) -> int | str:
    """``count_or_all``, or "run": base_eval's and the analyses' --max-per-task, where run follows the checkpoint's
    --core-max-per-task (nanochat.eval_bundle.run_core_inputs)."""
    if text == "run":
        return text
    try:
        return count_or_all(text)
    except argparse.ArgumentTypeError:  # count_or_all's message would leave out "run"
        raise argparse.ArgumentTypeError(f"must be 'run', an integer >= 1, or -1 for all (got {text!r})") from None


def count_or_all_or_zero(text: str) -> int:
    """``count_or_all``, and 0: base_train --core-max-per-task with --resume, where 0 ("all" in the versions that
    took it) continues a run recorded with it; nanochat.train_resume reads it as -1 there and refuses it elsewhere."""
    return 0 if _int_or(text, -2) == 0 else count_or_all(text)


def recorded_args(config: dict | None) -> dict:
    """The flags a run's resolved config records (config.json, or meta.json's "config": base_train's args, "args");
    {} where it records none ("args" absent or null: an imported checkpoint, a file another tool wrote or a hand
    edited), so a reader's .get(flag) is None for a flag not recorded, as for a flag added since the run."""
    return (config or {}).get("args") or {}


def recorded_args_now(saved: dict) -> dict:
    """A run's recorded flags (config.json "args") as this version reads them: --core-max-per-task 0, "all" in the
    older versions that took it, is -1 (as nanochat.train_resume.read_old_records reads a --resume of such a run)."""
    return {**saved, "core_max_per_task": -1} if saved.get("core_max_per_task") == 0 else saved
