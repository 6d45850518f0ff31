"""Training-step cost of the memory designs: forward, backward and optimizer time, and peak memory.

    python bench/step.py [--device cpu|cuda] [--dtype float32|bfloat16] [--compile] [--reps 10] [--warmup 3]
        [--tokens 4096] [--full-tokens 1024] [--sections layer,hook,full,family,mscale,memory] [--out FILE]

Sections (every design of a section lives in ONE process and the designs are timed round-robin, one step of
each per repetition, so machine-load drift hits them alike and the ratios to Base and VE are same-run ratios):

* ``layer``: one d12-shaped transformer layer with memory (C=768, H=6, d=128, V=32768, --tokens tokens as 2
  sequences): the memory's prepare/residual hooks, then ``nanochat.gpt.Block`` (q/k/v, the value hook, RoPE,
  QK-norm, causal SDPA, c_proj, relu^2 MLP), i.e. what GPT.forward runs for one memory layer, minus the token
  embedding and unembedding (``LayerHarness``). All block weights are random (no zero-init c_proj), so
  every memory parameter gets a gradient.
* ``hook``: the memory hooks plus only the value projection they attach to (``HookHarness``: prepare ->
  residual -> norm -> c_v -> value). A magnifying glass: without q/k/attention/MLP, MoME's router and
  gather-mix are a much larger share of the step than in any real model.
* ``full``: a small full GPT (depth 6, C=384, H=6, d=64, V=32768, memory on layers 1,3,5, --full-tokens tokens
  per step as 2 sequences) with the real MuonAdamW optimizer.
* ``family``: the same for the other backbone families (``nanochat.families``): a small MobileLLM (Llama) and a
  small Qwen3 model (depth 6, C=384, 6 query / 3 KV heads of 64 (MobileLLM) or 96 (Qwen3, query width 576 != C),
  memory on layers 1,3,5, --full-tokens tokens) with each family's optimizer groups; designs Base, STEM (V x F table
  replacing W_up), VE, MoME A1/3 (iso-VE, M = H_kv) and A2/6 (router value for MobileLLM, hidden for Qwen3, as in
  the paper's rows). The paper's Wall column (1.03-1.09x) is the GPU analogue of step/Base here.
* ``mscale``: forward only of the MoME token hook harness at K=2 and M in 6, 12, 24, 48 (N = V rows, so the
  table grows with M), together with the router matmul alone, to separate the lookup from the C x H*M router.
* ``memory``: peak memory of a steady-state training step (the second) of each harness section requested
  (layer, hook) per design, each in a FRESH subprocess: on CUDA torch.cuda.max_memory_allocated; on CPU the
  peak of live tensor bytes from torch.profiler's memory timeline (parameters, AdamW state, gradients and
  activations). The JSON also keeps the growth of max RSS over the post-import RSS, which is noisier (±8%
  between runs): it counts allocator caching and every page touched.

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
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as `python bench/step.py` from anywhere
    sys.path.insert(0, str(REPO))

from nanochat.cli_types import device_choice  # noqa: E402
from nanochat.common import autocast_context  # noqa: E402
from nanochat import families  # noqa: E402
from nanochat.gpt import Block, GPTConfig, rotary_tables  # noqa: E402
from nanochat.memory import build_memory  # noqa: E402
from nanochat.memory import mome_mix as mix_paths  # noqa: E402
from nanochat.memory.slot_map import write_slot_map  # noqa: E402
from nanochat.optim import MuonAdamW, OptimConfig, shape_routed_groups  # noqa: E402

SECTIONS = ("layer", "hook", "full", "family", "mscale", "memory")
LAYER = dict(n_embd=768, n_head=6, n_kv_head=6)  # d12: head_dim 128
FULL = dict(n_layer=6, n_embd=384, n_head=6, n_kv_head=6, memory_layers=(1, 3, 5))  # head_dim 64, H = 6 = M
FAMILY_FULL = {  # small models of the other families, GQA 6/3 heads, memory on layers 1, 3, 5
    "mobilellm": dict(n_layer=6, n_embd=384, n_head=6, n_kv_head=3, head_dim=64, ffn_hidden=1024, memory_layers=(1, 3, 5)),
    "qwen3": dict(n_layer=6, n_embd=384, n_head=6, n_kv_head=3, head_dim=96, ffn_hidden=1152, memory_layers=(1, 3, 5)),
}


def family_designs(family: str) -> list[tuple[str, str, dict, str | None]]:
    """(label, --memory, options, mix) of the paper's family rows: Base, STEM, VE, MoME A1/3 (= VE's table
    size with M = H_kv = 3) and A2/6, routed from the values (MobileLLM) or the hidden state (Qwen3)."""
    router = "value" if family == "mobilellm" else "hidden"
    return [("Base", "base", {}, None), ("STEM", "stem", {}, None), ("VE", "ve", {}, None),
            ("MoME A1/3", "mome", {"slots": 3, "topk": 1, "router_input": router}, None),
            ("MoME A2/6", "mome", {"slots": 6, "topk": 2, "router_input": router}, None)]


def designs(l_mem: int, slot_map: str, variants: bool) -> list[tuple[str, str, dict, str | None]]:
    """(label, --memory, options, mix) at equal table memory for l_mem memory layers; mix: ``mome_mix.MIX`` (None =
    the model's default: row for the bigram-indexed table, and for per-layer tables where the Triton kernel applies
    (CUDA); else embedding_bag on CPU and plain on CUDA). ``variants``
    adds MoME rows with other mixes."""
    token = {"slots": 6, "topk": 2}
    bigram_idx = {"slots": 6, "topk": 2, "index": "bigram", "bigram_factor": l_mem}
    out = [
        ("Base", "base", {}, None),
        ("VE", "ve", {}, None),
        ("Bigram", "bigram", {"factor": l_mem}, None),
        ("MoME A2/6 token", "mome", token, None),
        ("MoME A2/12 c2 grouped", "mome", {"slots": 12, "topk": 2, "index": "grouped", "group_size": 2,
                                           "slot_map": slot_map}, None),
        ("MoME A2/6 bigram-idx", "mome", bigram_idx, None),
    ]
    if variants:
        out += [("MoME A2/6 token, plain mix", "mome", token, "plain"),
                ("MoME A2/6 token, bag mix", "mome", token, "bag"),
                ("MoME A2/6 token, row mix", "mome", token, "row"),
                ("MoME A2/6 bigram-idx, plain mix", "mome", bigram_idx, "plain"),
                ("MoME A2/6 bigram-idx, bag mix", "mome", bigram_idx, "bag")]
    return out


def pairing_slot_map(directory: str, vocab_size: int) -> str:
    """A valid c_grp=2 map (row i = tokens 2i, 2i+1): routing cost does not depend on which tokens share a row."""
    path = Path(directory) / "pairs.json"
    write_slot_map(path, [[2 * i, 2 * i + 1] for i in range(vocab_size // 2)], vocab_size, 2)
    return str(path)


# -- the single-layer harnesses --------------------------------------------------------------------------
class LayerHarness(nn.Module):
    """One d12-shaped transformer layer with its memory: ``nanochat.gpt.Block`` (attention with the memory value
    hook, relu^2 MLP) after the memory's prepare/residual hooks, exactly as GPT.forward runs a memory layer.
    No token embedding and no unembedding (identical for every design). forward(idx, x) -> (x',)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.block = Block(config, 0)
        self.memory = build_memory(config)

    @torch.no_grad()
    def init_weights(self) -> None:
        for lin in self.block.modules():
            if isinstance(lin, nn.Linear):  # c_proj too: zero output projections would zero the memory gradients
                nn.init.uniform_(lin.weight, -0.036, 0.036)
        self.memory.init_weights()

    def forward(self, idx, x):
        T = idx.size(1)
        cos_sin = rotary_tables(T, self.config.head_dim, x.device)
        ctx = self.memory.prepare(idx, None)
        x = self.memory.residual(0, x, ctx)  # Bigram injects here
        return (self.block(x, cos_sin, self.memory, ctx, None),)  # VE / MoME inject inside attention


class HookHarness(nn.Module):
    """The memory hooks of one layer + the value projection c_v they attach to, nothing else: a magnifying
    glass on the memory op (q/k/attention/MLP would be common cost). forward(idx, x) -> (x', v')."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.H, self.d = config.n_kv_head, config.head_dim
        self.c_v = nn.Linear(config.n_embd, self.H * self.d, bias=False)
        self.memory = build_memory(config)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.uniform_(self.c_v.weight, -0.036, 0.036)
        self.memory.init_weights()

    def forward(self, idx, x):
        B, T, C = x.shape
        ctx = self.memory.prepare(idx, None)
        x = self.memory.residual(0, x, ctx)  # Bigram injects here
        xn = F.rms_norm(x, (C,))
        v = self.c_v(xn).view(B, T, self.H, self.d)
        return x, self.memory.value(0, xn, v, ctx)  # VE / MoME inject here


HARNESSES = {"layer": LayerHarness, "hook": HookHarness}


def harness_optimizer(h: nn.Module) -> MuonAdamW:
    """The trainer's grouping rules applied to the harness (nanochat.optim.build_param_groups minus the
    embedding, unembedding and residual-lambda groups the harness has no parameters for; width and depth
    scales are 1 at the d12 width, and Muon's weight decay is the d12 value)."""
    oc, mem = OptimConfig(), h.memory
    adam = dict(kind="adamw", betas=(oc.adam_beta1, oc.adam_beta2), eps=oc.eps, weight_decay=0.0)
    tables, scalars = mem.memory_tables(), mem.scalar_params()
    seen = {id(p) for p in tables + scalars}
    groups = [dict(adam, params=tables, lr=oc.memory_lr, betas=(oc.memory_beta1, oc.memory_beta2),
                   weight_decay=mem.table_weight_decay)] if tables else []
    if scalars:
        groups.append(dict(adam, params=scalars, lr=oc.scalar_lr))
    groups += shape_routed_groups([p for p in h.parameters() if id(p) not in seen], oc, oc.matrix_lr,
                                  oc.weight_decay)
    return MuonAdamW(groups)


# -- one benchmark case ----------------------------------------------------------------------------------
def full_config(kind: str, args, memory: str = "base", opts: dict | None = None):
    """The config of a full-model case: ``kind`` "full" (FULL, the nanochat backbone) or a FAMILY_FULL family."""
    common = dict(sequence_len=args.full_tokens // 2, vocab_size=args.vocab_size, memory=memory,
                  memory_options=opts or {})
    if kind in FAMILY_FULL:
        return families.FAMILIES[kind].config_cls(**common, **FAMILY_FULL[kind])
    return GPTConfig(**common, **FULL)


def model_shape(cfg) -> str:
    """A section heading's size of the model it steps: "depth 6, C=384, 6/3 heads" (query/KV heads where they
    differ)."""
    heads = str(cfg.n_head) if cfg.n_kv_head == cfg.n_head else f"{cfg.n_head}/{cfg.n_kv_head}"
    return f"depth {cfg.n_layer}, C={cfg.n_embd}, {heads} heads"


class Case:
    """A model + optimizer + fixed batch; ``step()`` returns (forward, backward, optimizer) seconds."""

    def __init__(self, label, memory, opts, mix, kind, args, device, seed=0):
        self.label, self.mix, self.kind, self.device = label, mix, kind, device
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        V = args.vocab_size
        if kind in HARNESSES:
            cfg = GPTConfig(n_layer=1, vocab_size=V, memory=memory, memory_options=opts, **LAYER)
            with torch.device("meta"):
                self.model = HARNESSES[kind](cfg)
            self.model.to_empty(device=device)
            self.model.init_weights()
            B, T = 2, args.tokens // 2
            self.idx = torch.randint(0, V, (B, T), generator=g).to(device)
            self.x = torch.randn(B, T, cfg.n_embd, generator=g).to(device).requires_grad_()
            with torch.no_grad():  # random cotangents for the harness outputs: loss = sum_i <out_i, cot_i>
                outs = self.model(self.idx, self.x)
            self.cot = [torch.randn(o.shape, generator=g).to(device) for o in outs]
            self.opt = harness_optimizer(self.model)
        else:
            self.model = families.build_model(full_config(kind, args, memory, opts), device=device, seed=seed)
            data = torch.randint(0, V, (2, args.full_tokens // 2 + 1), generator=g).to(device)
            self.idx, self.targets = data[:, :-1], data[:, 1:]
            self.opt = MuonAdamW(families.param_groups(self.model, OptimConfig()))
        self.model.train()
        self.table_params = sum(p.numel() for p in self.model.memory.memory_tables())
        if args.compile:  # every case recompiles the same forward code (new model, MIX guard): keep them all compiled
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.forward = torch.compile(self.model) if args.compile else self.model
        self.autocast = autocast_context(device.type, args.dtype)

    def loss(self):
        mix_paths.set_path("MIX", self.mix)  # set before every call: the designs share the module
        with self.autocast:
            if self.kind in HARNESSES:
                outs = self.forward(self.idx, self.x)
                return sum((o.float() * c).sum() for o, c in zip(outs, self.cot))
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
        if self.kind in HARNESSES:
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
    l_mem = 1 if kind in HARNESSES else len(FULL["memory_layers"])
    specs = family_designs(kind) if kind in FAMILY_FULL else designs(l_mem, slot_map, args.variants)
    cases = [Case(lbl, mem, o, mix, kind, args, device) for lbl, mem, o, mix in specs]
    raw = round_robin(cases, args.reps, args.warmup)
    rows = {}
    for c in cases:
        fwd, bwd, opt = zip(*raw[c.label])
        rows[c.label] = {"forward": summary(fwd), "backward": summary(bwd), "optimizer": summary(opt),
                         "fwd_bwd": summary([f + b for f, b, _ in raw[c.label]]),
                         "step": summary([sum(t) for t in raw[c.label]]), "table_params": c.table_params}
    for ref in ("Base", "VE"):  # ratios of medians, same run
        for lbl, r in rows.items():
            for col in ("forward", "backward", "optimizer", "fwd_bwd", "step"):
                r.setdefault("ratio_to_" + ref, {})[col] = r[col]["median"] / rows[ref][col]["median"]
    return rows


def mscale_section(args, device) -> dict:
    """MoME token layer forward at K=2 for growing M; the router matmul timed alone on the same input."""
    slots = (6, 12, 24, 48)
    cases = [Case(f"M={m}", "mome", {"slots": m, "topk": 2}, None, "hook", args, device) for m in slots]
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


def cpu_tensor_peak_mb(fn) -> float:
    """Peak bytes of live CPU tensors while ``fn()`` runs, from torch.profiler's memory timeline (every tensor
    allocated before or during fn: parameters, optimizer state, gradients, activations). Deterministic, unlike
    RSS, which also counts allocator caching and page reuse."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the exporter is deprecated in favour of a CUDA-only API
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text(encoding="utf-8"))
    return max(sum(s) for s in sizes) / 2**20


def probe_memory(args, device, label: str, slot_map: str) -> dict:
    """Runs inside a fresh subprocess: one --probe-kind harness case; the peak of its second step (the first
    allocates the optimizer state, which stays live and is counted)."""
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    spec = {lbl: (mem, o, mix) for lbl, mem, o, mix in designs(1, slot_map, True)}[label]
    case = Case(label, *spec, args.probe_kind, args, device)
    case.step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        case.step()
        return {"peak_mb": torch.cuda.max_memory_allocated() / 2**20, "measure": "torch.cuda.max_memory_allocated"}
    peak_mb = cpu_tensor_peak_mb(case.step)
    rss_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kb) / 1024
    return {"peak_mb": peak_mb, "measure": "peak live CPU tensor bytes (torch.profiler memory timeline)",
            "rss_growth_mb": rss_mb}


def profile_design(args, device, label: str, slot_map: str, kind: str) -> str:
    """torch.profiler table (self time per op and input shape, per step) of one design's harness steps."""
    from torch.profiler import profile

    specs = {lbl: (mem, o, mix) for lbl, mem, o, mix in designs(1, slot_map, True)}
    if label not in specs:
        raise SystemExit(f"--profile {label!r} is not a design; allowed: {', '.join(specs)}")
    case = Case(label, *specs[label], kind, args, device)
    for _ in range(max(args.warmup, 1)):
        case.step()
    with profile(record_shapes=True) as prof:
        for _ in range(args.reps):
            case.step()
    table = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=45, max_shapes_column_width=60)
    head = f"{label} ({kind} harness), {args.reps} steps profiled; divide the times by {args.reps} for per-step cost"
    return head + "\n" + table


def memory_section(args, slot_map: str, kind: str) -> dict:
    out = {}
    for label, *_ in designs(1, slot_map, args.variants):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--probe-memory", label, "--probe-kind", kind,
               "--slot-map", slot_map, "--device", args.device, "--dtype", args.dtype, "--tokens", str(args.tokens),
               "--vocab-size", str(args.vocab_size)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        out[label] = json.loads(res.stdout.strip().splitlines()[-1])
    for label in out:
        for ref in ("Base", "VE"):
            ref_mb = out[ref]["peak_mb"]  # 0 when a tiny smoke run never grows the RSS past the import peak
            out[label]["ratio_to_" + ref] = out[label]["peak_mb"] / ref_mb if ref_mb > 0 else float("nan")
    return out


# -- output ----------------------------------------------------------------------------------------------
def fmt(s: dict) -> str:
    return f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"


def step_table(rows: dict, mem: dict | None) -> str:
    head = ("| design | table params | fwd ms | bwd ms | opt ms | step ms | step/Base | step/VE | fwd+bwd/VE "
            "| fwd/VE | bwd/VE | opt/VE |" + (" peak MiB | peak/VE |" if mem else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for lbl, r in rows.items():
        rv, rb = r["ratio_to_VE"], r["ratio_to_Base"]
        cells = [lbl, f"{r['table_params'] / 1e6:.1f}M", fmt(r["forward"]), fmt(r["backward"]), fmt(r["optimizer"]),
                 fmt(r["step"]), f"{rb['step']:.3f}", f"{rv['step']:.3f}", f"{rv['fwd_bwd']:.3f}",
                 f"{rv['forward']:.2f}",
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
    p.add_argument("--device", type=device_choice("cpu", "cuda"), default="cpu", metavar="{cpu,cuda}")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="bfloat16 = autocast")
    p.add_argument("--compile", action="store_true", help="torch.compile the model / harness (not the optimizer)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4096, help="B*T of the d12-shaped layer (as 2 sequences)")
    p.add_argument("--full-tokens", type=int, default=1024, help="B*T of the small full model (as 2 sequences)")
    p.add_argument("--sections", default="layer,hook,full,family,mscale,memory",
                   help="comma list of layer, hook, full, family, mscale, memory")
    p.add_argument("--vocab-size", type=int, default=32768, help="V (32768 = d12; smaller only for smoke tests)")
    p.add_argument("--no-variants", dest="variants", action="store_false",
                   help="skip the MoME rows with a forced mix (plain, bag, row)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch default)")
    p.add_argument("--out", default="", help="JSON path (default bench/results/step_<device>_<dtype>.json)")
    p.add_argument("--profile", default="", metavar="DESIGN",
                   help='print a torch.profiler op table of one design instead of timing, e.g. "MoME A2/6 token"; '
                        "uses the first of layer/hook in --sections, --reps steps after --warmup")
    p.add_argument("--probe-memory", default="", help=argparse.SUPPRESS)  # internal: one design, fresh process
    p.add_argument("--probe-kind", default="layer", choices=tuple(HARNESSES), help=argparse.SUPPRESS)
    p.add_argument("--slot-map", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [s for s in args.sections.split(",") if s and s not in SECTIONS]
    if unknown:
        p.error(f"--sections: unknown {unknown}; allowed: {', '.join(SECTIONS)}")
    if args.vocab_size % 2 or args.vocab_size < 64:
        p.error(f"--vocab-size must be even and >= 64 (the c_grp=2 slot map pairs tokens); got {args.vocab_size}")
    if args.reps < 1 or args.warmup < 0:
        p.error(f"--reps must be >= 1 and --warmup >= 0 (got {args.reps}, {args.warmup})")
    if args.compile and args.warmup < 1:  # each case's first compiled step compiles: it must not be a timed one
        p.error("--warmup must be >= 1 with --compile (the first step of each case compiles)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.probe_memory:
        print(json.dumps(probe_memory(args, device, args.probe_memory, args.slot_map)))
        return
    sections = [s for s in args.sections.split(",") if s]
    if args.profile:
        kind = next((k for k in sections if k in HARNESSES), "hook")
        with tempfile.TemporaryDirectory() as tmp:
            print(profile_design(args, device, args.profile, pairing_slot_map(tmp, args.vocab_size), kind))
        return
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "platform": platform.platform(), "args": vars(args)}
    titles = {"layer": f"one d12-shaped transformer layer with memory, {args.tokens} tokens",
              "hook": f"d12-shaped memory hook + c_v only, {args.tokens} tokens",
              "full": f"small full model ({model_shape(full_config('full', args))}), {args.full_tokens} tokens"}
    result["memory"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        slot_map = pairing_slot_map(tmp, args.vocab_size)
        for kind in ("layer", "hook", "full"):
            if kind not in sections:
                continue
            mem = None
            if "memory" in sections and kind in HARNESSES:
                mem = result["memory"][kind] = memory_section(args, slot_map, kind)
            result[kind] = step_section(kind, args, device, slot_map)
            print(f"\n### {titles[kind]} ({args.device}, {args.dtype}{', compiled' if args.compile else ''})\n")
            print(step_table(result[kind], mem))
    if "family" in sections:
        for fam in FAMILY_FULL:
            result[f"family_{fam}"] = step_section(fam, args, device, "")
            print(f"\n### small {fam} model ({model_shape(full_config(fam, args))}), {args.full_tokens} tokens "
                  f"({args.device}, {args.dtype}{', compiled' if args.compile else ''})\n")
            print(step_table(result[f"family_{fam}"], None))
    if "mscale" in sections:
        result["mscale"] = mscale_section(args, device)
        print(f"\n### MoME forward vs M at K=2 (token index, d12 memory hook, {args.tokens} tokens)\n")
        print(mscale_table(result["mscale"]))
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"step_{args.device}_{args.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
