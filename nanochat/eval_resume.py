"""Finished parts of an evaluation kept on disk, so an interrupted base_eval (Ctrl-C, a Slurm time limit, a crash)
continues where it stopped instead of from zero.

Every finished CORE task and bpb split/corpus is written at once to ``<out>/core.partial.json`` or
``<out>/bpb.partial.json`` (temp file + rename, rank 0 only) together with two fingerprints: the settings of the
whole evaluation (checkpoint, tokenizer, dtype, numerics, attention kernel, MoME's kernel path, device, torch and
code versions, batch size, world size: all that can change a number, down to its last digits) and the item's own
inputs (task file and --max-per-task, data manifest or corpus file and --eval-tokens). A rerun reuses an item only
when both are equal, so a report never mixes numbers computed under different settings: it equals, to the byte, the
report of an uninterrupted run. The files are deleted once the whole evaluation has finished, so a rerun of a
completed evaluation computes everything again (as one with --fresh does).

scripts/base_train.py keeps the parts of its final evaluation (each bpb split, each CORE task) the same way, in
``<run dir>/final_eval.partial.json``, fingerprinted by the checkpoint of the evaluated step.

Which items are reused is decided on rank 0 and broadcast (``rank0_decides``): ranks never disagree about which
items to score, so they enter the same collectives.
"""

import itertools
import json
import signal
from contextlib import contextmanager
from pathlib import Path

import torch

from nanochat.common import is_dist, rank0_decides
from nanochat.jsonfile import write_text_atomic
from nanochat.report import code_version  # a fix between an interrupt and the rerun is other code


def checkpoint_fingerprint(model_pt: Path, run: Path, step: int) -> dict:
    """Run, step, and size + modification time of model.pt. Not a sha256: hashing the 5.5 GB of a d24 checkpoint
    would hold every rank for many seconds at each start, and a re-saved model.pt is always a new file (written
    under a temp name, then renamed), so its mtime changes. A copy that keeps the mtime (rsync -a, cp -p) keeps the
    bytes; one that does not merely recomputes."""
    stat = model_pt.stat()
    return {"run": str(run.resolve()), "step": step, "model_pt_bytes": stat.st_size,
            "model_pt_mtime_ns": stat.st_mtime_ns}


def device_fingerprint(device: torch.device) -> str:
    """The device kind, and the GPU model on CUDA: kernels (and their rounding) are chosen per architecture."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return device.type


def eval_settings(model_pt: Path, run: Path, step: int, device: torch.device, **settings) -> dict:
    """The fingerprint shared by every item of an evaluation: checkpoint, device, torch version, this code's
    version and ``settings`` (the caller's: tokenizer, dtype, numerics, kernels, batch size, world size)."""
    return {"checkpoint": checkpoint_fingerprint(model_pt, run, step), "device": device_fingerprint(device),
            "torch": torch.__version__, "code": code_version(), **settings}


def _as_json(obj):
    return json.loads(json.dumps(obj))


def _differences(old: dict, new: dict) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys)


def partial_path(out_dir, name: str) -> Path:
    """Where ``FinishedResults`` of evaluation ``name`` keeps its finished items: ``<out_dir>/<name>.partial.json``."""
    return Path(out_dir) / f"{name}.partial.json"


class FinishedResults:
    """The finished items of one evaluation (``core`` or ``bpb``) in ``partial_path(out_dir, name)``.

    Build it with ``open`` on every rank (a collective); ``get_or_run`` is then called for each item in the same
    order on every rank."""

    def __init__(self, path: Path, settings: dict, items: dict | None = None):
        self.path = path
        self.settings = settings
        self.items = items or {}  # {item: {"key": {...}, "result": ...}}
        self.reused: list[str] = []  # the items this run took from the file

    @classmethod
    def open(cls, out_dir: Path, name: str, settings_fn, fresh: bool) -> "FinishedResults":
        """Read the earlier run's file on rank 0 (with ``settings_fn()`` computed there) and broadcast it."""
        return rank0_decides(lambda: cls._read(partial_path(out_dir, name), settings_fn(), fresh))

    @classmethod
    def _read(cls, path: Path, settings: dict, fresh: bool) -> "FinishedResults":
        settings = _as_json(settings)  # compared with what the file gives back
        if not path.is_file():
            return cls(path, settings)
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            items, old_settings = dict(saved["items"]), saved["settings"]
        except (ValueError, KeyError, TypeError) as e:
            print(f"{path} is unreadable ({type(e).__name__}: {e}); its results are recomputed", flush=True)
            return cls(path, settings)
        if fresh:
            print(f"--fresh: {len(items)} finished result(s) in {path} ignored; everything is recomputed", flush=True)
            return cls(path, settings)
        if old_settings != settings:
            print(f"{path}: {len(items)} finished result(s) were computed with other settings "
                  f"({_differences(old_settings, settings)}); recomputing them", flush=True)
            return cls(path, settings)
        return cls(path, settings, items)

    def would_reuse(self, item: str, key: dict) -> bool:
        """Whether ``get_or_run(item, ...)`` with inputs ``key`` takes the earlier run's result (rank 0's items;
        silent): the one test of both that decision and a caller's "are item's inputs (rows) needed" (base_eval's
        prepare_bpb), so the two cannot drift apart."""
        saved = self.items.get(item)
        return saved is not None and saved.get("key") == _as_json(key) and saved.get("result") is not None

    def _earlier(self, item: str, key: dict):
        """(key, result of an earlier run or None); rank 0."""
        key = _as_json(key)
        if self.would_reuse(item, key):
            return key, self.items[item]["result"]
        saved = self.items.get(item)
        if saved is not None and saved.get("key") != key:
            print(f"{self.path}: the inputs of {item} changed ({_differences(saved.get('key') or {}, key)}); "
                  "recomputing it", flush=True)
        return key, None

    def get_or_run(self, item: str, key_fn, run):
        """The earlier run's result of ``item`` when its inputs ``key_fn()`` (computed on rank 0) are unchanged,
        else ``run()`` on every rank (it may be collective), kept on disk before it is returned."""
        key, result = rank0_decides(lambda: self._earlier(item, key_fn()))
        if result is not None:
            self.reused.append(item)
            return result
        result = run()
        items = {**self.items, item: {"key": key, "result": result}}
        try:
            write_on_rank0(self.path, lambda: write_text_atomic(
                self.path, json.dumps({"settings": self.settings, "items": items}, indent=1) + "\n"))
        except Interrupted:  # with several ranks, a stop voted in the write's step comes once the write succeeded
            if is_dist():
                self.items = items
            raise
        self.items = items  # only what is on disk: the "kept" line counts these
        return result

    def reuse_note(self, what: str, total: int) -> str:
        """A line for the progress output."""
        return f"{what}: {len(self.reused)} of {total} reused from {self.path} (finished by an earlier run)"

    def discard(self) -> None:
        """Delete the file once the evaluation's report is written (rank 0)."""
        if not is_dist() or torch.distributed.get_rank() == 0:
            self.path.unlink(missing_ok=True)


class ResultWriteError(OSError):
    """Rank 0 could not write a result file of the evaluation (a full disk, a quota); raised on every rank.
    ``failure``: what failed, without base_eval's advice (base_train's final evaluation gives its own)."""

    failure = ""


def write_on_rank0(what, write) -> None:
    """``write()`` (of ``what``, a file) on rank 0, the other ranks waiting for it: an OSError there (a full
    disk) raises ``ResultWriteError`` naming it on every rank, so no rank goes on alone into a collective the
    others never reach (or exits 0 while rank 0 fails)."""
    def attempt():
        try:
            write()
        except OSError as e:
            failure = f"writing {what} failed ({type(e).__name__}: {e})"
            error = ResultWriteError(f"{failure}; free some space and run the same command again (it reuses what "
                                     "was kept)")
            error.failure = failure  # an attribute, so rank0_decides's pickling takes it to the other ranks
            raise error from e

    rank0_decides(attempt)


def write_report_on_rank0(what, write) -> None:
    """The evaluation's last write (its report), after which it only tidies up: ``write_on_rank0``, then a signal
    stops nothing more (``evaluation_complete``). Under torch.distributed a signal voted in the write's own step is
    raised once the write succeeded (``rank0_decides``): the report is on disk, so it is noted and the evaluation
    finishes (exit 0, the partial files deleted) rather than exit 128+N beside a complete report. In one process a
    signal raises inside the write, which may not have finished: it stops the evaluation as before."""
    try:
        write_on_rank0(what, write)
    except Interrupted as e:
        if not is_dist():
            raise
        if torch.distributed.get_rank() == 0:
            print(f"{e} came as the report was written: the evaluation is complete", flush=True)
    evaluation_complete()


# The signals that stop a run or an evaluation (base_train saves first): Ctrl-C, SIGTERM (a scheduler's cancel or time
# limit, torchrun passing on its own) and SIGUSR1 (Slurm's pre-emption notice, `sbatch --signal=USR1@90`, whose
# default action would kill the process without a word or a checkpoint).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Interrupted(KeyboardInterrupt):
    """One of STOP_SIGNALS arrived during the evaluation."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def interrupts_raise():
    """Turn STOP_SIGNALS into ``Interrupted`` (SIGTERM or SIGUSR1 would otherwise kill the process without a word), at
    once or, under torch.distributed, at the next stop vote or set-up step (``stop_evaluation``). Nothing is saved
    on the way out: every finished item is already on disk."""
    def handle(signum, frame):
        stop_evaluation(signum)

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        with signals_latched_for_votes():
            yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# The signal (its number) of this process's running evaluation that waits for the next stop vote (torch.distributed
# only); one per process, as signal handlers are. None outside an evaluation and before a signal.
_latched_signum: int | None = None


@contextmanager
def signals_latched_for_votes():
    """The block is an evaluation whose signal handlers call ``stop_evaluation``: it starts with no latched signal and
    leaves none behind (an evaluation that finished after its last vote ignores a later signal)."""
    global _latched_signum
    _latched_signum = None
    try:
        yield
    finally:
        _latched_signum = None


def evaluation_complete() -> None:
    """From here to the end of the evaluation's block (``signals_latched_for_votes``) a signal changes nothing: the
    reports are written, what is left (deleting the partial files, the last line) is not worth a 128+N exit. The
    handler ignores a signal once one is latched; 0 is latched and reads as none (``latched_signal``)."""
    global _latched_signum
    _latched_signum = 0


def latched_signal() -> int:
    """The number of the signal this process latched for the next stop vote; 0 when none. Outside an evaluation
    (training's set-up, which StopSignal handles without latching here) it is always 0."""
    return _latched_signum or 0


def stop_together(signum: int) -> None:
    """Raise ``Interrupted(signum)``: a vote (``stop_voted``, or the exchange of a set-up step in
    ``nanochat.common.every_rank_ok`` / ``rank0_decides``) found ``signum`` latched on some rank, so every rank raises
    it here. Latched on every rank, so a later signal changes nothing on any rank (the clean-up that follows destroys
    the group, after which a signal would otherwise take the one-process path and raise again)."""
    global _latched_signum
    _latched_signum = signum
    raise Interrupted(signum)


def stop_if_latched_on_any_rank(signals: list[int]) -> None:
    """``signals``: every rank's ``latched_signal()``, gathered by a set-up step's exchange. The largest one stops
    every rank with the same ``Interrupted`` (as the stop vote picks it); all 0: nothing."""
    if max(signals):
        stop_together(max(signals))


def stop_evaluation(signum: int) -> None:
    """What a signal handler does during an evaluation. One process: raise ``Interrupted`` at once. Several: latch
    the signal; every rank raises it together at the next ``stop_voted`` batch or at the end of the next set-up
    step (``nanochat.common.every_rank_ok`` / ``rank0_decides``: loading, tokenizing, preparing a task), whichever
    comes first. Raised here it would leave this rank alone: the others wait in the evaluation's next collective
    (gloo: an error; NCCL: a hang until the timeout) when a signal reaches one rank only, or the ranks stop at
    different batches when it reaches each at a different moment."""
    global _latched_signum
    if _latched_signum is not None:  # the evaluation is already stopping (e.g. in its clean-up): nothing changes
        return
    _latched_signum = signum
    if not is_dist():
        raise Interrupted(signum)


# A vote costs an all-reduce (0.3-0.5 ms on 2 CPU gloo processes) and the wait for the slowest rank (each rank's
# jitter, paid per vote instead of once per evaluation). bench/eval_stop_vote.py, 2 gloo processes, 6.4 ms batches:
# +1.2 ms per batch voting at each batch, +0.3 ms every 4th, +0.07 ms every 16th (dev/LOG.md 2026-11-26). Every 4th:
# a stop waits for at most 4 batches (about a second for a large model on a GPU, where a batch takes far longer than
# a vote; a scheduler's grace period before SIGKILL is tens of seconds).
VOTE_EVERY_BATCHES = 4


def stop_voted(batches, device, every: int = VOTE_EVERY_BATCHES):
    """``batches`` with a stop vote before the first batch and every ``every``-th after it, under torch.distributed:
    ONE all-reduce of two integers (a latched signal's number, whether this rank has a batch left), so every rank
    raises the same ``Interrupted`` at the same vote; a rank whose batches ran out (ranks can have one more than
    others) counts on without work until the vote at which no rank has any left. Every rank must iterate it to the
    end (a collective); in one process it is ``batches`` itself (a signal raises at once)."""
    if not is_dist():
        yield from batches
        return
    none_left = object()
    batches = iter(batches)
    for index in itertools.count():
        batch = next(batches, none_left)
        if index % every == 0:
            votes = torch.tensor([_latched_signum or 0, batch is not none_left], dtype=torch.int64, device=device)
            torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.MAX)
            signum, any_left = votes.tolist()
            if signum:  # the largest number when ranks got different signals: the same exception on every rank
                stop_together(signum)
            if not any_left:
                return
        if batch is not none_left:
            yield batch
