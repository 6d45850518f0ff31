"""Compare training runs: one markdown report plus the loss/bpb curves as a PNG, from the run directories' files.

    python -m scripts.report runs/A runs/B ...                       # -> <common parent>/report.md + _curves.png
    python -m scripts.report runs/A runs/B --output OUT.md --title "..."
    python -m scripts.report runs/A --run-report                     # rebuild runs/A/report.md (one run's report)
    python -m scripts.report runs/A runs/B --check-completed         # exit 1 unless every run trained all steps
    python -m scripts.report runs/speedrun_cpu/base runs/speedrun_cpu/mome --output runs/speedrun_cpu/report.md \\
        --readme README.md                                           # also put the table in the README

The table (printed too) has one row per run: params, steps, tokens, train minutes, val bpb, CORE; then
throughput (tok/s) and MFU, and where each run came from (commit, dirty flag, hardware, world size, versions).
``--readme FILE`` replaces the table between the ``<!-- cpu-demo-table -->`` and ``<!-- /cpu-demo-table -->``
lines of FILE, so the README shows exactly what the last CPU demo printed; there a row trained in part with other
learning rates (--resume-override-lr) is marked † and a line under the table says how.
"""

import argparse
import os
import shlex
import sys
from pathlib import Path

from nanochat.cli_types import dest_name
from nanochat.jsonfile import write_text_atomic
from nanochat.report import (NA, comparison_table, fmt_mfu, fmt_throughput, lr_override_notes, provenance_table,
                             read_metrics, run_facts, run_labels, unfinished, write_run_report)
from nanochat.terminal import replace_unencodable_output

README_START, README_END = "<!-- cpu-demo-table -->", "<!-- /cpu-demo-table -->"
LR_MARK = "†"  # the README table's mark of a row trained in part with other LRs (--resume-override-lr)


def default_output(run_dirs: list[Path]) -> Path:
    """<common parent>/report.md; comparison.md when that directory is itself a run (its report.md is taken)."""
    parent = Path(os.path.commonpath([str(p.resolve()) for p in run_dirs]))
    return parent / ("comparison.md" if (parent / "config.json").is_file() else "report.md")


def curve_series(run_dir: Path) -> dict:
    """{"loss": [(tokens, train loss)], "val_bpb": [(tokens, val bpb)]} from metrics.jsonl (empty without one:
    a run killed before its first log)."""
    out = {"loss": [], "val_bpb": []}
    if not (Path(run_dir) / "metrics.jsonl").is_file():
        return out
    for r in read_metrics(run_dir):
        if r.get("kind") == "train" and "loss" in r:
            out["loss"].append((r.get("tokens", r["step"]), r["loss"]))
        elif r.get("kind") in ("eval", "final") and r.get("val_bpb") is not None:
            out["val_bpb"].append((r.get("tokens", r["step"]), r["val_bpb"]))
    return out


def plot_curves(facts: list[dict], out: Path) -> Path:
    from scripts.plot import _plt

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for f, name in zip(facts, run_labels(facts)):
        series = curve_series(f["run_dir"])
        for ax, key in zip(axes, ("loss", "val_bpb")):
            if series[key]:
                x, y = zip(*series[key])
                ax.plot(x, y, marker="o" if len(x) < 5 else None, label=name)
    for ax, ylabel in zip(axes, ("train loss (nats/token)", "val bpb")):
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, bbox_inches="tight", dpi=120)
    except OSError as e:
        out.unlink(missing_ok=True)  # a torn PNG must not pass for the curves
        raise OutputError(f"cannot write {out}: {e}") from e
    finally:
        plt.close(fig)
    return out


def comparison_report(facts: list[dict], title: str, curves: Path | None, command: str) -> str:
    lines, labels = [f"# {title}", "", *comparison_table(facts), ""], run_labels(facts)
    # a row trained in part with other LRs than its flags' (--resume-override-lr): said under the table it is in
    lines += [f"- {label}: learning rates {note}" for label, note in lr_override_notes(facts)]
    lines += [""] if lines[-1] != "" else []
    if curves is not None:
        lines += [f"![train loss and val bpb against tokens]({curves.name})", ""]
        lines += [f"- {label}: no metrics.jsonl (stopped before its first log): no curves"
                  for f, label in zip(facts, labels) if not (Path(f["run_dir"]) / "metrics.jsonl").is_file()]
        lines += [""] if lines[-1] != "" else []
    lines += ["## Throughput", "", "| run | tok/s | MFU | wall min |", "|---|---|---|---:|"]
    for f, label in zip(facts, labels):
        wall = f["summary"].get("wall_time_s")
        lines.append(f"| {label} | {fmt_throughput(f['summary'])} | {fmt_mfu(f['summary'], f['env'], f['sessions'])} | "
                     f"{f'{wall / 60:.1f}' if wall is not None else NA} |")
    lines += ["", "## Provenance", "", *provenance_table(facts), "",
              f"Written by `{command}` from each run directory's config.json, summary.json, metrics.jsonl and "
              "environment.json; each run's own report is its report.md."]
    return "\n".join(lines) + "\n"


def readme_table(facts: list[dict]) -> list[str]:
    """The table --readme writes (and main prints): a row trained in part with other LRs marked, and a line for each
    such run under it, each after a blank line (a line right below a table is one of its rows, and two lines in a
    row are one markdown paragraph)."""
    notes = [f"{LR_MARK} {label}: learning rates {note}" for label, note in lr_override_notes(facts)]
    return [*comparison_table(facts, LR_MARK), *(line for note in notes for line in ("", note))]


def replace_readme_table(readme: Path, table: list[str]) -> None:
    text = readme.read_text(encoding="utf-8")
    if text.count(README_START) != 1 or text.count(README_END) != 1:
        raise ValueError(f"{readme} needs exactly one {README_START} line and one {README_END} line around the "
                         "table to replace")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    write_output(readme, head + README_START + "\n" + "\n".join(table) + "\n" + README_END + tail)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", type=Path, help="run directories (each with config.json/summary.json)")
    p.add_argument("--output", type=Path, default=None,
                   help="markdown file to write (default: <common parent of the runs>/report.md); the curves go "
                   "next to it as <name>_curves.png")
    p.add_argument("--title", default=None, help="report title (default: Run comparison)")
    p.add_argument("--no-curves", action="store_true", help="skip the PNG")
    p.add_argument("--readme", type=Path, default=None, help="also replace the CPU-demo table in this README")
    p.add_argument("--run-report", action="store_true", help="rebuild each run's own report.md instead")
    p.add_argument("--check-completed", action="store_true",
                   help="only check that every run trained all its steps: print where the others stopped, exit 1")
    args = p.parse_args(argv)
    comparison = {"--output": args.output, "--title": args.title, "--no-curves": args.no_curves or None,
                  "--readme": args.readme}
    for mode, others in (("--check-completed", {"--run-report": args.run_report or None, **comparison}),
                         ("--run-report", comparison)):
        given = [flag for flag, value in others.items() if value is not None]
        if getattr(args, dest_name(mode)) and given:  # the other flags would be silently ignored
            p.error(f"{mode} cannot be combined with {', '.join(given)}")
    args.title = args.title or "Run comparison"
    return args


def write_output(path: Path, text: str) -> None:
    """Atomically (a full disk or a kill mid-write must not empty the README); OutputError names the file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e}") from e


class OutputError(Exception):
    pass


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "scripts.report", *(sys.argv[1:] if argv is None else argv)])
    try:
        if args.check_completed:
            problems = [p for p in map(unfinished, args.run_dirs) if p]
            for p in problems:
                print(f"not completed: {p}", file=sys.stderr)
            return 1 if problems else 0
        if args.run_report:
            for run_dir in args.run_dirs:
                try:
                    print(f"wrote {write_run_report(run_dir)}")
                except OSError as e:
                    raise OutputError(f"cannot write {run_dir}/report.md: {e}") from e
            return 0
        facts = [run_facts(d) for d in args.run_dirs]
        out = args.output or default_output(args.run_dirs)
        curves = None if args.no_curves else plot_curves(facts, out.with_name(out.stem + "_curves.png"))
        write_output(out, comparison_report(facts, args.title, curves, command))
        table = readme_table(facts)
        if args.readme is not None:
            replace_readme_table(args.readme, table)
    except (FileNotFoundError, ValueError, OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(table))
    print(f"report written to {out}" + (f" (curves: {curves})" if curves else "")
          + (f"; table written to {args.readme}" if args.readme else ""))
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
