"""This process's resident memory from /proc/self/status (Linux), for the benches that measure host memory."""

from pathlib import Path


def resident_mib() -> dict:
    """{"VmRSS": resident now, "VmHWM": peak resident so far}, in MiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text(encoding="utf-8").splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return fields
