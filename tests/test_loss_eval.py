"""bits-per-byte: hand-computed value on the rigged model, BOS/ignored masking, document-reset rows."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _eval_helpers import BOOST, LOG_Z, CharTok, SuccessorModel, succ  # noqa: E402

from nanochat.loss_eval import bpb_rows_from_text, evaluate_bpb, iter_row_batches, read_corpus  # noqa: E402

a, b, c, x = (CharTok().encode(ch)[0] for ch in "abcx")


def test_bpb_hand_computation_masks_bos_and_ignored():
    token_bytes = CharTok().token_bytes()
    token_bytes[b] = 2  # a 2-byte token, to check the byte weighting
    inputs = torch.tensor([[0, a, b, c], [c, x, 0, a]])
    targets = torch.tensor([[a, b, c, x], [x, 0, a, -1]])
    # row 0: a (boosted, 1 B), b (boosted, 2 B), c (boosted, 1 B), x after c (not boosted, 1 B)
    # row 1: x after c (1 B), BOS target (0 B: excluded), a after BOS (boosted, 1 B), -1 ignored
    nats = 3 * (LOG_Z - BOOST) + LOG_Z + LOG_Z + (LOG_Z - BOOST)
    expected = nats / (math.log(2) * (1 + 2 + 1 + 1 + 1 + 1))
    got = evaluate_bpb(SuccessorModel(), [(inputs, targets)], token_bytes)
    assert got == pytest.approx(expected, rel=1e-6)
    # splitting into batches changes nothing (sums, not a mean of means)
    split = [(inputs[:1], targets[:1]), (inputs[1:], targets[1:])]
    assert evaluate_bpb(SuccessorModel(), split, token_bytes) == pytest.approx(expected, rel=1e-6)


def test_bpb_without_counted_targets_is_an_error():
    with pytest.raises(ValueError, match="no target with a positive byte count"):
        evaluate_bpb(SuccessorModel(), [], CharTok().token_bytes())
    with pytest.raises(ValueError, match="no target with a positive byte count"):
        evaluate_bpb(SuccessorModel(), [(torch.tensor([[a]]), torch.tensor([[0]]))], CharTok().token_bytes())


def test_document_reset_rows():
    xs, ys = bpb_rows_from_text(CharTok(), ["abc", "de"], seq_len=2)
    d, e = CharTok().encode("de")
    # "abc" -> [BOS a b c]: windows ([BOS a] -> [a b]) and ([b c] -> [c, ignored]); "de" restarts at BOS
    assert xs.tolist() == [[0, a], [b, c], [0, d]]
    assert ys.tolist() == [[a, b], [c, -1], [d, e]]
    xs, ys = bpb_rows_from_text(CharTok(), ["abc", "de"], seq_len=2, max_tokens=4)
    assert xs.shape == (2, 2)


def test_document_reset_bpb_equals_per_document_sum():
    docs = ["abc xyz", "hello world", "a"]
    xs, ys = bpb_rows_from_text(CharTok(), docs, seq_len=4)
    got = evaluate_bpb(SuccessorModel(), iter_row_batches(xs, ys, 2), CharTok().token_bytes())
    nats = nbytes = 0
    for doc in docs:  # score each document from BOS with the successor rule
        toks = [0] + CharTok().encode(doc)
        for p, t in zip(toks[:-1], toks[1:]):
            nats += LOG_Z - (BOOST if succ(p) == t else 0.0)
            nbytes += 1
    assert got == pytest.approx(nats / (math.log(2) * nbytes), rel=1e-6)


def test_iter_row_batches_partitions_rows_across_ranks():
    xs = torch.arange(7).view(7, 1)
    seen = [int(v) for r in range(3) for bx, _ in iter_row_batches(xs, xs, 2, rank=r, world_size=3) for v in bx]
    assert sorted(seen) == list(range(7))


def test_read_corpus(tmp_path):
    (tmp_path / "t.txt").write_text("one doc\n\nstill one")
    assert read_corpus(tmp_path / "t.txt") == ["one doc\n\nstill one"]
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n{"text": "y"}\n{"txt": 1}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:3"):
        read_corpus(tmp_path / "d.jsonl")
    with pytest.raises(FileNotFoundError, match="--bpb-corpus"):
        read_corpus(tmp_path / "nope.txt")
