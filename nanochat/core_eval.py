"""CORE evaluation (DCLM's 22-task in-context-learning suite, as nanochat runs it).

Three task types, each turned into token rows with a scored region [start, end):
* multiple_choice: one prompt per choice; the region starts at the first token where the choices differ;
  the choice with the lowest mean loss over its region wins (first one on ties). A choice whose tokens are a
  prefix of another's has an empty region (the real piqa has such rows): here it never wins; nanochat's mean
  of no losses is NaN, which makes it win when it is the first choice (``--numerics reference`` does that).
* schema: one prompt per context option, shared continuation; the region is the common token suffix.
* language_modeling: one prompt; correct iff greedy argmax reproduces every continuation token.
Prompts, few-shot sampling (random.Random(1234 + i)) and the per-task shuffle (random.Random(1337)) follow
nanochat exactly so numbers are comparable. Unlike nanochat, rows of many examples share one forward pass,
prompts longer than model.max_seq_len are cropped from the left (under ``--numerics reference`` only where the
rotary table ends, as the authors' evaluation: ``crop_length``), and there is a progress bar per task.
"""

import math
import random
from typing import NamedTuple
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from nanochat.common import every_rank_ok, rank0_decides
from nanochat.download import file_sha256
from nanochat.eval_bundle import bundle_info, load_core_tasks, load_random_baselines, load_task_data, TaskSpec
from nanochat.eval_resume import stop_voted
from nanochat.jsonfile import write_text_atomic


# -- prompt rendering (same strings nanochat's Jinja templates produce) ---------------------------------------
def _with_fewshot(blocks: list[str], final: str) -> str:
    return "".join(b + "\n\n" for b in blocks) + final


def render_prompts_mc(item: dict, delim: str, fewshot: list[dict]) -> list[str]:
    blocks = [f"{ex['query']}{delim}{ex['choices'][ex['gold']]}" for ex in fewshot]
    return [_with_fewshot(blocks, f"{item['query']}{delim}{choice}") for choice in item["choices"]]


def render_prompts_schema(item: dict, delim: str, fewshot: list[dict]) -> list[str]:
    blocks = [f"{ex['context_options'][ex['gold']]}{delim}{ex['continuation']}" for ex in fewshot]
    return [_with_fewshot(blocks, f"{ctx}{delim}{item['continuation']}") for ctx in item["context_options"]]


def render_prompts_lm(item: dict, delim: str, fewshot: list[dict]) -> list[str]:
    """[without continuation, with continuation]. The without-prompt is stripped: a trailing space would be
    merged into the continuation's first token and break the token-prefix relation."""
    blocks = [f"{ex['context'].strip()}{delim}{ex['continuation']}" for ex in fewshot]
    without = _with_fewshot(blocks, f"{item['context'].strip()}{delim}")
    return [without.strip(), without + item["continuation"]]


RENDERERS = {"multiple_choice": render_prompts_mc, "schema": render_prompts_schema,
             "language_modeling": render_prompts_lm}


# -- tokenisation into scored rows ----------------------------------------------------------------------------
@dataclass
class Prepared:
    rows: list[list[int]]  # token rows (BOS first) of one example
    starts: list[int]  # scored region per row: tokens rows[r][starts[r]:ends[r]]
    ends: list[int]
    gold: int  # index of the correct row (0 for language modelling)


def common_length(seqs: list[list[int]], direction: str) -> int:
    """Length of the common prefix ("left") or suffix ("right") of all sequences."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        idx = i if direction == "left" else -1 - i
        if any(s[idx] != seqs[0][idx] for s in seqs):
            return i
    return n


def prepare_example(tokenizer, item: dict, task: TaskSpec, fewshot: list[dict], where: str = "") -> Prepared:
    prompts = RENDERERS[task.task_type](item, task.delimiter, fewshot)
    bos = tokenizer.bos_token_id
    rows = [[bos] + list(tokenizer.encode(p)) for p in prompts]
    if task.task_type == "multiple_choice":
        start = common_length(rows, "left")
        return Prepared(rows, [start] * len(rows), [len(r) for r in rows], int(item["gold"]))
    if task.task_type == "schema":
        suffix = common_length(rows, "right")
        return Prepared(rows, [len(r) - suffix for r in rows], [len(r) for r in rows], int(item["gold"]))
    without, with_ = rows
    if len(without) >= len(with_) or with_[: len(without)] != without:
        raise ValueError(f"{where}: the tokens of the prompt without continuation are not a strict prefix of the "
                         "prompt with continuation (tokenizer merges across the delimiter)")
    return Prepared([with_], [len(without)], [len(with_)], 0)


class RegionTooLong(ValueError):
    """The scored tokens of an example (plus one token of context) exceed the model's max_seq_len."""


class TaskCounts(NamedTuple):
    correct: int
    n: int
    too_long: int = 0  # examples that cannot be scored within crop_length(model); counted in n as incorrect


def crop_length(model) -> tuple[int, str]:
    """(how many tokens of a prompt CORE keeps, counted from its end; the limit's name for messages): the model's
    context ``max_seq_len``, or its rotary table's end once ``nanochat.numerics.apply_numerics(model, "reference")``
    has set ``core_crop_len`` (the authors' evaluator crops nothing: no longer prompt fits their rotary table)."""
    crop = getattr(model, "core_crop_len", None)
    if crop is None:
        return model.max_seq_len, "max_seq_len"  # AttributeError on purpose: cropping is part of the protocol
    return crop, "rotary_len"


def crop_left(ex: Prepared, max_len: int, where: str = "", limit: str = "max_seq_len") -> Prepared:
    """Keep the last ``max_len`` tokens of each row, shifting the scored region with it.

    The region needs one token of context before it (its first token is predicted from position start-1)."""
    rows, starts, ends = [], [], []
    for row, s, e in zip(ex.rows, ex.starts, ex.ends):
        cut = max(0, len(row) - max_len)
        if s - cut < 1:
            raise RegionTooLong(f"{where}: scored region of {e - s} tokens does not fit into {limit}={max_len}")
        rows.append(row[cut:])
        starts.append(s - cut)
        ends.append(e - cut)
    return Prepared(rows, starts, ends, ex.gold)


# -- batched scoring --------------------------------------------------------------------------------------
def reference_scoring(model) -> bool:
    """Whether CORE scores as the authors' evaluator where ours differs on purpose (an empty region, ``_judge``):
    under ``nanochat.numerics.apply_numerics(model, "reference")``, which marks the model with ``core_crop_len``."""
    return getattr(model, "core_crop_len", None) is not None


def _judge(task_type: str, losses: torch.Tensor, preds: torch.Tensor, ids: torch.Tensor, ex: Prepared,
           reference: bool = False) -> bool:
    """losses/preds/ids: this example's rows of the batch. Position p predicts token p+1."""
    if task_type == "language_modeling":
        s, e = ex.starts[0], ex.ends[0]
        return bool(torch.equal(preds[0, s - 1 : e - 1], ids[0, s:e]))
    # An empty region (a choice whose tokens are a prefix of another's) has no mean loss. Ours: +inf, so it never
    # wins. The authors' evaluator takes the mean of no losses (NaN) into means.index(min(means)); Python's min
    # keeps a NaN it starts from and never takes a later one, so there the FIRST choice wins whenever its region
    # is empty, and an empty region further on never wins. (All regions empty, as for identical options: both
    # pick the first.)
    if reference and ex.ends[0] <= ex.starts[0]:
        return ex.gold == 0
    means = [losses[r, s - 1 : e - 1].mean().item() if e > s else math.inf
             for r, (s, e) in enumerate(zip(ex.starts, ex.ends))]
    return means.index(min(means)) == ex.gold


def region_scores(logits: torch.Tensor, ids: torch.Tensor, regions: list[tuple[int, int]]):
    """(losses, preds) on the host, float32 and long of shape (rows, T-1): the cross-entropy of position p against
    token p+1 and the argmax of position p, at each row's scored positions [start-1, end-1) only (NaN and -1
    elsewhere: ``_judge`` reads no other). logits: (rows, T, V); ids: (rows, T); regions: (start, end) per row.

    Row by row on the logits' device, so besides the model's logits this holds one region's log-softmax (at most
    (T-1, V) floats), not a float32 copy of every position of the batch and its log-softmax (twice the logits:
    8.6 GB more at 16 rows x 2048 tokens x 32768 vocab). A position's loss and argmax are those of the full-batch
    computation (same kernels, same logits; tests/test_core_eval_memory33.py)."""
    rows, T = ids.shape
    row_losses, row_preds = [], []
    for r, (s, e) in enumerate(regions):
        if e <= s:  # an empty region (a multiple-choice option that is a prefix of another)
            continue
        scored = logits[r, s - 1 : e - 1].float()  # (e-s, V): a view of the row (a copy only for non-fp32 logits)
        row_losses.append(F.cross_entropy(scored, ids[r, s:e], reduction="none"))
        row_preds.append(scored.argmax(dim=-1))
    losses = torch.full((rows, T - 1), math.nan)
    preds = torch.full((rows, T - 1), -1, dtype=torch.long)
    if not row_losses:
        return losses, preds
    flat_losses, flat_preds = torch.cat(row_losses).cpu(), torch.cat(row_preds).cpu()  # one copy to the host
    i = 0
    for r, (s, e) in enumerate(regions):
        if e > s:
            losses[r, s - 1 : e - 1], preds[r, s - 1 : e - 1] = flat_losses[i : i + e - s], flat_preds[i : i + e - s]
            i += e - s
    return losses, preds


@torch.no_grad()
def _score_batch(model, batch: list[Prepared], task_type: str, pad_id: int, device, autocast_ctx) -> list[bool]:
    rows = [r for ex in batch for r in ex.rows]
    T = max(len(r) for r in rows)
    # Right-pad with BOS: attention is causal, so padding never influences the scored positions.
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    on_device = ids.to(device)
    with autocast_ctx if autocast_ctx is not None else nullcontext():
        logits = model(on_device)
    losses, preds = region_scores(logits, on_device, [(s, e) for ex in batch for s, e in zip(ex.starts, ex.ends)])
    reference = reference_scoring(model)
    out, r0 = [], 0
    for ex in batch:
        r1 = r0 + len(ex.rows)
        out.append(_judge(task_type, losses[r0:r1], preds[r0:r1], ids[r0:r1], ex, reference))
        r0 = r1
    return out


def _example_batches(examples: list[Prepared], batch_size: int):
    """Lists of example indices whose rows go through one forward (<= batch_size rows, an example with more rows
    than that alone), length-sorted to keep padding small."""
    order = sorted(range(len(examples)), key=lambda i: max(len(r) for r in examples[i].rows))
    i = 0
    while i < len(order):
        batch_idx, n_rows = [order[i]], len(examples[order[i]].rows)
        i += 1
        while i < len(order) and n_rows + len(examples[order[i]].rows) <= batch_size:
            n_rows += len(examples[order[i]].rows)
            batch_idx.append(order[i])
            i += 1
        yield batch_idx


def score_examples(model, examples: list[Prepared], task_type: str, pad_id: int, batch_size: int = 16,
                   device="cpu", autocast_ctx=None, bar=None) -> list[bool]:
    """Correctness of each example, scored in ``_example_batches``. A stop signal ends it with ``Interrupted``, on
    every rank at the same batch (``stop_voted``)."""
    results: list[bool] = [False] * len(examples)
    for batch_idx in stop_voted(_example_batches(examples, batch_size), device):
        scores = _score_batch(model, [examples[j] for j in batch_idx], task_type, pad_id, device, autocast_ctx)
        for j, ok in zip(batch_idx, scores):
            results[j] = ok
        if bar is not None:
            bar.update(len(batch_idx))
    return results


# -- per task and whole suite -----------------------------------------------------------------------------
def _dist_rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def order_task_data(data: list[dict], max_per_task: int = -1) -> list[dict]:
    data = list(data)
    random.Random(1337).shuffle(data)
    return data[:max_per_task] if max_per_task > 0 else data


def fewshot_for(data: list[dict], i: int, k: int) -> list[dict]:
    if k <= 0:
        return []
    available = [j for j in range(len(data)) if j != i]
    return [data[j] for j in random.Random(1234 + i).sample(available, min(k, len(available)))]


def evaluate_task(model, tokenizer, data: list[dict], task: TaskSpec, batch_size: int = 16, device="cpu",
                  autocast_ctx=None, progress: bool = True, where: str = "") -> TaskCounts:
    """(correct, n, too_long) over all ranks for already shuffled/truncated ``data``. Rank r takes examples
    r, r+W, ... An example whose scored region cannot fit into ``crop_length(model)`` (only short-context models
    hit this) is counted as incorrect, so n and the random baseline stay comparable, and reported in ``too_long``."""
    rank, world = _dist_rank_world()
    max_len, limit = crop_length(model)

    def prepare_mine():
        examples, too_long = [], 0
        for i in range(rank, len(data), world):
            ex = prepare_example(tokenizer, data[i], task, fewshot_for(data, i, task.num_fewshot),
                                 f"{where} example {i}")
            try:
                examples.append(crop_left(ex, max_len, f"{where} example {i}", limit))
            except RegionTooLong:
                too_long += 1
        return examples, too_long

    # a bad example on one rank stops every rank (none waits alone in the all_reduce below)
    examples, too_long = every_rank_ok(prepare_mine)
    # closed on an exception too: an interrupt's message must not land on the bar's line (leave=False clears it)
    with tqdm(total=len(examples), desc=f"{task.label:<34}", leave=False, disable=not progress or rank != 0) as bar:
        scores = score_examples(model, examples, task.task_type, tokenizer.bos_token_id, batch_size, device,
                                autocast_ctx, bar)
    counts = torch.tensor([sum(scores), len(scores) + too_long, too_long], dtype=torch.long, device=device)
    if world > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return TaskCounts(*(int(c) for c in counts.tolist()))


def centered_accuracy(acc: float, baseline_pct: float) -> float:
    b = 0.01 * baseline_pct
    return (acc - b) / (1.0 - b)


def summarize_core(task_results: dict[str, dict], baselines: dict[str, float], all_labels: list[str]) -> dict:
    """task_results: {label: {"accuracy", "n"}} for the tasks that ran. CORE = mean centered over them;
    the label says how many of the suite's tasks that is."""
    tasks = {}
    for label, r in task_results.items():
        if label not in baselines:
            raise KeyError(f"task {label!r} has no random baseline in eval_meta_data.csv")
        b = baselines[label]
        tasks[label] = {"accuracy": r["accuracy"], "centered": centered_accuracy(r["accuracy"], b),
                        "n": r["n"], "random_baseline": b, "too_long": r.get("too_long", 0)}
    missing = [lab for lab in all_labels if lab not in task_results]
    k, total = len(tasks), len(all_labels)
    core = sum(t["centered"] for t in tasks.values()) / k if k else float("nan")
    return {"core": core, "label": "CORE" if k == total else f"CORE-{k}/{total}", "tasks": tasks, "missing": missing}


def _core_plan(bundle_dir: Path) -> tuple[list[TaskSpec], dict[str, float], list[TaskSpec], dict]:
    """(all tasks, random baselines, the tasks whose data file exists, subset info), checked up front so a long
    evaluation cannot fail at the very end."""
    specs = load_core_tasks(bundle_dir)
    baselines = load_random_baselines(bundle_dir)
    present = [t for t in specs if (bundle_dir / "eval_data" / t.dataset_uri).is_file()]
    no_baseline = [t.label for t in present if t.label not in baselines]
    if no_baseline:
        raise KeyError(f"{bundle_dir / 'eval_meta_data.csv'} has no random baseline for {no_baseline}")
    if not present:
        raise FileNotFoundError(f"no task data file of {bundle_dir / 'core.yaml'} exists under "
                                f"{bundle_dir / 'eval_data'}")
    return specs, baselines, present, bundle_info(bundle_dir)


def _task_rows(path: Path, task: TaskSpec, max_per_task: int) -> list[dict]:
    data = order_task_data(load_task_data(path, task.task_type), max_per_task)
    if not data:
        raise ValueError(f"{path} (task {task.label}) has no rows")
    return data


def _task_inputs(task: TaskSpec, path: Path, max_per_task: int) -> dict:
    """What decides a task's counts besides the model and the evaluation settings."""
    return {"task": asdict(task), "file_sha256": file_sha256(path), "max_per_task": max_per_task}


def read_old_caps(finished) -> None:
    """Older versions took base_eval --max-per-task 0 and base_train --core-max-per-task 0 for "all" and kept the 0
    in the key of each task they finished: read as -1, the same rows, so such a task is reused instead of scored
    again (as nanochat.train_resume.read_old_records reads the flag). Only 0: any other cap is other inputs. On
    every rank, which all hold the broadcast items; what is written next keeps the -1."""
    for saved in finished.items.values():
        key = saved.get("key") if isinstance(saved, dict) else None
        if isinstance(key, dict) and "task" in key and type(key.get("max_per_task")) is int:
            key["max_per_task"] = key["max_per_task"] or -1


def evaluate_core(model, tokenizer, bundle_dir, max_per_task: int = -1, batch_size: int = 16, device="cpu",
                  autocast_ctx=None, progress: bool = True, finished=None) -> dict:
    """Evaluate every core.yaml task whose data file exists. See summarize_core for the result layout;
    also carries "bundle", "max_per_task" and, for the shipped subset, "subset" info.

    Under torch.distributed only rank 0 reads the bundle (task list, baselines, rows) and broadcasts it, so
    every rank scores the same tasks and enters the same collectives even if its own view of the files differs.
    ``finished`` (nanochat.eval_resume.FinishedResults, base_eval) keeps every task's counts on disk as soon as
    the task is done and hands back those an interrupted earlier run finished with the same inputs.
    """
    bundle_dir = Path(bundle_dir)
    specs, baselines, present, info = rank0_decides(lambda: _core_plan(bundle_dir))
    was_training = model.training
    results = {}
    try:  # a caller that catches a stop signal (Interrupted) or an error goes on with the model in its own mode
        model.eval()
        if finished is not None:
            read_old_caps(finished)
        for task in present:
            path = bundle_dir / "eval_data" / task.dataset_uri

            def score() -> dict:
                data = rank0_decides(lambda: _task_rows(path, task, max_per_task))
                correct, n, too_long = evaluate_task(model, tokenizer, data, task, batch_size, device, autocast_ctx,
                                                     progress, where=f"{path} (task {task.label})")
                return {"accuracy": correct / n if n else float("nan"), "n": n, "too_long": too_long}

            if finished is None:
                results[task.label] = score()
            else:
                results[task.label] = finished.get_or_run(task.label, lambda: _task_inputs(task, path, max_per_task),
                                                          score)
    finally:
        model.train(was_training)
    out = summarize_core(results, baselines, [t.label for t in specs])
    out.update(bundle=str(bundle_dir), max_per_task=max_per_task, subset=info)
    return out


# -- reports ----------------------------------------------------------------------------------------------
def write_core_report(results: dict, out_dir, extra: dict | None = None) -> None:
    """core.json (everything), core.csv (task, accuracy, centered, n + the CORE row), core.md (table)."""
    import json

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "core.json", json.dumps({**results, **(extra or {})}, indent=2) + "\n")
    tasks = results["tasks"]
    csv = ["task,accuracy,centered,n"] + [f"{k},{v['accuracy']:.6f},{v['centered']:.6f},{v['n']}"
                                           for k, v in tasks.items()]
    csv.append(f"{results['label']},,{results['core']:.6f},{sum(v['n'] for v in tasks.values())}")
    write_text_atomic(out_dir / "core.csv", "\n".join(csv) + "\n")
    approx = (results.get("subset") or {}).get("approx_tasks", {})
    md = ["| task | accuracy | centered | n | random baseline % |", "|---|---:|---:|---:|---:|"]
    md += [f"| {k}{' (approx.)' if k in approx else ''} | {v['accuracy']:.4f} | {v['centered']:.4f} | {v['n']} | "
           f"{v['random_baseline']:g} |" for k, v in tasks.items()]
    md.append(f"| **{results['label']}** | | **{results['core']:.4f}** | | |")
    notes = []
    if results["missing"]:
        notes.append(f"Missing task files (not averaged): {', '.join(results['missing'])}.")
    if results.get("subset"):
        notes.append("Computed on the shipped CORE **subset** (eval_data/core_subset): not comparable with full CORE.")
    long = {k: v["too_long"] for k, v in tasks.items() if v.get("too_long")}
    if long:
        limit = "the rotary table" if (extra or {}).get("core_crop") else "the model's context"  # numerics
        notes.append(f"Examples longer than {limit}, counted as incorrect: "
                     + ", ".join(f"{k} {n}" for k, n in long.items()) + ".")
    if results.get("max_per_task", -1) > 0:
        notes.append(f"At most {results['max_per_task']} examples per task (--max-per-task).")
    write_text_atomic(out_dir / "core.md", "\n".join(md + [""] + notes) + "\n")
