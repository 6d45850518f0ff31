"""MoME router analyses: the slot-utilisation audit (paper appendix "Router slot utilization across domains")
and semantic routes of polysemous words (appendix "Supplementary Semantic-Routing Examples").

    python -m scripts.analyze_routing --run runs/X --corpus val file:shakespeare.txt core:all [--reference val]
        [--max-tokens N] [--max-per-task run|N] [--bundle run|DIR|subset] [--min-count 32]
        [--train-rows run|manifest] [--out-dir DIR]
    python -m scripts.analyze_routing --run runs/X --words bank,python [--prompts FILE] [--sites 3:0,5:2]

Audit, per domain (BOS and padding excluded, statistics per layer-head site then macro-averaged over sites):
marginal effective slots exp(H) of the top-K membership distribution and of the routing-weight mass, the
largest-slot membership share, per-token effective slots (token ids seen >= --min-count times), site-slot cells
never selected, and mean/max base-2 JSD of each site's routing-weight distribution against the --reference
domain. Writes <out>/routing_audit.{md,csv,json}. A train domain reads the documents the run's loader read first (its
--data-seed, as its final train bpb), val the split's first documents; routing_audit.json "split_rows" says which,
"data_dir" the prepared data val/train read (found as base_eval finds it: --data-dir, else the checkpoint's
data_dir, else its recorded dataset's directory, e.g. an import's --dataset), and "core" the CORE bundle directory
and per-task cap its core: domains read (null without one).

Words: for every prompt that contains a target word as ONE token (with its leading space), the slot set each head
selects at the word's last occurrence (slots ordered by routing weight). --prompts FILE holds one prompt per
line, optionally "label<TAB>prompt" (e.g. the sense); without it a built-in set (two same-sense prompts and one
different-sense prompt per word) is used. Writes <out>/semantic_routes.{md,csv,json,png}.
"""

import argparse
import csv
import re
import sys
from pathlib import Path

import torch

from nanochat.analysis import (Domain, OutputWriteError, RoutingAccumulator, add_train_rows_flag,
                               build_domains, CoreSettings, file_path_name, iter_captured, load_run, memory_block,
                               pad_rows, SplitData, run_captured, single_token_at, split_rows, staged_outputs,
                               train_rows_order, write_json)
from nanochat.cli_types import checkpoint_step, device_name, int_at_least, positive_int
from nanochat.eval_bundle import add_core_flags
from nanochat.terminal import replace_unencodable_output

BUILTIN_PROMPTS = {
    "bank": [("finance", "She deposited her salary at the bank"), ("finance", "He took out a loan from the bank"),
             ("river", "They had a picnic on the grassy river bank")],
    "python": [("code", "The script was written in python"), ("code", "She fixed the import error in python"),
               ("animal", "At the zoo we watched a huge python")],
    "apple": [("fruit", "For lunch she ate a crisp red apple"), ("fruit", "He baked a pie with one sweet apple"),
              ("company", "The new phone was announced by apple")],
    "cell": [("biology", "The nucleus is the control centre of the cell"),
             ("biology", "Mitochondria produce energy inside the cell"),
             ("prison", "The prisoner was locked in his cell")],
    "bug": [("software", "The crash was caused by a subtle bug"), ("software", "The developer finally fixed the bug"),
            ("insect", "A tiny green insect, a garden bug")],
    "drive": [("vehicle", "On Sunday we went for a long drive"), ("vehicle", "The coast road makes a scenic drive"),
              ("storage", "He saved the files on the hard drive")],
}
AUDIT_COLUMNS = [("marginal_effective_slots", "Marginal effective slots"), ("weight_effective_slots",
                 "Weight-effective slots"), ("largest_slot_mass", "Largest-slot mass (weight)"),
                 ("largest_slot_positions", "Largest-slot share of positions"),
                 ("per_token_effective_slots", "Per-token effective slots")]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="run directory holding checkpoints/ (a MoME run)")
    ap.add_argument("--step", type=checkpoint_step, default=None, help="checkpoint step (default: the last one)")
    ap.add_argument("--corpus", nargs="*", action="extend", default=[],
                    help="val | train | core:<task> | core:all | file:PATH (several; repeatable)")
    ap.add_argument("--reference", default="val", help="corpus spec of the JSD reference domain ('' = no JSD)")
    ap.add_argument("--max-tokens", type=int_at_least(0), default=65536,
                    help="token positions per domain (0 = all for core/file; val/train take 65536 then)")
    add_core_flags(ap)
    ap.add_argument("--min-count", type=positive_int, default=32, help="per-token effective slots: min occurrences")
    ap.add_argument("--words", default="", help="comma-separated target words for semantic routes")
    ap.add_argument("--prompts", default=None, help="prompt file for --words (one per line, optional label<TAB>)")
    ap.add_argument("--sites", default="", help="figure columns for --words as layer:head list (default: all)")
    ap.add_argument("--batch-size", type=positive_int, default=8)
    ap.add_argument("--tokenizer-dir", default=None)
    ap.add_argument("--data-dir", default=None, help="prepared data of val/train domains (default: as base_eval: "
                    "meta's data_dir, else its recorded dataset's directory)")
    add_train_rows_flag(ap)
    ap.add_argument("--device", type=device_name, default="cpu")
    ap.add_argument("--out-dir", default=None, help="default: <run>/analysis")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if not args.corpus and not args.words:
        ap.error("nothing to do: give --corpus (slot audit) and/or --words (semantic routes)")
    return args


# -- slot-utilisation audit ---------------------------------------------------------------------------------
def accumulate(model, domain: Domain, batch_size: int, bos_id: int, progress: bool) -> RoutingAccumulator:
    block = memory_block(model, need_routing=True)
    S = len(block.layers) * block.H
    acc = RoutingAccumulator(S, block.M, model.config.vocab_size)
    for ids, mask, cap in iter_captured(model, domain.rows, batch_size, bos_id, domain.name, progress):
        acc.update(ids, mask, cap)
    return acc


def name_reference(reference: Domain, domains: list[Domain]) -> Domain:
    """The JSD column's "vs <name>" must say which data the reference is. A --corpus domain of its name is the same
    data where it has the same spec, the same CORE task or split; one of them being another file of the same stem
    (shakespeare/val.txt beside the val split), that file is named by its path."""
    for d in domains:
        if d.name == reference.name and d.spec != reference.spec and "file" in (d.kind, reference.kind):
            other = reference if reference.kind == "file" else d
            other.name = file_path_name(other)
    return reference


def slot_audit(model, domains: list[Domain], reference: Domain | None, batch_size: int, bos_id: int,
               min_count: int = 32, progress: bool = True) -> dict[str, dict]:
    ref_weight = None
    if reference is not None:
        ref_weight = accumulate(model, reference, batch_size, bos_id, progress).distributions()[1]
    return {d.name: accumulate(model, d, batch_size, bos_id, progress).audit(min_count, ref_weight) for d in domains}


def audit_markdown(rows: dict[str, dict], reference: str | None) -> str:
    head = [name for _, name in AUDIT_COLUMNS] + ["Inactive site-slot cells"]
    head += [f"Mean/max JSD vs {reference}"] if reference else []
    lines = ["| Domain | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for name, r in rows.items():
        cells = [f"{r['marginal_effective_slots']:.3f}", f"{r['weight_effective_slots']:.3f}",
                 f"{100 * r['largest_slot_mass']:.2f}%", f"{100 * r['largest_slot_positions']:.2f}%",
                 f"{r['per_token_effective_slots']:.3f}",
                 f"{r['inactive_cells']} / {r['total_cells']:,}"]
        if reference:
            cells.append(f"{r['jsd_mean']:.4f} / {r['jsd_max']:.4f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_audit(rows: dict, reference: str | None, out_dir: Path, header: dict) -> None:
    write_json(out_dir / "routing_audit.json", {**header, "reference": reference, "domains": rows})
    (out_dir / "routing_audit.md").write_text(audit_markdown(rows, reference), encoding="utf-8")
    keys = list(next(iter(rows.values())).keys())
    with open(out_dir / "routing_audit.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["domain", *keys])
        for name, r in rows.items():
            w.writerow([name, *(r[k] for k in keys)])


# -- semantic routes ----------------------------------------------------------------------------------------
def read_prompts(path) -> list[tuple[str, str]]:
    """(label, prompt) per non-empty line; the label is '' without a TAB."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: file does not exist")
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            label, sep, prompt = line.partition("\t")
            out.append((label.strip(), prompt.strip()) if sep else ("", line.strip()))
    return out


def find_targets(tokenizer, words: list[str], prompts: dict[str, list[tuple[str, str]]]):
    """-> (hits [(word, label, prompt, ids, position)], skipped [(word, prompt, reason)]). The last whole-word,
    case-insensitive occurrence is used: it has the most preceding context for the causal router."""
    hits, skipped = [], []
    for word in words:
        for label, prompt in prompts.get(word, []):
            found = list(re.finditer(rf"(?<![\w]){re.escape(word)}(?![\w])", prompt, flags=re.IGNORECASE))
            if not found:
                continue
            m = found[-1]
            ids, i = single_token_at(tokenizer, prompt, m.start(), m.end())
            if i is None:
                skipped.append((word, prompt, "target is not a single token"))
                continue
            hits.append((word, label, prompt, ids, i + 1))  # +1: BOS is prepended
    return hits, skipped


def semantic_routes(model, tokenizer, hits) -> list[dict]:
    """Slots (sorted by weight) and weights of every (memory layer, head) at each hit's target position."""
    if not hits:
        return []
    block = memory_block(model, need_routing=True)
    rows = [torch.tensor([tokenizer.bos_token_id] + ids) for _, _, _, ids, _ in hits]
    ids, _ = pad_rows(rows, tokenizer.bos_token_id)
    cap = run_captured(model, ids)
    pos = torch.tensor([p for *_, p in hits])
    at = torch.arange(len(hits))
    slots, weights = cap["slots"][at, pos].long(), cap["weights"][at, pos].float()  # (P, L, H, K)
    # weight descending, ties by slot index ascending (two stable sorts): fixed-random routing's equal 1/K weights
    # must give the same "top-weight slot" on every device and run
    by_slot = slots.sort(dim=-1, stable=True).indices
    slots, weights = slots.gather(-1, by_slot), weights.gather(-1, by_slot)
    order = weights.sort(dim=-1, descending=True, stable=True).indices
    slots, weights = slots.gather(-1, order), weights.gather(-1, order)
    out = []
    for j, (word, label, prompt, _, p) in enumerate(hits):
        out.append({"word": word, "label": label, "prompt": prompt, "position": p, "layers": list(block.layers),
                    "slots": slots[j].tolist(), "weights": weights[j].tolist()})
    return out


def routes_markdown(routes: list[dict]) -> str:
    lines = []
    for word in dict.fromkeys(r["word"] for r in routes):
        sel = [r for r in routes if r["word"] == word]
        H = len(sel[0]["slots"][0])
        lines += [f"### {word}", "", "| prompt | sense | layer | " + " | ".join(f"h{h}" for h in range(H)) + " |",
                  "|---|---|---:|" + "---|" * H]
        for r in sel:
            for layer, per_head in zip(r["layers"], r["slots"]):
                sets = ["{" + ",".join(map(str, s)) + "}" for s in per_head]
                lines.append(f"| {r['prompt']} | {r['label']} | {layer} | " + " | ".join(sets) + " |")
        lines.append("")
    return "\n".join(lines)


def parse_sites(text: str, layers, n_heads: int) -> list[tuple[int, int]] | None:
    """--sites "layer:head,..." -> (memory-layer position, KV head) pairs; None = every site."""
    if not text:
        return None
    out = []
    for item in text.split(","):
        try:
            layer, head = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"--sites {text!r}: expected layer:head pairs such as 3:0,5:2") from None
        if layer not in layers:
            raise ValueError(f"--sites: layer {layer} is not a memory layer ({list(layers)})")
        if not 0 <= head < n_heads:
            raise ValueError(f"--sites: head {head} is not a KV head (0..{n_heads - 1})")
        out.append((list(layers).index(layer), head))
    return out


def routes_figure(routes: list[dict], path: Path, sites=None) -> None:
    """Per word, a prompts x sites grid coloured by the top-weight slot and annotated with the selected set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    words = list(dict.fromkeys(r["word"] for r in routes))
    L, H = len(routes[0]["slots"]), len(routes[0]["slots"][0])
    sites = sites or [(li, h) for li in range(L) for h in range(H)]
    M = 1 + max(s for r in routes for lay in r["slots"] for hd in lay for s in hd)
    fig, axes = plt.subplots(len(words), 1, figsize=(max(4, 0.6 * len(sites) + 3), 1.0 + 0.8 * len(routes)),
                             squeeze=False, layout="constrained")
    short = lambda t: t if len(t) <= 48 else "..." + t[-45:]  # noqa: E731
    for ax, word in zip(axes[:, 0], words):
        sel = [r for r in routes if r["word"] == word]
        grid = torch.tensor([[r["slots"][li][h][0] for li, h in sites] for r in sel], dtype=torch.float)
        ax.imshow(grid.numpy(), cmap="tab20", vmin=0, vmax=max(M - 1, 1), aspect="auto")
        for i, r in enumerate(sel):
            for j, (li, h) in enumerate(sites):
                ax.text(j, i, ",".join(map(str, r["slots"][li][h])), ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(sel)), [f"[{r['label']}] {short(r['prompt'])}" for r in sel], fontsize=7)
        ax.set_xticks(range(len(sites)), [f"L{sel[0]['layers'][li]}h{h}" for li, h in sites], fontsize=6, rotation=90)
        ax.set_title(f"'{word}': selected slots per head (colour = top-weight slot)", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_routes(routes, skipped, out_dir: Path, header: dict, sites) -> None:
    write_json(out_dir / "semantic_routes.json", {**header, "routes": routes,
                                                  "skipped": [dict(word=w, prompt=p, reason=r) for w, p, r in skipped]})
    (out_dir / "semantic_routes.md").write_text(routes_markdown(routes), encoding="utf-8")
    with open(out_dir / "semantic_routes.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["word", "label", "prompt", "layer", "head", "slots", "weights"])
        for r in routes:
            for layer, s_l, w_l in zip(r["layers"], r["slots"], r["weights"]):
                for h, (s, wt) in enumerate(zip(s_l, w_l)):
                    w.writerow([r["word"], r["label"], r["prompt"], layer, h, " ".join(map(str, s)),
                                " ".join(f"{x:.4f}" for x in wt)])
    routes_figure(routes, out_dir / "semantic_routes.png", sites)


def run_words(args, model, tokenizer, out_dir: Path, header: dict, sites) -> None:
    words = [w.strip() for w in args.words.split(",") if w.strip()]
    if args.prompts:
        lines = read_prompts(args.prompts)
        prompts = {w: lines for w in words}
    else:
        unknown = [w for w in words if w.lower() not in BUILTIN_PROMPTS]
        if unknown:
            raise ValueError(f"--words {','.join(unknown)}: no built-in prompts (known: {', '.join(BUILTIN_PROMPTS)}); "
                             "pass --prompts FILE")
        prompts = {w: BUILTIN_PROMPTS[w.lower()] for w in words}
    hits, skipped = find_targets(tokenizer, words, prompts)
    for w, p, reason in skipped:
        print(f"skipped ({reason}): [{w}] {p}")
    if not hits:
        raise ValueError(f"--words {args.words}: no prompt holds a target word as a single token")
    routes = semantic_routes(model, tokenizer, hits)
    with staged_outputs(out_dir) as stage:
        write_routes(routes, skipped, stage, header, sites)
    print(routes_markdown(routes))
    print(f"wrote {out_dir}/semantic_routes.md, .csv, .json, .png")


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir) if args.out_dir else Path(args.run) / "analysis"
    try:
        return analyze(args, out_dir)
    except KeyboardInterrupt:  # each set of outputs is moved in whole (staged_outputs): none is torn
        print(f"interrupted: no partial output under --out-dir {out_dir}", file=sys.stderr)
        return 130


def analyze(args, out_dir: Path) -> int:
    try:
        model, meta, tokenizer = load_run(args.run, args.step, args.device, args.tokenizer_dir)
        block = memory_block(model, need_routing=True)
        sites = parse_sites(args.sites, block.layers, block.H)  # checked before any forward
        header = {"run": str(args.run), "step": meta["step"], "memory_options": model.config.memory_options}
        if args.corpus:
            core = CoreSettings(args, meta)
            data = SplitData(args.data_dir, meta)
            common = dict(data_dir=data, core=core, max_tokens=args.max_tokens or None,
                          train_rows=train_rows_order(args.train_rows, meta))
            domains = build_domains(args.corpus, tokenizer, model.max_seq_len, **common)
            reference = None
            if args.reference:
                refs = build_domains([args.reference], tokenizer, model.max_seq_len, **common, flag="--reference")
                if len(refs) != 1:
                    raise ValueError(f"--reference {args.reference}: must name exactly one domain")
                reference = name_reference(refs[0], domains)
            rows = slot_audit(model, domains, reference, args.batch_size, tokenizer.bos_token_id, args.min_count,
                              not args.no_progress)
            rows_of = split_rows(domains + ([reference] if reference else []))
            with staged_outputs(out_dir) as stage:
                write_audit(rows, reference.name if reference else None, stage,
                            {**header, "split_rows": rows_of, "data_dir": data.record(),
                             "core": core.record()})
            print(audit_markdown(rows, reference.name if reference else None))
            for name, order in rows_of.items():
                print(f"{name} rows: {order}")
            print(f"wrote {out_dir}/routing_audit.md, .csv, .json")
        if args.words:
            run_words(args, model, tokenizer, out_dir, header, sites)
    except (FileNotFoundError, ValueError, OutputWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
