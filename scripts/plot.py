"""Plots: memory-scaling curves and training curves (PNG + PDF).

    python -m scripts.plot scaling [--table d12_scaling] [--base-table d12]   # val bpb / CORE vs memory params
    python -m scripts.plot curves runs/d12/base/seed42 runs/d12/mome_c1_m6/seed42 [--metric loss]
    python -m scripts.plot families [--table families]    # val bpb / CORE per row of each backbone block, vs paper

Scaling: one line per method (rows named bigram_* and mome_* in the table), mean over seeds with a shaded ±std
band, and the Base row of --base-table as a horizontal band. Curves: the chosen metric of metrics.jsonl
against step for each run directory given. Families: one panel pair per block (rows <block>_<name>), bars of our
mean (with ±std) beside the paper's value; rows without finished runs show the paper's bar only.
"""

import argparse
import math
import sys
from pathlib import Path

from nanochat import report
from nanochat.row_config import REPO
from nanochat.terminal import replace_unencodable_output
from scripts.results import collect_tables, row_notes


class PlotError(ValueError):
    """Bad input or nothing to plot: main prints it and exits 2."""


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> list[Path]:
    """The PNG and the PDF, or neither: a torn file must not pass for a figure."""
    paths = [out.with_suffix(".png"), out.with_suffix(".pdf")]
    path = out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for path in paths:
            fig.savefig(path, bbox_inches="tight", dpi=150)
    except OSError as e:
        for written in paths:
            written.unlink(missing_ok=True)
        raise PlotError(f"cannot write {path}: {e}") from e
    return paths


def table_rows(configs_root, runs_root, table: str) -> list[dict]:
    try:
        return collect_tables(configs_root, Path(runs_root), [table])[table]
    except ValueError as e:  # an unknown table, a missing --runs-root, a corrupt summary.json
        raise PlotError(str(e)) from e


def no_finished_runs(table: str, runs_root, rows: list[dict]) -> PlotError:
    """The refusal of a plot with no averaged seed, with scripts.results's reason for each seed it did not count
    (unfinished, trained with other flags than the row's, diverged, --init-from)."""
    notes = row_notes(rows)
    why = ("; the seeds found, as scripts.results lists them:\n" + "\n".join(notes)) if notes else ""
    return PlotError(f"no finished runs for table {table!r} under {runs_root}{why}")


def scaling_series(rows: list[dict]) -> dict[str, list[dict]]:
    series: dict[str, list[dict]] = {}
    for r in rows:
        if r["seeds"] == 0:
            continue
        method = r["row"].split("_")[0]
        series.setdefault(method, []).append(r)
    for rows in series.values():
        rows.sort(key=lambda r: r["params_memory"])
    return series


def plot_scaling(configs_root, runs_root, table, base_table, out: Path) -> list[Path]:
    plt = _plt()
    rows = table_rows(configs_root, runs_root, table)
    series = scaling_series(rows)
    if not series:
        raise no_finished_runs(table, runs_root, rows)
    base = scaling_series(table_rows(configs_root, runs_root, base_table)).get("base", [])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, title) in zip(axes, [("val_bpb", "val bpb"), ("core", "CORE")]):
        for method, rows in sorted(series.items()):
            if method == "base":
                continue
            x = [r["params_memory"] / 1e6 for r in rows]
            y = [r[key][0] for r in rows]
            s = [0.0 if math.isnan(r[key][1]) else r[key][1] for r in rows]
            ax.plot(x, y, marker="o", label=method)
            ax.fill_between(x, [a - b for a, b in zip(y, s)], [a + b for a, b in zip(y, s)], alpha=0.2)
        if base and not math.isnan(base[0][key][0]):
            m, sd = base[0][key]
            ax.axhline(m, color="gray", linestyle="--", label="base")
            ax.axhspan(m - sd, m + sd, color="gray", alpha=0.15)
        ax.set_xlabel("memory parameters (M)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"memory scaling ({table})")
    paths = _save(fig, out)
    plt.close(fig)
    return paths


def plot_families(configs_root, runs_root, table, out: Path) -> list[Path]:
    plt = _plt()
    rows = table_rows(configs_root, runs_root, table)
    if not any(r["seeds"] for r in rows):  # the paper's bars alone would pass for a comparison
        raise no_finished_runs(table, runs_root, rows)
    blocks: dict[str, list[dict]] = {}  # per backbone block, blocks and rows in the paper's order
    for r in sorted(rows, key=lambda r: r["order"]):
        blocks.setdefault(r["row"].split("_")[0], []).append(r)
    fig, axes = plt.subplots(2, len(blocks), figsize=(4.5 * len(blocks), 6), squeeze=False)
    for col, (block, rows) in enumerate(blocks.items()):
        names = [r["label"].split(" ", 1)[-1] for r in rows]
        x = range(len(rows))
        for ax, (key, title) in zip(axes[:, col], [("val_bpb", "val bpb"), ("core", "CORE")]):
            paper = [r["paper"].get(key, math.nan) for r in rows]
            ours = [r[key][0] for r in rows]
            err = [0.0 if math.isnan(r[key][1]) else r[key][1] for r in rows]
            ax.bar([i - 0.2 for i in x], paper, width=0.4, label="paper", color="lightgray")
            ax.bar([i + 0.2 for i in x], ours, width=0.4, yerr=err, label="ours")
            finite = [v for v in paper + ours if not math.isnan(v)]
            if finite and key == "val_bpb":  # bpb differences are small: zoom on the range
                lo, hi = min(finite), max(finite)
                ax.set_ylim(lo - 0.2 * (hi - lo + 1e-3), hi + 0.2 * (hi - lo + 1e-3))
            ax.set_xticks(list(x), names, rotation=30, fontsize=7)
            ax.set_title(f"{block}: {title}", fontsize=9)
            ax.grid(alpha=0.3, axis="y")
        axes[0, col].legend(fontsize=7)
    fig.tight_layout()
    paths = _save(fig, out)
    plt.close(fig)
    return paths


def read_metrics(run_dir: Path) -> list[dict]:
    try:
        return report.read_metrics(run_dir)
    except (FileNotFoundError, ValueError) as e:
        raise PlotError(str(e)) from e


def plot_curves(run_dirs, metric: str, out: Path) -> list[Path]:
    missing = [str(d) for d in run_dirs if not Path(d).is_dir()]  # a typo, not a run that has not logged yet
    if missing:
        raise PlotError(f"{', '.join(missing)}: no such run directory")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    plotted = 0
    for run_dir in run_dirs:
        has_metrics = (Path(run_dir) / "metrics.jsonl").is_file()
        # a null is no value (e.g. "mfu" on a device of unknown peak): a line of them would be an empty figure
        rows = [r for r in read_metrics(run_dir) if r.get(metric) is not None and "step" in r] if has_metrics else []
        if not rows:  # one run without the metric (killed early, never evaluated) does not stop the others
            print(f"{Path(run_dir).name}: no {metric!r} values, left out of the plot", file=sys.stderr)
            continue
        ax.plot([r["step"] for r in rows], [r[metric] for r in rows], label=str(run_dir))
        plotted += 1
    if not plotted:
        plt.close(fig)
        raise PlotError(f"no run has {metric!r} values in its metrics.jsonl")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    paths = _save(fig, out)
    plt.close(fig)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scaling", help="val bpb and CORE vs memory params")
    s.add_argument("--table", default="d12_scaling")
    s.add_argument("--base-table", default="d12")
    s.add_argument("--configs", default=str(REPO / "configs"))
    s.add_argument("--runs-root", default=str(REPO / "runs"))
    s.add_argument("--out", default=None, help="output path without suffix (default: <runs-root>/results/scaling_<table>)")
    c = sub.add_parser("curves", help="training curves from metrics.jsonl")
    c.add_argument("run_dirs", nargs="+")
    c.add_argument("--metric", default="loss", help="a metrics.jsonl key: loss, grad_norm, val_bpb, tok_per_sec, ...")
    c.add_argument("--out", default=None, help="output path without suffix (default: <first run>/curves_<metric>)")
    f = sub.add_parser("families", help="val bpb and CORE per backbone block, ours vs paper")
    f.add_argument("--table", default="families")
    f.add_argument("--configs", default=str(REPO / "configs"))
    f.add_argument("--runs-root", default=str(REPO / "runs"))
    f.add_argument("--out", default=None, help="output path without suffix (default: <runs-root>/results/<table>)")
    args = p.parse_args(argv)
    try:
        paths = make_plot(args)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("[plot] wrote " + ", ".join(str(x) for x in paths))
    return 0


def make_plot(args) -> list[Path]:
    if args.cmd == "families":
        out = Path(args.out) if args.out else Path(args.runs_root) / "results" / args.table
        paths = plot_families(args.configs, args.runs_root, args.table, out)
    elif args.cmd == "scaling":
        out = Path(args.out) if args.out else Path(args.runs_root) / "results" / f"scaling_{args.table}"
        paths = plot_scaling(args.configs, args.runs_root, args.table, args.base_table, out)
    else:
        out = Path(args.out) if args.out else Path(args.run_dirs[0]) / f"curves_{args.metric}"
        paths = plot_curves(args.run_dirs, args.metric, out)
    return paths


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
