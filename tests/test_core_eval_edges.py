"""CORE edge cases that the real bundle has: a multiple-choice option whose scored region is empty (its tokens are a
prefix of another option's, e.g. piqa rows whose first choice is the start of the second), scored against a
naive transcription of the authors' (nanochat's) rule."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _eval_helpers import MC_ROWS, CharTok, SuccessorModel, tiny_gpt  # noqa: E402

from nanochat import core_eval as ce  # noqa: E402
from nanochat.eval_bundle import TaskSpec  # noqa: E402
from nanochat.numerics import apply_numerics  # noqa: E402

MC = TaskSpec("mc", "", "multiple_choice", 0, " ")
# "ab" is a token prefix of "abcde": the common prefix ends where "ab" ends, so its region is empty
PREFIX_ROWS = [
    {"query": "q", "choices": ["ab", "abcde"], "gold": 0},  # the empty region first, and gold
    {"query": "q", "choices": ["ab", "abcde"], "gold": 1},  # the empty region first, the other one gold
    {"query": "q", "choices": ["abcde", "ab"], "gold": 1},  # the empty region not first
]


def nanochat_verdicts(model, rows) -> list[bool]:
    """The authors' rule, one example per forward: the mean loss over each region (an empty region's mean is NaN),
    then ``means.index(min(means))`` (Python's min keeps a NaN it starts with and never picks a later one)."""
    out = []
    for item in rows:
        prompts = ce.render_prompts_mc(item, " ", [])
        tokens = [[CharTok.bos_token_id] + CharTok().encode(p) for p in prompts]
        start = ce.common_length(tokens, "left")
        T = max(len(t) for t in tokens)
        ids = torch.tensor([t + [CharTok.bos_token_id] * (T - len(t)) for t in tokens])
        with torch.no_grad():
            logits = model(ids)
        losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        means = [losses[r, start - 1 : len(t) - 1].mean().item() for r, t in enumerate(tokens)]
        out.append(means.index(min(means)) == item["gold"])
    return out


def verdicts(model, rows) -> list[bool]:
    examples = [ce.prepare_example(CharTok(), item, MC, []) for item in rows]
    return ce.score_examples(model, examples, MC.task_type, CharTok.bos_token_id, batch_size=16)


def test_reference_numerics_score_an_empty_first_region_as_the_authors_evaluator():
    model = tiny_gpt(seq_len=64)
    ours = verdicts(model, PREFIX_ROWS)
    assert ours == [False, True, False]  # ours: an empty region never wins
    apply_numerics(model, "reference")
    expected = nanochat_verdicts(model, PREFIX_ROWS)
    assert expected == [True, False, False]  # the first option wins whenever its region is empty
    assert verdicts(model, PREFIX_ROWS) == expected
    assert tuple(ce.evaluate_task(model, CharTok(), PREFIX_ROWS, MC, progress=False)) == (1, 3, 0)


def test_more_ranks_than_examples_and_rows_count_each_once():
    """8 ranks (threads) on a task of 5 examples (a small --max-per-task on 8 GPUs) and 3 bpb rows: ranks 5-7 score
    no example and 3-7 no row, yet every rank returns the one-process counts and bpb (sums, not means of ranks)."""
    from _thread_ranks import run_ranks

    from nanochat.loss_eval import bpb_rows_from_text, evaluate_bpb, iter_row_batches

    model = SuccessorModel()
    rows = MC_ROWS + PREFIX_ROWS[:1]
    x, y = bpb_rows_from_text(CharTok(), ["abc def", "mno pqr stu"], seq_len=8)
    assert x.size(0) == 3
    one = (tuple(ce.evaluate_task(model, CharTok(), rows, MC, batch_size=2, progress=False)),
           evaluate_bpb(model, iter_row_batches(x, y, 2), CharTok().token_bytes()))

    def rank(r, world):
        return (tuple(ce.evaluate_task(model, CharTok(), rows, MC, batch_size=2, progress=False)),
                evaluate_bpb(model, iter_row_batches(x, y, 2, r, world), CharTok().token_bytes()))

    results = run_ranks(8, rank)
    assert one[0] == (2, 5, 0)
    for counts, bpb in results:
        assert counts == one[0] and bpb == pytest.approx(one[1], rel=1e-12)


def test_centered_accuracies_and_core_equal_nanochats_gpt2_reports(shared_dir):
    """The real eval_meta_data.csv (quoted descriptions holding commas) and core.yaml, and nanochat's own CORE
    reports of the four GPT-2 models: their accuracies give their centered values and CORE (to the reports'
    6 printed digits)."""
    from nanochat.eval_bundle import load_core_tasks, load_random_baselines

    bundle = shared_dir / "eval_bundle"
    labels, baselines = [t.label for t in load_core_tasks(bundle)], load_random_baselines(bundle)
    reports = sorted(bundle.glob("openai-community-gpt2*.csv"))
    assert len(labels) == 22 and len(reports) == 4
    for report in reports:
        rows = [[cell.strip() for cell in line.split(",")] for line in report.read_text().splitlines()[1:]]
        accuracies = {task: {"accuracy": float(acc), "n": 1} for task, acc, _ in rows if acc}
        theirs = {task: float(centered) for task, _, centered in rows}
        ours = ce.summarize_core(accuracies, baselines, labels)
        assert ours["label"] == "CORE" and sorted(ours["tasks"]) == sorted(labels)
        for task, result in ours["tasks"].items():
            assert result["centered"] == pytest.approx(theirs[task], abs=2e-6), (report.name, task)
        assert ours["core"] == pytest.approx(theirs["CORE"], abs=2e-6), report.name
