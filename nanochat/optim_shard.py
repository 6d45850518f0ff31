"""Gradient buckets of the distributed MuonAdamW: who reduces what, who owns which shard, and the collectives.

A bucket is one collective's worth of gradients and the parameters updated from it:

* ``MuonBucket``: the K same-shape (m, n) trainable matrices of one Muon group, stacked (K_pad, m, n) with K_pad =
  K rounded up to a multiple of the world size W, reduce-scattered so rank r owns matrices [r*c, (r+1)*c), c =
  K_pad / W (padding matrices are zeros and own nothing). Rank r keeps the Muon state of its c matrices only,
  updates them, and the updated (c, m, n) chunks are all-gathered back into every rank's parameters.
* ``RowShardBucket``: one large AdamW parameter (>= SHARD_MIN_NUMEL elements, >= W rows) reduce-scattered by rows;
  rank r keeps the Adam moments of its R // W rows only (ZeRO-2) and all-gathers its updated rows. When W does not
  divide the row count R (Engram's table is a sum of primes), the last R % W < W rows are all-reduced and updated
  on every rank instead: no padded copy of a table-sized gradient.
* ``ReplicatedBucket``: every other AdamW parameter (scalars, biases, small gates), flattened into one buffer,
  all-reduced; every rank applies the same (cheap) update.

Gradients are averaged (sum, then / W). With one process no collective runs, no buffer is allocated and the
local shard is the whole parameter, so the update is today's single-process update bit for bit.
"""

import math

import torch
import torch.distributed as dist

SHARD_MIN_NUMEL = 1 << 16  # smaller AdamW params are cheaper to all-reduce and update everywhere

# torch 2.13 renamed reduce_scatter_tensor and all_gather_into_tensor to *_single (the old names still work, with a
# FutureWarning on every call); an older torch (the GPU machines' image has 2.11) may have the old names alone.
# Chosen once, and called as dist.<name> so that a wrapper set there (the collective counts of
# tests/_shard_worker.py and bench/dist_optim.py) sees every call.
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def reduce_scatter(output: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
    """Sum ``inp`` (W * n, ...) over the ranks; this rank's (n, ...) block of the sum into ``output``."""
    return getattr(dist, REDUCE_SCATTER)(output, inp, op=dist.ReduceOp.SUM, async_op=async_op)


def all_gather(output: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
    """Every rank's (n, ...) ``inp`` into ``output`` (W * n, ...), in rank order."""
    return getattr(dist, ALL_GATHER)(output, inp, async_op=async_op)


def world_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _dense_grad(p: torch.Tensor) -> torch.Tensor:
    """p.grad, densified in place if sparse (a table shared by several layers, see MoMEMemory.sparse_shared_grad),
    zeros if the parameter got no gradient (every rank must join every collective)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    elif p.grad.is_sparse:
        p.grad = p.grad.to_dense()
    return p.grad


class Bucket:
    """Lifecycle per step: [param_ready ...] -> launch -> wait_reduced -> (update) -> launch_gather -> finish."""

    def __init__(self, params: list, groups: list[dict], world: int, rank: int):
        self.params, self.groups, self.world, self.rank = params, groups, world, rank  # trainable params only
        self._ready = 0
        self._work = None
        self.launched = False

    def param_ready(self) -> None:
        self._ready += 1

    def ready(self) -> bool:
        """Every parameter's gradient of this step is final."""
        return self._ready == len(self.params)

    def launch(self) -> None:
        if not self.launched:
            self.launched = True
            self._work = self._start_reduce()

    def wait_reduced(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._after_reduce()

    def launch_gather(self) -> None:
        self._work = self._start_gather()

    def finish(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._after_gather()
        self._ready, self.launched = 0, False

    # per kind
    def _start_reduce(self):
        return None

    def _after_reduce(self) -> None:
        pass

    def _start_gather(self):
        return None

    def _after_gather(self) -> None:
        pass

    def grad_sq_sum(self) -> torch.Tensor:
        raise NotImplementedError

    def full_state(self, state: dict, dst: int | None = None) -> dict:
        """{param: {name: full CPU tensor}} for the parameters this bucket owns state for (collective). With ``dst``
        only that rank gets them (the others get {}): no other rank holds a full copy, even for a moment."""
        raise NotImplementedError

    def load_full_state(self, state: dict, full: dict) -> None:
        """Inverse of full_state: keep this rank's shard of each tensor, on the parameter's device."""
        raise NotImplementedError


def _to_param_device(value, p: torch.Tensor, name: str = ""):
    """A loaded state tensor on p's device: Adam's moments in p's dtype (as ``_adamw_update`` creates them; the
    fused kernel refuses a mix), every other floating tensor (step counts, Muon buffers) in fp32."""
    if not torch.is_tensor(value):
        return value
    dtype = value.dtype
    if value.is_floating_point():
        dtype = p.dtype if name in ("exp_avg", "exp_avg_sq") else torch.float32
    return value.to(device=p.device, dtype=dtype).clone()


def _gather_shards(v: torch.Tensor, world: int, rank: int, dst: int | None) -> torch.Tensor | None:
    """The (world * n, ...) concatenation of every rank's (n, ...) shard ``v``, on v's device: on every rank
    (all-gather) or, with ``dst``, on rank dst only (gather; None elsewhere, which then allocates nothing)."""
    full = None
    if dst is None or rank == dst:
        full = torch.empty((v.shape[0] * world, *v.shape[1:]), dtype=v.dtype, device=v.device)
    if dst is None:
        all_gather(full, v.contiguous())
    else:
        dist.gather(v.contiguous(), list(full.chunk(world)) if full is not None else None, dst=dst)
    return full


class ReplicatedBucket(Bucket):
    """Small AdamW parameters of any group: one all-reduce of their flattened gradients."""

    def _start_reduce(self):
        if self.world == 1:
            return None
        grads = [_dense_grad(p) for p in self.params]
        self._flat = torch.cat([g.reshape(-1) for g in grads])
        return dist.all_reduce(self._flat, op=dist.ReduceOp.SUM, async_op=True)

    def _after_reduce(self) -> None:
        if self.world == 1:
            for p in self.params:
                if p.grad is not None and p.grad.is_sparse:
                    p.grad = p.grad.to_dense()
            return
        self._flat.div_(self.world)
        offset = 0
        for p in self.params:
            p.grad.copy_(self._flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self._flat = None

    def adamw_items(self, group: dict) -> list[tuple]:
        """(state key, tensor to update, its gradient) for the group's parameters in this bucket."""
        mine = {id(p) for p in self.params}
        return [(p, p, p.grad) for p in group["params"] if id(p) in mine and p.grad is not None]

    def grad_sq_sum(self) -> torch.Tensor:
        sq = [p.grad.float().square().sum() for p in self.params if p.grad is not None]
        if not sq or self.rank != 0:  # replicated: counted once, by rank 0
            return torch.zeros((), device=self.params[0].device)
        return torch.stack(sq).sum()

    def full_state(self, state: dict, dst: int | None = None) -> dict:
        if dst is not None and self.rank != dst:
            return {}
        return {p: {k: v.detach().cpu().clone() for k, v in state[p].items()} for p in self.params if p in state}

    def load_full_state(self, state: dict, full: dict) -> None:
        for p in self.params:
            if p in full:
                state[p] = {k: _to_param_device(v, p, k) for k, v in full[p].items()}


class RowShardBucket(Bucket):
    """One large AdamW parameter of R rows split by rows: with c = R // W, rank r owns rows [r*c, (r+1)*c) and
    every rank owns the tail rows [W*c, R) (fewer than W; none when W divides R), all-reduced and updated alike.
    The tail's Adam moments live under their own state key (``self.tail_key``); the state dict joins them."""

    def __init__(self, p, group, world, rank):
        super().__init__([p], [group], world, rank)
        rows = p.shape[0] // world
        self.rows = slice(rank * rows, (rank + 1) * rows)
        self.main = rows * world  # rows [0, main) are sharded, [main, R) are the tail
        self.tail_key = ("row-shard tail", id(p)) if self.main < p.shape[0] else None
        self.local_grad = self.tail_grad = self._tail_work = None

    def _start_reduce(self):
        p = self.params[0]
        grad = _dense_grad(p)
        self.local_grad = torch.empty_like(p[self.rows])
        if self.tail_key is not None:  # a few rows: cheaper to all-reduce than to pad the whole gradient
            self.tail_grad = grad[self.main:].contiguous()
            self._tail_work = dist.all_reduce(self.tail_grad, op=dist.ReduceOp.SUM, async_op=True)
        return reduce_scatter(self.local_grad, grad[:self.main], async_op=True)

    def _after_reduce(self) -> None:
        self.local_grad.div_(self.world)
        if self._tail_work is not None:
            self._tail_work.wait()
            self._tail_work = None
            self.tail_grad.div_(self.world)

    def adamw_items(self, group: dict) -> list[tuple]:
        p = self.params[0]
        items = [(p, p.data[self.rows], self.local_grad)]  # a contiguous row block: updated in place
        if self.tail_key is not None:
            items.append((self.tail_key, p.data[self.main:], self.tail_grad))
        return items

    def grad_sq_sum(self) -> torch.Tensor:
        total = self.local_grad.float().square().sum()
        if self.tail_key is not None and self.rank == 0:  # replicated rows: counted once, by rank 0
            total = total + self.tail_grad.float().square().sum()
        return total

    def _start_gather(self):
        p = self.params[0]
        return all_gather(p.data[:self.main], p.data[self.rows].clone(), async_op=True)

    def _after_gather(self) -> None:
        self.local_grad = self.tail_grad = None
        self.params[0].grad = None  # the full gradient is stale (only the local rows were averaged)

    def full_state(self, state: dict, dst: int | None = None) -> dict:
        p = self.params[0]
        if p not in state:
            return {}
        out = {}
        for k, v in state[p].items():
            if v.dim() == 0:  # the step count: the same on every rank (and for the tail)
                out[k] = v.detach().cpu().clone()
                continue
            full = _gather_shards(v, self.world, self.rank, dst)
            if full is None:
                continue
            if self.tail_key is not None:
                full = torch.cat([full, state[self.tail_key][k]])
            out[k] = full.cpu()
        return {p: out} if dst is None or self.rank == dst else {}

    def load_full_state(self, state: dict, full: dict) -> None:
        p = self.params[0]
        if p not in full:
            return
        saved = full[p]
        state[p] = {k: _to_param_device(v if v.dim() == 0 else v[self.rows], p, k) for k, v in saved.items()}
        if self.tail_key is not None:
            state[self.tail_key] = {k: _to_param_device(v if v.dim() == 0 else v[self.main:], p, k)
                                    for k, v in saved.items()}


class MuonBucket(Bucket):
    """One Muon group: K same-shape matrices, split by matrix across ranks (see the module docstring)."""

    def __init__(self, params, group, world, rank):
        super().__init__(params, [group], world, rank)
        self.K = len(self.params)
        self.chunk = math.ceil(self.K / world)
        self.first = rank * self.chunk  # global index of this rank's first matrix
        self.owned = [(j, self.params[self.first + j]) for j in range(self.chunk) if self.first + j < self.K]
        self._send = self._full = None
        self.local_grad = self.local_param = None

    def _start_reduce(self):
        if self.world == 1:
            self.local_grad = torch.stack([(p.grad if p.grad is not None else torch.zeros_like(p)).float()
                                           for p in self.params])
            return None
        grads = [_dense_grad(p) for p in self.params]
        if self._send is None:  # persistent; the padding matrices stay zero
            m, n = self.params[0].shape
            self._send = torch.zeros(self.chunk * self.world, m, n, device=self.params[0].device)
        torch._foreach_copy_(list(self._send[:self.K].unbind(0)), grads)
        self.local_grad = torch.empty_like(self._send[:self.chunk])
        return reduce_scatter(self.local_grad, self._send, async_op=True)

    def _after_reduce(self) -> None:
        if self.world > 1:
            self.local_grad.div_(self.world)

    def own_params(self) -> torch.Tensor:
        """(c, m, n) fp32 values of this rank's matrices (zeros for padding)."""
        vals = torch.zeros_like(self.local_grad)
        for j, p in self.owned:
            vals[j].copy_(p)
        return vals

    def write_own(self, new: torch.Tensor) -> None:
        """Store the updated (c, m, n) chunk: into the params directly with one process, else for the gather."""
        if self.world == 1:
            for j, p in self.owned:
                if p.grad is not None:  # single process: a parameter without gradient is left as it is
                    p.copy_(new[j])
        else:
            self.local_param = new

    def grad_sq_sum(self) -> torch.Tensor:
        return self.local_grad.square().sum()

    def _start_gather(self):
        if self.world == 1:
            return None
        if self._full is None:
            self._full = torch.empty_like(self._send)
        return all_gather(self._full, self.local_param.contiguous(), async_op=True)

    def _after_gather(self) -> None:
        if self.world > 1:
            torch._foreach_copy_([p.data for p in self.params], list(self._full[:self.K].unbind(0)))
            for p in self.params:
                p.grad = None
        self.local_grad = self.local_param = None

    def full_state(self, state: dict, dst: int | None = None) -> dict:
        key = self.params[0]
        if key not in state:
            return {}
        if self.world == 1:
            return {key: {k: v.detach().cpu().clone() for k, v in state[key].items()}}
        out = {}
        for k, v in state[key].items():  # (c, ...) per rank -> (K, ...)
            full = _gather_shards(v, self.world, self.rank, dst)
            if full is not None:
                out[k] = full[:self.K].cpu()
        return {key: out} if out else {}

    def load_full_state(self, state: dict, full: dict) -> None:
        key = self.params[0]
        if key not in full:
            return
        out = {}
        mine = slice(min(self.first, self.K), min(self.first + self.chunk, self.K))  # empty for an all-padding rank
        for k, v in full[key].items():
            if v.shape[0] != self.K:
                raise ValueError(f"optimizer state {k!r} of a Muon group has {v.shape[0]} matrices, expected {self.K}")
            # only this rank's matrices are read: a memory-mapped checkpoint then pages in only those
            chunk = torch.zeros((self.chunk, *v.shape[1:]), dtype=v.dtype)
            chunk[:mine.stop - mine.start] = v[mine]
            out[k] = _to_param_device(chunk, key)
        state[key] = out


def build_buckets(param_groups: list[dict], world: int, rank: int) -> list[Bucket]:
    """Muon groups and large AdamW params get a bucket each; all small AdamW params share one. A frozen parameter
    (requires_grad False) is in no bucket: nothing reduces or updates it, with any number of ranks (in a bucket
    of several ranks it would count as a zero gradient, and decay and momentum would move it)."""
    buckets, small, small_groups = [], [], []
    for group in param_groups:
        trainable = [p for p in group["params"] if p.requires_grad]
        if group["kind"] == "muon":
            if trainable:
                buckets.append(MuonBucket(trainable, group, world, rank))
            continue
        for p in trainable:
            if world > 1 and p.numel() >= SHARD_MIN_NUMEL and p.shape[0] >= world:
                buckets.append(RowShardBucket(p, group, world, rank))
            else:
                small.append(p)
                if not small_groups or small_groups[-1] is not group:
                    small_groups.append(group)
    if small:
        buckets.append(ReplicatedBucket(small, small_groups, world, rank))
    return buckets


# -- world-size independent state dicts (the format torch.optim.Optimizer.state_dict uses) -----------------------
def _param_index(opt) -> dict:
    """{param: its index in the state dict}: the groups' parameters numbered in order, as torch numbers them."""
    return {p: i for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}


def pack_state_dict(opt, dst: int | None = None) -> dict | None:
    """Collective with more than one process: every rank must call it. Every rank gets the full state on CPU,
    or with ``dst`` rank dst alone does and the others get None (they hold no full copy at any point)."""
    full = {}
    for b in opt.buckets:
        full.update(b.full_state(opt.state, dst))
    if dst is not None and opt.rank != dst:
        return None
    index = _param_index(opt)
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [index[p] for p in group["params"]]}
              for group in opt.param_groups]
    return {"state": {index[p]: st for p, st in full.items()}, "param_groups": groups}


def local_state(opt) -> dict:
    """This rank's share of what ``pack_state_dict`` saves (its shards, the replicated state), keyed like its
    "state" (a row-shard tail under "<index> tail"); views, no collective, no copy. A Muon chunk's padding
    matrices are left out: they are never saved."""
    index = _param_index(opt)
    by_id = {id(p): i for p, i in index.items()}
    muon = {id(b.params[0]): b for b in opt.buckets if isinstance(b, MuonBucket) and b.world > 1}
    out = {}
    for key, st in opt.state.items():
        if isinstance(key, tuple):
            out[f"{by_id[key[1]]} tail"] = st
            continue
        if id(key) in muon:
            st = {k: v[:len(muon[id(key)].owned)] for k, v in st.items()}
        out[index[key]] = st
    return out


def load_packed_state_dict(opt, state_dict: dict) -> None:
    """Load a full state (any world size) into this rank's shards; state tensors go to their parameter's device
    (the fused AdamW kernel needs its step counts there too); the group hyperparameters (lr, ...) are restored."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"optimizer state has {len(saved_groups)} parameter groups, this optimizer "
                         f"{len(opt.param_groups)}")
    by_index = {}
    for i, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        # same counts are not the same groups: two of one size (lm_head's and wte's V x D) would take each other's
        # moments and lr without a word. A group saved without a name (none today) is not compared
        for key in ("name", "kind"):
            if key in saved and saved[key] != group.get(key):
                raise ValueError(f"optimizer group {i} is {group.get(key)!r} here but {saved[key]!r} in the saved "
                                 f"state: it was written by code with other parameter groups")
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(f"optimizer group {group.get('name')!r}: state has {len(saved['params'])} parameters, "
                             f"this optimizer {len(group['params'])}")
        for p, i in zip(group["params"], saved["params"]):
            by_index[i] = p
    full = {by_index[int(i)]: st for i, st in state_dict["state"].items()}
    opt.state.clear()
    for b in opt.buckets:
        b.load_full_state(opt.state, full)
    for group, saved in zip(opt.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
