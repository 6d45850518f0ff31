"""Sense-sensitive routing on WiC (paper appendix "Quantifying Sense-Sensitive Routing on WiC").

    python -m scripts.wic_probe --run runs/X --wic train.data.txt --gold train.gold.txt [--wic test.tsv ...]
        [--bootstrap 1000] [--taus 0.1,0.2,0.25] [--distribution scores|executed] [--out-dir DIR]

Accepted input (WiC itself is not shipped; get it from its authors):
* TSV as distributed: ``word <TAB> POS <TAB> i-j <TAB> sentence1 <TAB> sentence2`` with i, j the ZERO-based
  indices of the target among the space-separated words of each sentence, plus the label either as a 6th
  column (T/F) or from --gold FILE (one T/F per line, same order; one --gold per --wic).
* JSONL: one object per line {"word", "pos", "index": "i-j" (or "idx1"/"idx2"), "sentence1", "sentence2",
  "label": "T"/"F"/true/false}.

Strict-natural filtering (drop reasons are counted): the marked surface word equals the target
case-insensitively in both sentences; each occurrence is exactly ONE token including its leading space, as the
tokenizer sees it in the sentence; both have the same token id; and both lie strictly after the midpoint:
r = (p - 1/2)/(L - 1) > 1/2 with p the zero-based target position in [BOS] + sentence tokens and L that
sequence's length (the p-th of the L-1 sentence tokens has its centre at relative position r).

Per layer-head site s, with q the routing distribution over all M slots at the target position (``scores``:
the router's sigmoid/softmax scores normalised to sum 1; ``executed``: the top-K mixing weights, 0 elsewhere),
A the executed top-K set and gamma the injection gate:
    d = JSD_2(q1, q2),  dJSD = E[d|F] - E[d|T];   O~ = (|A1 & A2| - K^2/M)/(K - K^2/M),  dO = E[O~|T] - E[O~|F]
gate-weighted variants with w = sqrt(gamma1 gamma2)/2 multiplied in before the class means, and thresholded
variants keeping pairs with min(gamma1, gamma2) >= tau (cells with < 10 pairs in either class are flagged and
grey in the maps). 95% intervals: pair-stratified bootstrap (T and F resampled separately) for the unweighted
and gate-weighted effects. Writes wic.json, wic_sites.csv, wic_routing.png (dJSD and dO~ per site), wic_gate.png
(the gate-weighted and thresholded dJSD) and wic_gate_mean.png (the mean pair gate per site).
"""

import argparse
import csv
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from nanochat.analysis import (OutputWriteError, heatmaps, load_run, memory_block, pad_rows, run_captured,
                               single_token_at, staged_outputs, top_ranks, write_json)
from nanochat.cli_types import checkpoint_step, device_name, positive_int, seed_int
from nanochat.routing_metrics import chance_corrected_overlap, jsd_base2, stratified_bootstrap
from nanochat.terminal import replace_unencodable_output

MIN_PAIRS = 10  # thresholded cells with fewer pairs in either class are flagged (grey), as in the paper
# torch.quantile puts the 2.5% end of the 95% interval at (n - 1) x 0.025 in the n sorted resamples: below 41 it
# interpolates towards the single most extreme draw, which then sets the interval (n = 1: lo == hi)
MIN_BOOTSTRAP = 41


@dataclass
class WiCPair:
    word: str
    pos: str
    idx1: int
    idx2: int
    sentence1: str
    sentence2: str
    label: bool  # True = same sense (T)
    source: str = ""  # file:line, for error messages and the kept-pairs listing


# -- reading ------------------------------------------------------------------------------------------------
def _label(value, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).strip().upper() in ("T", "TRUE", "1"):
        return True
    if str(value).strip().upper() in ("F", "FALSE", "0"):
        return False
    raise ValueError(f"{where}: label {value!r} is not T/F")


def _index_pair(text: str, where: str) -> tuple[int, int]:
    try:
        i, j = (int(x) for x in str(text).split("-"))
        return i, j
    except ValueError:
        raise ValueError(f"{where}: index {text!r} is not of the form i-j") from None


def _text(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:  # EIO and the like carry no file name: the flag and file are said here
        raise ValueError(f"{flag} {path}: cannot be read ({e.strerror or e})") from e


def read_wic(path, gold=None) -> list[WiCPair]:
    """Read a WiC TSV (5 columns + --gold, or 6 columns) or JSONL file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--wic {path}: file does not exist")
    labels = None
    if gold is not None:
        if not Path(gold).is_file():
            raise FileNotFoundError(f"--gold {gold}: file does not exist")
        labels = [line.strip() for line in _text(Path(gold), "--gold").splitlines() if line.strip()]
    lines = [(n, line) for n, line in enumerate(_text(path, "--wic").splitlines(), 1) if line.strip()]
    if labels is not None and len(labels) != len(lines):
        raise ValueError(f"--gold {gold}: {len(labels)} labels for {len(lines)} pairs in {path}")
    pairs = []
    for k, (n, line) in enumerate(lines):
        where = f"{path}:{n}"
        if path.suffix == ".jsonl":
            try:
                o = json.loads(line)
                i, j = _index_pair(o["index"], where) if "index" in o else (int(o["idx1"]), int(o["idx2"]))
                pairs.append(WiCPair(o["word"], o.get("pos", ""), i, j, o["sentence1"], o["sentence2"],
                                     _label(o["label"] if labels is None else labels[k], where), where))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{where}: expected a JSON object with word, index (or idx1/idx2), sentence1, "
                                 f"sentence2, label ({type(e).__name__}: {e})") from e
            continue
        cols = line.split("\t")
        if len(cols) == 6 and labels is not None:  # which label would count is not for us to guess
            raise ValueError(f"{where}: has a label column (6th) and --gold {gold} gives labels too; pass one")
        if len(cols) not in (5, 6) or (len(cols) == 5 and labels is None):
            raise ValueError(f"{where}: expected 6 tab-separated columns (word, POS, i-j, sentence1, sentence2, T/F) "
                             f"or 5 plus --gold; got {len(cols)}")
        i, j = _index_pair(cols[2], where)
        label = _label(cols[5] if len(cols) == 6 else labels[k], where)
        pairs.append(WiCPair(cols[0], cols[1], i, j, cols[3], cols[4], label, where))
    return pairs


# -- strict-natural filtering ---------------------------------------------------------------------------------
def _occurrence(tokenizer, sentence: str, index: int, word: str):
    """-> (reason or None, ids, zero-based position in [BOS] + ids)."""
    words = sentence.split(" ")
    if not 0 <= index < len(words):
        return "index out of range", None, None
    if words[index].lower() != word.lower():
        return "surface mismatch", None, None
    start = len(" ".join(words[:index])) + (1 if index > 0 else 0)
    ids, i = single_token_at(tokenizer, sentence, start, start + len(words[index]))
    if i is None:
        return "multi-token target", None, None
    return None, ids, i + 1


def relative_position(p: int, L: int) -> float:
    return (p - 0.5) / (L - 1)


def filter_pairs(pairs: list[WiCPair], tokenizer) -> tuple[list[dict], dict[str, int]]:
    """Strict-natural pairs as dicts (pair, ids1, ids2, pos1, pos2 with BOS prepended), and drop-reason counts."""
    kept, dropped = [], {}
    for pair in pairs:
        occ = [_occurrence(tokenizer, s, i, pair.word) for s, i in ((pair.sentence1, pair.idx1), (pair.sentence2, pair.idx2))]
        reason = next((o[0] for o in occ if o[0]), None)
        if reason is None:
            (_, ids1, p1), (_, ids2, p2) = occ
            if ids1[p1 - 1] != ids2[p2 - 1]:
                reason = "different token ids"
            elif not all(relative_position(p, len(ids) + 1) > 0.5 for p, ids in ((p1, ids1), (p2, ids2))):
                reason = "target not after the midpoint"
        if reason:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        bos = tokenizer.bos_token_id
        kept.append(dict(pair=pair, ids1=[bos] + ids1, ids2=[bos] + ids2, pos1=p1, pos2=p2))
    return kept, dropped


# -- capture at the targets -----------------------------------------------------------------------------------
def capture_targets(model, kept: list[dict], batch_size: int, distribution: str, progress=True):
    """-> q1, q2 (P, S, M) routing distributions; a1, a2 (P, S, K) slot sets; g1, g2 (P, S) gates."""
    block = memory_block(model, need_routing=True)
    seqs = [(k["ids1"], k["pos1"]) for k in kept] + [(k["ids2"], k["pos2"]) for k in kept]
    q, a, g = [], [], []
    for start in tqdm(range(0, len(seqs), batch_size), desc="wic", disable=not progress, leave=False):
        chunk = seqs[start : start + batch_size]
        ids, _ = pad_rows([torch.tensor(s) for s, _ in chunk], 0)
        cap = run_captured(model, ids)
        at, pos = torch.arange(len(chunk)), torch.tensor([p for _, p in chunk])
        slots, w = cap["slots"][at, pos].long(), cap["weights"][at, pos].double()  # (n, L, H, K)
        if distribution == "scores":
            if "probs" not in cap:
                raise ValueError("--distribution scores: this router has no scores (fixed-random); use executed")
            dist = cap["probs"][at, pos].double()
        else:
            dist = torch.zeros(*slots.shape[:-1], block.M, dtype=torch.float64).scatter_add_(-1, slots, w)
        n = len(chunk)
        q.append(dist.reshape(n, -1, block.M))
        a.append(slots.reshape(n, -1, slots.size(-1)))
        g.append(cap["gamma"][at, pos].double().reshape(n, -1))
    q, a, g = torch.cat(q), torch.cat(a), torch.cat(g)
    P = len(kept)
    return q[:P], q[P:], a[:P], a[P:], g[:P], g[P:]


# -- statistics -----------------------------------------------------------------------------------------------
def pair_metrics(q1, q2, a1, a2, g1, g2, M: int) -> dict[str, torch.Tensor]:
    """Per pair and site (P, S): d = JSD_2, O~, w = sqrt(g1 g2)/2, gmin = min(g1, g2), pair gate sqrt(g1 g2)."""
    pair_gate = (g1 * g2).clamp_min(0).sqrt()
    return {"d": jsd_base2(q1, q2), "o": chance_corrected_overlap(a1, a2, M), "w": pair_gate / 2,
            "gmin": torch.minimum(g1, g2), "pair_gate": pair_gate}


def class_means(x: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor | None = None):
    """Mean of x (P, S) over T pairs and over F pairs (optionally only where keep (P, S)); and the counts."""
    keep = torch.ones_like(x, dtype=torch.bool) if keep is None else keep
    t, f = keep & labels[:, None], keep & ~labels[:, None]
    nt, nf = t.sum(0), f.sum(0)
    mt = (x * t).sum(0) / nt.clamp_min(1)
    mf = (x * f).sum(0) / nf.clamp_min(1)
    nan = torch.tensor(float("nan"), dtype=x.dtype)
    return torch.where(nt > 0, mt, nan), torch.where(nf > 0, mf, nan), nt, nf


def site_effects(m: dict, labels: torch.Tensor) -> torch.Tensor:
    """(4, S): dJSD = E[d|F]-E[d|T], dO = E[O~|T]-E[O~|F], and both with w multiplied in before the means."""
    out = []
    for x, t_minus_f in ((m["d"], False), (m["o"], True), (m["w"] * m["d"], False), (m["w"] * m["o"], True)):
        mt, mf, _, _ = class_means(x, labels)
        # mt - mf rather than -(mf - mt): the same value, but equal means give 0.0, not -0.0 (in wic.json too)
        out.append(mt - mf if t_minus_f else mf - mt)
    return torch.stack(out)


EFFECTS = ("dJSD", "dO", "dJSD_gate", "dO_gate")


def threshold_effects(m: dict, labels: torch.Tensor, tau: float) -> dict[str, torch.Tensor]:
    keep = m["gmin"] >= tau
    dt, df, nt, nf = class_means(m["d"], labels, keep)
    ot, of, _, _ = class_means(m["o"], labels, keep)
    return {"dJSD": df - dt, "dO": ot - of, "n_T": nt, "n_F": nf, "flagged": torch.minimum(nt, nf) < MIN_PAIRS}


def analyse(m: dict, labels: torch.Tensor, n_boot: int, taus: list[float], seed: int = 0) -> dict:
    if labels.all() or not labels.any():
        raise ValueError("--wic: the filtered pairs need both T and F labels")
    point = site_effects(m, labels)
    res = {name: point[i] for i, name in enumerate(EFFECTS)}
    if n_boot > 0:
        lo, hi = stratified_bootstrap(lambda idx: site_effects({k: v[idx] for k, v in m.items()}, labels[idx]),
                                      labels, n_boot, seed)
        for i, name in enumerate(EFFECTS):
            res[f"{name}_lo"], res[f"{name}_hi"] = lo[i], hi[i]
    res["mean_pair_gate"] = m["pair_gate"].mean(0)
    res["thresholds"] = {tau: threshold_effects(m, labels, tau) for tau in taus}
    return res


# -- reporting --------------------------------------------------------------------------------------------------
def summary(res: dict, layers, H: int) -> dict:
    out = {}
    for name in EFFECTS:
        v = res[name]
        order = v.nan_to_num(nan=-float("inf")).argsort(descending=True)[:10]
        top = []
        for s in order.tolist():
            item = {"layer": layers[s // H], "head": s % H, "effect": v[s].item()}
            if f"{name}_lo" in res:
                item["ci95"] = [res[f"{name}_lo"][s].item(), res[f"{name}_hi"][s].item()]
            top.append(item)
        out[name] = {"positive_sites": int((v > 0).sum()), "sites": v.numel(), "top10": top}
        if f"{name}_lo" in res:
            out[name]["ci_above_zero"] = int((res[f"{name}_lo"] > 0).sum())
    return out


def csv_number(x: float) -> str:
    """Six decimals; a value that rounds to zero is written "0.000000" whatever its sign."""
    text = f"{x:.6f}"
    return text[1:] if text == "-0.000000" else text


def write_sites_csv(res: dict, layers, H: int, path: Path) -> None:
    cols = [k for k in res if k not in ("thresholds",)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        taus = list(res["thresholds"])
        w.writerow(["layer", "head", *cols, *(f"{k}@{t}" for t in taus for k in ("dJSD", "dO", "n_T", "n_F", "flagged"))])
        for s in range(len(layers) * H):
            row = [layers[s // H], s % H, *(csv_number(res[c][s].item()) for c in cols)]
            for t in taus:
                th = res["thresholds"][t]
                row += [csv_number(th["dJSD"][s].item()), csv_number(th["dO"][s].item()), int(th["n_T"][s]), int(th["n_F"][s]),
                        bool(th["flagged"][s])]
            w.writerow(row)


def write_maps(res: dict, layers, H: int, out_dir: Path) -> None:
    grid = lambda v: v.view(len(layers), H)  # noqa: E731
    panels = {"dJSD (F - T)": grid(res["dJSD"]), "dO~ (T - F)": grid(res["dO"])}
    heatmaps(panels, out_dir / "wic_routing.png", layers, cmap="RdBu",
             ranks={k: top_ranks(v) for k, v in panels.items()}, title="WiC routing differences per site",
             symmetric=True)
    gate = {"mean pair gate sqrt(g1 g2)": grid(res["mean_pair_gate"])}
    heatmaps(gate, out_dir / "wic_gate_mean.png", layers, vmin=0.0, vmax=2.0)
    eff = {"dJSD gate-weighted": grid(res["dJSD_gate"])}
    for tau, th in res["thresholds"].items():
        eff[f"dJSD, min gamma >= {tau}"] = grid(torch.where(th["flagged"], float("nan"), th["dJSD"]))
    heatmaps(eff, out_dir / "wic_gate.png", layers, cmap="RdBu", ranks={"dJSD gate-weighted": top_ranks(eff["dJSD gate-weighted"])},
             title="gate-aware WiC effects (grey: < 10 pairs in a class)", symmetric=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="run directory holding checkpoints/ (a MoME run)")
    ap.add_argument("--step", type=checkpoint_step, default=None)
    ap.add_argument("--wic", action="append", required=True, help="WiC TSV or JSONL file (repeatable: files are pooled)")
    ap.add_argument("--gold", action="append", default=[], help="T/F labels for a 5-column --wic (same order)")
    ap.add_argument("--bootstrap", type=int, default=1000,
                    help=f"pair-stratified bootstrap resamples: 0 = no intervals, else >= {MIN_BOOTSTRAP}")
    ap.add_argument("--taus", default="0.1,0.2,0.25", help="gate thresholds for min(gamma1, gamma2) >= tau")
    ap.add_argument("--distribution", default="scores", choices=("scores", "executed"))
    ap.add_argument("--seed", type=seed_int, default=0, help="bootstrap seed, 0 to 2**32-1")
    ap.add_argument("--batch-size", type=positive_int, default=32)
    ap.add_argument("--tokenizer-dir", default=None)
    ap.add_argument("--device", type=device_name, default="cpu")
    ap.add_argument("--out-dir", default=None, help="default: <run>/analysis/wic")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.gold and len(args.gold) != len(args.wic):
        ap.error(f"--gold: give one per --wic ({len(args.wic)}) or none")
    try:
        args.tau_list = [float(t) for t in args.taus.split(",") if t.strip()]
    except ValueError:
        args.tau_list = [math.nan]
    if not all(math.isfinite(t) and t >= 0 for t in args.tau_list):
        ap.error(f"--taus {args.taus!r}: expected comma-separated numbers >= 0")
    if args.bootstrap != 0 and args.bootstrap < MIN_BOOTSTRAP:  # a negative count silently meant no intervals
        ap.error(f"--bootstrap must be 0 (no intervals) or >= {MIN_BOOTSTRAP} resamples (got {args.bootstrap}): "
                 "with fewer, the single most extreme resample sets the ends of the 95% interval")
    return args


OUTPUTS = ("wic_sites.csv", "wic_routing.png", "wic_gate.png", "wic_gate_mean.png", "wic.json")


def write_outputs(out_dir: Path, report: dict, res: dict, layers, H: int) -> None:
    """The set is staged and moved in whole (staged_outputs): a write that fails (a full disk) or is interrupted
    leaves the earlier set as it was, so no report describes another probe's files."""
    with staged_outputs(out_dir) as stage:
        write_sites_csv(res, layers, H, stage / "wic_sites.csv")
        write_maps(res, layers, H, stage)
        write_json(stage / "wic.json", report)


def probe(args, out_dir: Path) -> dict:
    """Read, filter, capture, analyse, write; returns the per-metric summary."""
    if out_dir.exists() and not out_dir.is_dir():  # found before the forwards, not after them
        raise ValueError(f"--out-dir {out_dir} exists and is not a directory")
    model, meta, tokenizer = load_run(args.run, args.step, args.device, args.tokenizer_dir)
    block = memory_block(model, need_routing=True)
    if block.K >= block.M:
        raise ValueError(f"the chance-corrected overlap needs K < M (run has K={block.K}, M={block.M})")
    golds = args.gold or [None] * len(args.wic)
    pairs = [p for f, g in zip(args.wic, golds) for p in read_wic(f, g)]
    kept, dropped = filter_pairs(pairs, tokenizer)
    labels = torch.tensor([k["pair"].label for k in kept], dtype=torch.bool)
    print(f"{len(pairs)} pairs read, {len(kept)} kept ({int(labels.sum())} T / {int((~labels).sum())} F); dropped: {dropped}")
    if not kept:
        raise ValueError(f"--wic {' '.join(args.wic)}: no pair survives the strict-natural filter")
    caps = capture_targets(model, kept, args.batch_size, args.distribution, not args.no_progress)
    res = analyse(pair_metrics(*caps, block.M), labels, args.bootstrap, args.tau_list, args.seed)
    layers, H = list(block.layers), block.H
    summ = summary(res, layers, H)
    write_outputs(out_dir, {
        "run": str(args.run), "step": meta["step"], "files": args.wic, "distribution": args.distribution,
        "pairs_read": len(pairs), "pairs_kept": len(kept), "kept_T": int(labels.sum()), "dropped": dropped,
        "unique_target_ids": len({k["ids1"][k["pos1"]] for k in kept}), "bootstrap": args.bootstrap,
        "bootstrap_seed": args.seed, "layers": layers, "heads": H, "summary": summ,
        "sites": {k: v for k, v in res.items() if k != "thresholds"},
        "thresholds": {str(t): th for t, th in res["thresholds"].items()},
        "kept_pairs": [asdict(k["pair"]) for k in kept]}, res, layers, H)
    return summ


def signed(x: float) -> str:
    """x to 4 decimals with its sign; what rounds to zero prints +0.0000: a -0.0, or a -1e-17 left by float
    rounding, is no evidence of a negative effect (Python >= 3.11 would write this as format spec "+z.4f")."""
    text = f"{x:+.4f}"
    return "+" + text[1:] if float(text) == 0 else text


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir) if args.out_dir else Path(args.run) / "analysis" / "wic"
    try:
        summ = probe(args, out_dir)
    # OutputWriteError: the earlier outputs stay whole; OSError: reading the run (the writes raise OutputWriteError)
    except (OSError, ValueError, OutputWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted; {out_dir} holds no partial results of this probe", file=sys.stderr)
        return 130
    for name, s in summ.items():
        best = s["top10"][0]
        ci = f" CI {signed(best['ci95'][0])}..{signed(best['ci95'][1])}" if "ci95" in best else ""
        print(f"{name}: positive at {s['positive_sites']}/{s['sites']} sites; largest L{best['layer']}h{best['head']} "
              f"{signed(best['effect'])}{ci}")
    print(f"wrote {out_dir}/wic.json, wic_sites.csv, wic_routing.png, wic_gate.png, wic_gate_mean.png")
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
