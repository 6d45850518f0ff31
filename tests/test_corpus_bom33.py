"""A --bpb-corpus text file saved with a UTF-8 byte order mark (some editors) reads as the same document as the
file without one: the BOM's 3 bytes counted in its bpb before (the .jsonl reader already dropped it)."""

from nanochat.loss_eval import read_corpus


def test_a_leading_bom_is_not_part_of_a_text_corpus(tmp_path):
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("call me Ishmael\ufeff inside\n", encoding="utf-8")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert read_corpus(marked) == read_corpus(plain) == ["call me Ishmael\ufeff inside\n"]  # one inside stays
