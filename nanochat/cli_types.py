"""argparse ``type=`` helpers shared by the scripts, so a bad value stops at parse time with the flag's name
(argparse prefixes the message with ``argument --flag:``) instead of failing later inside torch or a loop."""

import argparse

DEVICE_TYPES = ("cuda", "cpu", "mps")


def _int_or(text: str, invalid: int) -> int:
    """``int(text)``, or ``invalid`` (a value the caller's range check refuses, naming the text) if it is none."""
    try:
        return int(text)
    except ValueError:
        return invalid


def int_at_least(low: int):
    """argparse ``type=`` for an integer >= ``low``: a negative count stops at its flag instead of reading, later,
    as a missing checkpoint step_-00001, an empty domain or "all"."""
    def parse(text: str) -> int:
        value = _int_or(text, low - 1)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low} (got {text!r})")
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


def device_name(text: str) -> str:
    """A torch device this machine has: cuda, cuda:N, cpu or mps (checked here: torch's own error is a traceback,
    and comes only once the checkpoint is loaded)."""
    kind, _, index = text.partition(":")
    if kind not in DEVICE_TYPES or (index and not (kind == "cuda" and index.isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; allowed: cuda, cuda:N, cpu, mps")
    import torch  # here, not at the top: scripts import this module before they need torch (e.g. for --plan)

    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(index or 0) >= count:
            raise argparse.ArgumentTypeError(f"{text}: no such device here (torch sees {count} CUDA device(s)); "
                                             "use cpu, or cuda:N with N < that count")
    if kind == "mps" and not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
        raise argparse.ArgumentTypeError(f"{text}: no such device here (torch sees no MPS device); use cpu")
    return text


def device_type_name(text: str) -> str:
    """A device type this machine has, without an index (cuda, cpu, mps): for the scripts that run under torchrun,
    where each rank takes cuda:LOCAL_RANK (compute_init refuses an index, but only after parsing, exit 1)."""
    if ":" in text:
        raise argparse.ArgumentTypeError(f"{text!r}: no GPU index (each rank uses cuda:LOCAL_RANK; choose the GPUs "
                                         "with CUDA_VISIBLE_DEVICES); allowed: cuda, cpu, mps")
    return device_name(text)


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


def count_or_all_or_zero(text: str) -> int:
    """``count_or_all``, and 0: base_train --core-max-per-task with --resume, where 0 ("all" in the versions that
    took it) continues a run recorded with it; nanochat.train_resume reads it as -1 there and refuses it elsewhere."""
    return 0 if _int_or(text, -2) == 0 else count_or_all(text)
