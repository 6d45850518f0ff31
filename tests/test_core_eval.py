"""CORE evaluator: scoring rules on a rigged model, prompt rendering, arithmetic, batching, cropping, ranks."""

import json
import math
import random
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _eval_helpers import (LM_ROWS, LOG_Z, MC_ROWS, SCHEMA_ROWS, CharTok, SuccessorModel, hand_rows,  # noqa: E402
                           tiny_gpt, write_bundle)

from nanochat import core_eval as ce  # noqa: E402
from nanochat.eval_bundle import TaskSpec, load_task_data  # noqa: E402

MC = TaskSpec("mc", "cat/mc.jsonl", "multiple_choice", 0, " ")
SCHEMA = TaskSpec("sc", "cat/sc.jsonl", "schema", 0, " ")
LM = TaskSpec("lm", "cat/lm.jsonl", "language_modeling", 0, " ")


def _eval(model, rows, task, batch_size=16):
    return tuple(ce.evaluate_task(model, CharTok(), rows, task, batch_size=batch_size, progress=False))[:2]


# -- each task type on hand-made examples ----------------------------------------------------------------
def test_multiple_choice_rigged_model():
    # Region = tokens after the common prefix (BOS q ' ' [a]). Boosted transitions cost LOG_Z - 2.
    # ex0: 'abcd' region b,c,d all boosted vs 'azzz' none -> 0 (gold 0) correct
    # ex1: 'mno' 2/3 boosted, 'mnx' 1/3, 'abc' 2/3 -> tie 0 vs 2, first wins -> 0 (gold 2) wrong
    # ex2: 'ab' is a prefix of 'abcde' -> its region is empty (never chosen); 'abcde' -> 1 (gold 1) correct
    # ex3: 'zyx' 0/3 boosted, 'efg' 2/3 -> 1 (gold 0) wrong
    assert _eval(SuccessorModel(), MC_ROWS, MC) == (2, 4)
    ex = ce.prepare_example(CharTok(), MC_ROWS[0], MC, [])
    assert ex.starts == [4, 4] and ex.ends == [7, 7]
    ex = ce.prepare_example(CharTok(), MC_ROWS[2], MC, [])
    assert ex.starts == [5, 5] and ex.ends == [5, 8]


def test_mc_mean_loss_values():
    """The per-choice mean losses equal the closed form LOG_Z - BOOST * (boosted fraction)."""
    ex = ce.prepare_example(CharTok(), MC_ROWS[1], MC, [])
    ids = torch.tensor([r for r in ex.rows])
    logits = SuccessorModel()(ids)
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    means = [losses[r, s - 1 : e - 1].mean().item() for r, (s, e) in enumerate(zip(ex.starts, ex.ends))]
    assert means == pytest.approx([LOG_Z - 4 / 3, LOG_Z - 2 / 3, LOG_Z - 4 / 3])


def test_schema_rigged_model():
    # Common suffix ' ABC'; ' ' is boosted only after 'z'. ex0 picks 'xyz' (gold 0) correct;
    # ex1 picks 'abz' (gold 1) wrong; ex2 picks 'mnz' (gold 1) correct.
    assert _eval(SuccessorModel(), SCHEMA_ROWS, SCHEMA) == (2, 3)
    ex = ce.prepare_example(CharTok(), SCHEMA_ROWS[0], SCHEMA, [])
    assert ex.starts == [4, 4] and ex.ends == [8, 8]


def test_language_modeling_rigged_model():
    # Greedy = successor. 'xyz' + ' ABC': z->' ', ' '->A, A->B, B->C all greedy -> correct;
    # ' ABD': D is not greedy after C -> wrong; 'abc' + ' ABC': c->' ' is not greedy -> wrong.
    assert _eval(SuccessorModel(), LM_ROWS, LM) == (1, 3)
    ex = ce.prepare_example(CharTok(), LM_ROWS[1], LM, [])  # context is trimmed before rendering
    assert ex.rows == [[0] + CharTok().encode("xyz ABD")] and ex.starts == [4] and ex.ends == [8]


# -- prompt rendering (golden strings) ------------------------------------------------------------------
def test_render_mc_golden():
    shots = [{"query": "Q1", "choices": ["a", "b"], "gold": 1}, {"query": "Q2", "choices": ["c", "d"], "gold": 0}]
    item = {"query": "Q3", "choices": ["e", "f"], "gold": 0}
    assert ce.render_prompts_mc(item, "\nAnswer: ", shots) == [
        "Q1\nAnswer: b\n\nQ2\nAnswer: c\n\nQ3\nAnswer: e", "Q1\nAnswer: b\n\nQ2\nAnswer: c\n\nQ3\nAnswer: f"]
    assert ce.render_prompts_mc(item, " ", []) == ["Q3 e", "Q3 f"]


def test_render_schema_golden():
    shots = [{"context_options": ["C1", "C2"], "continuation": "x.", "gold": 1}]
    item = {"context_options": ["D1", "D2"], "continuation": "y.", "gold": 0}
    assert ce.render_prompts_schema(item, " ", shots) == ["C2 x.\n\nD1 y.", "C2 x.\n\nD2 y."]


def test_render_lm_golden():
    shots = [{"context": " ctx1 ", "continuation": "ans1"}]
    item = {"context": "ctx2\n", "continuation": " ans2"}
    assert ce.render_prompts_lm(item, "\nAnswer: ", shots) == [
        "ctx1\nAnswer: ans1\n\nctx2\nAnswer:", "ctx1\nAnswer: ans1\n\nctx2\nAnswer:  ans2"]


def test_fewshot_sampling_and_order_are_fixed():
    data = [{"i": i} for i in range(10)]
    expected = random.Random(1234 + 3).sample([0, 1, 2, 4, 5, 6, 7, 8, 9], 4)
    assert [d["i"] for d in ce.fewshot_for(data, 3, 4)] == expected
    assert 3 not in expected
    assert len(ce.fewshot_for(data[:3], 0, 10)) == 2  # k > available is clamped, not an error
    shuffled = list(range(10))
    random.Random(1337).shuffle(shuffled)
    assert [d["i"] for d in ce.order_task_data(data, 4)] == shuffled[:4]


# -- arithmetic and labels ------------------------------------------------------------------------------
def test_core_arithmetic():
    res = ce.summarize_core({"a": {"accuracy": 0.5, "n": 10}, "b": {"accuracy": 0.25, "n": 4},
                             "c": {"accuracy": 0.2, "n": 5}}, {"a": 25.0, "b": 50.0, "c": 0.0}, ["a", "b", "c"])
    # a: (0.5-0.25)/0.75 = 1/3; b: (0.25-0.5)/0.5 = -0.5; c: 0.2 -> mean = (1/3 - 0.5 + 0.2)/3
    assert res["tasks"]["a"]["centered"] == pytest.approx(1 / 3)
    assert res["tasks"]["b"]["centered"] == pytest.approx(-0.5)
    assert res["core"] == pytest.approx((1 / 3 - 0.5 + 0.2) / 3)
    assert res["label"] == "CORE" and res["missing"] == []


def test_missing_task_file_gives_partial_label(tmp_path):
    bundle = write_bundle(tmp_path / "b", {"mc": ("multiple_choice", 0, " ", MC_ROWS),
                                           "lm": ("language_modeling", 0, " ", LM_ROWS)},
                          {"mc": 25, "lm": 0, "gone": 50}, total_tasks=["gone"])
    res = ce.evaluate_core(SuccessorModel(), CharTok(), bundle, progress=False)
    assert res["label"] == "CORE-2/3" and res["missing"] == ["gone"]
    assert res["tasks"]["mc"]["accuracy"] == 0.5 and res["tasks"]["mc"]["n"] == 4
    assert res["core"] == pytest.approx(((0.5 - 0.25) / 0.75 + 1 / 3) / 2)


def test_corrupt_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(MC_ROWS[0]) + "\n" + '{"query": "x", "choices": [\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:2: invalid JSON"):
        load_task_data(p, "multiple_choice")
    p.write_text(json.dumps({"query": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:1: .*lacks key\(s\) \['choices', 'gold'\]"):
        load_task_data(p, "multiple_choice")


# -- batching and cropping ------------------------------------------------------------------------------
def _reference_one_by_one(model, rows, task):
    """One forward per example, no padding, no batching: the plain definition of the metric."""
    out = []
    for i in range(len(rows)):
        ex = ce.prepare_example(CharTok(), rows[i], task, ce.fewshot_for(rows, i, task.num_fewshot))
        out.append(ce.score_examples(model, [ex], task.task_type, 0, batch_size=1)[0])
    return out


def test_batched_equals_one_at_a_time():
    model = tiny_gpt(seq_len=256)
    mc, lm = hand_rows()
    for rows, task in [(mc, TaskSpec("m", "", "multiple_choice", 2, " ")),
                       (lm, TaskSpec("l", "", "language_modeling", 2, "\nAnswer: "))]:
        exs = [ce.prepare_example(CharTok(), rows[i], task, ce.fewshot_for(rows, i, 2)) for i in range(len(rows))]
        batched = ce.score_examples(model, exs, task.task_type, 0, batch_size=16)
        assert batched == _reference_one_by_one(model, rows, task)  # no near-ties: see the 2-process test
    calls = SuccessorModel()
    ce.evaluate_task(calls, CharTok(), MC_ROWS, MC, batch_size=16, progress=False)
    assert calls.calls == 1  # all 4 examples (9 rows) share one forward


def test_crop_left_shifts_region():
    ex = ce.Prepared([list(range(10)), list(range(6))], [7, 3], [10, 6], 0)
    out = ce.crop_left(ex, 5)
    assert out.rows == [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]]
    assert out.starts == [2, 2] and out.ends == [5, 5]
    with pytest.raises(ValueError, match="does not fit into max_seq_len=3"):
        ce.crop_left(ex, 3, "task x example 0")


def test_left_truncation_keeps_scores():
    # With 3 few-shot blocks the prompts exceed 12 tokens; the successor model only looks at the current
    # token, so cropping must leave every verdict unchanged if the scored tokens are kept.
    task = TaskSpec("mc", "", "multiple_choice", 3, " ")
    full = ce.evaluate_task(SuccessorModel(), CharTok(), MC_ROWS, task, progress=False)
    cropped = ce.evaluate_task(SuccessorModel(max_seq_len=12), CharTok(), MC_ROWS, task, progress=False)
    assert full == cropped == (2, 4, 0)
    lm_task = TaskSpec("lm", "", "language_modeling", 2, " ")
    assert ce.evaluate_task(SuccessorModel(max_seq_len=9), CharTok(), LM_ROWS, lm_task, progress=False) == (1, 3, 0)


def test_examples_longer_than_the_context_count_as_incorrect():
    task = TaskSpec("mc", "", "multiple_choice", 3, " ")
    # a 2-token context cannot hold any choice's scored tokens plus one token of context
    assert ce.evaluate_task(SuccessorModel(max_seq_len=2), CharTok(), MC_ROWS, task, progress=False) == (0, 4, 4)


# -- distributed ----------------------------------------------------------------------------------------
def test_two_process_equals_one_process_core_and_bpb(gloo_checks):
    # the 2-rank run: tests/_core_eval_worker.py on _eval_helpers.two_task_bundle, in the session's shared launch
    # (conftest.gloo_checks), which wrote the bundle beside its result
    bundle = gloo_checks / "core_eval_bundle"
    one = ce.evaluate_core(tiny_gpt(seq_len=256), CharTok(), bundle, batch_size=4, progress=False)
    two = json.loads((gloo_checks / "core_eval.json").read_text())
    # correctness counts compare exactly although the two runs batch rows differently (float32 logits differ in
    # the last bits): these rows have no near-ties (measured: best vs second-best MC mean loss >= 0.019, greedy
    # top-2 logit gaps >= 1e-4, against ~1e-6 of float32 noise)
    assert two["tasks"] == one["tasks"] and two["core"] == pytest.approx(one["core"])
    assert not math.isnan(one["core"])
    # the worker also runs document-reset bpb over 2 ranks: it must equal the 1-process value
    from nanochat.loss_eval import bpb_rows_from_text, evaluate_bpb, iter_row_batches

    x, y = bpb_rows_from_text(CharTok(), ["abc def ghi. jkl", "mno pqr", "stu vwx yz"], seq_len=8)
    bpb = evaluate_bpb(tiny_gpt(seq_len=256), iter_row_batches(x, y, 2), CharTok().token_bytes())
    assert two["bpb"] == pytest.approx(bpb, rel=1e-6)


def test_an_example_that_fails_on_one_rank_stops_every_rank(tmp_path, monkeypatch):
    """Examples are prepared per rank: a bad one on rank 1 must stop rank 0 too with the same message (no rank
    left waiting alone in the all_reduce, which NCCL would only end at its timeout). 2 ranks as threads of this
    process (tests/_thread_ranks.py: a hang shows as a rank left in a collective); what a rank's error does to the
    processes of a launch is base_eval's (test_base_eval_errors_ranks, test_base_eval_ranks)."""
    import torch.distributed as dist

    from _thread_ranks import BUILD_LOCK, run_ranks

    mc, _ = hand_rows(6)
    bundle = write_bundle(tmp_path / "b", {"mc": ("multiple_choice", 0, " ", mc)}, {"mc": 25})
    real = ce.prepare_example

    def prepare(*args, **kwargs):  # e.g. a tokenizer prefix failure seen on rank 1 only
        if dist.get_rank() == 1:
            raise ValueError(f"{args[-1]}: the tokens of the prompt without continuation are not a strict prefix")
        return real(*args, **kwargs)

    monkeypatch.setattr(ce, "prepare_example", prepare)

    def rank_main(rank: int, world: int) -> str:
        with BUILD_LOCK:  # one global RNG for every thread
            model = tiny_gpt(seq_len=256)
        with pytest.raises(ValueError) as raised:
            ce.evaluate_core(model, CharTok(), bundle, batch_size=4, progress=False)
        return str(raised.value)

    said = run_ranks(2, rank_main)
    assert all(s.startswith("rank 1 of 2: ") and "not a strict prefix" in s for s in said), said  # on both ranks


@pytest.mark.parametrize("row, needle", [
    ({"query": "q", "choices": ["a", "b"], "gold": 2}, "'gold' must be an index into 'choices' (0..1), got 2"),
    ({"query": "q", "choices": ["a", "b"], "gold": "0"}, "'gold' must be an index into 'choices' (0..1), got '0'"),
    ({"query": "q", "choices": [], "gold": 0}, "'choices' must be a non-empty list of strings"),
    ({"query": 3, "choices": ["a"], "gold": 0}, "'query' must be a string"),
])
def test_bad_row_values_name_file_and_line(tmp_path, row, needle):
    """A gold index out of range would be scored as a wrong answer (0-shot) or crash only when the row is drawn
    as a few-shot example: refused when the file is read."""
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(MC_ROWS[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:2: multiple_choice row: " + re.escape(needle)):
        load_task_data(p, "multiple_choice")
    s = tmp_path / "s.jsonl"
    s.write_text(json.dumps({"context_options": ["a", "b"], "continuation": "c", "gold": -1}) + "\n")
    with pytest.raises(ValueError, match=r"s\.jsonl:1: schema row: 'gold' must be an index"):
        load_task_data(s, "schema")
    lm = tmp_path / "lm.jsonl"
    lm.write_text(json.dumps({"context": "a", "continuation": None}) + "\n")
    with pytest.raises(ValueError, match=r"lm\.jsonl:1: language_modeling row: 'continuation' must be a string"):
        load_task_data(lm, "language_modeling")


def test_missing_baseline_and_empty_file_fail_up_front(tmp_path):
    bundle = write_bundle(tmp_path / "b", {"mc": ("multiple_choice", 0, " ", MC_ROWS)}, {"other": 25})
    with pytest.raises(KeyError, match=r"no random baseline for \['mc'\]"):
        ce.evaluate_core(SuccessorModel(), CharTok(), bundle, progress=False)
    bundle = write_bundle(tmp_path / "c", {"mc": ("multiple_choice", 0, " ", [])}, {"mc": 25})
    with pytest.raises(ValueError, match=r"mc\.jsonl \(task mc\) has no rows"):
        ce.evaluate_core(SuccessorModel(), CharTok(), bundle, progress=False)


# -- resuming from finished parts ------------------------------------------------------------------------
def test_parts_an_older_version_finished_with_cap_0_are_reused_as_all(tmp_path, capsys):
    """Older versions took --core-max-per-task 0 for "all" and kept it in the key of each finished task; read as -1
    (the same rows), such a task is reused, not scored again. Any other cap is still other inputs."""
    from nanochat.eval_resume import FinishedResults

    bundle = write_bundle(tmp_path / "b", {"mc": ("multiple_choice", 0, " ", MC_ROWS),
                                           "lm": ("language_modeling", 0, " ", LM_ROWS)}, {"mc": 25, "lm": 0})
    out = tmp_path / "o"
    out.mkdir()

    def run():
        finished = FinishedResults.open(out, "core", lambda: {"model": "successor"}, fresh=False)
        return ce.evaluate_core(SuccessorModel(), CharTok(), bundle, progress=False, finished=finished), finished

    first, _ = run()
    partial = out / "core.partial.json"
    saved = json.loads(partial.read_text())
    saved["items"]["mc"]["key"]["max_per_task"] = 0  # as an older version recorded it
    saved["items"]["mc"]["result"]["accuracy"] = 0.125  # not what scoring gives: shows the result was reused
    saved["items"]["lm"]["key"]["max_per_task"] = 5
    partial.write_text(json.dumps(saved))
    capsys.readouterr()
    again, finished = run()
    assert finished.reused == ["mc"] and again["tasks"]["mc"]["accuracy"] == 0.125
    assert again["tasks"]["lm"] == first["tasks"]["lm"]
    assert "the inputs of lm changed (max_per_task 5 -> -1); recomputing it" in capsys.readouterr().out
    assert [v["key"]["max_per_task"] for v in json.loads(partial.read_text())["items"].values()] == [-1, -1]


class _StopsAtSecondBatch(SuccessorModel):
    def forward(self, *args, **kwargs):
        if self.calls == 1:
            raise KeyboardInterrupt  # what a signal raises mid-task (base_eval turns it into its one line)
        return super().forward(*args, **kwargs)


def test_an_interrupted_task_clears_its_progress_bar(capsys):
    """base_eval prints its 'interrupted ...; finished results are kept' line to stderr right after; an
    unclosed bar left the line glued to the bar's text ('0/6 [00:00<?, ?it/s]base_eval: interrupted')."""
    from tqdm import tqdm

    try:
        ce.evaluate_task(_StopsAtSecondBatch(), CharTok(), MC_ROWS, MC, batch_size=1, progress=True)
    except KeyboardInterrupt:  # its traceback keeps the task's frame alive here, as in base_eval's handler
        err = capsys.readouterr().err
        assert "mc" in err and err.endswith("\r")  # the bar was drawn, then its line cleared (leave=False)
        assert not [bar for bar in tqdm._instances if not bar.disable]
    else:
        pytest.fail("the model's KeyboardInterrupt did not propagate")
