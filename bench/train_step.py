"""Throughput of the real training step for the paper's d12 designs (Table 1) and, with ``--designs all``, the
largest compound-scaling row and the appendix designs (Engram, JTok, JTok-M, MoVE-Input, MoE-FFN, MoE + MoME) at
the same size: tokens/s, MFU, peak memory.

    python bench/train_step.py                                   # CUDA: d12, seq 2048, bf16, compiled
    python bench/train_step.py --designs ve,mome --mix plain     # MoME's top-K mix as gather + weighted sum
    python bench/train_step.py --designs ve,mome,mome-bigram --mix auto,row   # each MoME design once per mix
    python bench/train_step.py --rounds 2        # every process twice (order reversed): the median of the rounds
    python bench/train_step.py --designs ve,mome --mome-kernels row  # MoME's injection apart from the row-mix kernels
    python bench/train_step.py --designs mome --mome-kernels torch --row-sum reduce   # the older torch row sum
    python bench/train_step.py --designs ve,mome-bigram --shared-table-kernel   # the kernels on the shared table too
    python bench/train_step.py --designs ve,mome-bigram --mix row --shared-table-kernel both --rounds 2  # off and on
    python bench/train_step.py --designs all                     # + the appendix designs
    python bench/train_step.py --designs ve,mome --profile-dir prof  # + every kernel of 3 steps per design, then
    python bench/profile_diff.py prof/ve_auto_auto.json prof/mome_auto_auto.json   # where MoME's extra time goes
    python bench/train_step.py --device cpu --depth 2 --seq-len 64 --device-batch-size 2 --steps 2 --warmup 1

Each design runs in a FRESH process (its own compile, its own peak-memory counter) and calls the trainer's
``nanochat.train_loop.train_step`` (micro-steps with gradient accumulation, the armed gradient hooks, MuonAdamW,
the one host sync per step) on fixed random token batches already on the device, so data loading is left out.
Reported per design: median step time over --steps after --warmup steps, tokens/s, MFU (peak bf16 FLOP/s of
the GPU, when known), peak allocated memory of the timed steps (GiB), and ratios of step time to VE and Base. The
paper's Table 1 throughput (4 GPUs) is printed beside ours divided by 4 as a per-GPU figure.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# key -> (label, --memory, options, paper row config under configs/d12 or None, backbone config fields)
DESIGNS = {
    "base": ("Base", "base", {}, "base", {}),
    "ve": ("VE", "ve", {}, "ve", {}),
    "bigram": ("Bigram 6V", "bigram", {"factor": 6}, "bigram", {}),
    "mome": ("MoME A2/6 token", "mome", {"slots": 6, "topk": 2}, "mome_c1_m6", {}),
    "mome-bigram": ("MoME A2/6 bigram-idx n6", "mome", {"slots": 6, "topk": 2, "index": "bigram",
                                                       "bigram_factor": 6}, None, {}),
    # the largest compound-scaling row (configs/d12_compound/mome_n24_m6): a 604M-entry table shared by 6 layers
    "mome-bigram-n24": ("MoME A2/6 bigram-idx n24", "mome", {"slots": 6, "topk": 2, "index": "bigram",
                                                             "bigram_factor": 24}, None, {}),
    # the appendix designs (configs/d24_token_memory, d24_sparse_moe) at the benchmark's depth; Engram's
    # compression map does not change the work per token, so the identity map stands in for a tokenizer's
    "engram": ("Engram (2 modules)", "engram", {"compression": "identity"}, None, {}),
    "jtok": ("JTok", "jtok", {}, None, {}),
    "jtokm": ("JTok-M n_e 4 K 2", "jtokm", {}, None, {}),
    "move_input": ("MoVE-Input E12 r64", "move_input", {}, None, {}),
    "moe": ("MoE-FFN E6/K2 +1 shared", "base", {}, None, {"mlp": "moe"}),
    "moe-mome": ("MoE-FFN + MoME A2/6", "mome", {"slots": 6, "topk": 2}, None, {"mlp": "moe"}),
}
TABLE1 = ("base", "ve", "bigram", "mome", "mome-bigram")  # the default set
MIXES = ("auto", "bag", "plain", "row")  # --mix: nanochat.memory.mome_mix.MIX (auto = None)
SHARED_TABLE_KERNEL = ("off", "on", "both")  # --shared-table-kernel: nanochat.memory.mome_mix.SHARED_TABLE_KERNEL
PAPER_GPUS = 4  # Table 1 throughput is for 4 GPUs


def paper_tok_per_sec(row: str | None) -> float | None:
    if row is None:
        return None
    from nanochat.row_config import load_row_config

    paper = load_row_config(REPO / "configs" / "d12" / f"{row}.toml").get("paper", {})
    return paper["tok_per_sec_m"] * 1e6 / PAPER_GPUS if "tok_per_sec_m" in paper else None


def measure_one(args) -> dict:
    """Inside the per-design process: build, warm up (compile), time --steps steps of train_step."""
    import torch

    from nanochat.common import autocast_context, compute_init
    from nanochat.gpt import GPTConfig, build_model, model_summary
    from nanochat.memory import mome_mix as mix_paths
    from nanochat.memory.mome_triton import resolve_kernels
    from nanochat.metrics import peak_flops
    from nanochat.optim import build_optimizer
    from nanochat.train_setup import model_kernel_path
    from nanochat.train_loop import train_step

    _, device = compute_init(args.device)
    kernels, kernels_reason = resolve_kernels(args.mome_kernels, device)  # as base_train's --mome-kernels
    mix_paths.set_kernels(kernels)
    mix_paths.set_shared_table_kernel(args.shared_table_kernel == "on")
    if args.row_sum != "unrolled":  # bench only: the torch row mix's older sum (parse_args: with kernels torch)
        mix_paths.set_path("ROW_SUM", args.row_sum)
    mix_paths.set_path("MIX", None if args.mix == "auto" else args.mix)
    mix_paths.set_path("TOPK_BY_ARGMAX", {"auto": None, "argmax": True, "topk": False}[args.topk])
    label, memory, options, _, backbone = DESIGNS[args.one]
    cfg = GPTConfig.from_depth(args.depth, sequence_len=args.seq_len, vocab_size=args.vocab_size, memory=memory,
                               memory_options=options, **backbone)
    model = build_model(cfg, device=device, seed=0)
    opt = build_optimizer(model)
    step_model = torch.compile(model, dynamic=False) if args.compile else model
    autocast = autocast_context(device.type, args.dtype)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab_size, (args.device_batch_size, args.seq_len + 1), generator=g).to(device)
               for _ in range(4)]

    class Batches:  # a fixed rotation of device batches: the model and optimizer are measured, not the loader
        i = 0

        def __next__(self):
            self.i += 1
            b = batches[self.i % len(batches)]
            return b[:, :-1], b[:, 1:]

    loader = Batches()
    t_compile = time.perf_counter()
    for _ in range(args.warmup):
        train_step(step_model, opt, loader, args.grad_accum, autocast, device)
    warmup_s = time.perf_counter() - t_compile
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_step(step_model, opt, loader, args.grad_accum, autocast, device)  # ends with a host sync
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    tokens = args.device_batch_size * args.seq_len * args.grad_accum
    summary = model_summary(cfg)
    peak = peak_flops(device)
    result = {"label": label, "step_ms": 1e3 * dt, "step_ms_min": 1e3 * min(times), "step_ms_max": 1e3 * max(times),
              "tok_per_sec": tokens / dt, "tokens_per_step": tokens, "flops_per_token": summary["flops_per_token"],
              "mfu": 100 * summary["flops_per_token"] * tokens / dt / peak if peak else None,
              "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
              "params_total": summary["params_total"], "params_memory": summary["params_memory"],
              "warmup_s": warmup_s, "mix": args.mix, "topk": args.topk, "row_sum": args.row_sum,
              "mome_kernels": kernels, "mome_kernels_requested": args.mome_kernels, "mome_kernels_reason": kernels_reason,
              "shared_table_kernel": args.shared_table_kernel == "on", "kernel_path": model_kernel_path(model),
              "compile": args.compile,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "torch": torch.__version__}
    if args.profile_dir:
        try:
            write_profile(args, device, lambda: train_step(step_model, opt, loader, args.grad_accum, autocast, device),
                          result)
        except Exception as e:  # the profile is an extra: a failure there must not cost the timed row
            result["profile_error"] = f"{type(e).__name__}: {e}"
            print(f"profile of {args.one} failed: {result['profile_error']}", file=sys.stderr)
    return result


def write_profile(args, device, step, result: dict) -> None:
    """--profile-steps more steps under torch.profiler, after the timed ones: the top-40 op table as text and every
    kernel as JSON (bench/kernel_table.py; bench/profile_diff.py compares two designs' JSON). Several steps, as the
    timed steps' median, keep one slow step from deciding a kernel's share; their totals are divided by the steps
    in profile_diff, not here."""
    from torch.profiler import ProfilerActivity, profile

    from bench.kernel_table import write_profile_json

    on_device = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            step()  # ends with a host sync: the wall time covers the steps' kernels
        wall_ms = 1e3 * (time.perf_counter() - t0) / args.profile_steps
    stk = "_stk" if args.shared_table_kernel == "on" else ""  # --shared-table-kernel both: one file per switch
    stem = Path(args.profile_dir) / f"{args.one}_{args.mix}_{args.topk}{stk}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    sort = "self_cuda_time_total" if on_device else "self_cpu_time_total"
    stem.with_name(stem.name + ".txt").write_text(
        f"{args.profile_steps} steps profiled: the times are their sums\n"
        + prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70), encoding="utf-8")
    meta = {"design": args.one, "device": device.type, "profiled_step_ms": wall_ms,
            **{k: result[k] for k in ("label", "mix", "topk", "mome_kernels", "row_sum", "shared_table_kernel",
                                      "kernel_path", "compile", "step_ms", "tokens_per_step", "device_name", "torch")}}
    meta["label"] += " +stk" if stk else ""  # profile_diff's column heads: the off and on runs share a label
    write_profile_json(stem.with_name(stem.name + ".json"), prof.events(), on_device, args.profile_steps, meta)


def merge_rounds(results: list[dict]) -> dict:
    """One design's per-round results -> step time = the median of the rounds' medians (tok/s and MFU follow from
    it; min/max and peak memory over all rounds), each round's step time kept; failed rounds are listed under
    ``failed_rounds`` (the row is an error only when every round failed)."""
    failed = [r["error"] for r in results if "error" in r]
    results = [r for r in results if "error" not in r]
    if not results:
        return {"error": failed[0]}
    step_ms = statistics.median(r["step_ms"] for r in results)
    first = results[0]
    return {**first, "step_ms": step_ms, "tok_per_sec": first["tokens_per_step"] / step_ms * 1e3,
            "mfu": first["mfu"] * first["step_ms"] / step_ms if first["mfu"] is not None else None,
            "step_ms_min": min(r["step_ms_min"] for r in results), "step_ms_max": max(r["step_ms_max"] for r in results),
            "peak_mem_gb": max((r["peak_mem_gb"] for r in results if r["peak_mem_gb"] is not None), default=None),
            "round_step_ms": [r["step_ms"] for r in results], **({"failed_rounds": failed} if failed else {})}


def design_of(row_key: str) -> str:
    return row_key.split("@")[0].split("+")[0]  # "mome@row" -> "mome"; "mome-bigram+stk" -> "mome-bigram"


def table(rows: dict) -> str:
    ve, base = rows.get("ve"), rows.get("base")
    lines = ["| design | step ms [min-max] | tok/s | MFU % | step/VE | step/Base | peak GiB | paper tok/s per GPU |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for key, r in rows.items():
        design = DESIGNS[design_of(key)]
        if "error" in r:
            lines.append(f"| {design[0]} | failed: {r['error'][-120:]} | | | | | | |")
            continue
        paper = paper_tok_per_sec(design[3])
        variant = [f"{r['mix']} mix" if r["mix"] != "auto" else "", f"{r['topk']} selection" if r["topk"] != "auto" else "",
                   f"{r['mome_kernels']} kernels" if r.get("mome_kernels_requested", "auto") != "auto" else "",
                   f"{r['row_sum']} row sum" if r.get("row_sum", "unrolled") != "unrolled" else "",
                   f"shared-table {r.get('kernel_path')} kernels" if r.get("shared_table_kernel") else ""]
        variant = ", ".join(v for v in variant if v) if design[1] == "mome" else ""
        cells = [r["label"] + (f" ({variant})" if variant else ""),
                 f"{r['step_ms']:.1f} [{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}]", f"{r['tok_per_sec']:,.0f}",
                 f"{r['mfu']:.1f}" if r["mfu"] is not None else "n/a",
                 f"{r['step_ms'] / ve['step_ms']:.3f}" if ve and "error" not in ve else "",
                 f"{r['step_ms'] / base['step_ms']:.3f}" if base and "error" not in base else "",
                 f"{r['peak_mem_gb']:.1f}" if r["peak_mem_gb"] is not None else "n/a",
                 f"{paper:,.0f}" if paper else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    from nanochat.cli_types import device_choice
    from nanochat.memory.mome_mix import MOME_KERNELS  # base_train's --mome-kernels choices

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--designs", default=",".join(TABLE1),
                   help=f"comma list of {', '.join(DESIGNS)}, or 'all' (default: the Table 1 designs)")
    # checked here, in the parent: a missing GPU failed in every design process, then exited 0 with a table of errors
    p.add_argument("--device", type=device_choice("cuda", "cpu"), default="cuda", metavar="{cuda,cpu}")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on for CUDA)")
    p.add_argument("--mix", default="auto",
                   help="MoME mix, or a comma list to run every MoME design once per mix: bag (one embedding_bag), "
                        "plain (gather + weighted sum), row (all M slots of the row, zero weight off the top-K); "
                        "auto = the model's default (row for the bigram-indexed table, and for per-layer tables "
                        "where the Triton kernel applies; else plain on CUDA, bag on CPU)")
    p.add_argument("--topk", default="auto", choices=("auto", "argmax", "topk"),
                   help="MoME top-K selection: masked argmax passes or torch.topk; auto = the model's default "
                        "(argmax on CUDA)")
    p.add_argument("--mome-kernels", default="auto", choices=MOME_KERNELS,
                   help="MoME's Triton kernels, as base_train's flag (resolved for --device, installed with "
                        "nanochat.memory.mome_mix.set_kernels): fused = the row mix and the value injection "
                        "v + gamma * mem as one kernel pair, for per-layer tables on CUDA; row = the row-mix kernels, "
                        "then the injection in torch; torch = no kernels (the unrolled row sum); auto = fused where "
                        "the kernels run, else torch")
    p.add_argument("--row-sum", default=None, choices=("unrolled", "reduce"),
                   help="bench only, with --mome-kernels torch: the torch row mix's sum over M: unrolled "
                        "multiply-adds (the model's, the default) or reduce, a broadcast multiply + reduction "
                        "(before 2026-11-26)")
    p.add_argument("--shared-table-kernel", nargs="?", const="on", default="off", choices=SHARED_TABLE_KERNEL,
                   help="MoME's shared bigram-indexed table through the --mome-kernels kernel pair too, on its rows "
                        "gathered once (nanochat.memory.mome_mix.SHARED_TABLE_KERNEL, off by default): on (the flag "
                        "alone), off, or both: each shared-table design once off and once on (row key <design>+stk), "
                        "in the same rounds; recorded with the kernel path that ran")
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--device-batch-size", type=int, default=32)
    p.add_argument("--grad-accum", type=int, default=2, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the list of design processes this many times, alternating its order, and report the "
                        "median of each design's per-round medians (separates design from run-to-run drift)")
    p.add_argument("--profile-dir", default="",
                   help="after the timed steps, profile --profile-steps more steps per design (in the first round "
                        "only) and write DIR/<design>_<mix>_<topk>[_stk].txt (the top-40 op table; _stk with the "
                        "shared-table kernel on) and .json (every "
                        "kernel: name, category, calls, device us; compare two with bench/profile_diff.py)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled with --profile-dir")
    p.add_argument("--out", default="", help="JSON path (default bench/results/train_step_<device>.json)")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: one design in this process
    args = p.parse_args(argv)
    if args.designs == "all":
        args.designs = ",".join(DESIGNS)
    unknown = [d for d in args.designs.split(",") if d not in DESIGNS]
    if unknown:
        p.error(f"--designs: unknown {unknown}; allowed: {', '.join(DESIGNS)}")
    bad = [m for m in args.mix.split(",") if m not in MIXES]
    if bad or not args.mix:
        p.error(f"--mix: unknown {bad}; allowed: {', '.join(MIXES)} (or a comma list of them)")
    if args.one and "," in args.mix:
        p.error("--mix: one value per design process")
    # given at all (unrolled too: before --mome-kernels it meant "no kernels"), it needs the torch row mix
    if args.row_sum is not None and args.mome_kernels != "torch":
        p.error(f"--row-sum {args.row_sum} is a sum of the torch row mix: pass --mome-kernels torch with it (the "
                f"kernels of --mome-kernels {args.mome_kernels} do their own)")
    args.row_sum = args.row_sum or "unrolled"
    if args.one and args.shared_table_kernel == "both":
        p.error("--shared-table-kernel: on or off per design process")
    if args.shared_table_kernel != "off" and args.mome_kernels == "torch":
        p.error("--shared-table-kernel puts the shared table through the MoME Triton kernels: it needs --mome-kernels "
                "auto, fused or row (torch keeps the kernels off for every table)")
    if args.profile_steps < 1:
        p.error(f"--profile-steps must be >= 1 (got {args.profile_steps})")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1 (got {args.rounds})")
    if args.compile is None:
        args.compile = args.device == "cuda"
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0 (got {args.steps}, {args.warmup})")
    if args.compile and args.warmup < 1:  # the first compiled step compiles: it must not be a timed one
        p.error("--warmup must be >= 1 with --compile (the first step compiles; --no-compile to time eager steps "
                "without a warm-up)")
    return args


def plan_runs(args) -> list[tuple[str, str, str, str]]:
    """(design, mix, shared-table kernel on/off, row key) per design process of a round: a MoME design once per
    --mix, keyed design@mix when there are several; --shared-table-kernel for the shared-table designs only (the
    others run off: the switch does nothing there), with "both" once off and once on, the latter keyed +stk."""
    mixes, stk = args.mix.split(","), args.shared_table_kernel
    runs = []
    for key in args.designs.split(","):
        _, memory, options, _, _ = DESIGNS[key]
        if memory != "mome":
            runs.append((key, "auto", "off", key))
            continue
        switches = ("off",) if options.get("index") != "bigram" else ("off", "on") if stk == "both" else (stk,)
        for mix in mixes:
            row_key = key if len(mixes) == 1 else f"{key}@{mix}"
            runs += [(key, mix, on, row_key + ("+stk" if stk == "both" and on == "on" else "")) for on in switches]
    return runs


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args)))
        return
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
    runs = plan_runs(args)
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"train_step_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rounds: dict, complete: bool) -> dict:
        """Written after every process too: a run killed at a time limit keeps the rows measured so far."""
        rows = {key: merge_rounds(results) for key, results in rounds.items()}
        out.write_text(json.dumps({"command": " ".join(["bench/train_step.py", *forwarded]), "args": vars(args),
                                   "complete": complete, "rows": rows}, indent=1), encoding="utf-8")
        return rows

    # the repo first, the caller's paths kept: dev/gpu/run_all.sh's carried wheels must reach the design processes
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    rounds: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for key, mix, stk, row_key in (runs if r % 2 == 0 else runs[::-1]):
            cmd = [sys.executable, str(Path(__file__).resolve()), *forwarded, "--one", key, "--mix", mix,
                   "--shared-table-kernel", stk,
                   "--compile" if args.compile else "--no-compile", *(["--profile-dir", ""] if r else [])]
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": pythonpath})
            if res.returncode != 0:
                rounds.setdefault(row_key, []).append({"error": res.stderr.strip()})
                print(f"{row_key}: failed\n{res.stderr[-2000:]}", file=sys.stderr)
            else:
                one = json.loads(res.stdout.strip().splitlines()[-1])
                rounds.setdefault(row_key, []).append(one)
                print(f"{row_key} (round {r + 1}): {one['step_ms']:.1f} ms/step, {one['tok_per_sec']:,.0f} tok/s"
                      + (f"; profile failed: {one['profile_error']}" if "profile_error" in one else ""), flush=True)
            save(rounds, complete=False)
    rows = save(rounds, complete=True)
    head = next((r for r in rows.values() if "error" not in r), {})
    print(f"\n### d{args.depth} training step, {args.device_batch_size} x {args.seq_len} tokens x {args.grad_accum} "
          f"micro-steps, {args.device} ({head.get('device_name', '?')}, torch {head.get('torch', '?')}), "
          f"{'compiled' if args.compile else 'eager'}, MoME mix: {args.mix}, selection: {args.topk}\n")
    print(table(rows))
    print(f"\nwrote {out}")
    if args.profile_dir:
        print(f"profiles: {args.profile_dir}/<design>_<mix>_<topk>[_stk].txt|.json (_stk: --shared-table-kernel on); "
              "compare two with bench/profile_diff.py")


if __name__ == "__main__":
    main()
