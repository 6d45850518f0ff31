"""Small shared helpers: device choice, torch.distributed setup, rank-0 printing, seeding, and the two ways a
decision is kept the same on every rank (rank0_decides, every_rank_ok)."""

import gc
import importlib
import json
import os
import pickle
import platform
import random
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nanochat.cli_types import DEVICE_TYPES, another_rank_reports_for_the_node


# How long a rank waits in a collective before the job is ended: nccl's default is 10 min (gloo's 30), and ranks do
# wait while rank 0 alone works (the CORE bundle's download, a d24 checkpoint's write to slow storage)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def autodetect_device() -> str:
    """cuda > mps > cpu."""
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


@dataclass
class DistInfo:
    is_distributed: bool
    rank: int
    local_rank: int
    world_size: int


def get_dist_info() -> DistInfo:
    """Read the torchrun environment (works before and after init_process_group)."""
    if all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return DistInfo(True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    return DistInfo(False, 0, 0, 1)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def compute_init(device_type: str = "") -> tuple[DistInfo, torch.device]:
    """Initialise torch.distributed when launched by torchrun (nccl on CUDA, gloo otherwise).

    Returns the dist info and the device this rank should use.
    """
    device_type = device_type or autodetect_device()
    if device_type not in DEVICE_TYPES:  # e.g. "cuda:1" would skip the CUDA set-up below (and nccl under torchrun)
        raise SystemExit(f"error: device type {device_type!r} is not one of {', '.join(DEVICE_TYPES)} (no GPU index: "
                         "each process uses cuda:LOCAL_RANK; choose the GPUs with CUDA_VISIBLE_DEVICES)")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device-type cuda requested but CUDA is not available")
    info = get_dist_info()
    if device_type == "cuda" and info.local_rank >= (count := torch.cuda.device_count()):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # else set_device's "invalid device ordinal" traceback
        raise SystemExit(f"error: LOCAL_RANK {info.local_rank} needs cuda:{info.local_rank}, but this process sees "
                         f"{count} GPU(s) (CUDA_VISIBLE_DEVICES {'unset' if visible is None else repr(visible)}): "
                         f"launch at most {count} processes per node (torchrun --nproc_per_node)")
    if device_type == "cuda":
        # before the first CUDA allocation: fewer fragmentation OOMs with variable-size eval/CORE batches
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast (optimizer, eval in fp32)
        torch.backends.cudnn.allow_tf32 = True
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device(device_type)
    if info.is_distributed and not dist.is_initialized():
        _import_group_default_modules()
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, device_id=device if device_type == "cuda" else None,
                                timeout=COLLECTIVE_TIMEOUT)
        dist.barrier()
    return info, device


# Modules whose functions take ``group.WORLD`` as a default argument, evaluated at import: imported after
# init_process_group (torch._dynamo imports the first on first use: a MoE forward, torch.compile), they keep the
# default group alive past destroy_process_group, and interpreter shutdown then tears gloo down in an order that
# sometimes aborts ("terminate called without an active exception", SIGABRT after the work was done; torch 2.13).
# Imported before it, their default is None (= the default group, looked up at call time). ~15 ms.
GROUP_DEFAULT_MODULES = ("torch.distributed.nn.functional",)


def _import_group_default_modules() -> None:
    for name in GROUP_DEFAULT_MODULES:
        importlib.import_module(name)


def broadcast_object(obj, src: int = 0):
    """``obj`` of rank ``src`` on every rank (picklable); the identity without torch.distributed."""
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def portable_error(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (so another rank can raise the same type), else a RuntimeError copy."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _latched_signal() -> int:
    """The signal an evaluation latched on this rank for the next stop vote, 0 when none (see
    nanochat.eval_resume.stop_evaluation); imported here, not at the top: eval_resume imports this module."""
    from nanochat.eval_resume import latched_signal
    return latched_signal()


def _stop_if_latched_on_any_rank(signals: list[int]) -> None:
    from nanochat.eval_resume import stop_if_latched_on_any_rank
    stop_if_latched_on_any_rank(signals)


def rank0_decides(fn):
    """Run ``fn()`` on rank 0 only and return its result on every rank; if it raises, every rank raises it.

    For choices that must not differ between ranks (which checkpoint to resume, whether the CORE bundle is
    there, which task files exist): a per-rank decision on per-node filesystems or flaky downloads lets ranks
    take different branches and then hang in a collective. Every rank must call this (it is a collective).

    In an evaluation (``nanochat.eval_resume.interrupts_raise``) a signal latched on any rank, before or during the
    step, ends it with the same ``Interrupted`` on every rank once ``fn`` has returned, so a set-up step does not
    carry a signal on to the first batch's stop vote; an error of ``fn`` is raised instead (the signal stays
    latched and stops the next step or vote): it is what the user has to fix before the rerun.
    """
    if not is_dist():
        return fn()
    outcome, error = None, None
    if dist.get_rank() == 0:
        try:
            value = fn()
            pickle.dumps(value)  # fail here, not inside the broadcast the other ranks are already waiting in
            outcome = ("ok", value)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            outcome, error = ("error", portable_error(e)), e
    with chained_to(error):
        outcome = broadcast_object(outcome)  # rank 0 keeps fn's own objects
    if error is not None:  # rank 0's account (own_error, errors_by_rank), set after the broadcast: a copy sent with
        # them would make each receiving rank print rank 0's traceback as its own
        error.own_error, error.errors_by_rank = error, {0: error_text(error)}
    # the signals go in a small exchange of their own: rank 0's outcome may be a whole task's rows, which an
    # all_gather_object would send from every rank's padded buffer
    signals = [0] * dist.get_world_size()
    with chained_to(error):
        dist.all_gather_object(signals, _latched_signal())
    if outcome[0] == "error":
        raise raised_on_every_rank(error if error is not None else outcome[1])
    _stop_if_latched_on_any_rank(signals)
    return outcome[1]


def every_rank_ok(fn):
    """Run ``fn()`` on every rank and return this rank's result, but only once every rank has succeeded.

    If ``fn`` raises on any rank, every rank raises the lowest failing rank's exception (same type, message
    prefixed with that rank), so no rank goes on to a collective the others never enter. ``fn`` itself must not
    enter collectives (a failing rank would skip them). Every rank must call this (it is a collective).

    A signal an evaluation latched on any rank ends the step on every rank as in ``rank0_decides`` (the error of a
    failing rank first); the signals travel in the same exchange as the errors.
    """
    if not is_dist():
        return fn()
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - shared with the other ranks below
        error = let_go_of_the_failed_work(e)
    gathered = [None] * dist.get_world_size()
    with chained_to(error):
        dist.all_gather_object(gathered, (None if error is None else portable_error(error), _latched_signal()))
    raise_lowest_rank_error([exc for exc, _ in gathered], error)
    _stop_if_latched_on_any_rank([signum for _, signum in gathered])
    return result


@contextmanager
def chained_to(error: BaseException | None):
    """An exchange that shares this rank's own ``error`` (None: none): if the exchange fails too (a peer gone, an
    OOM in NCCL's buffer), its error names ``error`` as its cause, so the traceback still shows this rank's own."""
    try:
        yield
    except Exception as exchange_error:  # noqa: BLE001 - re-raised, chained to this rank's own error
        if error is None:
            raise
        raise exchange_error from error


def let_go_of_the_failed_work(error: Exception) -> Exception:
    """``error`` with its traceback's frames cleared (their lines stay printable), and CUDA's cache emptied after
    an OOM: the half-built model those frames held would otherwise stay allocated through the exchange that shares
    the error (all_gather_object allocates on the GPU under NCCL), which could fail for want of that memory. The
    errors it was raised from or while handling (``__cause__``, ``__context__``) hold their own frames: cleared too."""
    seen, chain, oom = set(), [error], False
    while chain:  # every error of the chain once (a hand-made chain can loop)
        exc = chain.pop()
        if exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            traceback.clear_frames(exc.__traceback__)
            oom |= isinstance(exc, torch.OutOfMemoryError)  # an OOM a step caught and raised as another error too
            chain += [exc.__cause__, exc.__context__]
    if oom and torch.cuda.is_initialized():
        gc.collect()  # what the cleared frames held, in reference cycles
        torch.cuda.empty_cache()
    return error


def raise_lowest_rank_error(errors: list, own: BaseException | None = None) -> None:
    """``errors``: every rank's ``portable_error`` or None, gathered in rank order. If any rank failed, raise the
    lowest failing rank's error on this rank (same type, so callers catch it as they would on the failing rank; the
    message prefixed with that rank; chained to ``own``, this rank's error, if any); else nothing."""
    for rank, exc in enumerate(errors):
        if exc is not None:
            try:
                shared = type(exc)(f"rank {rank} of {len(errors)}: {exc}")
            except Exception:  # noqa: BLE001 - a type that needs more than a message
                shared = exc
            shared.own_error = own
            shared.errors_by_rank = {r: error_text(e) for r, e in enumerate(errors) if e is not None}
            raise raised_on_every_rank(shared) from (own or exc)


def error_text(exc: BaseException) -> str:
    """``exc`` as an account of a stop (summary.json's "error"): its type and message."""
    return f"{type(exc).__name__}: {exc}"


def own_error(exc: BaseException) -> BaseException | None:
    """This rank's own error behind ``exc``, whose traceback is worth printing: ``exc`` itself, unless every rank
    raised it together (rank0_decides, raise_lowest_rank_error): then the error this rank raised in the shared
    step, None where it only received another rank's."""
    if not getattr(exc, "raised_on_every_rank", False):
        return exc
    return getattr(exc, "own_error", None)


def errors_by_rank(exc: BaseException) -> dict[int, str]:
    """The error of each rank that failed, by rank, behind an error every rank raised together (as rank 0 holds
    them: rank0_decides, raise_lowest_rank_error); {this rank: ``exc``} for an error of its own."""
    rank = dist.get_rank() if is_dist() else 0
    return getattr(exc, "errors_by_rank", None) or {rank: error_text(exc)}


def raised_on_every_rank(exc: BaseException) -> BaseException:
    """``exc``, marked as raised by every rank together (``print_error`` prints it once per job)."""
    exc.raised_on_every_rank = True
    return exc


def raised_like(cause: BaseException, exc: BaseException) -> BaseException:
    """``exc``, raised in place of ``cause`` (a message with more advice), marked as every rank's where ``cause``
    was: a new exception does not carry the mark, and print_error would print it once per rank."""
    return raised_on_every_rank(exc) if getattr(cause, "raised_on_every_rank", False) else exc


def print_error(exc: BaseException) -> None:
    """``error: exc`` on stderr, once per job. An error every rank raised together (``raised_on_every_rank``:
    rank0_decides, every_rank_ok, raise_lowest_rank_error) is printed by rank 0 alone, and then every rank waits in a
    barrier: torchrun ends the ranks left once one has exited, maybe before rank 0 wrote the line. Any other error is
    printed by the rank that raised it: the other ranks may not have it."""
    together = getattr(exc, "raised_on_every_rank", False) and is_dist()
    if not together or dist.get_rank() == 0:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    if together:
        dist.barrier()


# How long a rank other than its node's local rank 0 waits, after an error found before the process group, for
# torchrun to end it: longer than ranks of one node drift apart by then (imports, the meta-device model)
PEER_PRINT_WAIT_S = 30.0


def wait_for_the_node_reporter() -> None:
    """Before a rank reports an error that every rank of its node found alike before the process group (flags, this
    node's files): local rank 0 reports it at once; the others must not exit first (torchrun ends the ranks left as
    soon as one exits: rank 0 could be ended before it printed, and the error lost), so they wait to be ended, and
    report it themselves if that does not come (rank 0 far behind): twice at worst, never lost. Outside torchrun
    (no TORCHELASTIC_RUN_ID: a plain run, a LOCAL_RANK exported by hand, another launcher) nothing ends this process
    for it, so nothing waits and every rank prints."""
    if another_rank_reports_for_the_node():
        time.sleep(PEER_PRINT_WAIT_S)


def refuse_before_the_group(error: Exception) -> int:
    """Print ``error`` (a flag check's, a set-up step's before the process group) once per node; exit code 2."""
    wait_for_the_node_reporter()
    print(f"error: {error}", file=sys.stderr, flush=True)
    return 2


def post_rank_error(key: str, text: str, group: "GroupStore | None" = None) -> None:
    """Post this rank's error to the process group's store (``group``'s; the default group's if None) as
    ``key``/<rank>, numbered (``key``/order) in the order the ranks post: no collective (the other ranks may wait in
    one that never completes), and the store outlives this rank (torchrun's agent hosts it), so rank 0 can name the
    error that broke its collective once this rank's exit broke it (rank_errors_posted). Raises if the store is
    gone."""
    group = group or GroupStore.of_the_group()
    group.store.set(f"{key}/{group.rank}", json.dumps([group.store.add(f"{key}/order", 1), text]))


@dataclass
class GroupStore:
    """The process group's key-value store with this rank's place in the group, kept by a rank that leaves the group
    (destroy_process_group) and still reads and writes the store, which outlives it (torchrun's agent hosts it)."""
    store: object
    rank: int
    world: int
    backend: str = ""  # the group's ("gloo", "nccl"), read while it exists: how a rank waits once it has left it

    @classmethod
    def of_the_group(cls) -> "GroupStore | None":
        """The default group's (None in one process, or a group of one)."""
        if not is_dist():
            return None
        return cls(dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size(),
                   dist.get_backend())


def rank_errors_count(key: str, group: GroupStore | None = None) -> int:
    """How many ranks have posted an error under ``key`` so far (post_rank_error's numbering), in ``group`` (the
    default group's store if None). Raises if the store is gone."""
    return (group or GroupStore.of_the_group()).store.add(f"{key}/order", 0)


def rank_errors_posted(key: str, group: GroupStore | None = None) -> dict[int, str]:
    """The errors posted under ``key`` so far (no waiting), by rank, in the order they were posted: the first is the
    likely cause (a collective breaks on the others once a rank leaves it). ``group``: where to read (the default
    group's store if None). {} in one process, or when the store is gone (it went with a rank that hosted it)."""
    group = group or GroupStore.of_the_group()
    if group is None:
        return {}
    try:
        store = group.store
        posted = {r: json.loads(store.get(f"{key}/{r}")) for r in range(group.world) if store.check([f"{key}/{r}"])}
    except Exception:  # noqa: BLE001 - the store went with a rank that hosted it
        return {}
    return {r: text for r, (_, text) in sorted(posted.items(), key=lambda item: item[1][0])}


def compute_cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # Collect now what still references the process group (async Work objects, cycles), so gloo's threads are
        # joined while the interpreter is alive. Left to interpreter shutdown, a joinable C++ thread was sometimes
        # destroyed first: "terminate called without an active exception", SIGABRT after the work was done
        # (torch 2.13 CPU, 2 gloo processes: 4 of 55 runs of bench/dist_optim.py without this, 0 of 90 with it).
        gc.collect()


def print0(*args, **kwargs) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


DTYPES = ("auto", "float32", "bfloat16")


def resolve_dtype(device_type: str, dtype: str = "auto") -> str:
    """'auto' -> bfloat16 on CUDA, float32 elsewhere; other values are checked and returned."""
    if dtype == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be one of auto, float32, bfloat16 (got {dtype!r})")
    return dtype


def autocast_context(device_type: str, dtype: str = "auto"):
    """bf16 autocast on CUDA by default; fp32 elsewhere unless dtype='bfloat16' is asked for. Every entry point that
    runs a model with --dtype passes through here: a CPU without native bf16 gets its note (note_slow_cpu_bf16)."""
    dtype = resolve_dtype(device_type, dtype)
    if dtype == "float32":
        return nullcontext()
    if device_type == "cpu":
        note_slow_cpu_bf16()
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


X86_MACHINES = ("x86_64", "amd64", "i386", "i686")
# torch's private CPU feature checks (torch.cpu, in 2.11 and 2.13 alike): either one is a native bf16 matmul
NATIVE_BF16_CHECKS = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU multiplies bf16 matrices natively (x86 with AVX512-BF16 or AMX): True or False; None where it
    cannot be told: another architecture (torch's x86 checks say False there), or a torch without the checks."""
    if platform.machine().lower() not in X86_MACHINES:
        return None
    answers = []
    for name in NATIVE_BF16_CHECKS:
        check = getattr(torch.cpu, name, None)
        try:
            answers.append(bool(check()) if check is not None else None)
        except Exception:  # noqa: BLE001 - a private API: an error is an unknown, not a stop
            answers.append(None)
    if any(answers):
        return True
    return None if None in answers else False


# Measured (dev/LOG.md, 2026-11-27): a 4096x256 @ 256x1024 matmul on 1 thread of an AVX2-only AMD EPYC
SLOW_BF16_RATIO = 60
# decided once per process, noted or not: however many contexts it makes (bench/mome_ops enters one per timed call),
# the CPU cannot change
_slow_bf16_decided = False


def note_slow_cpu_bf16() -> None:
    """Say once, on rank 0, that bf16 on this CPU is slow where it has no native bf16 matmuls. A note, not an error,
    and nothing changes: float32 is the user's choice to make (it changes the numerics)."""
    global _slow_bf16_decided
    if _slow_bf16_decided:
        return
    _slow_bf16_decided = True
    if cpu_has_native_bf16() is not False:
        return
    print0(f"note: this run computes in bfloat16 on a CPU without native bf16 matmuls (no AVX512-BF16, no AMX): "
           f"torch takes its slow path, a bf16 matmul costing about {SLOW_BF16_RATIO}x a float32 matmul on a CPU "
           "like this one, so expect steps many times slower than in float32. --dtype float32 is fast here but "
           "changes the numerics: a config row's seed trained so is listed by scripts.results apart from the row's "
           "bf16 seeds, not averaged with them")


def rows_to_device(batch: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) rows -> inputs row[:, :-1], targets row[:, 1:]; one pinned non-blocking copy on CUDA."""
    if device.type == "cuda":
        batch = batch.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        batch = batch.to(device)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
