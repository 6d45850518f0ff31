"""Pieces of the training loop that are worth testing on their own: one optimizer step with gradient
accumulation, the synthetic data stand-in, cross-rank helpers, and the stop-signal latch.
"""

import math
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanochat.common import is_dist, portable_error, raise_lowest_rank_error, rows_to_device
from nanochat.dataset import DataError
from nanochat.eval_resume import STOP_SIGNALS, signals_latched_for_votes, stop_evaluation


def any_rank(flag: bool, device) -> bool:
    """True on every rank if ``flag`` is true on any rank (used so all ranks stop at the same step)."""
    if not is_dist():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order; [obj] without torch.distributed."""
    if not is_dist():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@dataclass(frozen=True)
class StopVotes:
    """What the ranks asked for in one step's reduction, the same on every rank: a stop signal (STOP_SIGNALS)
    on any rank, the --max-wall-time-seconds budget spent on any rank (their clocks differ)."""
    signal: bool = False
    wall_time: bool = False

    def __bool__(self) -> bool:
        return self.signal or self.wall_time


def _batch_or_stand_in(loader, batch_shape, device, failed: list):
    """The next micro-batch; under torch.distributed, after a DataError of this rank's loader (appended to
    ``failed``), a stand-in batch of zeros of ``batch_shape`` (B, T), so this rank still enters the step's
    collectives the other ranks are in (their gradient reductions start during backward) and votes to stop."""
    if not failed:
        try:
            return next(loader)
        except DataError as e:
            if not is_dist() or batch_shape is None:
                raise
            failed.append(e)
    # two tensors, as a real batch: one as both would fail dynamo's aliasing guard and recompile this rank alone
    zeros = torch.zeros(batch_shape, dtype=torch.long, device=device)
    return zeros, torch.zeros_like(zeros)


def _share_data_error(failed: list) -> None:
    """Collective, once a rank voted a data error: every rank raises the lowest failing rank's DataError, named."""
    own = failed[0] if failed else None
    raise_lowest_rank_error(gather_objects(None if own is None else portable_error(own)), own)


def train_step(model, optimizer, loader, grad_accum: int, autocast_ctx, device, stop_requested=False,
               time_up=None, batch_shape: tuple[int, int] | None = None) -> tuple[float, float, StopVotes, float]:
    """Run ``grad_accum`` micro-steps and one optimizer step; return (LM loss, grad norm, every rank's stop votes,
    aux loss). ``time_up`` (a callable, e.g. ``WallTimeLimit.reached``) is asked after the optimizer step, so the
    vote covers the step itself; so is ``stop_requested`` when it is a callable (a signal latched during this step
    then stops after it, not after the next one), else it is the bool the caller read before the step.

    Each micro-loss is divided by grad_accum, so the summed gradient equals the gradient of the mean loss over
    the whole per-rank batch; MuonAdamW.step then averages over ranks (its reductions start from gradient hooks
    during the last micro-step's backward). The memory block's auxiliary loss (JTok-M's balance; 0 for most
    blocks) is added before backward and reported apart from the LM loss. The returned losses are means over
    micro-steps and ranks (the loss of the full global batch), not rank 0's last micro-batch. The losses, the
    grad norm and every rank's stop request come back in ONE host sync per step (one small all-reduce with
    several processes); the votes ride in it, so deciding to stop costs no extra collective or sync.

    A DataError of this rank's loader (a data file only it reads, unreadable mid-run): with several processes and
    ``batch_shape`` (device batch, seq len) the rank finishes the step on a stand-in batch with zero loss weight
    (the others are already in its collectives), votes in the same reduction, and then every rank raises the
    failing rank's DataError together: the step's update is not to be saved (the caller stops without saving).
    """
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    aux_sum = torch.zeros((), dtype=torch.float64, device=device)
    failed = []  # this rank's DataError, if its loader failed in this step
    for micro in range(grad_accum):
        x, y = _batch_or_stand_in(loader, batch_shape, device, failed)
        with autocast_ctx:
            loss, aux = model(x, targets=y, return_aux=True)
        weight = 0.0 if failed else 1.0  # a stand-in batch adds nothing to the gradients the other ranks average
        loss_sum += loss.detach().double() * weight
        aux_sum += aux.detach().double() * weight
        if micro == grad_accum - 1:
            optimizer.arm_grad_hooks()
        ((loss + aux) * (weight / grad_accum)).backward()
    optimizer.step()
    after_optimizer_step(model)
    model.zero_grad(set_to_none=True)
    signalled = stop_requested() if callable(stop_requested) else stop_requested
    votes = [float(signalled), float(time_up is not None and time_up()), float(bool(failed))]
    shared = torch.cat([torch.stack([loss_sum / grad_accum, aux_sum / grad_accum]),
                        torch.tensor(votes, dtype=torch.float64, device=device)])
    if is_dist():
        dist.all_reduce(shared, op=dist.ReduceOp.SUM)
        shared[:2] /= dist.get_world_size()
    loss_mean, aux_mean, signals, times_up, data_errors, gnorm = torch.cat(
        [shared, optimizer.grad_norm.double().reshape(1)]).tolist()
    if data_errors > 0:
        _share_data_error(failed)
    return loss_mean, gnorm, StopVotes(signal=signals > 0, wall_time=times_up > 0), aux_mean


@torch.no_grad()
def after_optimizer_step(model) -> None:
    """Call ``after_optimizer_step()`` of every module that has one, once per optimizer step: the memory block
    (MoME's balancing-bias update) and backbone parts with state of their own (the MoE FFN's routing bias)."""
    for module in getattr(model, "_orig_mod", model).modules():
        hook = getattr(module, "after_optimizer_step", None)
        if hook is not None:
            hook()


# counters a checkpoint keeps: those of the log steps, and those of a window that closes on its own schedule
# (MoME's --mome-maxvio-window; summed over the ranks by the module itself when the window closes)
CHECKPOINTED_COUNTERS = ("STATS_BUFFERS", "WINDOW_BUFFERS")
# results a checkpoint keeps as they are: the same on every rank, not summed (a closed window's MaxVio that the next
# log step has not read yet: with --log-every > 1 a checkpoint can fall between the close and the log step)
CHECKPOINTED_RESULTS = ("RESULT_BUFFERS",)


def stats_buffers(model, kinds: tuple[str, ...] = ("STATS_BUFFERS",)) -> dict[str, torch.Tensor]:
    """The counters behind ``module_stats`` accumulated since the last log step (slot/expert loads, gate sums),
    by qualified buffer name: each module names its own in ``STATS_BUFFERS`` (and in the other ``kinds``). They
    are per process until ``module_stats`` sums them over the ranks."""
    out = {}
    for prefix, module in getattr(model, "_orig_mod", model).named_modules():
        for kind in kinds:
            for name in getattr(module, kind, ()):
                if hasattr(module, name):  # e.g. the window counters exist only while a window is set
                    out[f"{prefix}.{name}" if prefix else name] = getattr(module, name)
    return out


@torch.no_grad()
def _sum_over_ranks_(tensors: list[torch.Tensor]) -> None:
    """In place: each tensor summed over the ranks, in ONE collective per dtype (an MoE FFN has its counters in
    every layer), in that dtype: integer counters stay exact. Collective with several processes; a no-op with one."""
    if not (is_dist() and tensors):
        return
    for dtype in dict.fromkeys(t.dtype for t in tensors):  # the same order on every rank
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for t, total in zip(group, flat.split([t.numel() for t in group])):
            t.copy_(total.view_as(t))


@torch.no_grad()
def summed_stats_buffers(model) -> dict[str, torch.Tensor]:
    """Collective: copies of ``stats_buffers`` summed over the ranks, and of the results (the same on every rank)
    as they are, on the CPU (for a checkpoint)."""
    copies = {name: buf.detach().clone() for name, buf in stats_buffers(model, CHECKPOINTED_COUNTERS).items()}
    _sum_over_ranks_(list(copies.values()))
    copies.update({name: buf.detach().clone() for name, buf in stats_buffers(model, CHECKPOINTED_RESULTS).items()})
    return {name: total.cpu() for name, total in copies.items()}


@torch.no_grad()
def restore_stats_buffers(model, saved: dict[str, torch.Tensor], rank: int, step: int) -> None:
    """Put a checkpoint's summed counters back: on rank 0, zero elsewhere, so the next sum over the ranks (at the
    next log step, or when a window closes) equals the uninterrupted run's for any world size; its results on
    every rank; a module with a window learns where in it the checkpoint's ``step`` is. Checkpoints from before
    they were saved have none: the counters and results then start from zero (only the first stats record or
    window after the resume differs)."""
    for name, buf in stats_buffers(model, CHECKPOINTED_COUNTERS).items():
        if rank == 0 and name in saved:
            buf.copy_(saved[name])
        else:
            buf.zero_()
    for name, buf in stats_buffers(model, CHECKPOINTED_RESULTS).items():
        if name in saved:
            buf.copy_(saved[name])
        else:
            buf.zero_()
    for module in getattr(model, "_orig_mod", model).modules():
        if hasattr(module, "resume_window"):
            module.resume_window(step)


@torch.no_grad()
def module_stats(model) -> dict[str, float]:
    """The ``stats()`` of every module that has one (the memory block's "memory/...", each MoE FFN's "moe/..."),
    merged for a metrics record; called at log steps only (they may sync with the device). Collective: the
    counters are first summed over the ranks, so the record describes the whole global batch, not rank 0's."""
    _sum_over_ranks_(list(stats_buffers(model).values()))
    out = {}
    for module in getattr(model, "_orig_mod", model).modules():
        stats = getattr(module, "stats", None)
        if callable(stats):
            out.update({k: float(v) for k, v in stats().items()})
    return out


class SyntheticLoader:
    """Seeded stand-in for PackedDataLoader (``--synthetic-data``): learnable token rows, no files, no tokenizer.

    Row g of the global stream is a random walk x_t = (x_{t-1} + d_t) mod V with d_t in {1, 2, 3}, drawn from a
    generator seeded by (seed, g). Rank r's c-th batch holds global rows [(c*W + r)*B, (c*W + r + 1)*B), so the
    rows of one optimizer step are the same for every (world size, device batch, grad accum) with the same
    total batch: that is what makes the 1-process vs 2-process and grad-accum equivalence tests meaningful.
    """

    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, device="cpu"):
        self.V, self.B, self.T = vocab_size, batch_size, seq_len
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.device = torch.device(device)
        self.count = 0

    def _row(self, g: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + g)
        start = torch.randint(0, self.V, (1,), generator=gen)
        steps = torch.randint(1, 4, (self.T,), generator=gen)
        return torch.cat([start, start + steps.cumsum(0)]) % self.V

    def rows(self, first: int, n: int) -> torch.Tensor:
        """Rows [first, first + n) at once, equal to stacking ``_row`` (their generators replayed together)."""
        from nanochat.cpu_rng import first_outputs

        draws = first_outputs(self.seed * 1_000_003 + torch.arange(first, first + n), self.T + 1)  # (n, T+1)
        start, steps = draws[:, :1] % self.V, draws[:, 1:] % 3 + 1  # torch.randint's low + draw % range
        return torch.cat([start, start + steps.cumsum(1)], dim=1) % self.V

    def __iter__(self):
        return self

    def __next__(self):
        first = (self.count * self.world_size + self.rank) * self.B
        self.count += 1
        return rows_to_device(torch.stack([self._row(first + i) for i in range(self.B)]), self.device)

    def state_dict(self) -> dict:
        return {"kind": "synthetic", "count": self.count, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "batch_size": self.B, "seq_len": self.T}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("kind", "seed", "rank", "world_size", "seq_len"):
            if state.get(key) != mine[key]:
                raise ValueError(f"synthetic loader state has {key}={state.get(key)!r} but this loader has "
                                 f"{mine[key]!r}; exact resume needs the same layout")
        # another --device-batch-size (the total batch is checked by --resume): every rank has read count x B rows
        # of the stream, in whole optimizer steps, so the next step starts at the same global row (see the class doc)
        rows = int(state["count"]) * int(state["batch_size"])
        if rows % self.B:
            raise ValueError(f"synthetic loader state has batch_size={state['batch_size']} ({rows} rows read per "
                             f"rank), not a whole number of batches of {self.B}; resume with a --device-batch-size "
                             "that divides it")
        self.count = rows // self.B

    def repartition(self, old_states: list[dict]) -> str:
        """Continue after a world-size change: skip past every row the old ranks consumed (see the class doc).
        Returns a one-line summary for the log."""
        if any(s.get("seed") != self.seed or s.get("seq_len") != self.T for s in old_states):
            raise ValueError("synthetic loader state has another --data-seed or seq len than this run")
        consumed = max(int(s["count"]) * int(s["world_size"]) * int(s["batch_size"]) for s in old_states)
        self.count = math.ceil(consumed / (self.world_size * self.B))
        return f"{consumed} rows already read; continuing at batch {self.count}"


def synthetic_eval_rows(vocab_size: int, seq_len: int, num_tokens: int, seed: int) -> torch.Tensor:
    """Fixed (N, T+1) validation rows for --synthetic-data, drawn from a stream disjoint from training."""
    loader = SyntheticLoader(vocab_size, 1, seq_len, seed=seed + 7_777_777)
    return loader.rows(0, math.ceil(num_tokens / seq_len))


class StopSignal:
    """Latch STOP_SIGNALS (SIGINT, SIGTERM, Slurm's SIGUSR1 notice) so the loop can save at the next step boundary.
    Only a second Ctrl-C (SIGINT) at least ``abort_after_s`` after the first signal aborts at once: a scheduler's
    cancel or time limit (Slurm) sends SIGTERM to the launcher AND every worker, and torchrun forwards its own, so a
    worker sees two SIGTERMs (or a SIGINT from the terminal plus a forwarded one) within milliseconds and must still
    save.

    Inside ``interrupts()`` (the final evaluation, after the last checkpoint is saved, when only the evaluation and
    the summary are left; a step's periodic evals, before its checkpoint is saved, which the caller then saves as a
    signal stop's) the first signal ends the evaluation instead, and one latched before ends it on entry: at
    once in one process, at the next batch's stop vote or set-up step (e.g. preparing a CORE task) on every rank
    under torch.distributed (see ``nanochat.eval_resume.stop_evaluation``); the signals after it change nothing (a
    later Ctrl-C aborts, as always), so the checkpoint or summary that follows is written."""

    abort_after_s = 1.0

    def __init__(self, clock=time.monotonic):
        self.received: str | None = None
        self._previous = {}
        self._clock = clock
        self._first_at = 0.0
        self._raise = False

    @contextmanager
    def interrupts(self):
        """Run the block so that a stop signal ends it with ``Interrupted`` (see the class doc)."""
        with signals_latched_for_votes():
            self._raise = True  # armed before the check: a signal between the two would otherwise be lost
            try:
                if self.received is not None:
                    self._raise = False
                    stop_evaluation(signal.Signals[self.received])
                yield
            finally:
                self._raise = False

    def install(self) -> "StopSignal":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received is None:
            self.received, self._first_at = signal.Signals(signum).name, self._clock()
            if self._raise:
                self._raise = False
                stop_evaluation(signum)
        elif signum == signal.SIGINT and self._clock() - self._first_at >= self.abort_after_s:
            self.uninstall()  # a later Ctrl-C: the user really wants out now
            raise KeyboardInterrupt

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()
