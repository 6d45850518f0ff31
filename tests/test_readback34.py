"""Session 34's read-back (helper readback34): bugs found in the session's library changes, each shown by a test."""

import torch

from nanochat.loss_eval import TextFile, bpb_rows_from_text, corpus_documents, read_corpus


# -- TextFile / encode_prefix: a budget far beyond a short file ----------------------------------------------------
def test_text_file_prefix_of_a_huge_count_reads_a_short_file_whole(tmp_path):
    # TextIOWrapper.read(n) asks the buffered reader for ~n bytes in one read1, which allocates n bytes up front: a
    # prefix of 10**15 characters (a budget, not the file's size) was a MemoryError on an 11-byte file
    path = tmp_path / "short.txt"
    path.write_text("hello world")
    assert TextFile(path).prefix(10**15) == "hello world"
    assert TextFile(path).prefix(5) == "hello"


def test_bpb_rows_of_a_short_corpus_under_a_huge_budget_are_its_whole_rows(tmp_path, tiny_tokenizer):
    # --eval-tokens 200_000_000_000 ("all of it") on a small corpus: every row, as the whole read gives them
    path = tmp_path / "small.txt"
    path.write_text("The quick brown fox jumps over the lazy dog.\nIt's 42 o'clock, isn't it?\n" * 20)
    x, y = bpb_rows_from_text(tiny_tokenizer, corpus_documents(path), 16, max_tokens=200_000_000_000)
    toks = [tiny_tokenizer.bos_token_id] + tiny_tokenizer.encode(read_corpus(path)[0])
    assert x.shape == y.shape == ((len(toks) - 1 + 15) // 16, 16)
    assert y[y >= 0].tolist() == toks[1:]
    assert torch.equal(x[:, 0], torch.tensor(toks[0 : len(toks) - 1 : 16]))
