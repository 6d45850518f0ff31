"""Where design B's training step spends more device time than design A's: two kernel profiles written by
``bench/train_step.py --profile-dir DIR`` (DIR/<design>_<mix>_<topk>.json), per step, as markdown.

    python bench/profile_diff.py DIR/ve_auto_auto.json DIR/mome_auto_auto.json [--top 40]

Prints each side's step time (timed, profiled wall, device busy = the sum of its kernels, and the rest: device
idle, i.e. host-bound gaps), then the busy-time gap B - A split by category and by kernel, sorted by |B - A|,
with the share of the gap each explains (signed: a negative share is time B saves). Inductor numbers its
generated kernels per graph, so one fused op can be ``triton_poi_fused_add_14`` in A and ``..._add_17`` in B:
kernels are matched by name with a trailing ``_<number>`` stripped, and kernels sharing a stripped name and
category are summed. Warning lines come first where the comparison is doubtful: two devices, a device profile
without the optimizer step's device-side annotation (its 'optimizer' row is then only the kernels named so), or
kernels adding up to more than the profiled wall (overlapping events counted). Bad input (a missing file, not
JSON, missing fields) is one error line and exit status 2.
"""

import argparse
import json
import math
import re
import sys
from pathlib import Path

KERNEL_FIELDS = {"name": str, "category": str, "calls": int, "total_us": (int, float)}
WANT = "name: str, category: str, calls: int, total_us: number"


class ProfileError(Exception):
    pass


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def load(path: str) -> dict:
    """A profile JSON, checked: 'steps' >= 1, 'total_us' a number, 'kernels' a list of {name, category, calls,
    total_us}."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file ({_beside(Path(path))})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: cannot read ({e})") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ProfileError(f"{path}: expected a JSON object from bench/train_step.py --profile-dir")
    steps = doc.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ProfileError(f"{path}: 'steps' must be an integer >= 1 (got {steps!r})")
    kernels = doc.get("kernels")
    if not isinstance(kernels, list) or not kernels:
        raise ProfileError(f"{path}: 'kernels' must be a non-empty list")
    for i, k in enumerate(kernels):
        bad = [f for f, t in KERNEL_FIELDS.items() if not isinstance(k, dict) or not isinstance(k.get(f), t)
               or isinstance(k[f], bool) or (t is not str and not _number(k[f]))]
        if bad:
            raise ProfileError(f"{path}: kernels[{i}]: missing or wrong {', '.join(bad)} (want {WANT})")
    if not _number(doc.get("total_us")):  # the busy time the gap and the shares are taken from
        raise ProfileError(f"{path}: 'total_us' must be a number (got {doc.get('total_us')!r})")
    return doc


def _beside(path: Path) -> str:
    """The profiles in a missing file's folder: a non-MoME design is profiled under mix "auto" whatever --mix
    (VE beside --mix row is ve_auto_auto.json), and the diff is rerun from the files a GPU session returned."""
    if not path.parent.is_dir():
        return f"no folder {path.parent}"
    names = sorted(p.name for p in path.parent.glob("*.json"))
    return f"profiles there: {', '.join(names)}" if names else f"no .json profile in {path.parent}"


def busy_us(doc: dict) -> float:
    """The sum of the kernels per profiled step, in us (the device's busy time; a CPU profile's self time)."""
    return doc["total_us"] / doc["steps"]


def on_device(doc: dict) -> bool:
    return doc.get("time", "device") == "device"


def base_name(name: str) -> str:
    return re.sub(r"_\d+$", "", name)


def per_step(doc: dict) -> dict[tuple[str, str], dict]:
    """(stripped name, category) -> calls and us per step."""
    out: dict[tuple[str, str], dict] = {}
    for k in doc["kernels"]:
        row = out.setdefault((base_name(k["name"]), k["category"]), {"calls": 0.0, "us": 0.0})
        row["calls"] += k["calls"] / doc["steps"]
        row["us"] += k["total_us"] / doc["steps"]
    return out


def diff_rows(a: dict, b: dict) -> list[dict]:
    """Every (stripped name, category) of either side with its per-step calls/us and delta, largest |delta| first."""
    pa, pb = per_step(a), per_step(b)
    zero = {"calls": 0.0, "us": 0.0}
    rows = [{"name": key[0], "category": key[1], "a": pa.get(key, zero), "b": pb.get(key, zero),
             "delta_us": pb.get(key, zero)["us"] - pa.get(key, zero)["us"]} for key in {**pa, **pb}]
    return sorted(rows, key=lambda r: (-abs(r["delta_us"]), r["name"], r["category"]))


def by_category(rows: list[dict]) -> list[dict]:
    cats: dict[str, dict] = {}
    for r in rows:
        c = cats.setdefault(r["category"], {"category": r["category"], "a_us": 0.0, "b_us": 0.0})
        c["a_us"] += r["a"]["us"]
        c["b_us"] += r["b"]["us"]
    return sorted(({**c, "delta_us": c["b_us"] - c["a_us"]} for c in cats.values()),
                  key=lambda c: (-abs(c["delta_us"]), c["category"]))


def share(delta: float, gap: float) -> str:
    return f"{100 * delta / gap:+.1f}%" if gap else "n/a"


def _ms(x, sign: str = "") -> str:
    return f"{x:{sign}.2f}" if _number(x) else "n/a"


def _cell(name: str, width: int = 100) -> str:
    name = name if len(name) <= width else name[:width - 3] + "..."
    return name.replace("|", "\\|")


def side_label(doc: dict, path: str) -> str:
    return doc.get("label") or doc.get("design") or Path(path).stem


def summary_table(a: dict, b: dict, la: str, lb: str) -> list[str]:
    device = on_device(a)
    busy = "device busy" if device else "CPU self time"
    ta, tb = busy_us(a) / 1e3, busy_us(b) / 1e3
    lines = [f"| per step, ms | A: {_cell(la)} | B: {_cell(lb)} | B - A |", "|---|---:|---:|---:|"]
    for what, xa, xb in (("timed step (median, not profiled)", a.get("step_ms"), b.get("step_ms")),
                         (f"profiled step (wall; A {a['steps']}, B {b['steps']} steps)", a.get("profiled_step_ms"),
                          b.get("profiled_step_ms")),
                         (f"{busy} (sum of the kernels)", ta, tb)):
        lines.append(f"| {what} | {_ms(xa)} | {_ms(xb)} | {_ms(xb - xa, '+') if _number(xa) and _number(xb) else 'n/a'} |")
    pa, pb = a.get("profiled_step_ms"), b.get("profiled_step_ms")
    if _number(pa) and _number(pb) and device:  # host ops overlap across threads: no idle time
        lines.append(f"| profiled wall - {busy} (idle: host-bound gaps) | {_ms(pa - ta)} | {_ms(pb - tb)} | "
                     f"{_ms((pb - tb) - (pa - ta), '+')} |")
    calls = [sum(k["calls"] for k in d["kernels"]) / d["steps"] for d in (a, b)]
    lines.append(f"| {'kernel launches' if device else 'op calls'} | {calls[0]:.0f} | {calls[1]:.0f} | {calls[1] - calls[0]:+.0f} |")
    return lines


def doubts(a: dict, b: dict) -> list[str]:
    """What makes the comparison doubtful, read from the profiles themselves (nothing of this has a GPU test)."""
    out = [f"warning: A ran on {a.get('device_name')!r}, B on {b.get('device_name')!r}"] \
        if a.get("device_name") != b.get("device_name") else []
    for side, doc in (("A", a), ("B", b)):
        if not on_device(doc):
            continue
        if doc.get("optimizer_windows") == 0:
            out.append(f"warning: {side} has no device-side Optimizer.step annotation: its 'optimizer' row holds only "
                       "the kernels named so (Muon's GEMMs count as gemm)")
        wall, busy = doc.get("profiled_step_ms"), busy_us(doc) / 1e3
        if _number(wall) and busy > wall:
            out.append(f"warning: {side}'s kernels add up to {busy:.2f} ms per step, more than its profiled wall "
                       f"{wall:.2f} ms: overlapping events are counted (several streams, or annotations read as "
                       "kernels)")
    return out


def render(a: dict, b: dict, path_a: str, path_b: str, top: int) -> str:
    la, lb = side_label(a, path_a), side_label(b, path_b)
    rows = diff_rows(a, b)
    gap = busy_us(b) - busy_us(a)
    out = [f"### Kernel profile: B = {lb} ({path_b}) vs A = {la} ({path_a})", ""]
    warn = doubts(a, b)
    out += [*warn, ""] if warn else []
    out += summary_table(a, b, la, lb)
    out += ["", f"Gap B - A in the sum of the kernels: {gap / 1e3:+.3f} ms per step. Kernels are matched by name with "
            "a trailing `_<number>` stripped (inductor numbers its kernels per graph); kernels with the same stripped "
            "name and category are summed. 'optimizer' is every kernel run inside the optimizer step.", "",
            "| category | A ms | B ms | B - A ms | share of gap |", "|---|---:|---:|---:|---:|"]
    out += [f"| {c['category']} | {c['a_us'] / 1e3:.3f} | {c['b_us'] / 1e3:.3f} | {c['delta_us'] / 1e3:+.3f} | "
            f"{share(c['delta_us'], gap)} |" for c in by_category(rows)]
    out += ["", f"| kernel (top {min(top, len(rows))} of {len(rows)} by abs(B - A)) | category | A calls | A us | "
            "B calls | B us | B - A us | share of gap |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {_cell(r['name'])} | {r['category']} | {r['a']['calls']:g} | {r['a']['us']:.1f} | "
            f"{r['b']['calls']:g} | {r['b']['us']:.1f} | {r['delta_us']:+.1f} | {share(r['delta_us'], gap)} |"
            for r in rows[:top]]
    rest = sum(r["delta_us"] for r in rows[top:])
    if rows[top:]:
        out.append(f"| (the other {len(rows) - top}) | | | | | | {rest:+.1f} | {share(rest, gap)} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", help="profile JSON of the reference design (e.g. DIR/ve_auto_auto.json)")
    p.add_argument("b", help="profile JSON of the design compared with it (e.g. DIR/mome_auto_auto.json)")
    p.add_argument("--top", type=int, default=40, help="kernels listed (default 40); the rest are summed")
    args = p.parse_args(argv)
    if args.top < 0:
        p.error(f"--top must be >= 0 (got {args.top})")
    try:
        a, b = load(args.a), load(args.b)
        if a.get("time", "device") != b.get("time", "device"):
            raise ProfileError(f"{args.b}: time is {b.get('time')!r} but {args.a}'s is {a.get('time')!r} "
                               "(a CPU profile cannot be compared with a device profile)")
    except ProfileError as e:
        print(f"profile_diff: error: {e}", file=sys.stderr)
        return 2
    print(render(a, b, args.a, args.b, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
