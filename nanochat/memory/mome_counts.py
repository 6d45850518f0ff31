"""MoME's counters: the training load counts, the loss-free balancing bias update, the training-window MaxVio
and the final evaluation's slot-balance counts, with their buffers and the logged stats.

Split from nanochat.memory.mome (the block's tables, routing and mix): ``MoMECounters`` is a mixin of
``MoMEMemory``, so the buffers stay the block's own (``load_counts``, ``router_bias``, ... : the same state_dict
keys and checkpointed counter names as before the split) and every method stays a method of the block. It reads
the block's ``layers``, ``rows``, ``H``, ``M``, ``opts``, ``tracker`` (GammaTracker) and ``_table(pos)``.
"""

import torch

from nanochat.balance import loss_free_bias_update, sum_over_ranks, trust_region_bias_update
from nanochat.slot_balance import window_maxvio


class MoMECounters:
    STATS_BUFFERS = ("load_counts",)  # summed over ranks before stats() and kept in checkpoints
    WINDOW_BUFFERS = ("window_counts",)  # summed over ranks when the window closes; kept in checkpoints too
    RESULT_BUFFERS = ("window_result",)  # a closed window's result until logged: the same on every rank; kept too

    def _register_counters(self) -> None:
        L, H, M = len(self.layers), self.H, self.M
        if self.opts.balance != "none":
            self.register_buffer("router_bias", torch.empty(L, self.rows, H, M, dtype=torch.float32))
            self.register_buffer("balance_counts", torch.empty(L, self.rows, H, M, dtype=torch.float32),
                                 persistent=False)
        # int64 counters: a cell gets at most one selection per token, and in fp32 the logged loads of a (head, slot)
        # round past 2^24 (16 steps of d24's 2^20 tokens if one slot took them all, ~100 at K/M = 2/12), an int32
        # window cell wraps past 2^31 - 1 (W = 2048 such steps if one row took them all). int64 doubles the
        # window's bytes, with the flag on only: 432 MiB instead of 216 MiB at d24 (L*N*H*M = 12 x 32768 x 12 x 12;
        # its tables 2.26 GiB).
        self.register_buffer("load_counts", torch.empty(L, H, M, dtype=torch.int64), persistent=False)
        if self.opts.maxvio_window:  # selections per (layer, row, head, slot) of the current window (not in state_dict)
            self.register_buffer("window_counts", torch.empty(L, self.rows, H, M, dtype=torch.int64),
                                 persistent=False)
            # the last closed window's [1, window_maxvio ...] until stats() logs it (then zeros): on the device, so
            # closing needs no host sync, and a buffer, so a checkpoint between the close and the log step keeps it
            self.register_buffer("window_result", torch.empty(4, dtype=torch.float64), persistent=False)
        self.window_steps = 0  # optimizer steps into the current window: windows end at steps W, 2W, ...
        # (L, N, H, M) int64 selections per (layer, row, head, slot) while an evaluation collects them
        # (nanochat.slot_balance); None otherwise, so the forward does no counting work at all
        self.eval_loads: torch.Tensor | None = None

    def _zero_counters(self) -> None:
        if hasattr(self, "router_bias"):
            self.router_bias.zero_()
            self.balance_counts.zero_()
        if hasattr(self, "window_counts"):
            self.window_counts.zero_()
            self.window_result.zero_()
        self.load_counts.zero_()

    @torch.no_grad()
    def _count(self, pos, sel, row, gamma) -> None:
        """Training bookkeeping without host syncs: per-(head, slot) load and, with balancing, per-cell counts."""
        self.tracker.add(pos, gamma)
        M = self.M
        if sel is None:  # full routing: every slot of every head is read once per token
            self.load_counts[pos] += row.numel()
            return
        # per-(head, slot) load as a reduction over tokens, not a scatter: an index_add_ of B*T*H*K ones into
        # H*M bins is an atomic pile-up on a few addresses on CUDA
        hits = sel[..., None] == torch.arange(M, device=sel.device)  # (B, T, H, K, M)
        self.load_counts[pos] += hits.sum(dim=(0, 1, 3), dtype=self.load_counts.dtype)  # (H, M)
        # per (row, head, slot) for balancing and the MaxVio window: N*H*M bins, sparse hits, so a scatter
        grids = [getattr(self, name) for name in ("balance_counts", "window_counts") if hasattr(self, name)]
        self._add_selections([counts[pos] for counts in grids], row, sel)

    def start_eval_loads(self) -> None:
        """Count, in the forwards until ``pop_eval_loads``, every selection per (layer, row n_t, head, slot): the
        selection the forward mixes (with --mome-balance on: the biased one, as this block routes in eval too;
        K == M: all M slots). int64 (int32 would wrap past 2^31 - 1 evaluated tokens on one row, summed over the
        ranks); L*N*H*M counters (2H/d of the per-layer tables' fp32 bytes, 2L*H/d of the shared bigram-indexed
        table's), allocated here and freed by the pop."""
        L, H, M = len(self.layers), self.H, self.M
        self.eval_loads = torch.zeros(L, self.rows, H, M, dtype=torch.int64, device=self._table(0).device)

    def pop_eval_loads(self) -> torch.Tensor | None:
        """The counts since ``start_eval_loads`` (this process's tokens only); counting stops."""
        loads, self.eval_loads = self.eval_loads, None
        return loads

    def _add_selections(self, grids: list[torch.Tensor], row, sel) -> None:
        """+1 per selection into each (N, H, M) count table of ``grids``, at its cell (row n_t, head, slot); the
        flat cell ids (B*T*H*K) are computed once for all of them."""
        if not grids:
            return
        head = torch.arange(self.H, device=sel.device)[:, None] * self.M  # (H, 1)
        cell = (row[..., None, None] * (self.H * self.M) + head + sel).reshape(-1)  # (B, T, H, K) -> flat
        for counts in grids:
            counts.view(-1).index_add_(0, cell, torch.ones(cell.numel(), device=sel.device, dtype=counts.dtype))

    @torch.no_grad()
    def _count_eval_loads(self, pos, sel, row) -> None:
        if sel is None:  # full routing (K == M): every slot of every head
            sel = torch.arange(self.M, device=row.device).expand(*row.shape, self.H, self.M)
        self._add_selections([self.eval_loads[pos]], row, sel)

    def after_optimizer_step(self) -> None:
        self.update_balance()
        self.close_window()

    @torch.no_grad()
    def close_window(self) -> None:
        """Every W-th call (one per optimizer step, on every rank alike): sum the window's counts over the ranks
        (one collective, at the same step everywhere), keep their ``window_maxvio`` on the device (``window_result``)
        and restart the counts. No host sync: stats() reads the result at the next log step (the latest window if
        several closed since)."""
        if not hasattr(self, "window_counts"):
            return
        self.window_steps += 1
        if self.window_steps < self.opts.maxvio_window:
            return
        sum_over_ranks(self.window_counts)  # int64: exact
        self.window_result[0] = 1.0  # a result to log
        self.window_result[1:] = window_maxvio(self.window_counts)
        self.window_counts.zero_()
        self.window_steps = 0

    @torch.no_grad()
    def update_balance(self) -> None:
        """Update the selection bias from the counts since the last call (call after optimizer.step())."""
        if not hasattr(self, "router_bias"):
            return
        # counts (L, N, H, M): one routing site per (layer, row, head); all-reduced, so every rank updates alike
        o = self.opts
        if o.balance == "trust-region":
            trust_region_bias_update(self.router_bias, self.balance_counts, o.balance_lr, o.balance_band,
                                     o.balance_min_visits)
        else:
            loss_free_bias_update(self.router_bias, self.balance_counts, o.balance_lr)

    def resume_window(self, step: int) -> None:
        """A resume from the checkpoint of ``step``: its partial window's counts, and the result of a window closed
        but not yet logged, came back with the checkpoint's counters (nanochat.train_loop.restore_stats_buffers), so
        the window closes at the same step as in the uninterrupted run, with the same counts, and the next log step
        logs what it would have."""
        if hasattr(self, "window_counts"):
            self.window_steps = step % self.opts.maxvio_window

    # -- logging ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def stats(self) -> dict[str, float]:
        """Per layer: slot-load entropy (normalised by log M, 1 = uniform) and max violation (max - mean)/mean
        of the per-slot load summed over heads, since the last call; mean gamma."""
        out = self.tracker.pop(self.layers)
        load = self.load_counts.sum(dim=1).double()  # (L, M), exact below 2^53
        total = load.sum(dim=-1, keepdim=True)
        frac = load / total.clamp_min(1)
        ent = -(frac * frac.clamp_min(1e-30).log()).sum(-1) / max(torch.log(torch.tensor(float(self.M))).item(), 1e-30)
        maxvio = (load.max(dim=-1).values - total[:, 0] / self.M) / (total[:, 0] / self.M).clamp_min(1e-30)
        for i, layer in enumerate(self.layers):
            if total[i, 0] > 0:
                out[f"memory/load_entropy/layer{layer}"] = float(ent[i]) if self.M > 1 else 1.0
                out[f"memory/maxvio/layer{layer}"] = float(maxvio[i])
        if hasattr(self, "router_bias"):
            out["memory/router_bias_absmean"] = float(self.router_bias.abs().mean())
        if hasattr(self, "window_result"):
            closed, mean, eligible, layers = self.window_result.tolist()
            if closed:
                if layers > 0:
                    out["memory/maxvio_window_mean"] = mean
                out["memory/maxvio_window_eligible_mean"] = eligible
                out["memory/maxvio_window_layers"] = layers
                self.window_result.zero_()
        self.load_counts.zero_()
        return out
