"""Shared code of the memory/routing analyses (scripts/analyze_memory.py, analyze_routing.py, wic_probe.py).

* loading a run (model + tokenizer, directories from meta.json unless overridden),
* building token rows per *domain* (``val``/``train`` split, one or all CORE tasks, any text file; the train
  split's rows are the documents the run's loader read first, as the final train bpb's, unless --train-rows
  manifest),
* running the model over rows with the memory block's opt-in ``capture`` on, yielding per-batch tensors
  stacked over memory layers, and streaming accumulators so that nothing per-token is kept in memory,
* heat-map plotting (layers x heads).

Shapes: a capture batch holds ``(B, T, L, H, ...)`` tensors (L memory layers in ``block.layers`` order, H heads);
a *site* is one (layer, head) pair, flattened as s = l*H + h. BOS positions are excluded everywhere (they are
a fixed start symbol, not text) and so is right padding of variable-length rows.

The analyses run the model in fp32 (no autocast) with PyTorch SDPA attention, whatever dtype and --attention the
run trained with: they measure gates and routes, not a loss to compare with training's, and FlashAttention would
round q/k/v to bf16.
"""

import dataclasses
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from nanochat.jsonfile import write_text_atomic
from nanochat.routing_metrics import effective_count, jsd_base2
from nanochat.work_dirs import work_dir


# -- flags and outputs --------------------------------------------------------------------------------------
class OutputWriteError(Exception):
    """An output under --out-dir could not be written (full disk, no permission, not a directory)."""


@contextmanager
def staged_outputs(out_dir: Path):
    """A fresh folder inside ``out_dir`` for one set of outputs, moved into ``out_dir`` once every file of the
    set is written: a failure midway (full disk, Ctrl-C) leaves the previous set whole, never a mix or a torn
    file. A SIGKILLed run's folder is removed by the next (nanochat.work_dirs). Raises OutputWriteError naming
    --out-dir for any OSError of the writes.

    The .json is moved last: each tool's set has one (run, step, settings and every number), which marks the set
    complete. A kill between two renames can leave the older .json beside some new files, but a new .json always
    stands beside every file of its own set."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with work_dir(out_dir, ".partial-") as stage:
            yield stage
            for f in sorted(stage.iterdir(), key=lambda f: (f.suffix == ".json", f.name)):
                f.replace(out_dir / f.name)
    except OSError as e:
        raise OutputWriteError(f"cannot write the outputs under --out-dir {out_dir}: {e}") from e


# -- loading ----------------------------------------------------------------------------------------------
def run_tokenizer_dir(flag_value, meta: dict) -> tuple[Path, str]:
    """(the run's tokenizer directory, where it came from): --tokenizer-dir, else meta.json's 'tokenizer_dir', else
    the run's recorded --tokenizer-dir (checkpoints saved before 2026-11-22 lack the meta key), else the default
    directory. base_eval (which prints the source), the analyses and export_reference resolve it alike."""
    from nanochat.checkpoint import recorded_run_args
    from nanochat.tokenizer import default_tokenizer_dir

    if flag_value:
        return Path(flag_value), "--tokenizer-dir"
    if meta.get("tokenizer_dir"):
        return Path(meta["tokenizer_dir"]), "checkpoint meta 'tokenizer_dir'"
    recorded = recorded_run_args(meta).get("tokenizer_dir")
    if recorded:
        return Path(recorded), "the run's recorded --tokenizer-dir (no 'tokenizer_dir' in meta.json)"
    return Path(default_tokenizer_dir()), "default (no --tokenizer-dir and no 'tokenizer_dir' in meta.json)"


class SplitData:
    """The prepared data of the val/train domains, found as base_eval finds its bpb data
    (nanochat.dataset.run_data_dir: --data-dir, else the meta's data_dir, else the recorded dataset's directory);
    like CoreSettings, found, checked and printed at the first such domain only: an analysis that reads no split
    needs none. ``record()`` is what the outputs' JSON says of it."""

    def __init__(self, flag_value, meta: dict):
        self.flag_value, self.meta = flag_value, meta
        self.path = None  # once a val/train domain asked

    def __call__(self, asking: str) -> Path:
        """The directory, for the domain ``asking`` ("--corpus val"), named in the error of one without data."""
        from nanochat.dataset import MANIFEST, DataError, check_run_data, prepare_data_command, run_data_dir

        if self.path is None:
            found = run_data_dir(self.flag_value, self.meta)
            if not (found.path / MANIFEST).is_file():
                raise ValueError(f"{asking}: no prepared data in {found.path} (no {MANIFEST}; {found.source}): "
                                 f"prepare it with {'' if found.dataset else 'e.g. '}"
                                 f"`{prepare_data_command(found.path, found.dataset)}`, or pass --data-dir DIR")
            try:
                check_run_data(found)
            except DataError as e:
                raise ValueError(f"{asking}: {e}") from None
            print(f"data: {found.path} ({found.source})", flush=True)
            self.path = found.path
        return self.path

    def record(self) -> str | None:
        return None if self.path is None else str(self.path)


def load_run(run, step=None, device="cpu", tokenizer_dir=None):
    """(model in eval mode, meta, tokenizer) of a checkpoint; errors name the run directory. A run trained with
    --synthetic-data is refused, naming the flag, before its weights are read."""
    from nanochat.checkpoint import check_not_synthetic, load_meta, load_model
    from nanochat.tokenizer import check_vocab_matches, get_tokenizer

    if not Path(run).is_dir():
        raise FileNotFoundError(f"--run {run}: directory does not exist")
    meta = load_meta(run, step)
    check_not_synthetic(meta, f"--run {run} step {meta['step']}", "this tool reads text in the run's own tokenizer",
                        "analyze")
    model, meta = load_model(run, meta["step"], device=device)
    model.eval()
    tokenizer = get_tokenizer(run_tokenizer_dir(tokenizer_dir, meta)[0])
    check_vocab_matches(tokenizer, model.config.vocab_size, f"--run {run}", meta)
    return model, meta, tokenizer


def capturing_designs(config) -> list[str]:
    """The registered designs whose block the analyses can capture on ``config``'s family: those that set
    ``capture`` (an instance attribute, so each block is built on the meta device at its default options; one the
    family refuses, e.g. STEM without a SwiGLU FFN, is left out)."""
    from nanochat.families import meta_device
    from nanochat.memory import MEMORY_BLOCKS

    names = []
    for name, cls in MEMORY_BLOCKS.items():
        try:
            with meta_device():
                block = cls(dataclasses.replace(config, memory=name, memory_options={}, memory_layers=[]))
        except ValueError:
            continue
        if block.layers and hasattr(block, "capture"):
            names.append(name)
    return names


def memory_block(model, need_routing: bool = False):
    block = model.memory
    if not block.layers:
        raise ValueError(f"--memory {model.config.memory} has no memory layers to analyse (needs "
                         f"{', '.join(capturing_designs(model.config))})")
    if not hasattr(block, "capture"):
        raise ValueError(f"--memory {model.config.memory}: the analyses cannot capture its memory layers (on this "
                         f"family they capture {', '.join(capturing_designs(model.config))}): a design opts in by "
                         "setting self.capture = None in its block's __init__ and calling "
                         "nanochat.memory.ve.record(self.capture, layer, gamma=..., inject_norm=...) in its forward "
                         "(docs/extending.md)")
    if need_routing and not hasattr(block, "route"):
        raise ValueError(f"routing analysis needs a MoME model (this run uses --memory {model.config.memory})")
    return block


# -- domains ------------------------------------------------------------------------------------------------
TRAIN_ROWS = ("run", "manifest")  # --train-rows
VAL_ROWS = "manifest order"  # the val split's rows: its first documents, as every val bpb reads them


def add_train_rows_flag(ap) -> None:
    ap.add_argument("--train-rows", choices=TRAIN_ROWS, default="run",
                    help="the train split's rows for --corpus/--reference train: run = the documents the checkpoint's "
                    "run read first (its --data-seed), the rows of its final train bpb and of base_eval's (a "
                    "checkpoint that records no --data-seed, e.g. an imported one: manifest order); manifest = the "
                    "split's first documents in manifest order (the analyses' rows before 2026-11-27), which a run "
                    "may never have read")


def train_rows_order(flag: str, meta: dict) -> tuple[int | None, str]:
    """(``first_read_seed`` of the train split's rows for build_eval_rows, their description as summary.json's
    "train_bpb_rows"): --train-rows run follows the run's recorded --data-seed through eval_rows_order, as the final
    train bpb and base_eval do."""
    from nanochat.checkpoint import recorded_run_args
    from nanochat.dataloader import eval_rows_order
    from nanochat.report import train_rows_description

    if flag == "manifest":
        return None, "manifest order (--train-rows manifest)"
    data_seed = recorded_run_args(meta).get("data_seed")
    first_read, rows_key = eval_rows_order("train", data_seed)
    return first_read, train_rows_description(rows_key)


@dataclass
class Domain:
    name: str
    rows: list[torch.Tensor]  # 1-D LongTensors, BOS first (or a window of a longer BOS-started document)
    kind: str = "file"  # split | core | file
    order: str = ""  # a split's: which of its documents the rows hold (train_rows_order, VAL_ROWS)
    spec: str = ""  # the --corpus/--reference spec it came from (build_domains)

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.rows)


def _cap_rows(rows: list[torch.Tensor], max_tokens: int | None) -> list[torch.Tensor]:
    """Keep whole rows (the last one cut) until max_tokens positions are reached."""
    if not max_tokens:
        return rows
    out, total = [], 0
    for r in rows:
        if total >= max_tokens:
            break
        out.append(r[: max_tokens - total])
        total += len(out[-1])
    return out


def text_rows(tokenizer, documents: list, seq_len: int, max_tokens: int | None = None) -> list[torch.Tensor]:
    """[BOS] + tokens of each document (str, or loss_eval.TextFile), cut into windows of seq_len (later windows keep
    no earlier context). With ``max_tokens``, documents are read and encoded only as far as that many positions
    take (the last window may then be shorter than the whole document's): ``_cap_rows(rows, max_tokens)`` is the
    same as without it."""
    from nanochat.loss_eval import encode_document

    rows, total = [], 0
    for doc in documents:
        if max_tokens and total >= max_tokens:
            break
        need = max_tokens - total - 1 if max_tokens else None  # positions left, less the BOS
        toks = torch.tensor([tokenizer.bos_token_id] + encode_document(tokenizer, doc, need), dtype=torch.long)
        rows.extend(toks[s : s + seq_len] for s in range(0, len(toks), seq_len))
        total += len(toks)
    return rows


def core_domains(tokenizer, bundle_dir, which: str, seq_len: int, max_per_task: int,
                 flag: str = "--corpus") -> list[Domain]:
    """One domain per CORE task: every rendered row the evaluator executes (all multiple-choice candidates count,
    as in the paper's audit), with the evaluator's few-shot sampling and shuffle; rows longer than seq_len keep
    their last seq_len tokens like the evaluator's left crop (no scored-region check: nothing is scored here)."""
    from nanochat.core_eval import fewshot_for, order_task_data, prepare_example
    from nanochat.eval_bundle import load_core_tasks, load_task_data

    specs = load_core_tasks(Path(bundle_dir))
    if which != "all":
        specs = [t for t in specs if t.label == which]
        if not specs:
            labels = ", ".join(t.label for t in load_core_tasks(Path(bundle_dir)))
            raise ValueError(f"{flag} core:{which}: no such task in {bundle_dir}/core.yaml; known: {labels}")
    out = []
    for task in specs:
        path = Path(bundle_dir) / "eval_data" / task.dataset_uri
        if not path.is_file():
            if which != "all":
                raise FileNotFoundError(f"{flag} core:{which}: data file {path} is missing")
            continue
        data = order_task_data(load_task_data(path, task.task_type), max_per_task)
        rows = []
        for i, item in enumerate(data):
            ex = prepare_example(tokenizer, item, task, fewshot_for(data, i, task.num_fewshot), f"{path} example {i}")
            rows.extend(torch.tensor(r[-seq_len:], dtype=torch.long) for r in ex.rows)
        out.append(Domain(task.label, rows, "core"))
    return out


class CoreSettings:
    """The CORE bundle and cap of the core: domains (nanochat.eval_bundle.run_core_inputs, the resolver base_eval
    uses), resolved, printed and the bundle found at the first core: domain only: a run's recorded bundle that is
    missing here stops no analysis that reads none. ``record()`` is what the outputs' JSON says of them."""

    def __init__(self, args, meta: dict):
        self.args, self.meta = args, meta
        self.resolved = None  # (CoreInputs, the bundle directory read), once a core: domain asked

    def __call__(self):
        if self.resolved is None:
            from nanochat.eval_bundle import find_bundle, run_core_inputs

            inputs = run_core_inputs(self.args.bundle, self.args.max_per_task, self.meta, self.args.run)
            print(inputs.describe(), flush=True)
            self.resolved = inputs, find_bundle(inputs.bundle)
        return self.resolved

    def record(self) -> dict | None:
        """{"bundle": the directory read, "max_per_task": its cap (-1: every example), and where each came from};
        None where no core: domain read a bundle."""
        if self.resolved is None:
            return None
        inputs, bundle_dir = self.resolved
        return {"bundle": str(bundle_dir), "bundle_source": inputs.bundle_source,
                "max_per_task": inputs.max_per_task, "max_per_task_source": inputs.max_per_task_source}


def build_domains(specs: list[str], tokenizer, seq_len: int, *, data_dir=None, core=None,
                  max_tokens: int | None = None, flag: str = "--corpus",
                  train_rows: tuple[int | None, str] = (None, "manifest order")) -> list[Domain]:
    """--corpus val|train|core:<task>|core:all|file:PATH (a file domain is named after the file stem, or its path as
    given where another domain has that name: ``name_uniquely``); ``flag`` is the option the specs came from, named
    in errors; ``data_dir``: the prepared data of val/train domains, or a function of the asking domain ("--corpus
    val") giving it (SplitData); ``core``: a function giving the settings and the bundle directory of core:
    domains (CoreSettings; None: the search order, every example); ``train_rows``: train_rows_order's
    (first-read seed, description) of the train split's rows."""
    domains = []
    for spec in specs:
        start = len(domains)
        kind, _, arg = spec.partition(":")
        if kind in ("val", "train") and not arg:
            from nanochat.dataloader import EvalRowsTooFew, build_eval_rows
            from nanochat.dataset import DataError

            if data_dir is None:
                raise ValueError(f"{flag} {spec}: no data directory (SplitData finds a run's)")
            split_dir = data_dir(f"{flag} {spec}") if callable(data_dir) else data_dir
            n = max_tokens or 65536
            first_read, order = train_rows if kind == "train" else (None, VAL_ROWS)
            try:
                rows = build_eval_rows(split_dir, kind, tokenizer, seq_len, n, first_read_seed=first_read,
                                       budget_flag="--max-tokens")[:, :-1]
            except EvalRowsTooFew as e:  # say where the budget came from
                budget = f"--max-tokens {n:,}" if max_tokens else f"--max-tokens 0 = {n:,}"
                raise ValueError(f"{flag} {spec}: {budget} is more than the split holds: {e}") from e
            except DataError as e:  # e.g. a corrupt manifest: an error line, not a traceback
                raise ValueError(f"{flag} {spec}: {e}") from e
            domains.append(Domain(kind, list(rows), "split", order))
        elif kind == "core" and arg:
            from nanochat.download import DownloadError
            from nanochat.eval_bundle import find_bundle

            try:
                inputs, bundle_dir = core() if core else (None, find_bundle(None))
            except DownloadError as e:  # offline without --bundle: its advice (--bundle subset), not a traceback
                raise ValueError(f"{flag} {spec}: {e}") from e
            cap = inputs.max_per_task if inputs else -1
            for d in core_domains(tokenizer, bundle_dir, arg, seq_len, cap, flag):
                domains.append(Domain(d.name, _cap_rows(d.rows, max_tokens), "core"))
        elif kind == "file" and arg:
            from nanochat.loss_eval import corpus_documents

            path = Path(arg)
            if not path.is_file():
                raise FileNotFoundError(f"{flag} {spec}: file {path} does not exist")
            rows = text_rows(tokenizer, corpus_documents(path), seq_len, max_tokens)
            domains.append(Domain(path.stem, _cap_rows(rows, max_tokens)))
        else:
            raise ValueError(f"{flag} {spec!r}: expected val, train, core:<task>, core:all or file:PATH")
        for d in domains[start:]:  # means over no position would read as measured zeros / uniform routing
            if not any(bool((r != tokenizer.bos_token_id).any()) for r in d.rows):
                raise ValueError(f"{flag} {spec}: domain {d.name!r} has no token to analyse (empty or only BOS)")
        for d in domains[start:]:
            d.spec = spec
    if not domains:
        raise ValueError(f"{flag}: no domain given")
    name_uniquely(domains, flag)
    return domains


CORE_AVERAGE = "CORE"  # analyze_memory's task-balanced entry beside the tasks'


def name_uniquely(domains: list[Domain], flag: str) -> None:
    """The outputs key each domain by its name, so two of one name would be one entry (the second's numbers
    under it, the first's lost) and one task named twice would weigh twice in the task-balanced CORE average. A file
    domain whose stem another domain (or the CORE average) has is named by its path as given (enwik9/val.txt beside
    shakespeare/val.txt and the val split), by its spec where that path is another domain's name too (file:copa
    beside core:copa); a domain given twice (core:copa beside core:all, val twice) is refused."""
    names = [d.name for d in domains]
    taken = {d.name for d in domains if d.kind != "file"} | {CORE_AVERAGE}  # names a file domain never keeps
    for d in domains:
        if d.kind == "file" and (names.count(d.name) > 1 or d.name in taken):
            path = file_path_name(d)
            d.name = d.spec if path in taken else path
    first = {}
    for d in domains:
        if d.name in first:
            raise ValueError(f"{flag}: domain {d.name!r} is given twice ({first[d.name]} and {d.spec}): it would be "
                             "one entry of the outputs (and count twice in the CORE average); give it once")
        first[d.name] = d.spec


def file_path_name(domain: Domain) -> str:
    """A file domain's name where its stem is taken: the path as given in its spec."""
    return domain.spec.partition(":")[2]


def split_rows(domains: list[Domain]) -> dict[str, str]:
    """{split domain: which of its documents it holds}, for the outputs' "split_rows"."""
    return {d.name: d.order for d in domains if d.kind == "split"}


# -- forward with capture -----------------------------------------------------------------------------------
def pad_rows(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to (B, T); the mask marks real tokens. Right padding is exact: attention is causal and the
    memory blocks are per-position, so real positions never see the padding."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = True
    return ids, mask


def stack_capture(capture: dict, layers) -> dict[str, torch.Tensor]:
    """{layer: {key: (B, T, H, ...)}} -> {key: (B, T, L, H, ...)} in the block's layer order."""
    missing = [l for l in layers if l not in capture]
    if missing:
        raise RuntimeError(f"memory capture recorded no tensors for layer(s) {missing}")
    keys = set.intersection(*(set(capture[l]) for l in layers))
    return {k: torch.stack([capture[l][k] for l in layers], dim=2) for k in keys}


@torch.no_grad()
def run_captured(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward of (B, T) ids with capture on; returns stacked CPU tensors (see stack_capture)."""
    block = model.memory
    device = model.wte.weight.device
    block.capture = {}
    try:
        model(ids.to(device))
        cap = stack_capture(block.capture, block.layers)
    finally:
        block.capture = None
    return {k: v.cpu() for k, v in cap.items()}


def iter_captured(model, rows: list[torch.Tensor], batch_size: int, bos_id: int, desc: str = "", progress=True):
    """Yield (ids (B, T), mask (B, T) = real non-BOS positions, stacked capture) per batch of rows."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths together: less padding
    for start in tqdm(range(0, len(order), batch_size), desc=desc, disable=not progress, leave=False):
        ids, mask = pad_rows([rows[i] for i in order[start : start + batch_size]], bos_id)
        cap = run_captured(model, ids)
        yield ids, mask & (ids != bos_id), cap


# -- streaming accumulators ---------------------------------------------------------------------------------
class GateAccumulator:
    """Per (layer, head): sums of gamma and of the injected norm ||gamma m~||_2 over masked positions."""

    def __init__(self, L: int, H: int):
        self.gamma = torch.zeros(L, H, dtype=torch.float64)
        self.norm = torch.zeros(L, H, dtype=torch.float64)
        self.count = 0

    def update(self, mask: torch.Tensor, cap: dict) -> None:
        m = mask.to(torch.float64)[..., None, None]  # (B, T, 1, 1)
        self.gamma += (cap["gamma"].double() * m).sum((0, 1))
        self.norm += (cap["inject_norm"].double() * m).sum((0, 1))
        self.count += int(mask.sum())

    def result(self) -> dict:
        """Means per (layer, head); NaN (null in the JSON) over no position rather than a measured-looking 0."""
        n = self.count if self.count else float("nan")
        return {"gamma": (self.gamma / n).tolist(), "inject_norm": (self.norm / n).tolist(), "tokens": self.count}


class RoutingAccumulator:
    """Streaming version of routing_metrics.audit: per-site membership counts and routing-weight mass, and
    per-(token, site, slot) membership counts (a dense int32 (V, S*M) table: 226 MB for the paper's d24 with
    V = 32768, 144 sites, M = 12) for the per-token effective slot count."""

    def __init__(self, S: int, M: int, vocab_size: int):
        self.S, self.M, self.V = S, M, vocab_size
        self.member = torch.zeros(S, M, dtype=torch.float64)
        self.weight = torch.zeros(S, M, dtype=torch.float64)
        self.cells = torch.zeros(vocab_size * S * M, dtype=torch.int32)
        self.token_counts = torch.zeros(vocab_size, dtype=torch.long)

    def update(self, ids: torch.Tensor, mask: torch.Tensor, cap: dict) -> None:
        S, M = self.S, self.M
        K = cap["slots"].size(-1)
        topk = cap["slots"][mask].reshape(-1, S, K).long()  # (N, S, K)
        w = cap["weights"][mask].reshape(-1, S, K).double()
        tok = ids[mask]  # (N,)
        site = torch.arange(S).view(1, S, 1).expand_as(topk)
        cell = site * M + topk  # (N, S, K)
        self.member.view(-1).index_add_(0, cell.reshape(-1), torch.ones(cell.numel(), dtype=torch.float64))
        self.weight.view(-1).index_add_(0, cell.reshape(-1), w.reshape(-1))
        flat = tok.view(-1, 1, 1) * (S * M) + cell
        self.cells.index_add_(0, flat.reshape(-1), torch.ones(flat.numel(), dtype=torch.int32))
        self.token_counts += torch.bincount(tok, minlength=self.V)

    def distributions(self) -> tuple[torch.Tensor, torch.Tensor]:
        norm = lambda x: x / x.sum(-1, keepdim=True).clamp_min(1e-30)  # noqa: E731
        return norm(self.member), norm(self.weight)

    def per_token_effective(self, min_count: int) -> float:
        keep = (self.token_counts >= min_count).nonzero().flatten()
        if keep.numel() == 0:
            return float("nan")
        cells = self.cells.view(self.V, self.S, self.M)
        total = torch.zeros(self.S, dtype=torch.float64)
        for chunk in keep.split(1024):  # bounded memory: (chunk, S, M) float64 at a time
            total += effective_count(cells[chunk].double(), dim=-1).sum(0)
        return (total / keep.numel()).mean().item()

    def audit(self, min_count: int = 32, reference_weight=None) -> dict:
        member, weight = self.distributions()
        row = {
            "marginal_effective_slots": effective_count(member).mean().item(),
            "weight_effective_slots": effective_count(weight).mean().item(),
            "largest_slot_mass": weight.max(-1).values.mean().item(),  # see routing_metrics.audit
            "largest_slot_positions": (self.member.max(-1).values / self.token_counts.sum().clamp_min(1)).mean().item(),
            "per_token_effective_slots": self.per_token_effective(min_count),
            "inactive_cells": int((self.member == 0).sum()),
            "total_cells": self.member.numel(),
            "positions": int(self.token_counts.sum()),
        }
        if reference_weight is not None:
            j = jsd_base2(weight, reference_weight)
            row["jsd_mean"], row["jsd_max"] = j.mean().item(), j.max().item()
        return row


# -- token location (WiC targets, --words prompts) ----------------------------------------------------------
def token_spans(tokenizer, ids: list[int]) -> list[tuple[int, int]]:
    """Byte span [start, end) of each token in the UTF-8 text (per-token loop: only used on short sentences)."""
    spans, pos = [], 0
    for t in ids:
        n = len(tokenizer.decode_bytes([t]))
        spans.append((pos, pos + n))
        pos += n
    return spans


def single_token_at(tokenizer, text: str, char_start: int, char_end: int) -> tuple[list[int], int | None]:
    """Encode ``text``; return (ids, i) where ids[i] covers exactly the word text[char_start:char_end] with its
    preceding space (as the tokenizer sees it in context) or, at the very start, the word alone. i is None when
    the word is split over several tokens or merged with neighbouring characters."""
    ids = tokenizer.encode(text)
    b_start = len(text[:char_start].encode("utf-8"))
    b_end = len(text[:char_end].encode("utf-8"))
    want_start = b_start - 1 if char_start > 0 and text[char_start - 1] == " " else b_start
    for i, (s, e) in enumerate(token_spans(tokenizer, ids)):
        if s == want_start and e == b_end:
            return ids, i
    return ids, None


# -- outputs -------------------------------------------------------------------------------------------------
def write_json(path: Path, obj) -> None:
    """Strict JSON: NaN (e.g. a threshold cell with an empty class) is written as null, not as bare NaN."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(_nan_to_none(obj), indent=2, allow_nan=False) + "\n")


def _nan_to_none(x):
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_to_none(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def heatmaps(panels: dict[str, torch.Tensor], path: Path, layers, *, vmin=None, vmax=None, cmap="viridis",
             ranks: dict[str, torch.Tensor] | None = None, title: str = "", symmetric: bool = False) -> None:
    """One (layers x heads) panel per entry, shared colour scale; NaN cells are grey; ``ranks`` (same shape,
    0 = none) are written into the cells (the paper's top-10 effect numbering). ``symmetric`` centres the colour
    scale on 0 (signed effects on a diverging map: white = no effect)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    L, H = next(iter(panels.values())).shape
    fig, axes = plt.subplots(1, n, figsize=(max(3.0, 0.45 * H + 1.5) * n, max(2.5, 0.4 * L + 1.2)), squeeze=False,
                             layout="constrained")
    vals = torch.cat([p.flatten() for p in panels.values()]).double()
    vals = vals[~vals.isnan()]
    lo = vmin if vmin is not None else (vals.min().item() if vals.numel() else 0.0)
    hi = vmax if vmax is not None else (vals.max().item() if vals.numel() else 1.0)
    if symmetric:
        lo, hi = -max(abs(lo), abs(hi), 1e-12), max(abs(lo), abs(hi), 1e-12)
    cm = matplotlib.colormaps[cmap].with_extremes(bad="lightgrey")
    for k, (ax, (name, grid)) in enumerate(zip(axes[0], panels.items())):
        im = ax.imshow(grid.double().numpy(), vmin=lo, vmax=hi, cmap=cm, aspect="auto")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("head")
        if k == 0:
            ax.set_ylabel("layer")
        ax.set_xticks(range(H))
        ax.set_yticks(range(L), [str(l) for l in layers])
        if ranks and name in ranks:
            for (li, hi_), r in zip(torch.nonzero(ranks[name]).tolist(), ranks[name][ranks[name] > 0].tolist()):
                ax.text(hi_, li, str(int(r)), ha="center", va="center", fontsize=7, color="black",
                        bbox=dict(boxstyle="circle,pad=0.1", fc="white", ec="black", lw=0.5))
    fig.colorbar(im, ax=list(axes[0]), shrink=0.8)
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def top_ranks(grid: torch.Tensor, k: int = 10) -> torch.Tensor:
    """Rank 1..k of the k largest positive cells (0 elsewhere; NaN and non-positive cells are never ranked); equal
    cells in row-major order (a stable sort: the same ranks on every device and run)."""
    flat = grid.flatten().double().nan_to_num(nan=-math.inf)
    order = flat.sort(descending=True, stable=True).indices[:k]
    ranks = torch.zeros_like(flat, dtype=torch.long)
    for r, i in enumerate(order.tolist(), start=1):
        if flat[i] > 0:
            ranks[i] = r
    return ranks.view(grid.shape)
