"""Run reports: ``report.md`` in every run directory, and the rows/tables that compare several runs.

The trainer records where a run came from when each training session starts (``record_environment``:
``environment.json``, one entry per session, since a resumed run may continue on other code or hardware) and
writes ``report.md`` from the run directory at the end (``write_run_report``). Everything in a report is read
back from files of the run directory:

    config.json       resolved flags, model config, plan, world size
    summary.json      steps, tokens, wall/train time, throughput (tok_per_sec, MFU when present), final metrics
    metrics.jsonl     the logged records (train loss, evals)
    environment.json  per session: git commit + dirty flag, Python/torch/CUDA/driver versions, devices, world size

so a report can be rebuilt later on any machine (``python -m scripts.report RUN_DIR``) and says "n/a" for
whatever an older run did not record.
"""

import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from nanochat.cli_types import flag_name, recorded_args
from nanochat.jsonfile import read_json_object, write_text_atomic
from nanochat.row_config import REPO

ENVIRONMENT = "environment.json"
REPORT = "report.md"
NA = "n/a"


# ---- environment -------------------------------------------------------------------------------------------
def _run(cmd: list[str], cwd=None) -> str | None:
    """stdout of ``cmd`` (stripped), or None when it is missing, fails or hangs. Bytes that are not UTF-8 (an
    uncommitted Latin-1 edit in a diff) come through as surrogates, which ``.encode(errors="surrogateescape")``
    turns back into them: strict decoding raised, and failed every evaluation's fingerprint."""
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, encoding="utf-8", errors="surrogateescape",
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state(repo: Path = REPO) -> dict:
    """{"commit": sha or None, "dirty": bool or None}; dirty = tracked files differ from the commit."""
    commit = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def code_version(repo: Path = REPO, paths=("nanochat", "scripts")) -> dict:
    """{"trees", "diff_sha256"}: git's ids of the committed ``paths`` (the code) and a hash of their uncommitted
    changes (None when clean): another commit that leaves the code alone (docs, tests) keeps the version, an edit
    of the code after the commit changes it. Both None outside a git checkout."""
    import hashlib

    trees = _run(["git", "rev-parse", *(f"HEAD:{p}" for p in paths)], cwd=repo)
    diff = _run(["git", "diff", "HEAD", "--", *paths], cwd=repo) if trees else None
    return {"trees": trees.split() if trees else None,
            "diff_sha256": hashlib.sha256(diff.encode(errors="surrogateescape")).hexdigest() if diff else None}


def nvidia_driver_version() -> str | None:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment(device, world_size: int) -> dict:
    """Facts about this process: code, software, hardware. ``device`` is the torch device the run trains on."""
    import torch

    device = torch.device(device)
    env = {"started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), **git_state(),
           "command": shlex.join(getattr(sys, "orig_argv", sys.argv)), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "driver": None, "platform": platform.platform(),
           "device_type": device.type, "device_name": None, "device_count": None, "world_size": world_size,
           "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
           "cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env.update(device_name=torch.cuda.get_device_name(device), device_count=torch.cuda.device_count(),
                   driver=nvidia_driver_version())
    elif device.type == "cpu":
        env.update(device_name=env["cpu"], device_count=1)
    return env


def record_environment(run_dir, device, world_size: int, fresh: bool) -> dict:
    """Append this session's environment to ``<run_dir>/environment.json`` (start it afresh for a new run)."""
    path = Path(run_dir) / ENVIRONMENT
    sessions = [] if fresh else read_json(path, {}).get("sessions", [])
    session = environment(device, world_size)
    sessions.append(session)
    write_text_atomic(path, json.dumps({"sessions": sessions}, indent=2) + "\n")
    return session


# ---- reading a run -----------------------------------------------------------------------------------------
def read_json(path, default=None):
    """The JSON object in ``path``, ``default`` when there is no file; ValueError naming the file otherwise."""
    try:
        return read_json_object(path, ValueError)  # every run file is an object: a list would fail later on .get
    except FileNotFoundError:
        return default


def read_metrics(run_dir) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl``; a torn last line (crash mid-write) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (is {run_dir} a run directory?)")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i < len(lines):
                raise ValueError(f"{path}:{i}: invalid JSON ({e})") from e
    return rows


def unfinished(run_dir) -> str | None:
    """None when the run trained all its steps; else one line saying where and why it stopped."""
    summary = read_json(Path(run_dir) / "summary.json")
    if summary is None:
        return f"{run_dir}: no summary.json (the run never finished: still running, killed or crashed)"
    if summary.get("stop_reason") == "completed":
        return None
    return (f"{run_dir}: stopped at step {summary.get('step')} of {summary.get('num_iterations')} "
            f"(stop reason: {summary.get('stop_reason')})")


def run_facts(run_dir) -> dict:
    """Everything a report shows about one run, from its files (missing values are None)."""
    run_dir = Path(run_dir)
    config, summary = read_json(run_dir / "config.json"), read_json(run_dir / "summary.json")
    if config is None and summary is None:
        raise FileNotFoundError(f"{run_dir} has neither config.json nor summary.json: not a run directory")
    config, summary = config or {}, summary or {}
    args, plan = recorded_args(config), config.get("plan") or {}
    sessions = read_json(run_dir / ENVIRONMENT, {}).get("sessions", [])
    data_dir = None if args.get("synthetic_data") else _data_dir(run_dir, config, args)
    return {"run_dir": str(run_dir), "run_name": summary.get("run_name") or args.get("run_name") or run_dir.name,
            "memory": config.get("model_config", {}).get("memory"), "config": config, "summary": summary,
            "args": args, "plan": plan, "sessions": sessions, "env": sessions[-1] if sessions else {},
            "data_dir": data_dir, "data_manifest": _manifest(data_dir)}


def _data_dir(run_dir: Path, config: dict, args: dict) -> str | None:
    """The data directory the run read: the resolved path its last checkpoint's meta.json records (the default one
    included, as $NANOCHAT_DATA_DIR or the cache resolved it then); before any checkpoint, config.json's (resolved
    too), else (an older run's config.json) --data-dir as given."""
    from nanochat import checkpoint as ckpt  # torch: imported only by the reports that need it

    steps = ckpt.list_steps(run_dir)
    try:
        recorded = ckpt.load_meta(run_dir, steps[-1]).get("data_dir") if steps else None
    except ValueError:  # a corrupt meta.json: the flags still tell what they can
        recorded = None
    return recorded or (config.get("data") or {}).get("data_dir") or args.get("data_dir")


def _manifest(data_dir: str | None) -> dict:
    if not data_dir:
        return {}
    try:
        return read_json(Path(data_dir) / "manifest.json", {}) or {}
    except ValueError:
        return {}


# ---- which rows a train bpb read ----------------------------------------------------------------------------
# summary.json's and bpb.json's "train_bpb_rows": nanochat.dataloader.eval_rows_order's description of the train
# rows ("first read with --data-seed N": the documents the run's loader reads first, since 2026-11-27), or for a run
# that records no --data-seed (an imported one) the split's first documents:
MANIFEST_ROWS = "manifest order (no --data-seed recorded)"
# a train bpb recorded without its rows: written before 2026-11-27 (commit 23ff4d5), on the split's first documents
UNRECORDED_ROWS = "manifest order (before 2026-11-27)"
FIRST_READ = "first read"  # how eval_rows_order's first-read descriptions begin


def train_rows_description(rows_key: dict) -> str:
    """The "train_bpb_rows" of a train bpb measured on the rows of ``rows_key`` (eval_rows_order's fingerprint
    entry for the train split)."""
    return rows_key.get("rows") or MANIFEST_ROWS


def train_bpb_rows(summary: dict) -> str | None:
    """Which rows the train bpb of ``summary`` read (None: it has none)."""
    if summary.get("train_bpb") is None:
        return None
    return summary.get("train_bpb_rows") or UNRECORDED_ROWS


def first_read_rows(description: str) -> bool:
    """Rows of the documents the run read first, not the split's first ones in manifest order: the two measure
    different data (seen early in training, or maybe never read), so their train bpbs are not averaged together."""
    return description.startswith(FIRST_READ)


# ---- formatting --------------------------------------------------------------------------------------------
def fmt(value, spec: str = "", suffix: str = "") -> str:
    """None (not measured) is n/a; NaN (a diverged run) stays visible as NaN."""
    if value is None:
        return NA
    if isinstance(value, float) and value != value:
        return "NaN"
    return f"{value:{spec}}{suffix}"


def fmt_duration(seconds) -> str:
    if seconds is None:
        return NA
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def fmt_core(summary: dict) -> str:
    if summary.get("core") is None:
        return NA
    return f"{summary['core']:.4f} ({summary.get('core_label', 'CORE')})"


def fmt_mfu(summary: dict, env: dict, sessions: list[dict] | None = None) -> str:
    """MFU in percent. A timed run without one (None; 0 in older summaries) ran on a device with no known peak
    FLOP/s (CPU, unlisted GPU): the devices of its ``sessions`` (environment.json's) that have none are named, else
    the last session's (``env``); no "mfu" key, or no timed steps, is plain n/a."""
    value = summary.get("mfu")
    if value is not None and value > 0:
        return f"{value:.2f}%"
    if "mfu" in summary and (value == 0 or summary.get("tok_per_sec") is not None):
        unknown = list(dict.fromkeys(s.get("device_name") for s in sessions or () if not _known_peak(s)))
        names = ", ".join(n or "a device not named" for n in unknown) or env.get("device_name") or "this device"
        return f"{NA} (no peak FLOP/s known for {names})"
    return NA


def _known_peak(session: dict) -> bool:
    from nanochat.metrics import gpu_peak_flops  # torch: imported only by the reports that need it

    return session.get("device_type") == "cuda" and gpu_peak_flops(session.get("device_name") or "") is not None


def fmt_throughput(summary: dict) -> str:
    """Steady-state tok/s with its attention kernel, what it covers (tok_per_sec_steps / _note), per GPU (where the
    run had more than one), the all-steps figure, any other tok_per_sec_* key as it is."""
    value, notes = summary.get("tok_per_sec"), []
    if summary.get("attention"):  # throughput depends on it (--attention); absent in older summaries
        computed = summary.get("attention_dtype")  # FlashAttention under --dtype float32: bfloat16
        shown = computed is not None and computed != summary.get("dtype")
        notes.append(f"attention {summary['attention']}" + (f" in {computed}" if shown else ""))
    if summary.get("tok_per_sec_note"):
        notes.append(str(summary["tok_per_sec_note"]))
    if summary.get("tok_per_sec_steps") is not None:
        notes.append(f"timed steps: {summary['tok_per_sec_steps']:,}")
    per_gpu = summary.get("tok_per_sec_per_gpu")
    if per_gpu is not None and not (value is not None and math.isclose(per_gpu, value, rel_tol=1e-9)):  # 1 GPU
        notes.append(f"per GPU: {per_gpu:,.0f}")
    if summary.get("tok_per_sec_all_steps") is not None:
        notes.append(f"all steps incl. warm-up: {summary['tok_per_sec_all_steps']:,.0f}")
    known = {"tok_per_sec", "tok_per_sec_note", "tok_per_sec_steps", "tok_per_sec_per_gpu", "tok_per_sec_all_steps"}
    notes += [f"{k}: {summary[k]}" for k in sorted(summary) if k.startswith("tok_per_sec") and k not in known]
    text = NA if value is None else f"{value:,.0f}"
    return text + (f" ({'; '.join(notes)})" if notes else "")


def fmt_code(env: dict) -> str:
    if not env.get("commit"):
        return NA
    dirty = {True: "dirty: uncommitted changes", False: "clean", None: "dirty: unknown"}[env.get("dirty")]
    return f"`{env['commit'][:12]}` ({dirty})"


def fmt_hardware(env: dict) -> str:
    if not env:
        return NA
    count = env.get("device_count")
    if env.get("device_type") == "cuda":
        return f"{count} x {env.get('device_name')} visible"
    if env.get("device_type") == "cpu":
        return f"CPU: {env.get('cpu') or NA} ({env.get('cpu_count')} cores, {env.get('torch_threads')} torch threads)"
    return str(env.get("device_type"))


def fmt_software(env: dict) -> str:
    if not env:
        return NA
    return (f"Python {env.get('python')}, torch {env.get('torch')}, CUDA {env.get('cuda') or NA}, "
            f"driver {env.get('driver') or NA}")


def fmt_data(facts: dict) -> str:
    args, manifest = facts["args"], facts["data_manifest"]
    if args.get("synthetic_data"):
        return "synthetic token stream (--synthetic-data)"
    # the dataset trained on (its manifest's, recorded in config.json "data" since session 33), else --dataset:
    # with --data-dir the flag is only a label (docs/extending.md trains on the embedded corpus as fineweb-edu)
    flag = args.get("dataset")
    dataset = (facts["config"].get("data") or {}).get("dataset") or flag or NA
    text = f"{dataset} in `{facts['data_dir'] or 'the default data dir'}`"
    notes = []
    if manifest.get("source"):
        notes.append(f"source: {manifest['source']}" + (f" @ {', '.join(r[:12] for r in manifest['hub_revision'])}"
                                                        if manifest.get("hub_revision") else ""))
    if flag and flag != dataset:
        notes.append(f"--dataset {flag}")
    return text + (f" ({'; '.join(notes)})" if notes else "")


def fmt_init(config: dict, args: dict) -> str:
    """Where the weights came from: a random init (its seed) or an --init-from source (tokens/FLOPs above are
    this run's only)."""
    source = config.get("init_from")
    if not source:
        return f"random init (--seed {fmt(args.get('seed'))})"
    return (f"--init-from `{source['run_dir']}` step {source['step']} (model.pt sha256 "
            f"{source['model_sha256'][:12]}); tokens and FLOPs below are this run's only")


def fmt_lr_overrides(config: dict) -> str | None:
    """The --resume-override-lr changes config.json records (lr_overrides, in the order they were made) on one line,
    so a run finished with other LRs (a non-finite stop's advice) does not read as trained with its flags' LRs
    throughout; None for a run without any (and an older run, which records none)."""
    changes = [f"{flag_name(key)} {change.get('checkpoint')} -> {change.get('now')} from step "
               f"{entry.get('step')}" for entry in config.get("lr_overrides") or []
               for key, change in (entry.get("changes") or {}).items()]
    return f"overridden by hand (--resume-override-lr): {', '.join(changes)}" if changes else None


def _kv_table(rows: list[tuple[str, str]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def run_report(run_dir) -> str:
    """The markdown of one run's report.md."""
    f = run_facts(run_dir)
    s, env, plan, args = f["summary"], f["env"], f["plan"], f["args"]
    lines = [f"# Run report: {f['run_name']}", "",
             f"Stop reason: {s.get('stop_reason', 'not finished (no summary.json)')}, step {fmt(s.get('step'))} of "
             f"{fmt(s.get('num_iterations', plan.get('num_iterations')))}. Run directory `{f['run_dir']}`.", "",
             "## Provenance", ""]
    lines += _kv_table([("code", fmt_code(env)), ("software", fmt_software(env)),
                        ("hardware", fmt_hardware(env)), ("world size", fmt(env.get("world_size"))),
                        ("platform", env.get("platform") or NA), ("started (UTC)", env.get("started_utc") or NA),
                        ("command", f"`{env['command']}`" if env.get("command") else NA),
                        ("data", fmt_data(f)), ("initial weights", fmt_init(f["config"], args))])
    if len(f["sessions"]) > 1:
        lines += ["", f"Trained in {len(f['sessions'])} sessions (resumed):", "",
                  "| session | started (UTC) | code | hardware | world size |", "|---:|---|---|---|---:|"]
        lines += [f"| {i} | {e.get('started_utc', NA)} | {fmt_code(e)} | {fmt_hardware(e)} | {fmt(e.get('world_size'))} |"
                  for i, e in enumerate(f["sessions"], 1)]
    lines += ["", "## Model and training", ""]
    lrs = fmt_lr_overrides(f["config"])  # a row only for a run resumed with other LRs
    lines += _kv_table([
        ("memory", f"{f['memory'] or NA}"), ("parameters", f"{fmt(s.get('params_total', plan.get('params_total')), ',')} "
                                             f"total, {fmt(s.get('params_memory', plan.get('params_memory')), ',')} memory"),
        ("FLOPs per token", fmt(s.get("flops_per_token", plan.get("flops_per_token")), ",")),
        ("batch", f"{fmt(args.get('total_batch_size'), ',')} tokens per step, sequence length "
                  f"{fmt(args.get('max_seq_len'))}"),
        ("tokens", fmt(s.get("tokens"), ",")), ("FLOPs", fmt(s.get("flops"), ".3e")),
        ("wall time", fmt_duration(s.get("wall_time_s"))), ("train time", fmt_duration(s.get("train_time_s"))),
        ("throughput (tok/s)", fmt_throughput(s)), ("MFU", fmt_mfu(s, env, f["sessions"])),
        *([("learning rates", lrs)] if lrs else [])])
    lines += ["", "## Results", ""]
    # MoME only: the slot balance of the final bpb passes (nanochat.slot_balance)
    balance = [(f"{split} MoME slot MaxVio / abs. load deviation",
                f"{fmt(s[f'{split}_mome_maxvio'], '.4f')} / {fmt(s.get(f'{split}_mome_abs_load_dev'), '.4f')}")
               for split in ("val", "train") if f"{split}_mome_maxvio" in s]
    rows = [("train bpb rows", train_bpb_rows(s))] if train_bpb_rows(s) else []
    lines += _kv_table([("val bpb", fmt(s.get("val_bpb"), ".6f")), ("train bpb", fmt(s.get("train_bpb"), ".6f")),
                        *rows, *balance, ("CORE", fmt_core(s)),
                        ("last train loss", fmt(_last_train_loss(run_dir), ".6f"))])
    if s.get("core_missing"):
        lines += ["", f"CORE tasks missing from the bundle: {', '.join(s['core_missing'])}."]
    lines += ["", "Files: `config.json` (resolved flags), `summary.json`, `metrics.jsonl`, `environment.json`, "
              "`checkpoints/`."]
    return "\n".join(lines) + "\n"


def _last_train_loss(run_dir) -> float | None:
    try:
        losses = [r["loss"] for r in read_metrics(run_dir) if r.get("kind") == "train" and "loss" in r]
    except (FileNotFoundError, ValueError):
        return None
    return losses[-1] if losses else None


def write_run_report(run_dir) -> Path:
    """Write ``<run_dir>/report.md`` (atomically) and return its path."""
    path = Path(run_dir) / REPORT
    write_text_atomic(path, run_report(run_dir))
    return path


# ---- comparing runs ----------------------------------------------------------------------------------------
COMPARISON_HEADER = "| run | memory | params total | params memory | steps | tokens | train min | val bpb | CORE |"


def _steps_cell(s: dict) -> str:
    """The steps trained; for a run that stopped early (e.g. wall_time_limit, which has a val bpb) also of how many
    and why, so its numbers do not read as a finished run's."""
    reason = s.get("stop_reason")
    if not s:  # still training, or killed before the end: its n/a cells are not a finished run's
        return f"{NA} (not finished: no summary.json)"
    if reason in (None, "completed"):
        return fmt(s.get("step"))
    return f"{fmt(s.get('step'))} of {fmt(s.get('num_iterations'))} ({reason})"


def run_labels(facts: list[dict]) -> list[str]:
    """Each run's name as the tables show it. Runs that share a name (runs/a/x and runs/b/x) would be identical
    rows, so each of them shows the shortest end of its path that differs ("a/x"; "name (a/x)" where the directory
    is named otherwise); one directory given twice is the same run and keeps its name."""
    names = [f["run_name"] for f in facts]
    labels = list(names)
    for name in set(names):
        # facts made by hand (a one-run table) may have no run_dir: they keep their name
        group = [i for i, n in enumerate(names) if n == name and facts[i].get("run_dir")]
        parts = {i: Path(os.path.abspath(facts[i]["run_dir"])).parts for i in group}
        distinct = set(parts.values())
        if len(distinct) < 2:
            continue
        k = next(k for k in range(1, max(map(len, distinct)) + 1) if len({p[-k:] for p in distinct}) == len(distinct))
        for i in group:
            tail = Path(*parts[i][-k:]).as_posix()
            labels[i] = tail if parts[i][-1] == name else f"{name} ({tail})"
    return labels


def lr_override_notes(facts: list[dict]) -> list[tuple[str, str]]:
    """(label, ``fmt_lr_overrides``) of each run trained in part with other LRs than its flags' (--resume-override-lr),
    for the line a comparison gives it under its table."""
    notes = [(label, fmt_lr_overrides(f["config"])) for f, label in zip(facts, run_labels(facts))]
    return [(label, note) for label, note in notes if note]


def comparison_table(facts: list[dict], lr_mark: str = "") -> list[str]:
    """One markdown row per run (``run_facts``): the table of the speedrun report and of the README's CPU demo;
    ``lr_mark`` after the label of a run with LR overrides (``lr_override_notes``) where no note follows the rows."""
    lines = [COMPARISON_HEADER, "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for f, label in zip(facts, run_labels(facts)):
        s, plan = f["summary"], f["plan"]
        train_s = s.get("train_time_s")
        if lr_mark and fmt_lr_overrides(f["config"]):
            label = f"{label} {lr_mark}"
        lines.append(" | ".join([
            f"| {label}", f["memory"] or NA, fmt(s.get("params_total", plan.get("params_total")), ","),
            fmt(s.get("params_memory", plan.get("params_memory")), ","), _steps_cell(s), fmt(s.get("tokens"), ","),
            fmt(train_s / 60 if train_s is not None else None, ".1f"), fmt(s.get("val_bpb"), ".4f"),
            fmt_core(s)]) + " |")
    return lines


def provenance_table(facts: list[dict]) -> list[str]:
    lines = ["| run | code | hardware | world size | software |", "|---|---|---|---:|---|"]
    for f, label in zip(facts, run_labels(facts)):
        env = f["env"]
        lines.append(f"| {label} | {fmt_code(env)} | {fmt_hardware(env)} | {fmt(env.get('world_size'))} | "
                     f"{fmt_software(env)} |")
    return lines
