"""Collect finished runs into the paper's tables, with the paper's numbers beside ours.

    python -m scripts.results                      # every table found under runs/
    python -m scripts.results --table d12 --out results/

For each config row (configs/<table>/<row>.toml) the finished seeds under runs/<table>/<row>/seed*/summary.json
are averaged (mean ± std over seeds) for train bpb, val bpb, CORE, memory/total params and throughput.
Writes <out>/<table>.md, .csv and .tex and prints the markdown.
"""

import argparse
import csv
import json
import math
import statistics
from pathlib import Path

from nanochat.row_config import REPO, find_configs, load_row_config

METRICS = [  # (summary key, paper key, column title, format)
    ("train_bpb", "train_bpb", "train bpb", "{:.4f}"),
    ("val_bpb", "val_bpb", "val bpb", "{:.4f}"),
    ("core", "core", "CORE", "{:.4f}"),
]


def mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def collect_row(cfg: dict, runs_root: Path) -> dict:
    row = cfg["row"]
    row_dir = runs_root / row["table"] / row["name"]
    summaries = []
    for path in sorted(row_dir.glob("seed*/summary.json")):
        try:
            summaries.append(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"corrupt {path}: {e}") from e
    out = {"table": row["table"], "row": row["name"], "label": row.get("label", row["name"]),
           "seeds": len(summaries), "paper": cfg.get("paper", {})}
    for key, _, _, _ in METRICS:
        out[key] = mean_std([s.get(key) for s in summaries])
    out["core_label"] = sorted({s.get("core_label") for s in summaries if s.get("core_label")})
    for key in ("params_memory", "params_total", "tok_per_sec"):
        out[key] = mean_std([s.get(key) for s in summaries])[0]
    return out


def _fmt(value: float, std: float | None, fmt: str) -> str:
    if value is None or math.isnan(value):
        return "–"
    s = fmt.format(value)
    return s + (f" ± {fmt.format(std)}" if std is not None and not math.isnan(std) and std > 0 else "")


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["row", "seeds"]
    for _, _, title, _ in METRICS:
        header += [title, f"paper {title}", "Δ"]
    header += ["mem/total params (M)", "paper mem/total (M)", "tok/s"]
    body = []
    for r in rows:
        line = [r["label"], str(r["seeds"])]
        for key, paper_key, _, fmt in METRICS:
            ours, std = r[key]
            paper = r["paper"].get(paper_key)
            delta = "–" if paper is None or math.isnan(ours) else f"{ours - paper:+.4f}"
            line += [_fmt(ours, std, fmt), "–" if paper is None else fmt.format(paper), delta]
        pm, pt = r["params_memory"], r["params_total"]
        line.append("–" if math.isnan(pt) else f"{pm / 1e6:.1f} / {pt / 1e6:.1f}")
        paper_m, paper_t = r["paper"].get("params_memory_m"), r["paper"].get("params_total_m")
        line.append("–" if paper_t is None else f"{paper_m} / {paper_t}")
        line.append("–" if math.isnan(r["tok_per_sec"]) else f"{r['tok_per_sec']:,.0f}")
        body.append(line)
    return header, body


def to_markdown(header, body) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def to_latex(header, body) -> str:
    esc = lambda s: s.replace("±", r"$\pm$").replace("Δ", r"$\Delta$").replace("_", r"\_").replace("%", r"\%")
    lines = [r"\begin{tabular}{" + "l" + "r" * (len(header) - 1) + "}", r"\toprule",
             " & ".join(esc(h) for h in header) + r" \\", r"\midrule"]
    lines += [" & ".join(esc(c) for c in row) + r" \\" for row in body]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=str(REPO / "configs"), help="configs root")
    p.add_argument("--runs-root", default=str(REPO / "runs"), help="root of runs/<table>/<row>/seed<N>")
    p.add_argument("--table", action="append", default=None, help="only these tables (repeatable)")
    p.add_argument("--out", default=None, help="output directory (default: <runs-root>/results)")
    args = p.parse_args(argv)
    runs_root = Path(args.runs_root)
    out_dir = Path(args.out) if args.out else runs_root / "results"
    by_table: dict[str, list[dict]] = {}
    for path in find_configs(args.configs):
        cfg = load_row_config(path)
        if args.table and cfg["row"]["table"] not in args.table:
            continue
        by_table.setdefault(cfg["row"]["table"], []).append(collect_row(cfg, runs_root))
    if not by_table:
        raise SystemExit(f"no configs found under {args.configs} (tables: {args.table or 'all'})")
    out_dir.mkdir(parents=True, exist_ok=True)
    for table, rows in sorted(by_table.items()):
        rows = [r for r in rows if r["seeds"] > 0] or rows
        header, body = table_rows(rows)
        md = to_markdown(header, body)
        (out_dir / f"{table}.md").write_text(md)
        (out_dir / f"{table}.tex").write_text(to_latex(header, body))
        with open(out_dir / f"{table}.csv", "w", newline="") as f:
            csv.writer(f).writerows([header, *body])
        print(f"## {table}\n\n{md}")
    print(f"[results] wrote {out_dir}/<table>.md/.csv/.tex")


if __name__ == "__main__":
    main()
