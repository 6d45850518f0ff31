"""Muon + AdamW in one optimizer, with the parameter groups of the paper's runs (reference spec §1.6).

- Muon (every 2-D matrix of the blocks, memory gates and routers): Nesterov momentum, Polar-Express
  orthogonalisation, NorMuon-style factored second-moment normalisation, cautious weight decay, and an
  effective LR of lr*sqrt(max(1, rows/cols)). Same-shape matrices are stacked and updated in one batch.
- AdamW (eps 1e-10, decoupled decay p <- p*(1 - lr*wd)) for embeddings, unembedding, scalars, memory tables
  and every other non-matrix parameter; torch's fused kernel, fp32 params and state.

Distributed (no DDP wrapper; ``nanochat.optim_shard`` holds the pieces): gradients are reduce-scattered in one
bucket per Muon group (same-shape matrices stacked, split by matrix across ranks) and per large AdamW parameter
(split by rows, ZeRO-2: each rank keeps the Adam state of its rows only); the small AdamW parameters share one
all-reduced bucket. Each rank updates only its shard, then the updated shards are all-gathered. Buckets are
launched from post-accumulate-grad hooks during the last micro-step's backward when the trainer arms them
(``arm_grad_hooks``), otherwise at the start of ``step()``, always in one order shared by every rank (rank 0's
order of readiness in the first armed step): a parameter without gradient on some ranks only delays its bucket
there, and never pairs one rank's bucket with another rank's. With one process the same code runs without any
collective and is today's exact single-process update. A parameter that got no gradient in a step is left as
it is by one process (its optimizer state too), but counts as a zero gradient with several (every rank joins
every collective), so Adam and Muon still move it (momentum, decay): give every trained parameter a gradient
each step, or freeze it (frozen parameters are left out of the groups; one in a group built by hand is in no
bucket: never updated).
``state_dict()`` is world-size independent (the full, unsharded state, gathered collectively: call it on every
rank); ``state_dict_on_rank0()`` is the same dict gathered onto rank 0 alone (None elsewhere), for a checkpoint
only rank 0 writes; ``local_state()`` is this rank's own shards (no collective); ``load_state_dict`` takes each
rank's shard.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanochat.optim_shard import (Bucket, build_buckets, load_packed_state_dict, local_state, pack_state_dict,
                                  world_info)

# Polar Express coefficients (Amsel et al. 2025): 5 steps of X <- aX + (bA + cA^2)X with A = XX^T.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def polar_express(G: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximate the orthogonal polar factor of each matrix in G (..., m, n), iterating in ``dtype``: None =
    bf16 on CUDA, fp32 elsewhere (the tests force bf16 on the CPU)."""
    if dtype is None:
        dtype = torch.bfloat16 if G.is_cuda else torch.float32
    X = G.to(dtype)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    transposed = X.size(-2) > X.size(-1)
    if transposed:  # iterate on the wide orientation so A = XX^T is the small Gram matrix
        X = X.mT
    for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if transposed:
        X = X.mT
    return X


def normuon_scale(U: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon: divide each row (or column, for wide matrices) by the RMS of its running second moment,
    then restore the update's overall Frobenius norm. ``second_moment`` is (K, m, 1) or (K, 1, n), updated in place.
    U: (K, m, n) orthogonalised updates."""
    U = U.float()
    red_dim = -1 if second_moment.size(-1) == 1 else -2
    v_now = U.square().mean(dim=red_dim, keepdim=True)
    second_moment.lerp_(v_now, 1 - beta2)
    scaled = U * second_moment.clamp_min(1e-10).rsqrt()
    ratio = U.norm(dim=(-2, -1), keepdim=True) / scaled.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10)
    return scaled * ratio


@dataclass
class OptimConfig:
    embedding_lr: float = 0.3
    unembedding_lr: float = 0.004
    matrix_lr: float = 0.02
    scalar_lr: float = 0.5
    adam_beta1: float = 0.8
    adam_beta2: float = 0.95
    weight_decay: float = 0.2  # Muon weight decay at depth 12; scaled by (12/depth)^2
    memory_lr: float = 0.2
    memory_beta1: float = 0.8
    memory_beta2: float = 0.995
    memory_wd: float | None = None  # None = the block's default (VE/MoME 0.001, Bigram 0)
    muon_momentum: float = 0.95
    muon_beta2: float = 0.95
    eps: float = 1e-10
    lr_scale: float = 1.0  # batch-size LR scale sqrt(B / 2^19), multiplies every LR


def adamw_group(name: str, params, lr: float, oc: OptimConfig, betas=None, wd: float = 0.0) -> dict:
    """One AdamW group (eps oc.eps); ``lr`` before the batch LR scale, ``betas`` default (adam_beta1, adam_beta2)."""
    return dict(kind="adamw", name=name, params=list(params), lr=lr * oc.lr_scale,
                betas=betas or (oc.adam_beta1, oc.adam_beta2), eps=oc.eps, weight_decay=wd)


def shape_routed_groups(params, oc: OptimConfig, adam_lr: float, muon_wd: float) -> list[dict]:
    """The parameters no named rule claimed, routed by shape: everything not 2-D to one AdamW group at
    ``adam_lr``, 2-D matrices to one Muon group per shape (stacked for Polar Express). LRs times oc.lr_scale."""
    groups = []
    extra = [p for p in params if p.ndim != 2]
    if extra:
        groups.append(adamw_group("adam_extra", extra, adam_lr, oc))
    by_shape: dict[tuple, list] = {}
    for p in params:
        if p.ndim == 2:
            by_shape.setdefault(tuple(p.shape), []).append(p)
    for shape, group in sorted(by_shape.items()):
        groups.append(dict(kind="muon", name=f"muon_{shape[0]}x{shape[1]}", params=group,
                           lr=oc.matrix_lr * oc.lr_scale, momentum=oc.muon_momentum, beta2=oc.muon_beta2,
                           weight_decay=muon_wd, ns_steps=5))
    return groups


def memory_table_group(memory, oc: OptimConfig, width_scale: float) -> list[dict]:
    """The memory block's tables in one AdamW group (--memory-lr x width scale, memory betas, the block's decay)."""
    tables = memory.memory_tables()
    if not tables:
        return []
    wd = memory.table_weight_decay if oc.memory_wd is None else oc.memory_wd
    return [adamw_group("memory_tables", tables, oc.memory_lr * width_scale, oc,
                        betas=(oc.memory_beta1, oc.memory_beta2), wd=wd)]


def finalize_groups(model, groups: list[dict]) -> list[dict]:
    """Check that every parameter of ``model`` is in exactly one group (raises naming them); set initial_lr.
    Frozen parameters (requires_grad False) are then left out: nothing updates them, with any number of ranks
    (with several, a parameter without gradient would otherwise count as a zero gradient: decay and momentum)."""
    counts: dict[int, int] = {}
    for g in groups:
        for p in g["params"]:
            counts[id(p)] = counts.get(id(p), 0) + 1
    names = {id(p): n for n, p in model.named_parameters()}
    bad = [names.get(i, "?") for i, c in counts.items() if c != 1]
    missing = [n for n, p in model.named_parameters() if id(p) not in counts]
    if bad or missing:
        raise RuntimeError(f"optimizer grouping error: duplicated {bad}, missing {missing}")
    for g in groups:
        g["initial_lr"] = g["lr"]
        g["params"] = [p for p in g["params"] if p.requires_grad]
    return [g for g in groups if g["params"]]


def build_param_groups(model, oc: OptimConfig) -> list[dict]:
    """The nanochat GPT's groups; every parameter in exactly one (other families: ``nanochat.families``)."""
    cfg = model.config
    width_scale = (cfg.n_embd / 768) ** -0.5
    muon_wd = oc.weight_decay * (12 / cfg.n_layer) ** 2
    memory = model.memory
    groups = [
        adamw_group("lm_head", [model.lm_head.weight], oc.unembedding_lr * width_scale, oc),
        adamw_group("wte", [model.wte.weight], oc.embedding_lr * width_scale, oc),
        adamw_group("resid_lambdas", [model.resid_lambdas], oc.scalar_lr * 0.01, oc),
        adamw_group("x0_lambdas", [model.x0_lambdas, *memory.scalar_params()], oc.scalar_lr, oc, betas=(0.96, 0.95)),
        *memory_table_group(memory, oc, width_scale),
    ]
    assigned = {id(p) for g in groups for p in g["params"]}
    groups += shape_routed_groups([p for p in model.parameters() if id(p) not in assigned], oc,
                                  oc.matrix_lr * width_scale, muon_wd)
    return finalize_groups(model, groups)


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer for both kinds of group; see the module docstring.

    After ``step()``, ``grad_norm`` holds the global L2 norm of the rank-averaged gradients as a 0-d device tensor
    (no host sync; the trainer reads it together with the loss)."""

    def __init__(self, param_groups: list[dict]):
        super().__init__(param_groups, defaults={})
        self.world, self.rank = world_info()
        self.buckets = build_buckets(self.param_groups, self.world, self.rank)
        self.grad_norm: torch.Tensor | None = None
        self._armed = False
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = []
        self._next = 0  # buckets[:_next] are launched this step; collectives start in list order on every rank
        self._seen: list[Bucket] | None = None  # readiness order observed in the first armed step (then None)
        self._order_fixed = self.world == 1

    def add_param_group(self, param_group: dict) -> None:
        # torch's own, without its torch._disable_dynamo wrapper: that wrapper imports torch._dynamo (~2.5 s of CPU)
        # in every training process, compiled or not; nothing here is traced (the optimizer is never compiled)
        add = torch.optim.Optimizer.add_param_group
        getattr(add, "__wrapped__", add)(self, param_group)

    # -- gradient hooks: launch a bucket's reduction as soon as its last gradient is final ------------------

    def arm_grad_hooks(self) -> None:
        """Call before the LAST micro-step's backward: each bucket's collective starts as soon as its gradients
        are accumulated, overlapping communication with the rest of the backward (and with later buckets).
        A no-op with one process."""
        if self.world == 1:
            return
        if not self._hooks:
            for b in self.buckets:  # trainable parameters only: frozen ones are in no bucket
                for p in b.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        if not self._order_fixed and self._seen is None:
            self._seen = []
        self._armed = True

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        bucket = self._bucket_of[id(p)]
        bucket.param_ready()
        if self._seen is not None and bucket.ready():
            self._seen.append(bucket)
        # never skip ahead: a bucket waits for every earlier one, so all ranks issue the same collective sequence
        while self._next < len(self.buckets) and self.buckets[self._next].ready():
            self.buckets[self._next].launch()
            self._next += 1

    def _fix_launch_order(self) -> None:
        """After the first armed step: order the buckets as rank 0 saw them become ready in its backward (the
        others after, in their order), the same on every rank, so later steps launch each one as early as the
        in-order rule allows."""
        from nanochat.common import broadcast_object

        index = {id(b): i for i, b in enumerate(self.buckets)}
        seen = [index[id(b)] for b in self._seen]
        order = broadcast_object(seen + [i for i in range(len(self.buckets)) if i not in seen])
        self.buckets = [self.buckets[i] for i in order]
        self._seen, self._order_fixed = None, True

    # -- step -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        self._armed = False
        for b in self.buckets[self._next:]:  # not launched by the hooks (not armed, no gradient, sparse grads)
            b.launch()
        sq = []
        for b in self.buckets:  # in launch order: later buckets' reductions overlap earlier buckets' updates
            b.wait_reduced()
            sq.append(b.grad_sq_sum())
            for group in b.groups:
                self._adamw_update(b, group) if group["kind"] == "adamw" else self._muon_update(b, group)
            b.launch_gather()
        for b in self.buckets:
            b.finish()
        self._next = 0
        if self._seen is not None:
            self._fix_launch_order()
        total = torch.stack(sq).sum() if sq else torch.zeros(())
        if self.world > 1:
            dist.all_reduce(total)
        self.grad_norm = total.sqrt()

    def _adamw_update(self, bucket, group) -> None:
        """One fused AdamW kernel over the group's tensors in this bucket (decoupled decay p <- p(1 - lr wd),
        bias-corrected moments); a row shard is updated in place as a view of its parameter.

        torch's fused kernel does the same math as torch.optim.AdamW in one pass over memory, ~5x faster than
        separate elementwise ops on a 25M-row table (measured on CPU); the state stays fp32 like the params."""
        items = bucket.adamw_items(group)  # (state key, tensor to update, averaged gradient)
        if not items:
            return
        for key, t, _ in items:
            state = self.state[key]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=t.device)
                state["exp_avg"] = torch.zeros_like(t)
                state["exp_avg_sq"] = torch.zeros_like(t)
        states = [self.state[key] for key, _, _ in items]
        steps = [st["step"] for st in states]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        torch._fused_adamw_([t for _, t, _ in items], [g for _, _, g in items], [st["exp_avg"] for st in states],
                            [st["exp_avg_sq"] for st in states], [], steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                            weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False)

    def _muon_update(self, bucket, group) -> None:
        """Nesterov momentum, Polar Express, NorMuon and cautious weight decay on this rank's (c, m, n) chunk."""
        # one process: a matrix without gradient keeps its value (write_own) and its state (restored below), as
        # AdamW skips such a parameter; with several it is a zero gradient on every rank (module docstring)
        idle = [j for j, p in enumerate(bucket.params) if p.grad is None] if self.world == 1 else []
        if len(idle) == len(bucket.params):
            return
        grads = bucket.local_grad  # (c, m, n) fp32, averaged over ranks
        state = self.state[bucket.params[0]]  # keyed by the group's first trainable matrix
        _, rows, cols = grads.shape
        if not state:
            state["momentum_buffer"] = torch.zeros_like(grads)
            moment_shape = (grads.size(0), rows, 1) if rows >= cols else (grads.size(0), 1, cols)
            state["second_moment"] = torch.zeros(moment_shape, device=grads.device, dtype=torch.float32)
        kept = {name: v[idle] for name, v in state.items()} if idle else {}  # copies (list indexing)
        buf = state["momentum_buffer"]
        buf.lerp_(grads, 1 - group["momentum"])
        nesterov = grads.lerp(buf, group["momentum"])
        update = polar_express(nesterov, group["ns_steps"])
        update = normuon_scale(update, state["second_moment"], group["beta2"])
        for name, v in kept.items():
            state[name][idle] = v
        lr = group["lr"] * math.sqrt(max(1.0, rows / cols))
        wd = group["weight_decay"]
        p32 = bucket.own_params()
        if wd:
            cautious = (update * p32) >= 0  # decay only where the update agrees in sign with the weight
            p32.sub_(lr * wd * p32 * cautious)
        p32.sub_(lr * update)
        bucket.write_own(p32)

    # -- checkpoints: the full (unsharded) state, same format for every world size ---------------------------
    def state_dict(self) -> dict:
        return pack_state_dict(self)

    def state_dict_on_rank0(self) -> dict | None:
        """``state_dict()`` on rank 0, None on the others (collective): one full copy in host memory per job
        instead of one per rank (at d24 several GB each), the shards streamed to rank 0 one tensor at a time."""
        return pack_state_dict(self, dst=0)

    def local_state(self) -> dict:
        """{index (as in ``state_dict()``): {name: tensor}} of the state this rank holds: enough to check the
        whole state for non-finite values without gathering it (every rank checks its own)."""
        return local_state(self)

    def load_state_dict(self, state_dict: dict) -> None:
        load_packed_state_dict(self, state_dict)


def build_optimizer(model, oc: OptimConfig | None = None) -> MuonAdamW:
    return MuonAdamW(model.param_groups(oc or OptimConfig()))  # every family's model class has param_groups
