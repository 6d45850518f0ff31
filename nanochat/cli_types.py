"""argparse ``type=`` helpers shared by the scripts, so a bad value stops at parse time with the flag's name
(argparse prefixes the message with ``argument --flag:``) instead of failing later inside torch or a loop."""

import argparse

DEVICE_TYPES = ("cuda", "cpu", "mps")


def positive_int(text: str) -> int:
    """An integer >= 1 (counts, sizes, attempts)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (got {text!r})")
    return value


def device_name(text: str) -> str:
    """A torch device: cuda, cuda:N, cpu or mps (checked here: torch's own error is a traceback)."""
    kind, _, index = text.partition(":")
    if kind not in DEVICE_TYPES or (index and not (kind == "cuda" and index.isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; allowed: cuda, cuda:N, cpu, mps")
    return text
