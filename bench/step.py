"""Training-step cost of the memory designs: forward, backward and optimizer time, and peak memory.

    python bench/step.py [--device cpu|cuda] [--dtype float32|bfloat16] [--compile] [--reps 10] [--warmup 3]
        [--tokens 4096] [--full-tokens 1024] [--sections layer,full,mscale,memory] [--out FILE]

Sections (every design of a section lives in ONE process and the designs are timed round-robin, one step of
each per repetition, so machine-load drift hits them alike and the ratios to Base and VE are same-run ratios):

* ``layer``: one d12-shaped memory layer (C=768, H=6, d=128, V=32768, --tokens tokens). What is timed is the
  layer's memory hooks plus the attention value projection they attach to (``LayerHarness``: prepare ->
  residual -> norm -> c_v -> value), NOT a one-layer GPT: a one-layer model would add q/k/attention/MLP and
  a V x C unembedding whose cost is identical for every design and would only dilute the differences.
* ``full``: a small full GPT (depth 6, C=384, H=6, d=64, V=32768, memory on layers 1,3,5, --full-tokens tokens
  per step as 2 sequences) with the real MuonAdamW optimizer.
* ``mscale``: forward only of the MoME token layer at K=2 and M in 6, 12, 24, 48 (N = V rows, so the table
  grows with M), together with the router matmul alone, to separate the lookup from the C x H*M router.
* ``memory``: peak memory of one layer-harness step per design, each in a FRESH subprocess: on CUDA
  torch.cuda.max_memory_allocated; on CPU the growth of resource.getrusage max RSS over the RSS after imports
  (tracemalloc does not see torch's allocator; RSS counts every page the step touched, params, grads, AdamW
  state and activations included).

Designs are compared at EQUAL memory-table size: per memory layer VE has V x H*d, MoME A2/6 token V x 6 x d
(H = 6 = M), A2/12 c2 grouped V/2 x 12 x d (pairing slot map 2i, 2i+1 built on the fly), Bigram and the
bigram-indexed MoME one shared table with factor = number of memory layers. Times are per step in ms:
median over --reps after --warmup, with [min-max]. The optimizer is MuonAdamW (AdamW on tables).
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as `python bench/step.py` from anywhere
    sys.path.insert(0, str(REPO))

from nanochat.common import autocast_context  # noqa: E402
from nanochat.gpt import GPTConfig, build_model  # noqa: E402
from nanochat.memory import build_memory  # noqa: E402
from nanochat.memory import mome as mome_module  # noqa: E402
from nanochat.memory.slot_map import write_slot_map  # noqa: E402
from nanochat.optim import MuonAdamW, OptimConfig, build_optimizer  # noqa: E402

VOCAB = 32768
LAYER = dict(n_embd=768, n_head=6, n_kv_head=6)  # d12: head_dim 128
FULL = dict(n_layer=6, n_embd=384, n_head=6, n_kv_head=6, memory_layers=(1, 3, 5))  # head_dim 64, H = 6 = M
PLAIN = "plain"  # design flag: time MoME with mome.FUSED_MIX = False (the pre-optimisation gather-mul-sum)


def designs(l_mem: int, slot_map: str, plain: bool) -> list[tuple[str, str, dict, bool]]:
    """(label, --memory, options, fused) at equal table memory for l_mem memory layers."""
    out = [
        ("Base", "base", {}, True),
        ("VE", "ve", {}, True),
        ("Bigram", "bigram", {"factor": l_mem}, True),
        ("MoME A2/6 token", "mome", {"slots": 6, "topk": 2}, True),
        ("MoME A2/12 c2 grouped", "mome", {"slots": 12, "topk": 2, "index": "grouped", "group_size": 2,
                                           "slot_map": slot_map}, True),
        ("MoME A2/6 bigram-idx", "mome", {"slots": 6, "topk": 2, "index": "bigram", "bigram_factor": l_mem}, True),
    ]
    if plain:
        out.append(("MoME A2/6 token, plain mix", "mome", {"slots": 6, "topk": 2}, False))
    return out


def pairing_slot_map(directory: str) -> str:
    """A valid c_grp=2 map (row i = tokens 2i, 2i+1): routing cost does not depend on which tokens share a row."""
    path = Path(directory) / "pairs.json"
    write_slot_map(path, [[2 * i, 2 * i + 1] for i in range(VOCAB // 2)], VOCAB, 2)
    return str(path)


# -- the single-layer harness ----------------------------------------------------------------------------
class LayerHarness(nn.Module):
    """Memory hooks of one layer + the value projection c_v they attach to. forward(idx, x) -> (x', v')."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.H, self.d = config.n_kv_head, config.head_dim
        self.c_v = nn.Linear(config.n_embd, self.H * self.d, bias=False)
        self.memory = build_memory(config)

    def forward(self, idx, x):
        B, T, C = x.shape
        ctx = self.memory.prepare(idx, None)
        x = self.memory.residual(0, x, ctx)  # Bigram injects here
        xn = F.rms_norm(x, (C,))
        v = self.c_v(xn).view(B, T, self.H, self.d)
        return x, self.memory.value(0, xn, v, ctx)  # VE / MoME inject here


def layer_optimizer(h: LayerHarness) -> MuonAdamW:
    """The trainer's grouping rules (nanochat.optim.build_param_groups) applied to the harness."""
    oc, mem = OptimConfig(), h.memory
    adam = dict(kind="adamw", betas=(oc.adam_beta1, oc.adam_beta2), eps=oc.eps, weight_decay=0.0)
    tables, scalars = mem.memory_tables(), mem.scalar_params()
    seen = {id(p) for p in tables + scalars}
    rest = [p for p in h.parameters() if id(p) not in seen]
    groups = [dict(adam, params=tables, lr=oc.memory_lr, betas=(oc.memory_beta1, oc.memory_beta2),
                   weight_decay=mem.table_weight_decay)] if tables else []
    if scalars:
        groups.append(dict(adam, params=scalars, lr=oc.scalar_lr))
    if [p for p in rest if p.ndim != 2]:
        groups.append(dict(adam, params=[p for p in rest if p.ndim != 2], lr=oc.matrix_lr))
    by_shape: dict[tuple, list] = {}
    for p in rest:
        if p.ndim == 2:
            by_shape.setdefault(tuple(p.shape), []).append(p)
    for params in by_shape.values():
        groups.append(dict(kind="muon", params=params, lr=oc.matrix_lr, momentum=oc.muon_momentum,
                           beta2=oc.muon_beta2, weight_decay=oc.weight_decay, ns_steps=5))
    return MuonAdamW(groups)


# -- one benchmark case ----------------------------------------------------------------------------------
class Case:
    """A model + optimizer + fixed batch; ``step()`` returns (forward, backward, optimizer) seconds."""

    def __init__(self, label, memory, opts, fused, kind, args, device, seed=0):
        self.label, self.fused, self.kind, self.device = label, fused, kind, device
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        if kind == "layer":
            cfg = GPTConfig(n_layer=1, vocab_size=VOCAB, memory=memory, memory_options=opts, **LAYER)
            with torch.device("meta"):
                self.model = LayerHarness(cfg)
            self.model.to_empty(device=device)
            nn.init.uniform_(self.model.c_v.weight, -0.036, 0.036)
            self.model.memory.init_weights()
            B, T = 2, args.tokens // 2
            self.idx = torch.randint(0, VOCAB, (B, T), generator=g).to(device)
            self.x = torch.randn(B, T, cfg.n_embd, generator=g).to(device).requires_grad_()
            self.cot = (torch.randn(B, T, cfg.n_embd, generator=g).to(device),
                        torch.randn(B, T, cfg.n_kv_head, cfg.head_dim, generator=g).to(device))
            self.opt = layer_optimizer(self.model)
        else:
            cfg = GPTConfig(sequence_len=args.full_tokens // 2, vocab_size=VOCAB, memory=memory,
                            memory_options=opts, **FULL)
            self.model = build_model(cfg, device=device, seed=seed)
            data = torch.randint(0, VOCAB, (2, args.full_tokens // 2 + 1), generator=g).to(device)
            self.idx, self.targets = data[:, :-1], data[:, 1:]
            self.opt = build_optimizer(self.model)
        self.model.train()
        self.table_params = sum(p.numel() for p in self.model.memory.memory_tables())
        self.forward = torch.compile(self.model) if args.compile else self.model
        self.autocast = autocast_context(device.type, args.dtype)

    def loss(self):
        mome_module.FUSED_MIX = self.fused  # set before every call: the designs share the module
        with self.autocast:
            if self.kind == "layer":
                x, v = self.forward(self.idx, self.x)
                return (x.float() * self.cot[0]).sum() + (v.float() * self.cot[1]).sum()
            return self.forward(self.idx, self.targets)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self):
        self.sync()
        t0 = time.perf_counter()
        loss = self.loss()
        self.sync()
        t1 = time.perf_counter()
        loss.backward()
        self.sync()
        t2 = time.perf_counter()
        self.opt.step()
        self.model.zero_grad(set_to_none=True)  # as the trainer: table grads are re-allocated every step
        if self.kind == "layer":
            self.x.grad = None
        self.sync()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    def forward_only(self):
        self.sync()
        t0 = time.perf_counter()
        self.loss()
        self.sync()
        return time.perf_counter() - t0


def summary(samples: list[float]) -> dict:
    ms = [s * 1e3 for s in samples]
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "n": len(ms)}


def round_robin(cases: list[Case], reps: int, warmup: int, fn: str = "step") -> dict[str, list]:
    """Warm up every case, then rotate through them ``reps`` times (start offset shifts each rep)."""
    for _ in range(warmup):
        for c in cases:
            getattr(c, fn)()
    out: dict[str, list] = {c.label: [] for c in cases}
    for r in range(reps):
        for c in cases[r % len(cases):] + cases[: r % len(cases)]:
            out[c.label].append(getattr(c, fn)())
    return out


# -- sections --------------------------------------------------------------------------------------------
def step_section(kind: str, args, device, slot_map: str) -> dict:
    l_mem = 1 if kind == "layer" else len(FULL["memory_layers"])
    cases = [Case(lbl, mem, o, fused, kind, args, device) for lbl, mem, o, fused in designs(l_mem, slot_map, args.plain)]
    raw = round_robin(cases, args.reps, args.warmup)
    rows = {}
    for c in cases:
        fwd, bwd, opt = zip(*raw[c.label])
        rows[c.label] = {"forward": summary(fwd), "backward": summary(bwd), "optimizer": summary(opt),
                         "step": summary([sum(t) for t in raw[c.label]]), "table_params": c.table_params}
    for ref in ("Base", "VE"):  # ratios of medians, same run
        for lbl, r in rows.items():
            for col in ("forward", "backward", "optimizer", "step"):
                r.setdefault("ratio_to_" + ref, {})[col] = r[col]["median"] / rows[ref][col]["median"]
    return rows


def mscale_section(args, device) -> dict:
    """MoME token layer forward at K=2 for growing M; the router matmul timed alone on the same input."""
    slots = (6, 12, 24, 48)
    cases = [Case(f"M={m}", "mome", {"slots": m, "topk": 2}, True, "layer", args, device) for m in slots]
    routers = []
    for m, c in zip(slots, cases):
        lin = c.model.memory.routers[0]
        xn = F.rms_norm(c.x.detach(), (c.x.size(-1),))

        class Router:  # duck-typed Case: times only the C x H*M router matmul
            label = f"router M={m}"

            def forward_only(self, lin=lin, xn=xn, c=c):
                c.sync()
                t0 = time.perf_counter()
                with c.autocast:
                    lin(xn)
                c.sync()
                return time.perf_counter() - t0
        routers.append(Router())
    raw = round_robin(cases + routers, args.reps, args.warmup, fn="forward_only")
    out = {}
    for m in slots:
        f, r = summary(raw[f"M={m}"]), summary(raw[f"router M={m}"])
        out[m] = {"forward": f, "router": r, "forward_minus_router": f["median"] - r["median"]}
    base = out[slots[0]]
    for m in slots:
        out[m]["growth_vs_M6"] = out[m]["forward"]["median"] / base["forward"]["median"] - 1
        out[m]["growth_minus_router_vs_M6"] = out[m]["forward_minus_router"] / base["forward_minus_router"] - 1
    return out


def probe_memory(args, device, label: str, slot_map: str) -> dict:
    """Runs inside a fresh subprocess: build one layer case, take 2 steps, report the peak."""
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    spec = {lbl: (mem, o, fused) for lbl, mem, o, fused in designs(1, slot_map, True)}[label]
    case = Case(label, *spec, "layer", args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        case.step()
    if device.type == "cuda":
        return {"peak_mb": torch.cuda.max_memory_allocated() / 2**20, "measure": "torch.cuda.max_memory_allocated"}
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mb": (peak_kb - base_kb) / 1024, "measure": "max RSS growth over post-import RSS"}


def memory_section(args, slot_map: str) -> dict:
    out = {}
    for label, *_ in designs(1, slot_map, args.plain):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--probe-memory", label, "--slot-map", slot_map,
               "--device", args.device, "--dtype", args.dtype, "--tokens", str(args.tokens)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        out[label] = json.loads(res.stdout.strip().splitlines()[-1])
    for label in out:
        for ref in ("Base", "VE"):
            out[label]["ratio_to_" + ref] = out[label]["peak_mb"] / out[ref]["peak_mb"]
    return out


# -- output ----------------------------------------------------------------------------------------------
def fmt(s: dict) -> str:
    return f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"


def step_table(rows: dict, mem: dict | None) -> str:
    head = ("| design | table params | fwd ms | bwd ms | opt ms | step ms | step/Base | step/VE | fwd/VE | bwd/VE "
            "| opt/VE |" + (" peak MB | peak/VE |" if mem else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for lbl, r in rows.items():
        rv, rb = r["ratio_to_VE"], r["ratio_to_Base"]
        cells = [lbl, f"{r['table_params'] / 1e6:.1f}M", fmt(r["forward"]), fmt(r["backward"]), fmt(r["optimizer"]),
                 fmt(r["step"]), f"{rb['step']:.3f}", f"{rv['step']:.3f}", f"{rv['forward']:.2f}",
                 f"{rv['backward']:.2f}", f"{rv['optimizer']:.2f}"]
        if mem:
            cells += [f"{mem[lbl]['peak_mb']:.0f}", f"{mem[lbl]['ratio_to_VE']:.3f}"] if lbl in mem else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mscale_table(out: dict) -> str:
    lines = ["| M (K=2) | forward ms | router alone ms | forward - router ms | growth vs M=6 | growth minus router |",
             "|---|---|---|---|---|---|"]
    for m, r in out.items():
        lines.append(f"| {m} | {fmt(r['forward'])} | {fmt(r['router'])} | {r['forward_minus_router']:.1f} "
                     f"| {100 * r['growth_vs_M6']:+.1f}% | {100 * r['growth_minus_router_vs_M6']:+.1f}% |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="bfloat16 = autocast")
    p.add_argument("--compile", action="store_true", help="torch.compile the model / harness (not the optimizer)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4096, help="B*T of the d12-shaped layer (as 2 sequences)")
    p.add_argument("--full-tokens", type=int, default=1024, help="B*T of the small full model (as 2 sequences)")
    p.add_argument("--sections", default="layer,full,mscale,memory")
    p.add_argument("--no-plain", dest="plain", action="store_false", help="skip the plain-mix MoME row")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch default)")
    p.add_argument("--out", default="", help="JSON path (default bench/results/step_<device>_<dtype>.json)")
    p.add_argument("--probe-memory", default="", help=argparse.SUPPRESS)  # internal: one design, fresh process
    p.add_argument("--slot-map", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.probe_memory:
        print(json.dumps(probe_memory(args, device, args.probe_memory, args.slot_map)))
        return
    sections = [s for s in args.sections.split(",") if s]
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "platform": platform.platform(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        slot_map = pairing_slot_map(tmp)
        mem = memory_section(args, slot_map) if "memory" in sections else None
        result["memory"] = mem
        for kind in ("layer", "full"):
            if kind in sections:
                result[kind] = step_section(kind, args, device, slot_map)
                title = {"layer": f"d12-shaped memory layer, {args.tokens} tokens",
                         "full": f"small full model (depth 6, C=384), {args.full_tokens} tokens"}[kind]
                print(f"\n### {title} ({args.device}, {args.dtype}{', compiled' if args.compile else ''})\n")
                print(step_table(result[kind], mem if kind == "layer" else None))
    if "mscale" in sections:
        result["mscale"] = mscale_section(args, device)
        print(f"\n### MoME forward vs M at K=2 (token index, d12 layer, {args.tokens} tokens)\n")
        print(mscale_table(result["mscale"]))
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"step_{args.device}_{args.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
