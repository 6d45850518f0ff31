"""Collect finished runs into the paper's tables, with the paper's numbers beside ours.

    python -m scripts.results                      # every table found under runs/
    python -m scripts.results --table d12 --out results/

For each config row (configs/<table>/<row>.toml) the finished seeds under runs/<table>/<row>/seed*/summary.json
(stop_reason "completed") are averaged (mean ± std over seeds) for train bpb, val bpb, CORE, memory/total params and
throughput; directories that are not the runner's seed<N> (a copy kept aside: seed42.old) or whose config.json
records another --seed than N, unfinished seeds (a seed without summary.json too), runs started from another run's
weights (--init-from), seeds trained with other flags than the row config gives (config.json "args"; layout, logging
and seeds aside) or in part with other learning rates ("lr_overrides") and CORE values over different task sets are
listed under the table instead; so are train bpbs of older runs (summary.json without "train_bpb_rows", before
2026-11-27: the train split's first documents in manifest order) beside seeds whose train bpb read the documents the
run read first, and a mean over manifest-order rows alone says "(rows in manifest order)". A CORE over fewer tasks
than the suite carries its label (e.g. "CORE-21/22"). A mean over fewer seeds than the row's seeds column (a seed
without a CORE, a train bpb on the other kind of rows) says so in its cell ("(2 of 3 seeds)"), and the notes name
the seeds left out.
Seeds of different commits (environment.json) are averaged with a note naming each seed's. Tables whose [paper]
has them get more columns: BB-avg and Wall (the families table), Wall (min) (d12_scaling; ours summary.json
wall_time_s, marked when the seeds ran on another GPU count than the paper's: each seed's sessions' counts, "8+4"
for a seed resumed on 4 GPUs after 8), FineWeb-Edu/enwik9/Shakespeare bpb
(d24; ours what base_eval --bpb-corpus fineweb_edu=PATH (enwik9=, shakespeare=) recorded for the seed's final step
in eval/step_<step>/bpb.json) and the routing controls' Δ val bpb / Δ CORE vs ref (the row minus its [row]
compare_to row). A row with finished seeds that record none of a run-recorded column prints n/a, and a footnote
says what would record it.
Writes <out>/<table>.md, .csv and .tex and prints the markdown. Rows whose config sets ``reconstructed = true``
(a design inferred from the paper's parameter total, not published) carry RECONSTRUCTED_MARK after their label,
and the markdown explains the mark under the table.
Throughput is per GPU (a run's tok/s over its world size; the paper's over [row] nproc_per_node: 4 GPUs for
Table 1, 8 for the sparse-MoE table). It depends on the attention kernel: a row's tok/s names the kernel its runs
used (summary.json "attention"; runs from before it was recorded ran on SDPA) when that differs from the paper's
(``[paper] attention``), e.g. "412,000 (sdpa; paper fa3)", or when the table's rows ran on different kernels.
"""

import argparse
import csv
import functools
import io
import json
import math
import statistics
import sys
from pathlib import Path

from nanochat.cli_types import flag_name, recorded_args, recorded_args_now
from nanochat.jsonfile import read_json_object, write_text_atomic
from nanochat.report import ENVIRONMENT, first_read_rows, fmt_lr_overrides, train_bpb_rows
from nanochat.row_config import REPO, find_configs, load_row_config
from nanochat.terminal import replace_unencodable_output

METRICS = [  # (summary key, paper key, column title, format)
    ("train_bpb", "train_bpb", "train bpb", "{:.4f}"),
    ("val_bpb", "val_bpb", "val bpb", "{:.4f}"),
    ("core", "core", "CORE", "{:.4f}"),
]
# columns shown only for tables whose [paper] reports them (the families table): BigBench mean accuracy (%) and
# training wall time relative to the block's Base row (rows <block>_<name>, Base = <block>_base; ours from tok/s)
OPTIONAL_METRICS = [("bb_avg", "bb_avg", "BB-avg", "{:.2f}"), ("wall_ratio", "wall_ratio", "Wall", "{:.2f}"),
                    # the sweep's wall minutes (ours: summary.json wall_time_s), d24's out-of-domain bpb (ours:
                    # base_eval --bpb-corpus NAME=PATH on the final step) and the routing controls' Δ vs MoME
                    ("wall_min", "wall_min", "Wall (min)", "{:.2f}"),
                    ("fineweb_edu_bpb", "fineweb_edu_bpb", "FineWeb-Edu bpb", "{:.4f}"),
                    ("enwik9_bpb", "enwik9_bpb", "enwik9 bpb", "{:.4f}"),
                    ("shakespeare_bpb", "shakespeare_bpb", "Shakespeare bpb", "{:.4f}"),
                    ("val_bpb_vs_ref", "val_bpb_vs_ref", "Δ val bpb vs ref", "{:+.4f}"),
                    ("core_vs_ref", "core_vs_ref", "Δ CORE vs ref", "{:+.4f}")]
OOD_CORPORA = ("fineweb_edu", "enwik9", "shakespeare")  # base_eval --bpb-corpus NAME=PATH names read for the columns
# why a column of what a run records reads n/a for a row with finished seeds, and what would record it
NOT_RECORDED = {"wall_min": "the seeds' summary.json has no wall_time_s (runs from before it was recorded)",
                **{f"{name}_bpb": f"no {name} corpus in the seed's eval/step_<final step>/bpb.json; python -m "
                   f"scripts.base_eval --run <seed dir> --eval bpb --bpb-corpus {name}=PATH writes it (the "
                   "document-reset protocol; the paper does not say its own)" for name in OOD_CORPORA}}
WALL_NOTE = ("Wall (min): ours is summary.json wall_time_s / 60 (start-up to the end of the final evaluation, compile "
             "and evaluations included) on the seed's GPUs (8+4: a seed resumed on 4 after 8); the paper does not "
             "say what its wall time spans")
RECONSTRUCTED_MARK = " [reconstructed]"
RECONSTRUCTED_NOTE = ("[reconstructed]: the design's structure is inferred from the paper's parameter total, not "
                      "published (see the row config's notes)")
BIGBENCH = ("bigbench_qa_wikidata", "bigbench_dyck_languages", "bigbench_cs_algorithms", "bigbench_operators",
            "bigbench_repeat_copy_logic", "bigbench_language_identification")


def bb_avg(summary: dict) -> float | None:
    """Mean accuracy (%) of the six BigBench CORE tasks, or None when any of them was not evaluated."""
    tasks = summary.get("core_tasks") or {}
    if not all(t in tasks for t in BIGBENCH):
        return None
    return 100.0 * statistics.fmean(tasks[t]["accuracy"] for t in BIGBENCH)


def measured(value) -> bool:
    """Whether a seed has the value (None: not measured; NaN: not a number, e.g. a task that had no examples)."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if measured(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


# flags that change no number of the table: the hardware layout (the runner's --device-batch-size keeps the total
# batch), compilation, logging, periodic evals and checkpoints, and paths (the checkpoint fingerprints the data and
# tokenizer). The attention kernel is marked on the tok/s column instead (attention_mark).
LAYOUT_KEYS = {"device-batch-size", "compile", "attention", "mome-kernels", "log-every", "eval-every", "core-every",
               "eval-every-flops", "sample-every", "save-every", "save-at-flops", "keep-last", "wandb",
               "wandb-project", "max-wall-time-seconds", "eval-batch-size", "tokenizer-dir", "data-dir", "device-type"}
# what the runner sets per start, and base_train's own bookkeeping: the same run whatever they are
BOOKKEEPING_KEYS = {"config", "run-dir", "run-name", "resume", "overwrite", "dry-run", "resume-new-world-size"}
# what a seed of the row differs in: its seeds (the data seed is a seed too, by default --seed), a start from a
# checkpoint (--init-from runs are listed apart, collect_row) or a resume's new LR, and the bookkeeping
RUN_KEYS = {"seed", "data-seed", "init-from", "resume-override-lr"} | BOOKKEEPING_KEYS


def _dests(keys) -> frozenset[str]:
    return frozenset(k.replace("-", "_") for k in keys)  # as config.json's "args" names them


IGNORED_ARGS = _dests(LAYOUT_KEYS | RUN_KEYS)
# what scripts.speedrun_preflight ignores when it asks whether a run is its own, done: a run finished by hand with
# --resume or on another GPU count is; one with another seed is not (the demo's Base and MoME would compare seeds)
SAME_RUN_IGNORED_ARGS = _dests(LAYOUT_KEYS | BOOKKEEPING_KEYS)


@functools.cache
def row_args(config_path: str) -> dict:
    """base_train's args for the row config alone (as the runner starts a seed), JSON-shaped as config.json holds
    them: the row's [train] over base_train's defaults and its design's presets."""
    from nanochat.train_args import parse_args  # imports torch: only for a table that has config.json files

    return json.loads(json.dumps(vars(parse_args(["--config", config_path])), default=str))


def flag_differences(cfg: dict, run_dir: Path, config: dict | None = None) -> list[str]:
    """The flags a seed trained with (config.json "args") that differ from what base_train makes of the row config
    ``cfg`` alone ("--key value (row: value)"), its [train] and every flag it leaves at the default alike (``--
    --matrix-lr 0.05`` or ``-- --num-iterations 2`` on a row that sets neither), in name order; [] for a run without
    config.json (older runs). Flags a run's config.json lacks (added since) are not compared; an older version's
    --core-max-per-task 0 ("all" then) is -1, as base_train --resume reads it (nanochat.train_resume). ``config``:
    the run's config.json when the caller has read it already (run_config)."""
    args = recorded_args_now(recorded_args(run_config(run_dir) if config is None else config))
    if not args:
        return []
    wanted = row_args(cfg["path"])
    return [f"{flag_name(dest)} {args[dest]} (row: {'not set' if value is None else value})"
            for dest, value in sorted(wanted.items())
            if dest not in IGNORED_ARGS and dest in args and args[dest] != value]


def run_config(run_dir: Path) -> dict:
    """A run's config.json; {} for a run without one (older runs)."""
    path = run_dir / "config.json"
    return read_json_object(path, ValueError, "rerun or remove that seed") if path.is_file() else {}


def seed_of_dir(name: str) -> int | None:
    """N of a directory named as scripts.run names a seed's (``seed<N>``, N as str(int) writes it), else None: a
    copy kept aside (seed42.old, seed42_rerun, seed042) is not a second seed 42."""
    digits = name.removeprefix("seed")
    return int(digits) if digits.isascii() and digits.isdigit() and str(int(digits)) == digits else None


def not_a_seed(run_dir: Path, config: dict | None = None) -> str | None:
    """Why ``run_dir`` holds no seed of its row (its name is not scripts.run's seed<N>, or config.json says it
    trained with another --seed than N, e.g. a copy of another seed's directory), else None. ``config``: its
    config.json when the caller has read it already."""
    seed = seed_of_dir(run_dir.name)
    if seed is None:
        return f"{run_dir.name} is not a seed directory of scripts.run (seed<N>, N the seed), not averaged"
    trained = recorded_args(run_config(run_dir) if config is None else config).get("seed")
    if trained is not None and trained != seed:
        return f"{run_dir.name} trained with --seed {trained}, not the seed its directory names, not averaged"
    return None


def collect_row(cfg: dict, runs_root: Path) -> dict:
    """Mean ± std over the row's finished seeds (summary.json with stop_reason "completed"); directories that are
    not a seed of the runner's (not_a_seed), unfinished seeds (no summary.json included), runs started from another
    run's weights (--init-from) and seeds trained with other flags than the row's (flag_differences) or in part with
    other learning rates (config.json "lr_overrides") are listed in ``notes``, never averaged.
    CORE values over different task sets (labels "CORE", "CORE-21/22", ...) are not averaged together either, nor
    train bpbs on other rows (train_bpb_mean); ``averaged`` counts the seeds in each column's mean."""
    row = cfg["row"]
    row_dir = runs_root / row["table"] / row["name"]
    summaries, names, notes, commits, ood, gpus = [], [], [], [], [], []
    for path in sorted(d / "summary.json" for d in row_dir.glob("seed*") if d.is_dir()):
        # read once (the checks below all ask it); a directory that is no seed<N> is refused unread
        config = run_config(path.parent) if seed_of_dir(path.parent.name) is not None else {}
        if (why := not_a_seed(path.parent, config)) is not None:
            notes.append(why)
            continue
        if not path.is_file():  # a seed that is training, or was killed before the end (SIGKILL, OOM, a lost node)
            notes.append(f"{path.parent.name} not finished (no summary.json: still training, or killed before "
                         "writing it), not averaged")
            continue
        summary = read_json_object(path, ValueError, "rerun or remove that seed")
        source = summary.get("init_from")
        diverged = [k for k, _, _, _ in METRICS if isinstance(summary.get(k), float) and not math.isfinite(summary[k])]
        if source:  # the paper's rows train from scratch: a fine-tune's numbers are not a seed of the row
            notes.append(f"{path.parent.name} started from the weights of {source['run_dir']} step {source['step']} "
                         "(--init-from), not averaged")
        elif summary.get("stop_reason") == "completed" and diverged:  # a mean without it would hide the divergence
            notes.append(f"{path.parent.name} has a non-finite {', '.join(f'{k} ({summary[k]})' for k in diverged)}, "
                         "not averaged")
        elif summary.get("stop_reason") == "completed" and (diffs := flag_differences(cfg, path.parent, config)):
            notes.append(f"{path.parent.name} trained with other flags than the row's [train]: {', '.join(diffs)}, "
                         "not averaged")  # a smoke test (-- --num-iterations 2) is not a seed of the row
        elif summary.get("stop_reason") == "completed" and (lrs := fmt_lr_overrides(config)):
            # "args" are the last session's flags: a seed continued with the row's LRs had others before
            notes.append(f"{path.parent.name} trained in part with other learning rates ({lrs}), not averaged")
        elif summary.get("stop_reason") == "completed":
            summaries.append(summary)
            names.append(path.parent.name)
            commits.append(seed_commits(path.parent))
            gpus.append(seed_gpu_counts(summary, config))
            ood.append(final_corpus_bpbs(path.parent, summary))
        else:
            notes.append(f"{path.parent.name} not finished (stop_reason {summary.get('stop_reason')!r}), "
                         "not averaged")
    label = row.get("label", row["name"]) + (RECONSTRUCTED_MARK if row.get("reconstructed") else "")
    out = {"table": row["table"], "row": row["name"], "label": label, "order": row.get("order", 0), "reconstructed": bool(row.get("reconstructed")),
           "seeds": len(summaries), "paper": cfg.get("paper", {}), "compare_to": row.get("compare_to")}
    out["train_bpb"], out["train_bpb_first_read"], rows_notes, train_seeds = train_bpb_mean(names, summaries)
    out["averaged"] = {"train_bpb": train_seeds}  # how many seeds each column's mean holds (the cell says when not all)
    for key, _, _, _ in METRICS:
        if key != "train_bpb":  # train_bpb_mean's: over the seeds whose train bpb read rows of one kind
            out[key] = mean_std([s.get(key) for s in summaries])
            out["averaged"][key] = sum(measured(s.get(key)) for s in summaries)
        if any(measured(s.get(key)) for s in summaries):  # a row without any says so by its "–"
            notes += [f"{name} has no {key}, not in its mean" for name, s in zip(names, summaries)
                      if not measured(s.get(key))]
    notes += rows_notes
    out["core_label"] = sorted({s.get("core_label") or "CORE" for s in summaries if s.get("core") is not None})
    if len(out["core_label"]) > 1:
        out["core"] = (float("nan"), float("nan"))
        notes.append(f"CORE over different task sets ({', '.join(out['core_label'])}), not averaged")
    out["notes"] = notes
    out["attention"] = sorted({s.get("attention", "sdpa") for s in summaries})  # unrecorded: older runs, SDPA
    bb = [bb_avg(s) for s in summaries]
    out["bb_avg"] = mean_std(bb)
    out["averaged"]["bb_avg"] = sum(map(measured, bb))
    if "bb_avg" in out["paper"] and any(map(measured, bb)):  # the families table's column: as a CORE left out
        notes += [f"{name} has no BB-avg (a BigBench task not evaluated, or without examples), not in its mean"
                  for name, value in zip(names, bb) if not measured(value)]
    recorded = {"wall_min": [s["wall_time_s"] / 60 if measured(s.get("wall_time_s")) else None for s in summaries],
                **{f"{c}_bpb": [bpbs.get(c) for bpbs in ood] for c in OOD_CORPORA}}
    for key, values in recorded.items():
        out[key] = mean_std(values)
        out["averaged"][key] = sum(map(measured, values))
        if key in out["paper"] and any(map(measured, values)):
            notes += [f"{name} has no {key}, not in its mean" for name, v in zip(names, values) if not measured(v)]
    out["world_sizes"] = sorted({g for g, w in zip(gpus, recorded["wall_min"]) if measured(w) and g},
                                key=lambda g: [int(n) for n in g.split("+")])
    if len(set(commits) - {"unknown"}) > 1:  # a fix between seeds would hide in the std
        notes.append("seeds of different commits averaged (environment.json): "
                     + "; ".join(f"{name} {c}" for name, c in zip(names, commits)))
    for key in ("params_memory", "params_total", "params_active"):
        out[key] = mean_std([s.get(key) for s in summaries])[0]
    # per GPU (summary.json's tok/s is of all the run's GPUs): seeds on other GPU counts compare, as the paper's does
    out["tok_per_sec"] = mean_std([per_gpu_tok_per_sec(s) for s in summaries])[0]
    out["paper_gpus"] = cfg["row"]["nproc_per_node"]
    return out


def per_gpu_tok_per_sec(summary: dict) -> float | None:
    """A seed's steady tok/s per GPU: summary.json's tok_per_sec_per_gpu (its tokens over the GPU-seconds of every
    session, whatever their world sizes), else (older summaries) tok_per_sec over world_size, the last session's."""
    if measured(summary.get("tok_per_sec_per_gpu")):
        return summary["tok_per_sec_per_gpu"]
    if measured(summary.get("tok_per_sec")) and summary.get("world_size"):
        return summary["tok_per_sec"] / summary["world_size"]
    return None


def final_corpus_bpbs(run_dir: Path, summary: dict) -> dict:
    """{corpus name: bpb} that base_eval --bpb-corpus recorded for the seed's final step (eval/step_<step>/bpb.json,
    read once); {} where it has not been run."""
    step = summary.get("step")
    path = run_dir / "eval" / f"step_{step:06d}" / "bpb.json" if isinstance(step, int) else None
    if path is None or not path.is_file():
        return {}
    corpora = read_json_object(path, ValueError, "rerun base_eval or remove that file").get("corpora")
    return {name: entry["bpb"] for name, entry in (corpora if isinstance(corpora, dict) else {}).items()
            if isinstance(entry, dict) and isinstance(entry.get("bpb"), (int, float))}


def seed_gpu_counts(summary: dict, config: dict) -> str | None:
    """The GPU count of each session of a seed, in order, "+" between them ("8+4": resumed on 4 after 8): config.json's
    world_size_changes (--resume-new-world-size; its checkpoints' record, so a rollback drops a later change) and
    summary.json's world_size (the last session's); None where neither is recorded (older runs)."""
    changes = [c for c in config.get("world_size_changes") or [] if isinstance(c, dict)]
    counts = [changes[0].get("checkpoint")] + [c.get("now") for c in changes] if changes else []
    counts.append(summary.get("world_size"))
    sessions = []
    for count in counts:
        if type(count) is int and count >= 1 and (not sessions or sessions[-1] != count):
            sessions.append(count)
    return "+".join(map(str, sessions)) or None


def seed_commits(run_dir: Path) -> str:
    """The git commit(s) a seed's sessions ran (environment.json), 12 digits each, " + " between the sessions' of a
    resumed run, "(dirty)" after one with uncommitted changes; "unknown" where none is recorded (older runs, no git
    checkout, an unreadable file: it only feeds a note)."""
    try:
        sessions = read_json_object(run_dir / ENVIRONMENT, ValueError).get("sessions")
    except (FileNotFoundError, ValueError):
        return "unknown"
    seen = []
    for env in sessions if isinstance(sessions, list) else []:
        if isinstance(env, dict) and isinstance(env.get("commit"), str):
            name = env["commit"][:12] + (" (dirty)" if env.get("dirty") else "")
            if name not in seen:
                seen.append(name)
    return " + ".join(seen) or "unknown"


def train_bpb_mean(names: list[str], summaries: list[dict]) -> tuple[tuple[float, float], bool, list[str], int]:
    """(mean ± std of the train bpb, whether its rows are the first-read ones, notes, how many seeds the mean holds)
    over the seeds whose train bpb read rows of one kind (nanochat.report.first_read_rows): the first-read ones
    (today's definition) where any seed has them, else the split's first documents in manifest order (runs before
    2026-11-27, imported ones); each seed of the other kind is listed, not averaged."""
    rows = [train_bpb_rows(s) for s in summaries]
    first_read = any(r is not None and first_read_rows(r) for r in rows)
    kept = [s.get("train_bpb") for s, r in zip(summaries, rows) if r is not None and first_read_rows(r) == first_read]
    notes = [f"{name} train bpb on rows in {r}, not averaged with the first-read ones"
             for name, r in zip(names, rows) if r is not None and first_read_rows(r) != first_read]
    return mean_std(kept), first_read, notes, sum(map(measured, kept))


def add_wall_ratios(rows: list[dict]) -> None:
    """wall_ratio = tok/s per GPU of the block's Base row / this row's (same tokens: the training-time ratio)."""
    by_name = {r["row"]: r for r in rows}
    for r in rows:
        base = by_name.get(r["row"].split("_")[0] + "_base")
        ok = base is not None and not math.isnan(base["tok_per_sec"]) and r["tok_per_sec"] > 0
        r["wall_ratio"] = (base["tok_per_sec"] / r["tok_per_sec"] if ok else float("nan"), float("nan"))


def add_ref_deltas(rows: list[dict]) -> None:
    """val_bpb_vs_ref / core_vs_ref = this row's mean - its [row] compare_to row's (the routing controls' "Δ vs
    MoME" columns); NaN where either is missing."""
    by_name = {r["row"]: r for r in rows}
    for r in rows:
        ref = by_name.get(r["compare_to"]) if r["compare_to"] else None
        for key in ("val_bpb", "core"):
            value = r[key][0] - ref[key][0] if ref is not None else float("nan")
            r[f"{key}_vs_ref"] = (value, float("nan"))


def attention_mark(row: dict, mixed_table: bool) -> str:
    """' (sdpa; paper fa3)' after a tok/s measured on another attention kernel than the paper's, ' (fa3)' in a
    table whose rows used different kernels; '' when the numbers compare like for like (or nothing is known)."""
    ours, paper = row["attention"], row["paper"].get("attention")
    if paper is not None and ours != [paper]:
        return f" ({', '.join(ours)}; paper {paper})"
    return f" ({', '.join(ours)})" if mixed_table else ""


def _fmt(value: float, std: float | None, fmt: str) -> str:
    if value is None or math.isnan(value):
        return "–"
    s = _no_negative_zero(fmt.format(value), signed="+" in fmt)
    return s + (f" ± {fmt.format(std)}" if std is not None and not math.isnan(std) and std > 0 else "")


def _no_negative_zero(text: str, signed: bool = True) -> str:
    """"-0.0000" (a negative value that rounds to zero) as "+0.0000", or "0.0000" for an unsigned format."""
    if text.startswith("-") and not text.strip("-0.,"):
        return ("+" if signed else "") + text[1:]
    return text


def fmt_delta(value: float) -> str:
    """A signed Δ to 4 decimals; "+0.0000" for one that rounds to zero (not "-0.0000": -0.00004 is no sign)."""
    return _no_negative_zero(f"{value:+.4f}")


def paper_tok_per_sec(row: dict) -> float | None:
    """The paper's training throughput per GPU (tok/s) of a row: [paper] tok_per_sec (the sparse-MoE table, 8 x H100)
    or tok_per_sec_m in millions (Table 1's "1.15M tok/s", 4 GPUs) over the row's GPUs ([row] nproc_per_node); None
    where the paper gives none."""
    paper = row["paper"]
    total = paper["tok_per_sec"] if "tok_per_sec" in paper else paper.get("tok_per_sec_m", math.nan) * 1e6
    return None if math.isnan(total) else total / row["paper_gpus"]


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    metrics = METRICS + [m for m in OPTIONAL_METRICS if any(m[1] in r["paper"] for r in rows)]
    header = ["row", "seeds"]
    for _, _, title, _ in metrics:
        header += [title, f"paper {title}", "Δ"]
    header += ["mem/total params (M)", "paper mem/total (M)", "tok/s per GPU"]
    # the sparse-MoE table also reports active parameters per token; it and Table 1 (d12) the paper's own throughput
    active = any("params_active_m" in r["paper"] for r in rows)
    paper_tps = any(paper_tok_per_sec(r) is not None for r in rows)
    header += ["active params (M)", "paper active (M)"] if active else []
    header += ["paper tok/s per GPU"] if paper_tps else []
    mixed_table = len({a for r in rows if not math.isnan(r["tok_per_sec"]) for a in r["attention"]}) > 1
    body = []
    for r in rows:
        line = [r["label"], str(r["seeds"])]
        for key, paper_key, _, fmt in metrics:
            ours, std = r.get(key, (float("nan"), float("nan")))
            paper = r["paper"].get(paper_key)
            delta = "–" if paper is None or math.isnan(ours) else fmt_delta(ours - paper)
            cell = _fmt(ours, std, fmt)
            if key == "core" and r.get("core_label", ["CORE"]) != ["CORE"] and not math.isnan(ours):
                cell += f" ({r['core_label'][0]})"  # fewer tasks than the paper's CORE
            if key == "train_bpb" and not r.get("train_bpb_first_read", True) and not math.isnan(ours):
                cell += " (rows in manifest order)"  # not the documents the run read first, as since 2026-11-27
            averaged = r.get("averaged", {}).get(key, r["seeds"])
            if 0 < averaged < r["seeds"] and not math.isnan(ours):  # the notes under the table name the others
                cell += f" ({averaged} of {r['seeds']} seeds)"
            if key in NOT_RECORDED and r["seeds"] and not averaged:
                cell = "n/a"  # the seeds do not record it: a footnote says what would
            if key == "wall_min" and r["world_sizes"] not in ([], [str(r["paper_gpus"])]) and not math.isnan(ours):
                cell += f" ({', '.join(r['world_sizes'])} GPUs; paper {r['paper_gpus']})"
            paper_std = r["paper"].get(f"{paper_key}_std")
            line += [cell, "–" if paper is None else _fmt(paper, paper_std, fmt), delta]
        pm, pt = r["params_memory"], r["params_total"]
        line.append("–" if math.isnan(pt) else f"{pm / 1e6:.1f} / {pt / 1e6:.1f}")
        paper_m, paper_t = r["paper"].get("params_memory_m"), r["paper"].get("params_total_m")
        line.append("–" if paper_m is None and paper_t is None else f"{paper_m if paper_m is not None else '–'} / "
                    f"{paper_t if paper_t is not None else '–'}")
        tok_s = r["tok_per_sec"]
        line.append("–" if math.isnan(tok_s) else f"{tok_s:,.0f}" + attention_mark(r, mixed_table))
        if active:
            line.append("–" if math.isnan(r["params_active"]) else f"{r['params_active'] / 1e6:.1f}")
            line.append(str(r["paper"].get("params_active_m", "–")))
        if paper_tps:
            tps = paper_tok_per_sec(r)
            line.append("–" if tps is None else f"{tps:,.0f}")
        body.append(line)
    return header, body


def column_notes(rows: list[dict], header: list[str]) -> list[str]:
    """The footnotes of the columns shown: how ours is measured, what would record an n/a, what a Δ vs ref is."""
    shown = {key: title for key, _, title, _ in OPTIONAL_METRICS if title in header}
    notes = [WALL_NOTE] if "wall_min" in shown else []
    for key, why in NOT_RECORDED.items():
        if key in shown and any(r["seeds"] and not r["averaged"].get(key) for r in rows):
            notes.append(f"n/a in {shown[key]}: {why}")
    labels = {r["row"]: r["label"] for r in rows}
    pairs = [f"{r['label']} vs {labels[r['compare_to']]}" for r in rows if r["compare_to"] in labels
             and r["seeds"]]
    if pairs and "val_bpb_vs_ref" in shown:
        notes.append(f"{shown['val_bpb_vs_ref']}, {shown['core_vs_ref']}: a row's mean minus that of the row its "
                     f"[row] compare_to names ({'; '.join(pairs)}), as the paper's columns")
    return notes


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


def collect_tables(configs, runs_root: Path, tables: list[str] | None) -> dict[str, list[dict]]:
    """{table: rows} of the row configs under ``configs`` (only ``tables`` when given); ValueError names an unknown
    table or a missing --runs-root (a typo would print the paper's numbers beside no run of ours), and two configs of
    one row (a copy whose [row] name was left: the row's seeds would be shown twice)."""
    configs_by_table: dict[str, list[dict]] = {}
    paths_by_row: dict[tuple[str, str], Path] = {}
    for path in find_configs(configs):
        cfg = load_row_config(path)
        table, name = cfg["row"]["table"], cfg["row"]["name"]
        if (first := paths_by_row.setdefault((table, name), path)) != path:  # both would read that row's seeds
            raise ValueError(f"{first} and {path} are both row {table}/{name} (runs/{table}/{name}/): give each row "
                             "config a [row] name of its own")
        configs_by_table.setdefault(table, []).append(cfg)
    if not configs_by_table:
        raise ValueError(f"--configs {configs}: no row configs found")
    unknown = [t for t in tables or [] if t not in configs_by_table]
    if unknown:
        raise ValueError(f"--table {', '.join(unknown)}: no such table under {configs} (known: "
                         f"{', '.join(sorted(configs_by_table))})")
    if not runs_root.is_dir():
        raise ValueError(f"--runs-root {runs_root}: directory does not exist")
    return {table: [collect_row(cfg, runs_root) for cfg in cfgs] for table, cfgs in configs_by_table.items()
            if not tables or table in tables}


def row_notes(rows: list[dict]) -> list[str]:
    """'- label: note' for each note of each row (the seeds not averaged and why), as printed under the table;
    scripts.plot gives them when no seed is left to plot."""
    return [f"- {r['label']}: {n}" for r in rows for n in r["notes"]]


def table_markdown(rows: list[dict]) -> tuple[str, list, list]:
    """(markdown with the notes under the table, header, body)."""
    header, body = table_rows(rows)
    md = to_markdown(header, body)
    if any(r["reconstructed"] for r in rows):
        md += f"\n{RECONSTRUCTED_NOTE}\n"
    if column := column_notes(rows, header):
        md += "\n" + "\n".join(column) + "\n"
    notes = row_notes(rows)
    if notes:
        md += "\n" + "\n".join(notes) + "\n"
    return md, header, body


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=str(REPO / "configs"), help="configs root")
    p.add_argument("--runs-root", default=str(REPO / "runs"), help="root of runs/<table>/<row>/seed<N>")
    p.add_argument("--table", action="append", default=None, help="only these tables (repeatable)")
    p.add_argument("--out", default=None, help="output directory (default: <runs-root>/results)")
    args = p.parse_args(argv)
    runs_root = Path(args.runs_root)
    out_dir = Path(args.out) if args.out else runs_root / "results"
    try:
        by_table = collect_tables(args.configs, runs_root, args.table)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for table, rows in sorted(by_table.items()):
        rows.sort(key=lambda r: r["order"])  # the paper's order (stable: file order among equal ones)
        add_wall_ratios(rows)
        add_ref_deltas(rows)
        rows = [r for r in rows if r["seeds"] > 0 or r["notes"]] or rows
        md, header, body = table_markdown(rows)
        csv_text = io.StringIO(newline="")
        csv.writer(csv_text).writerows([header, *body])
        try:  # each file whole or not at all: a full disk or a kill must not leave a torn table
            out_dir.mkdir(parents=True, exist_ok=True)
            for suffix, text in ((".md", md), (".tex", to_latex(header, body)), (".csv", csv_text.getvalue())):
                write_text_atomic(out_dir / f"{table}{suffix}", text)
        except OSError as e:
            print(f"error: cannot write the tables under --out {out_dir}: {e}", file=sys.stderr)
            return 2
        print(f"## {table}\n\n{md}")
    print(f"[results] wrote {', '.join(sorted(by_table))} to {out_dir} (.md, .csv, .tex each)")
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
