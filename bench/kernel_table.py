"""Every kernel of a torch.profiler run as JSON rows (name, category, calls, total us), for bench/profile_diff.py.

The op table that ``bench/train_step.py --profile-dir`` also writes stops at 40 rows and mixes host ops with the
kernels they launch; the many small kernels of a memory design live in its tail. Here every device event is
kept (kernels, copies, memsets), the host-side op events are not (their device time is their kernels'), so the
rows add up to the device time of the profiled steps. On CPU there are no device events: the rows are the ops'
self CPU time instead, so the same JSON and diff work for a CPU run.
"""

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the profiler's own stalls, listed with device time in the 2026-11-26 step profiles: not the model's work
PROFILER_OVERHEAD = ("Command Buffer Full",)
OPTIMIZER_ANNOTATION = "Optimizer.step"  # torch.optim's record_function around every optimizer.step()


def our_triton_kernels() -> tuple[str, ...]:
    """The @triton.jit kernel names of nanochat/memory/mome_triton.py, read from its source: triton (and a GPU)
    need not be installed to categorize a profile, and a renamed kernel cannot fall out of the category."""
    src = (REPO / "nanochat" / "memory" / "mome_triton.py").read_text(encoding="utf-8")
    return tuple(re.findall(r"@triton\.jit\s+def (\w+)\(", src))


# (category, pattern on the lower-cased kernel name); the first that matches wins, 'other' when none does.
# cudnn runs only the attention here (no convolutions), so its helper kernels (cudnn::fusion::...) count there.
CATEGORY_PATTERNS = (
    ("nccl", r"nccl"),
    ("mome_triton", "|".join(re.escape(k.lower()) for k in our_triton_kernels())),
    ("attention", r"sdpa|flash|fmha|cudnn|attention"),
    ("gemm", r"nvjet|cutlass|gemm|^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$"),
    ("optimizer", r"muon|adamw|multi_tensor|foreach|optimizer"),
    ("triton_inductor", r"^triton_(poi|red|per|tem|for)_"),
    ("copy_memset", r"memcpy|memset|copy|fill"),
)
CATEGORIES = tuple(c for c, _ in CATEGORY_PATTERNS) + ("other",)


def categorize(name: str) -> str:
    low = name.lower()
    return next((cat for cat, pat in CATEGORY_PATTERNS if pat and re.search(pat, low)), "other")


def _is_device(e) -> bool:
    return getattr(e.device_type, "name", str(e.device_type)).upper() != "CPU"


def _is_annotation(e) -> bool:
    return bool(getattr(e, "is_user_annotation", False)) or "annotation" in (getattr(e, "activity_type", None) or "")


def _side(events, on_device: bool) -> list:
    return [e for e in events if not getattr(e, "is_async", False) and _is_device(e) == on_device]


def optimizer_windows(events) -> list[tuple[float, float]]:
    """(start, end) of every ``Optimizer.step`` annotation among ``events`` (one side's). On the device these are
    the profiler's spans of the kernels the step launched; none there means this torch emitted no device-side
    annotation, and 'optimizer' then holds only the kernels named so (write_profile_json records the count)."""
    return [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith(OPTIMIZER_ANNOTATION)]


def kernel_rows(events, on_device: bool) -> list[dict]:
    """profiler FunctionEvents -> one row per (name, category), the longest first. on_device: the device events
    and their device time; else the host ops and their self CPU time. An event that starts inside an
    ``Optimizer.step`` annotation of its own side (on the device: the span of the step's kernels, never the host's
    launch window, whose clock runs ahead of the device's work) is 'optimizer' whatever its name:
    Muon's GEMMs and elementwise kernels are the optimizer's cost, not the model's."""
    return _rows_and_windows(events, on_device)[0]


def _rows_and_windows(events, on_device: bool) -> tuple[list[dict], int]:
    """``kernel_rows`` and the number of optimizer windows found: ``events`` filtered to one side and scanned for
    the windows once (tens of thousands of events)."""
    events = _side(events, on_device)
    windows = optimizer_windows(events)
    rows: dict[tuple[str, str], dict] = {}
    for e in events:
        if e.name in PROFILER_OVERHEAD or (on_device and _is_annotation(e)):
            continue  # device-side annotations span kernels already counted
        us = e.time_range.end - e.time_range.start if on_device else e.self_cpu_time_total
        in_opt = any(lo <= e.time_range.start < hi for lo, hi in windows)
        named = categorize(e.name)
        cat = "optimizer" if in_opt and named != "nccl" else named
        row = rows.setdefault((e.name, cat), {"name": e.name, "category": cat, "calls": 0, "total_us": 0.0})
        row["calls"] += 1
        row["total_us"] += float(us)
    return sorted(rows.values(), key=lambda r: -r["total_us"]), len(windows)


def write_profile_json(path: Path, events, on_device: bool, steps: int, meta: dict) -> dict:
    """The rows of ``steps`` profiled steps (totals over them: divide by ``steps``) with ``meta`` (design, device,
    ...) as the JSON bench/profile_diff.py reads."""
    rows, n_windows = _rows_and_windows(events, on_device)
    if not rows:
        raise RuntimeError(f"the profiler recorded no {'device' if on_device else 'CPU'} events for {path.name}")
    doc = {**meta, "steps": steps, "time": "device" if on_device else "self_cpu",
           "optimizer_windows": n_windows,
           "total_us": sum(r["total_us"] for r in rows), "kernels": rows}
    path.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return doc
