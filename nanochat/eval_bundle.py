"""Locate, download, verify and parse nanochat's CORE eval bundle.

A bundle directory holds ``core.yaml`` (key ``icl_tasks``), ``eval_meta_data.csv`` (random baselines in percent)
and ``eval_data/<dataset_uri>`` JSONL files. ``find_bundle`` resolves one in this order:

1. ``--bundle DIR`` (or ``--bundle subset`` for the small subset shipped in ``eval_data/core_subset/``),
2. the ``NANOCHAT_EVAL_BUNDLE`` environment variable,
3. the cache (``$NANOCHAT_EVAL_CACHE`` or ``~/.cache/nanochat``)/``eval_bundle``,
4. a download of ``eval_bundle.zip`` (URL overridable with ``NANOCHAT_EVAL_BUNDLE_URL``) through
   ``nanochat.download.download_file`` (retries, a resumable ``.part`` file, the sha256 check when
   ``NANOCHAT_EVAL_BUNDLE_SHA256`` is set) under a file lock (several ranks may call this at once); the observed
   sha256 is recorded.
"""

import csv
import fcntl
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from nanochat.download import download_file, file_sha256
from nanochat.jsonfile import fsync_dir, fsync_file

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBSET_DIR = REPO_ROOT / "eval_data" / "core_subset"
DEFAULT_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
# The upstream zip has never been published with a checksum. When the user (or a later release) knows it, set
# NANOCHAT_EVAL_BUNDLE_SHA256 and every download is verified against it; otherwise the observed hash is recorded.
KNOWN_SHA256: str | None = None
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
REQUIRED_KEYS = {
    "multiple_choice": ("query", "choices", "gold"),
    "schema": ("context_options", "continuation", "gold"),
    "language_modeling": ("context", "continuation"),
}
NO_BUNDLE_HINT = (
    "pass --bundle DIR (a directory holding core.yaml), set NANOCHAT_EVAL_BUNDLE, or use the small offline "
    "subset shipped in the repo with --bundle subset"
)


@dataclass(frozen=True)
class TaskSpec:
    label: str
    dataset_uri: str
    task_type: str
    num_fewshot: int
    delimiter: str


# -- locating / downloading --------------------------------------------------------------------------------
def cache_dir() -> Path:
    return Path(os.environ.get("NANOCHAT_EVAL_CACHE", Path.home() / ".cache" / "nanochat"))


def _check_bundle_dir(path: Path, source: str) -> Path:
    if not (path / "core.yaml").is_file():
        raise FileNotFoundError(f"eval bundle from {source} ({path}) has no core.yaml; {NO_BUNDLE_HINT}")
    return path


def find_bundle(bundle_arg: str | None = None) -> Path:
    """Return a bundle directory, resolved (see the module docstring for the search order): what a run records of
    it (config.json "data" "bundle") and what core.json names read the same from any directory, where a relative
    --bundle, $NANOCHAT_EVAL_BUNDLE or $NANOCHAT_EVAL_CACHE named another directory or none."""
    return _search_bundle(bundle_arg).resolve()


def _search_bundle(bundle_arg: str | None) -> Path:
    if bundle_arg:
        path = SUBSET_DIR if bundle_arg == "subset" else Path(bundle_arg).expanduser()
        return _check_bundle_dir(path, "--bundle")
    env = os.environ.get("NANOCHAT_EVAL_BUNDLE")
    if env:
        return _check_bundle_dir(Path(env).expanduser(), "NANOCHAT_EVAL_BUNDLE")
    cached = cache_dir() / "eval_bundle"
    if (cached / "core.yaml").is_file():
        return cached
    return download_bundle(cache_dir())


def add_core_flags(ap) -> None:
    """--bundle and --max-per-task of a CORE evaluation of a checkpoint (base_eval, the analyses' core: domains),
    both following the run by default (run_core_inputs)."""
    from nanochat.cli_types import count_or_all_or_run

    ap.add_argument("--bundle", default="run", help="CORE bundle dir, 'subset' for eval_data/core_subset, or run "
                    "= the bundle the checkpoint's run evaluated CORE on (its --bundle, else the one it found; an "
                    "older run's relative path is read from here; runs that record none, e.g. imported ones, get "
                    "$NANOCHAT_EVAL_BUNDLE, the cache, then a download)")
    ap.add_argument("--max-per-task", type=count_or_all_or_run, default="run",
                    help="examples per CORE task (-1 = all); run = the run's --core-max-per-task (runs that record "
                    "none, e.g. imported ones, get all)")


@dataclass(frozen=True)
class CoreInputs:
    """What CORE reads, resolved for one checkpoint (``run_core_inputs``), each with where it came from."""
    bundle: str | None  # find_bundle's argument: a directory, "subset", or None (the search order)
    bundle_source: str
    max_per_task: int  # -1 = every example
    max_per_task_source: str

    def describe(self) -> str:
        """For the line of resolved settings: the CORE bundle and cap, and why."""
        bundle = self.bundle or "the first found (NANOCHAT_EVAL_BUNDLE, the cache, a download)"
        cap = "all" if self.max_per_task == -1 else str(self.max_per_task)
        return (f"CORE bundle {bundle} ({self.bundle_source}); examples per task {cap} "
                f"({self.max_per_task_source})")


def run_core_inputs(bundle_flag: str, cap_flag: int | str, meta: dict, run_dir=None) -> CoreInputs:
    """The bundle and the per-task cap of a CORE evaluation of a checkpoint (base_eval, the analyses' core:
    domains): a flag's value as given, else (``run``) the run's own (``recorded_bundle``; --core-max-per-task,
    an older run's 0 read as -1), so the CORE printed equals the one of training; a run that records none (an
    imported checkpoint, an older run) gets the search order and every example, and the source says so."""
    from nanochat.checkpoint import recorded_value
    from nanochat.cli_types import recorded_args, recorded_args_now

    if bundle_flag != "run":
        bundle, bundle_source = bundle_flag, "--bundle"
    else:
        bundle, bundle_source = recorded_bundle(meta, run_dir)
    if cap_flag != "run":
        return CoreInputs(bundle, bundle_source, cap_flag, "--max-per-task")
    cap, where = recorded_value(meta, run_dir,
                                lambda config: recorded_args_now(recorded_args(config)).get("core_max_per_task"))
    if cap is None:
        return CoreInputs(bundle, bundle_source, -1, "default: the run records no --core-max-per-task")
    return CoreInputs(bundle, bundle_source, int(cap), f"the run's --core-max-per-task, {where}")


def recorded_bundle(meta: dict, run_dir=None) -> tuple[str | None, str]:
    """(find_bundle's argument, where it came from) for the bundle the run evaluated CORE on: --bundle subset keeps
    its meaning (this checkout's subset); else the directory the run read (config "data" "bundle": find_bundle's
    result, which is its --bundle or what its search order found), else its --bundle as given (a run that did not
    evaluate CORE), else None (the search order: a run that found none or records none). A recorded directory
    without core.yaml here is an error naming the run's value and --bundle PATH: the search order could find
    another bundle and print another CORE. This version records "data" "bundle" resolved; an older run's relative
    path (recorded as given) is read from the run's working directory, which the run does not record: from here,
    where that holds a bundle, as before."""
    from nanochat.checkpoint import recorded_value
    from nanochat.cli_types import recorded_args

    def pick(config):
        given, found = recorded_args(config).get("bundle"), (config.get("data") or {}).get("bundle")
        value = given if given == "subset" else (found or given)  # the flag ("args") stays as given
        return str(value) if value else None

    value, where = recorded_value(meta, run_dir, pick)
    if value is None:
        return None, "default: the run records no bundle"
    source = f"the run's bundle, {where}"
    if value == "subset":
        return value, source
    path = Path(value).expanduser()
    if not (path / "core.yaml").is_file():
        where_from = "" if path.is_absolute() else (f" (a relative path: the run read it from the directory it "
                                                    f"was started in, which it does not record; from here it is "
                                                    f"{path.resolve()})")
        raise ValueError(f"--bundle run: the run evaluated CORE on the bundle {value!r} ({where}){where_from}, "
                         "which holds no core.yaml here; pass --bundle PATH (a directory holding core.yaml, e.g. "
                         "a copy of that bundle) or --bundle subset")
    if not path.is_absolute():
        source += ", relative to this directory"
    return value, source


def _extract(zip_path: Path, target: Path) -> None:
    """Extract into a temp dir, find the folder holding core.yaml, then rename it into place atomically."""
    tmp = target.with_name(target.name + ".extract-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(zip_path) as zf:
            zf.extractall(tmp)
    except zipfile.BadZipFile as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"{zip_path} is not a valid zip file ({e}); delete it and retry") from e
    roots = sorted(p.parent for p in tmp.rglob("core.yaml"))
    if not roots:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"{zip_path} contains no core.yaml: not an eval bundle")
    _fsync_tree(roots[0])  # ~25 files once per machine: a bundle found complete after a power cut is complete
    shutil.rmtree(target, ignore_errors=True)
    os.replace(roots[0], target)
    fsync_dir(target.parent)
    shutil.rmtree(tmp, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (and ``root``): zipfile writes without it."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_file(Path(folder) / name)
        fsync_dir(folder)


def download_bundle(base: Path, retries: int = 3, timeout: float = 60.0) -> Path:
    """Download + verify + extract the bundle into ``base/eval_bundle`` (idempotent, safe across ranks)."""
    url = os.environ.get("NANOCHAT_EVAL_BUNDLE_URL", DEFAULT_URL)
    expected = os.environ.get("NANOCHAT_EVAL_BUNDLE_SHA256", KNOWN_SHA256)
    base.mkdir(parents=True, exist_ok=True)
    target, zip_path = base / "eval_bundle", base / "eval_bundle.zip"
    with open(base / ".eval_bundle.lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other ranks wait here and then find the extracted bundle
        if (target / "core.yaml").is_file():
            return target
        if zip_path.is_file() and expected and file_sha256(zip_path) != expected.lower():
            zip_path.unlink()  # left by an older run without the checksum: fetch it again and verify
        download_file(url, zip_path, sha256=expected, validate=_check_zip, max_attempts=retries, timeout=timeout,
                      backoff=2.0 * float(os.environ.get("NANOCHAT_EVAL_RETRY_SCALE", "1")), hint=NO_BUNDLE_HINT)
        _extract(zip_path, target)
        (base / "eval_bundle.sha256").write_text(json.dumps({"url": url, "sha256": file_sha256(zip_path)}) + "\n",
                                                  encoding="utf-8")
    return target


def _check_zip(path: Path) -> None:
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not a zip file")


# -- parsing -----------------------------------------------------------------------------------------------
def load_core_tasks(bundle_dir: Path) -> list[TaskSpec]:
    path = Path(bundle_dir) / "core.yaml"
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
        tasks = cfg["icl_tasks"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: cannot read the icl_tasks list ({type(e).__name__}: {e})") from e
    out = []
    for i, t in enumerate(tasks):
        try:
            shots = t["num_fewshot"]
            spec = TaskSpec(t["label"], t["dataset_uri"], t["icl_task_type"],
                            int(shots[0] if isinstance(shots, list) else shots),  # only element 0 is used
                            t.get("continuation_delimiter", " "))
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise ValueError(f"{path}: icl_tasks entry {i} is malformed ({type(e).__name__}: {e})") from e
        if spec.task_type not in TASK_TYPES:
            raise ValueError(f"{path}: task {spec.label!r} has unknown icl_task_type {spec.task_type!r}")
        out.append(spec)
    return out


def load_random_baselines(bundle_dir: Path) -> dict[str, float]:
    """{task label: random baseline in percent} from eval_meta_data.csv."""
    path = Path(bundle_dir) / "eval_meta_data.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (random baselines are needed for centered accuracy)")
    out = {}
    with open(path, newline="", encoding="utf-8") as f:
        for lineno, row in enumerate(csv.DictReader(f), start=2):
            try:
                out[row["Eval Task"]] = float(row["Random baseline"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: bad 'Eval Task'/'Random baseline' ({e})") from e
    return out


def load_task_data(path: Path, task_type: str) -> list[dict]:
    """Read a task JSONL; any bad line raises an error naming the file and line number."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
            missing = [k for k in REQUIRED_KEYS[task_type] if not isinstance(row, dict) or k not in row]
            if missing:
                raise ValueError(f"{path}:{lineno}: {task_type} row lacks key(s) {missing}")
            problem = _row_problem(row, task_type)
            if problem:
                raise ValueError(f"{path}:{lineno}: {task_type} row: {problem}")
            rows.append(row)
    return rows


def _row_problem(row: dict, task_type: str) -> str | None:
    """What is wrong with a row's values (None if nothing): a gold index out of range would otherwise be scored
    as a wrong answer, or fail only when the row is drawn as a few-shot example."""
    def strings(v) -> bool:
        return isinstance(v, list) and len(v) > 0 and all(isinstance(x, str) for x in v)

    options = {"multiple_choice": "choices", "schema": "context_options"}.get(task_type)
    if options is not None:
        if not strings(row[options]):
            return f"{options!r} must be a non-empty list of strings"
        gold = row["gold"]
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(row[options]):
            return f"'gold' must be an index into {options!r} (0..{len(row[options]) - 1}), got {gold!r}"
    text_keys = {"multiple_choice": ("query",), "schema": ("continuation",),
                 "language_modeling": ("context", "continuation")}[task_type]
    bad = [k for k in text_keys if not isinstance(row[k], str)]
    return f"{bad[0]!r} must be a string" if bad else None


def bundle_info(bundle_dir: Path) -> dict:
    """Optional SUBSET.json written by scripts/make_core_subset.py ({} for a full bundle)."""
    path = Path(bundle_dir) / "SUBSET.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
