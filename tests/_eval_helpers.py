"""Shared fixtures for the evaluator tests: a character tokenizer, a rigged "successor" model whose
log-probabilities are known in closed form, a tiny random GPT, and a hand-made on-disk bundle."""

import json
import math
import random
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ALPHA = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ\n:.?"
BOOST = 2.0


class CharTok:
    """id 0 = BOS, then one id per ALPHA character (BOS has 0 bytes, every char 1 byte)."""

    bos_token_id = 0
    vocab_size = len(ALPHA) + 1

    def encode(self, text):
        return [ALPHA.index(c) + 1 for c in text]

    def decode(self, ids):
        return "".join(ALPHA[i - 1] for i in ids if i > 0)

    def token_bytes(self):
        return torch.tensor([0] + [1] * len(ALPHA), dtype=torch.long)


def succ(token_id: int) -> int:
    """The next character in ALPHA (cyclic); BOS -> 'a'."""
    return token_id % len(ALPHA) + 1


class SuccessorModel(nn.Module):
    """logits[t] depend only on idx[t]: BOOST on succ(idx[t]), 0 elsewhere. So a boosted transition costs
    log Z - BOOST nats and any other costs log Z, Z = e^BOOST + V - 1."""

    def __init__(self, max_seq_len=10_000):
        super().__init__()
        V = CharTok.vocab_size
        table = torch.zeros(V, V)
        for a in range(V):
            table[a, succ(a)] = BOOST
        self.register_buffer("table", table)
        self.max_seq_len = max_seq_len
        self.dummy = nn.Parameter(torch.zeros(1))
        self.calls = 0

    def forward(self, idx, targets=None, loss_reduction="mean"):
        self.calls += 1
        logits = self.table[idx]
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                               reduction=loss_reduction)


LOG_Z = math.log(math.exp(BOOST) + CharTok.vocab_size - 1)


def tiny_gpt(seq_len=64, seed=0):
    """A small random GPT whose attention really mixes context (weights perturbed away from the zero init)."""
    from conftest import tiny_config
    from nanochat.gpt import build_model

    model = build_model(tiny_config(sequence_len=seq_len, vocab_size=CharTok.vocab_size, n_embd=64), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


MC_ROWS = [  # delimiter " ", see test_core_eval for the hand computation
    {"query": "q", "choices": ["abcd", "azzz"], "gold": 0},
    {"query": "q", "choices": ["mno", "mnx", "abc"], "gold": 2},
    {"query": "q", "choices": ["ab", "abcde"], "gold": 1},
    {"query": "q", "choices": ["zyx", "efg"], "gold": 0},
]
SCHEMA_ROWS = [
    {"context_options": ["xyz", "xyy"], "continuation": "ABC", "gold": 0},
    {"context_options": ["abz", "aby"], "continuation": "ABC", "gold": 1},
    {"context_options": ["qqq", "mnz"], "continuation": "ABC", "gold": 1},
]
LM_ROWS = [
    {"context": "xyz", "continuation": "ABC"},
    {"context": "  xyz ", "continuation": "ABD"},
    {"context": "abc", "continuation": "ABC"},
]


def write_bundle(root: Path, tasks: dict, baselines: dict, total_tasks: list | None = None) -> Path:
    """tasks: {label: (task_type, shots, delimiter, rows)}; total_tasks adds core.yaml entries with no file."""
    root.mkdir(parents=True, exist_ok=True)
    lines = ["icl_tasks:"]
    for label, (ttype, shots, delim, rows) in tasks.items():
        lines += ["-", f"  label: {label}", f"  dataset_uri: cat/{label}.jsonl", f"  num_fewshot: [{shots}]",
                  f"  icl_task_type: {ttype}", f"  continuation_delimiter: {json.dumps(delim)}"]
        (root / "eval_data" / "cat").mkdir(parents=True, exist_ok=True)
        with open(root / "eval_data" / "cat" / f"{label}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    for label in total_tasks or []:
        lines += ["-", f"  label: {label}", f"  dataset_uri: cat/{label}.jsonl", "  num_fewshot: [0]",
                  "  icl_task_type: multiple_choice"]
    (root / "core.yaml").write_text("\n".join(lines) + "\n")
    csv = ["Eval Task,Random baseline"] + [f"{k},{v}" for k, v in baselines.items()]
    (root / "eval_meta_data.csv").write_text("\n".join(csv) + "\n")
    return root


def hand_rows(n=12):
    """``n`` seeded multiple-choice rows and ``n`` language-modeling rows of random short words."""
    rng = random.Random(0)
    word = lambda: "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 6)))  # noqa: E731
    mc = [{"query": word() + " " + word(), "choices": [word() for _ in range(rng.randint(2, 4))], "gold": 0}
          for _ in range(n)]
    lm = [{"context": word() + " " + word(), "continuation": word()} for _ in range(n)]
    return mc, lm


def two_task_bundle(root: Path) -> Path:
    """A CORE bundle of an MC task (2-shot) and an LM task (1-shot), 9 hand rows each (test_core_eval's 2-rank
    check: tests/_core_eval_worker.py builds it in its shared launch, the test evaluates it in one process)."""
    mc, lm = hand_rows(9)
    return write_bundle(root, {"mc": ("multiple_choice", 2, " ", mc), "lm": ("language_modeling", 1, " ", lm)},
                        {"mc": 25, "lm": 0})
