"""Peak host memory of one CORE batch (``core_eval._score_batch``) and one bpb batch (``loss_eval.evaluate_bpb``)
on CPU, against the full-batch computations they replaced (session 33) and against the model's forward alone.

    python bench/core_eval_mem.py                                  # 8 rows x 1024 tokens x 32768 vocab
    python bench/core_eval_mem.py --family mobilellm               # a family without the logit softcap
    python bench/core_eval_mem.py --rows 16 --seq-len 2048         # base_eval's default batch at T = 2048 (~13 GB)

Every measurement runs in its own process (ru_maxrss is a process high-water mark): a tiny model (1 layer, C = 64,
so the (rows, T, V) logits are nearly all of the memory) scores ``--rows`` rows of ``--seq-len`` tokens. "extra"
is the peak RSS during the call minus the RSS just before it, in MiB and in units of one fp32 (rows, T, V)
logits tensor. The CORE rows are multiple-choice options whose last ``--region`` tokens are scored.
"""

import argparse
import gc
import json
import resource
import subprocess
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F

MODES = {
    "forward": "model(ids) alone: its logits, and its softcap's temporaries where the family has one",
    "core-before": "CORE, the full-batch scoring (fp32 copy of all positions, their log-softmax, argmax)",
    "core": "CORE, core_eval._score_batch",
    "bpb-before": "bpb, model(x, targets=y, loss_reduction='none') (the model's full-batch cross-entropy)",
    "bpb": "bpb, loss_eval.evaluate_bpb on one batch",
}


def rss_mib() -> float:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def core_scores_before(model, batch, task_type, pad_id, device, autocast_ctx):
    """core_eval._score_batch as it was before session 33 (the losses and argmax of every position of the batch)."""
    from nanochat.core_eval import _judge, reference_scoring

    rows = [r for ex in batch for r in ex.rows]
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    with autocast_ctx if autocast_ctx is not None else nullcontext():
        logits = model(ids)
    logits = logits.float()
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
    losses = losses.view(len(rows), T - 1).cpu()
    preds, ids = logits[:, :-1].argmax(dim=-1).cpu(), ids.cpu()
    out, r0 = [], 0
    for ex in batch:
        r1 = r0 + len(ex.rows)
        out.append(_judge(task_type, losses[r0:r1], preds[r0:r1], ids[r0:r1], ex, reference_scoring(model)))
        r0 = r1
    return out


def child(a) -> dict:
    from nanochat import core_eval, loss_eval
    from nanochat.core_eval import Prepared
    from nanochat.families import FAMILIES, build_model

    torch.set_num_threads(2)
    family = FAMILIES[a.family]
    kw = dict(sequence_len=a.seq_len, vocab_size=a.vocab, n_layer=1, n_head=1, n_kv_head=1, n_embd=64)
    if family.ffn_rule is not None:  # the SwiGLU families
        kw.update(head_dim=64, ffn_hidden=family.ffn_rule(64))
    model = build_model(family.config_cls(**kw), "cpu", seed=0).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, a.vocab, (a.rows, a.seq_len), generator=g)
    choices = 4
    batch = [Prepared([ids[i + c].tolist() for c in range(choices)], [a.seq_len - a.region] * choices,
                      [a.seq_len] * choices, 0) for i in range(0, a.rows - a.rows % choices, choices)]
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    token_bytes = torch.ones(a.vocab, dtype=torch.long)
    gc.collect()
    before = rss_mib()
    with torch.no_grad():
        if a.child == "forward":
            model(ids)
        elif a.child == "core-before":
            core_scores_before(model, batch, "multiple_choice", 0, "cpu", None)
        elif a.child == "core":
            core_eval._score_batch(model, batch, "multiple_choice", 0, "cpu", None)
        elif a.child == "bpb-before":
            model(x, targets=y, loss_reduction="none")
        else:
            loss_eval.evaluate_bpb(model, [(x, y)], token_bytes)
    return {"mode": a.child, "extra_mib": peak_mib() - before}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--region", type=int, default=32, help="scored tokens at the end of each CORE row")
    ap.add_argument("--family", default="nanochat", help="--model-type: nanochat (logit softcap) or mobilellm/qwen3")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return
    logits_mib = a.rows * a.seq_len * a.vocab * 4 / 2**20
    print(f"{a.family}: rows {a.rows} x T {a.seq_len} x V {a.vocab}: one fp32 (rows, T, V) logits tensor = {logits_mib:.0f} MiB, "
          f"one row's = {logits_mib / a.rows:.0f} MiB; CORE scores the last {a.region} tokens of each row")
    extra = {}
    for mode, what in MODES.items():
        cmd = [sys.executable, __file__, "--child", mode, "--rows", str(a.rows), "--seq-len", str(a.seq_len),
               "--vocab", str(a.vocab), "--region", str(a.region), "--family", a.family]
        extra[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["extra_mib"]
        print(f"{mode:<12} extra peak {extra[mode]:8.0f} MiB = {extra[mode] / logits_mib:5.2f} x logits  ({what})")
    for name in ("core", "bpb"):
        print(f"{name}: before / after = {extra[name + '-before'] / extra[name]:.2f}; "
              f"after - forward = {(extra[name] - extra['forward']) / logits_mib:+.2f} x logits")


if __name__ == "__main__":
    main()
