"""Build the offline CORE subset shipped in eval_data/core_subset/ (deterministic, re-runnable).

For every core.yaml task whose file exists in the source bundle, keep the first N rows (default 100) of the
file after the evaluator's own shuffle (random.Random(1337)), i.e. exactly the examples that
``--max-per-task N`` evaluates on the full bundle, stored so that the evaluator's shuffle of the subset file
gives them back in that order: every example gets the same few-shot examples as there, so the subset reproduces
``--max-per-task N`` on the full bundle example for example.
hellaswag.jsonl is missing from ../shared/eval_bundle; it is taken from
../shared/data/hellaswag_val_full/hellaswag_core_approx.jsonl (all 10,042 rows; differs from the real file
only by a missing leading space on some WikiHow endings), so the hellaswag tasks are marked approximate.

    python -m scripts.make_core_subset [--src ../shared] [--out eval_data/core_subset] [--rows 100]
"""

import argparse
import hashlib
import json
import random
import shutil
import sys
from pathlib import Path

from nanochat.cli_types import positive_int
from nanochat.eval_bundle import REPO_ROOT, load_core_tasks, load_task_data
from nanochat.terminal import replace_unencodable_output
from nanochat.work_dirs import work_dir

HELLASWAG_APPROX = "data/hellaswag_val_full/hellaswag_core_approx.jsonl"


def subset_rows(path: Path, task_type: str, n: int) -> list[dict]:
    """The first n examples of the evaluator's order (``order_task_data``), written in the order that its own
    shuffle of the subset file turns back into exactly that order: the same examples at the same positions, so
    each gets the same few-shot examples (``fewshot_for`` draws by position) as ``--max-per-task n``."""
    from nanochat.core_eval import order_task_data

    target = order_task_data(load_task_data(path, task_type), n)
    perm = list(range(len(target)))
    random.Random(1337).shuffle(perm)  # the evaluator's shuffle of a len(target)-row file: k-th <- file[perm[k]]
    rows = [None] * len(target)
    for k, src in enumerate(perm):
        rows[src] = target[k]
    return rows


def build(src: Path, out: Path, n: int) -> dict:
    """Builds beside --out and swaps it in at the end: a failed or interrupted rebuild keeps the old subset (the
    shipped one, by default), never half of one. Only a previous subset (SUBSET.json) or an empty dir is replaced."""
    if out.exists() and not (out / "SUBSET.json").is_file() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not a CORE subset (no SUBSET.json); it is replaced "
                              "wholesale, so give a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    # a fresh hidden folder of our own beside --out (same file system: the renames are atomic); fixed names such as
    # <out>.old could be a user's folder, which a clean-up would delete. One a SIGKILLed build left is removed now.
    with work_dir(out.parent, f".{out.name}.", salvage=lambda stale: _restore_out(stale, out)) as work:
        new, old = work / "new", work / "old"
        info = _build_into(src, new, n, readme_from=out / "README.md")
        if out.exists():
            out.rename(old)
            try:
                new.rename(out)
            except BaseException:
                old.rename(out)  # --out as it was
                raise
        else:
            new.rename(out)
    return info


def _restore_out(work: Path, out: Path) -> None:
    """A build killed between its two renames left --out moved aside into its work folder: put it back."""
    if (work / "old").is_dir() and not out.exists():
        (work / "old").rename(out)
        print(f"restored --out {out} from {work.name} (a build killed midway had moved it aside)", file=sys.stderr)


def _build_into(src: Path, out: Path, n: int, readme_from: Path) -> dict:
    bundle = src / "eval_bundle"
    readme = readme_from.read_text(encoding="utf-8") if readme_from.is_file() else None
    (out / "eval_data").mkdir(parents=True)
    for name in ("core.yaml", "eval_meta_data.csv"):
        shutil.copy(bundle / name, out / name)
    info = {"subset": True, "rows_per_task": n, "tasks": {}, "approx_tasks": {}, "missing_tasks": []}
    written = set()
    for task in load_core_tasks(bundle):
        source = bundle / "eval_data" / task.dataset_uri
        if not source.is_file() and task.dataset_uri.endswith("hellaswag.jsonl"):
            source = src / HELLASWAG_APPROX
            info["approx_tasks"][task.label] = f"from {HELLASWAG_APPROX} (leading spaces lost on some WikiHow endings)"
        if not source.is_file():
            info["missing_tasks"].append(task.label)
            continue
        dest = out / "eval_data" / task.dataset_uri
        if task.dataset_uri not in written:  # hellaswag and hellaswag_zeroshot share one file
            rows = subset_rows(source, task.task_type, n)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
            written.add(task.dataset_uri)
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        info["tasks"][task.label] = {"file": task.dataset_uri, "source": str(source.relative_to(src)),
                                     "source_sha256": digest, "rows": sum(1 for _ in open(dest, encoding="utf-8"))}
    (out / "SUBSET.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    if readme is not None:  # hand-written provenance notes survive a rebuild
        (out / "README.md").write_text(readme, encoding="utf-8")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(REPO_ROOT.parent / "shared"), help="shared/ folder holding eval_bundle/")
    ap.add_argument("--out", default=str(REPO_ROOT / "eval_data" / "core_subset"))
    ap.add_argument("--rows", type=positive_int, default=100, help="rows kept per task")
    args = ap.parse_args(argv)
    src = Path(args.src)
    if not (src / "eval_bundle" / "core.yaml").is_file():
        ap.error(f"--src {src} has no eval_bundle/core.yaml")
    try:
        info = build(src, Path(args.out), args.rows)
    except (OSError, ValueError) as e:  # a refused --out, an unreadable task file, a full disk
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted; --out {args.out} is as it was", file=sys.stderr)
        return 130
    print(f"wrote {len(info['tasks'])} tasks to {args.out}; missing: {info['missing_tasks']}; "
          f"approximate: {list(info['approx_tasks'])}")
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
