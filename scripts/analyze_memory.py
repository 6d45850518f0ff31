"""Test-time memory use per memory layer and head (paper Sec. "Model Analysis", appendix "Test-time memory use
across CORE domains").

    python -m scripts.analyze_memory --run runs/X [--step S] --corpus val core:all file:notes.txt
        [--max-tokens N] [--max-per-task run|N] [--bundle run|DIR|subset] [--batch-size B] [--train-rows run|manifest] [--out-dir DIR]

For every domain and every (memory layer, head): the mean injection gate gamma (the paper's gamma~_l before the
head average) and the mean injected norm ||gamma m~||_2 (M_l), over all non-BOS token positions. VE and MoME
inject into the attention values (H = KV heads); Bigram's gate scales its residual-stream injection
(H = attention heads, and its norm includes the per-layer lambda). With more than one CORE task, a task-balanced
"CORE" entry (every task weighted equally, as in the paper) is added.

Writes <run>/analysis/memory_use.{json,csv} and memory_gamma.png / memory_inject_norm.png (one layers x heads
panel per domain, shared colour scale; gamma on the paper's [0, 2] scale). --corpus train reads the documents the
run's loader read first (its --data-seed, as its final train bpb), val the split's first documents; memory_use.json
"split_rows" says which, "data_dir" the prepared data val/train read (found as base_eval finds it: --data-dir, else
the checkpoint's data_dir, else its recorded dataset's directory, e.g. an import's --dataset), and "core" the CORE
bundle directory and per-task cap its core: domains read (null without one).
"""

import argparse
import csv
import sys
from pathlib import Path

import torch

from nanochat.analysis import (CORE_AVERAGE, GateAccumulator, add_train_rows_flag, build_domains, CoreSettings,
                               heatmaps, iter_captured, load_run, memory_block, OutputWriteError, SplitData,
                               split_rows, staged_outputs, train_rows_order, write_json)
from nanochat.cli_types import checkpoint_step, device_name, int_at_least, positive_int
from nanochat.eval_bundle import add_core_flags
from nanochat.terminal import replace_unencodable_output


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="run directory holding checkpoints/")
    ap.add_argument("--step", type=checkpoint_step, default=None, help="checkpoint step (default: the last one)")
    ap.add_argument("--corpus", nargs="+", action="extend", default=None,
                    help="val | train | core:<task> | core:all | file:PATH (several; repeatable; default val)")
    ap.add_argument("--max-tokens", type=int_at_least(0), default=65536,
                    help="token positions per domain (0 = all for core/file; val/train take 65536 then)")
    add_core_flags(ap)
    ap.add_argument("--batch-size", type=positive_int, default=8, help="rows per forward pass")
    ap.add_argument("--tokenizer-dir", default=None, help="override meta['tokenizer_dir']")
    ap.add_argument("--data-dir", default=None, help="prepared data of --corpus val/train (default: as base_eval: "
                    "meta's data_dir, else its recorded dataset's directory)")
    add_train_rows_flag(ap)
    ap.add_argument("--device", type=device_name, default="cpu")
    ap.add_argument("--out-dir", default=None, help="default: <run>/analysis")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    args.corpus = args.corpus or ["val"]  # a list default would be extended, not replaced
    return args


def memory_use(model, domains, batch_size: int, bos_id: int, progress: bool = True) -> dict:
    """{domain: {"gamma": L x H, "inject_norm": L x H, "tokens": n}} (+ task-balanced "CORE")."""
    block = memory_block(model)
    L = len(block.layers)
    out = {}
    for dom in domains:
        acc = None
        for ids, mask, cap in iter_captured(model, dom.rows, batch_size, bos_id, dom.name, progress):
            acc = acc or GateAccumulator(L, cap["gamma"].size(-1))
            acc.update(mask, cap)
        out[dom.name] = acc.result()
    add_core_average(out, [d.name for d in domains if d.kind == "core"])
    return out


def add_core_average(results: dict, core_names: list[str]) -> None:
    if len(core_names) > 1:
        results[CORE_AVERAGE] = {key: torch.tensor([results[n][key] for n in core_names]).mean(0).tolist()
                                 for key in ("gamma", "inject_norm")}
        results[CORE_AVERAGE]["tokens"] = sum(results[n]["tokens"] for n in core_names)
        results[CORE_AVERAGE]["tasks"] = core_names


def write_outputs(results: dict, layers, out_dir: Path, header: dict) -> None:
    write_json(out_dir / "memory_use.json", {**header, "layers": list(layers), "domains": results})
    with open(out_dir / "memory_use.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["domain", "layer", "head", "gamma", "inject_norm", "tokens"])
        for name, r in results.items():
            for li, layer in enumerate(layers):
                for h, (g, n) in enumerate(zip(r["gamma"][li], r["inject_norm"][li])):
                    w.writerow([name, layer, h, f"{g:.6f}", f"{n:.6f}", r["tokens"]])
    gam = {n: torch.tensor(r["gamma"]) for n, r in results.items()}
    nrm = {n: torch.tensor(r["inject_norm"]) for n, r in results.items()}
    heatmaps(gam, out_dir / "memory_gamma.png", layers, vmin=0.0, vmax=2.0, title="mean injection gate gamma")
    heatmaps(nrm, out_dir / "memory_inject_norm.png", layers, vmin=0.0, title="mean injected norm ||gamma m||_2")


def print_summary(results: dict, layers) -> None:
    print(f"{'domain':<28} " + " ".join(f"L{l:<2} gam/norm " for l in layers))
    for name, r in results.items():
        cells = [f"{sum(g) / len(g):.3f}/{sum(n) / len(n):.3f}" for g, n in zip(r["gamma"], r["inject_norm"])]
        print(f"{name:<28} " + " ".join(f"{c:<13}" for c in cells))


def injection_sites(block) -> str:
    """Where the block writes into the model: the hooks it overrides ("residual", "value", ...), comma-joined."""
    from nanochat.memory.base import MemoryBlock

    hooks = ("residual", "value", "ffn_up", "mlp_out")
    return ",".join(h for h in hooks if getattr(type(block), h) is not getattr(MemoryBlock, h))


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir) if args.out_dir else Path(args.run) / "analysis"
    try:
        return analyze(args, out_dir)
    except KeyboardInterrupt:  # the outputs are moved in as a whole set (staged_outputs): none is torn
        print(f"interrupted: no partial output under --out-dir {out_dir}", file=sys.stderr)
        return 130


def analyze(args, out_dir: Path) -> int:
    try:
        model, meta, tokenizer = load_run(args.run, args.step, args.device, args.tokenizer_dir)
        block = memory_block(model)
        core = CoreSettings(args, meta)
        data = SplitData(args.data_dir, meta)
        domains = build_domains(args.corpus, tokenizer, model.max_seq_len, data_dir=data,
                                core=core, max_tokens=args.max_tokens or None,
                                train_rows=train_rows_order(args.train_rows, meta))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = memory_use(model, domains, args.batch_size, tokenizer.bos_token_id, not args.no_progress)
    header = {"run": str(args.run), "step": meta["step"], "memory": model.config.memory,
              "injection": injection_sites(block), "split_rows": split_rows(domains), "data_dir": data.record(),
              "core": core.record()}
    try:
        with staged_outputs(out_dir) as stage:
            write_outputs(results, block.layers, stage, header)
    except OutputWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(results, block.layers)
    for name, order in header["split_rows"].items():
        print(f"{name} rows: {order}")
    print(f"wrote {out_dir}/memory_use.json, memory_use.csv, memory_gamma.png, memory_inject_norm.png")
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
