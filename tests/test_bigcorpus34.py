"""A large single-document corpus (enwik9: 1 GB, one document) is encoded only as far as the token budget needs,
with the same rows as encoding every document whole (the functions as they were, kept below as the reference).

The exactness rests on nanochat.tokenizer.prefix_cut's argument (a cut after an ASCII letter before an ASCII
non-letter): checked here at every such cut of adversarial text (Unicode, digits, contractions, whitespace runs,
CRLF) and at random cuts of the shared books; the arbitrary cuts beside them show the check can fail."""

import random

import pytest
import torch

from nanochat.analysis import _cap_rows, text_rows
from nanochat.loss_eval import TextFile, bpb_rows_from_text, encode_document, read_corpus
from nanochat.tokenizer import SPLIT_PATTERN, Tokenizer, prefix_cut


# -- the reference: the whole-document functions as they were before the prefix encoding --------------------------
def bpb_rows_whole(tokenizer, documents, seq_len, max_tokens=None):
    bos = tokenizer.bos_token_id
    max_rows = max(1, max_tokens // seq_len) if max_tokens else None
    inputs, targets = [], []
    for doc in documents:
        toks = [bos] + list(tokenizer.encode(doc))
        for s in range(0, len(toks) - 1, seq_len):
            x, y = toks[s : s + seq_len], toks[s + 1 : s + seq_len + 1]
            inputs.append(x + [bos] * (seq_len - len(x)))
            targets.append(y + [-1] * (seq_len - len(y)))
            if max_rows is not None and len(inputs) >= max_rows:
                return torch.tensor(inputs, dtype=torch.long), torch.tensor(targets, dtype=torch.long)
    return torch.tensor(inputs, dtype=torch.long), torch.tensor(targets, dtype=torch.long)


def text_rows_whole(tokenizer, documents, seq_len):
    rows = []
    for doc in documents:
        toks = torch.tensor([tokenizer.bos_token_id] + tokenizer.encode(doc), dtype=torch.long)
        rows.extend(toks[s : s + seq_len] for s in range(0, len(toks), seq_len))
    return [r for r in rows if len(r) > 0]


class WholeEncodings:
    """The reference's tokenizer: whole-document encodings (no encode_prefix), each document's computed once."""

    def __init__(self, tok):
        self.tok, self.bos_token_id, self.cache = tok, tok.bos_token_id, {}

    def encode(self, text):
        if text not in self.cache:
            self.cache[text] = self.tok.encode(text)
        return self.cache[text]


class Recording:
    """``tok`` whose encode records the length of every text it is given (Tokenizer.encode_prefix calls it)."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def __enter__(self):
        self.tok.encode = self._encode
        return self

    def __exit__(self, *exc):
        del self.tok.encode  # back to the class's method

    def _encode(self, text):
        self.lengths.append(len(text))
        return Tokenizer.encode(self.tok, text)


# pieces that meet every alternative of SPLIT_PATTERN and the seams between them
PIECES = ["the", "The", "THE", "x", "naïve", "Straße", "мир", "Ελλάδα", "日本語", "한국어", "e\u0301", "\u00e9t\u00e9",
          "'s", "'S", "'ll", "'LL", "'ve", "'re", "'d", "'m", "'t", "'x", "''", "don't", "it'll",
          "0", "12", "345", "2026", "3.14", "1,000", "\u0663\u0664", "\u00bd",
          " ", "  ", "    ", "\t", " \t ", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", " \r\n", "\r", " \n ",
          "\u00a0", "\u2003", "\u3000",
          ".", ",", "!?", "...", "--", "<page>", "</text>", "[[", "]]", "{{", "}}", "&amp;", "@", "_", "`", "~",
          "\U0001f600", "\U0001f468\u200d\U0001f469", "\ufeff", "\x00", "\x7f", "\u200b"]


def adversarial_text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(PIECES) for _ in range(n))


def all_cuts(text: str) -> list[int]:
    cuts, c = [], prefix_cut(text, 0)
    while c is not None:
        cuts.append(c)
        c = prefix_cut(text, c + 1)
    return cuts


def test_prefix_cut_positions():
    assert all_cuts("ab cd.e") == [2, 5]  # after b (space), d (.); "e" ends the text: no cut there
    assert all_cuts("é x9y\r\nZ") == [3, 5]  # é is not ASCII; 9 and \r are ASCII non-letters
    assert all_cuts("日本 ab,") == [5] and all_cuts("abc") == [] and all_cuts("") == []
    assert prefix_cut("ab cd.e", 3) == 5 and prefix_cut("ab cd.e", 2) == 2 and prefix_cut("ab cd.e", 7) is None


def test_every_cut_of_adversarial_text_encodes_a_prefix(tiny_tokenizer):
    assert tiny_tokenizer.pattern == SPLIT_PATTERN
    bad_arbitrary = 0
    for seed in range(6):
        text = adversarial_text(seed, 1500)
        whole = tiny_tokenizer.encode(text)
        cuts = all_cuts(text)
        assert len(cuts) > 100
        for c in cuts:
            toks = tiny_tokenizer.encode(text[:c])
            assert toks == whole[: len(toks)], (seed, c, text[c - 10 : c + 10])
            assert tiny_tokenizer.decode_bytes(toks) == text[:c].encode("utf-8")  # the cut ends a piece
        # the check is not vacuous: arbitrary cuts (inside whitespace runs, digit groups, words) do break it
        for c in random.Random(seed).sample(range(1, len(text)), 300):
            toks = tiny_tokenizer.encode(text[:c])
            bad_arbitrary += toks != whole[: len(toks)]
    assert bad_arbitrary > 50


def test_random_cuts_of_shared_books_encode_a_prefix(tiny_tokenizer, shared_dir):
    files = sorted((shared_dir / "data" / "gutenberg").glob("*.txt")) + [shared_dir / "data/tinyshakespeare/input.txt"]
    rng = random.Random(0)
    for path in files:
        text = path.read_text(encoding="utf-8-sig")
        start = rng.randrange(0, max(1, len(text) - 30_000))
        text = text[start : start + 30_000]
        whole = tiny_tokenizer.encode(text)
        for at in rng.sample(range(len(text)), 12):
            c = prefix_cut(text, at)
            if c is None:
                continue
            toks = tiny_tokenizer.encode(text[:c])
            assert toks == whole[: len(toks)], (path.name, c)
        # CRLF line ends (Windows copies of the books) and long whitespace runs
        for variant in (text.replace("\n", "\r\n"), text.replace(" ", "   \t ").replace("\n", " \n\n   ")):
            whole = tiny_tokenizer.encode(variant)
            for at in rng.sample(range(len(variant)), 6):
                c = prefix_cut(variant, at)
                if c is not None:
                    toks = tiny_tokenizer.encode(variant[:c])
                    assert toks == whole[: len(toks)], (path.name, c)


def test_encode_prefix_reads_only_what_it_needs(tiny_tokenizer):
    text = adversarial_text(7, 40_000)
    whole = tiny_tokenizer.encode(text)
    for need in (0, 1, 50, 999, 4000, len(whole) - 1, len(whole), len(whole) + 5):
        with Recording(tiny_tokenizer) as rec:
            toks = tiny_tokenizer.encode_prefix(text, need)
        assert toks == whole[: len(toks)] and len(toks) >= min(need, len(whole)), need
        if need <= 4000:  # a prefix, grown a few times at most
            assert max(rec.lengths) < len(text) // 2 and len(rec.lengths) <= 4, (need, rec.lengths)
    assert tiny_tokenizer.encode_prefix(text, len(whole) + 5) == whole


def test_text_without_a_cut_or_another_pattern_encodes_whole(tiny_tokenizer, tmp_path):
    no_cut = "日本語 123 " * 5000 + "éé"
    assert prefix_cut(no_cut, 0) is None
    assert tiny_tokenizer.encode_prefix(no_cut, 10) == tiny_tokenizer.encode(no_cut)
    (tmp_path / "no_cut.txt").write_text(no_cut, encoding="utf-8")
    assert tiny_tokenizer.encode_prefix(TextFile(tmp_path / "no_cut.txt"), 10) == tiny_tokenizer.encode(no_cut)
    gpt2_pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    other = Tokenizer(tiny_tokenizer.mergeable_ranks, pattern=gpt2_pattern)  # the argument is SPLIT_PATTERN's only
    text = adversarial_text(3, 3000)
    assert other.encode_prefix(text, 10) == other.encode(text)
    # a tokenizer without encode_prefix (the tests' character tokenizers) encodes whole documents as before
    from _eval_helpers import CharTok  # noqa: E402

    assert encode_document(CharTok(), "abc de", need=1) == list(CharTok().encode("abc de"))


def corpora(shared):
    """(name, documents): single documents longer and shorter than the budgets, several documents, CRLF."""
    out = [("adversarial", [adversarial_text(11, 30_000)]),
           ("short", ["A short document.\nTwo lines."]),
           ("several", [adversarial_text(12, 3000), "", "tiny", adversarial_text(13, 20_000),
                        adversarial_text(14, 50)]),
           ("crlf", [adversarial_text(15, 20_000).replace("\n", "\r\n")])]
    if shared is not None:
        book = (shared / "data/gutenberg/pg2701_moby_dick.txt").read_text(encoding="utf-8-sig")
        out += [("moby", [book[:120_000]]), ("moby-crlf", [book[:50_000].replace("\n", "\r\n")]),
                ("shakespeare", [(shared / "data/tinyshakespeare/input.txt").read_text(encoding="utf-8")[:100_000]])]
    return out


@pytest.fixture
def shared_or_none(request):
    from conftest import SHARED

    return SHARED if SHARED.is_dir() else None


@pytest.mark.parametrize("seq_len", [pytest.param(3, marks=pytest.mark.slow), 64,
                                     pytest.param(256, marks=pytest.mark.slow)])  # 3 s each
def test_rows_equal_the_whole_document_rows(tiny_tokenizer, shared_or_none, seq_len):
    whole = WholeEncodings(tiny_tokenizer)
    for name, docs in corpora(shared_or_none):
        total = sum(1 + len(whole.encode(d)) for d in docs)
        budgets = [1, seq_len, seq_len + 1, 3 * seq_len - 1, 1000, 4096]
        if total // seq_len < 2000:  # the whole-document budgets, where the rows are few (Python lists are slow)
            budgets += [None, total - 1, total, total + seq_len]
        for max_tokens in budgets:
            got, want = bpb_rows_from_text(tiny_tokenizer, docs, seq_len, max_tokens), \
                bpb_rows_whole(whole, docs, seq_len, max_tokens)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (name, seq_len, max_tokens)
            got = _cap_rows(text_rows(tiny_tokenizer, docs, seq_len, max_tokens), max_tokens)
            want = _cap_rows(text_rows_whole(whole, docs, seq_len), max_tokens)
            assert [len(r) for r in got] == [len(r) for r in want], (name, seq_len, max_tokens)
            assert torch.equal(torch.cat(got), torch.cat(want)), (name, seq_len, max_tokens)


class ShortestPrefix(WholeEncodings):
    """The least encode_prefix may give: exactly ``need`` tokens (or all of them): the callers must ask for enough."""

    def encode_prefix(self, text, need):
        return self.encode(text)[: max(need, 0)]


def test_rows_from_the_shortest_allowed_prefixes(tiny_tokenizer):
    whole, shortest = WholeEncodings(tiny_tokenizer), ShortestPrefix(tiny_tokenizer)
    docs = [adversarial_text(41, 300), "", "x", adversarial_text(42, 2000), adversarial_text(43, 500)]
    total = sum(1 + len(whole.encode(d)) for d in docs)
    for seq_len in (2, 5, 64):
        for max_tokens in sorted({1, 2, 3, seq_len, seq_len + 1, 2 * seq_len, 100, 101, total - 2, total - 1, total,
                                  total + 1, total + seq_len}):
            got, want = bpb_rows_from_text(shortest, docs, seq_len, max_tokens), \
                bpb_rows_whole(whole, docs, seq_len, max_tokens)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (seq_len, max_tokens)
            got = _cap_rows(text_rows(shortest, docs, seq_len, max_tokens), max_tokens)
            want = _cap_rows(text_rows_whole(whole, docs, seq_len), max_tokens)
            assert [len(r) for r in got] == [len(r) for r in want], (seq_len, max_tokens)
            assert torch.equal(torch.cat(got), torch.cat(want)), (seq_len, max_tokens)


def test_file_rows_equal_the_whole_file_rows(tiny_tokenizer, tmp_path):
    """A one-document file read lazily (TextFile: CRLF and lone CR read as \\n, a BOM dropped) gives the rows of
    the file read whole."""
    whole = WholeEncodings(tiny_tokenizer)
    for i, text in enumerate([adversarial_text(31, 20_000), "Short.\r\nDoc", "\ufeff" + adversarial_text(32, 5000)]):
        path = tmp_path / f"c{i}.txt"
        path.write_bytes(text.replace("\n", "\r\n").encode("utf-8"))
        docs = read_corpus(path)
        assert "\r\n" not in docs[0]
        for seq_len, max_tokens in [(64, 1), (64, 64), (64, 1000), (7, 4096), (256, None), (256, 10**6)]:
            got, want = bpb_rows_from_text(tiny_tokenizer, [TextFile(path)], seq_len, max_tokens), \
                bpb_rows_whole(whole, docs, seq_len, max_tokens)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (i, seq_len, max_tokens)
            got = _cap_rows(text_rows(tiny_tokenizer, [TextFile(path)], seq_len, max_tokens), max_tokens)
            want = _cap_rows(text_rows_whole(whole, docs, seq_len), max_tokens)
            assert [len(r) for r in got] == [len(r) for r in want] and torch.equal(torch.cat(got), torch.cat(want))


def test_text_file_prefix_is_the_start_of_the_whole_read(tmp_path):
    """TextFile.prefix(n) is the first n characters of the file read whole as before (read_text: UTF-8, a leading
    BOM dropped, bad bytes replaced, universal newlines), also where a read's end splits a character, a \r\n or a
    bad sequence (TextIOWrapper decodes 8 KB at a time)."""
    rng = random.Random(5)
    pieces = [b"a", b"word ", b"\r\n", b"\r", b"\n", b"\r\r\n", "\u00e9".encode(), "\u65e5".encode(),
              "\U0001f600".encode(), b"\xff", b"\xe2\x82", b"\xc3", b"\xf0\x9f\x98", b"\x00", b"\xef\xbb\xbf"]
    for seed in range(3):
        path = tmp_path / f"doc{seed}.txt"
        path.write_bytes(b"\xef\xbb\xbf" * (seed != 1) + b"".join(rng.choice(pieces) for _ in range(20_000)))
        whole = path.read_text(encoding="utf-8-sig", errors="replace")  # read_corpus as it was
        assert read_corpus(path) == [whole] and TextFile(path).read() == whole
        near_chunks = [k * 8192 + d for k in range(1, 8) for d in (-2, -1, 0, 1, 2)]
        for n in [0, 1, 2, len(whole) - 1, len(whole), len(whole) + 1, 10 * len(whole)] + near_chunks \
                + rng.sample(range(len(whole)), 100):
            assert TextFile(path).prefix(n) == whole[:n], (seed, n)


def test_a_large_single_document_is_read_and_encoded_only_as_far_as_the_budget(tiny_tokenizer, tmp_path,
                                                                                 monkeypatch):
    """The --bpb-corpus and file: paths on a 1.5 MB one-document file at a 2,048-position budget: the rows are the
    whole document's, and no text past ~10% of the document is read or encoded (before: all of it, on every
    rank)."""
    from nanochat.analysis import build_domains
    from scripts.base_eval import corpus_rows

    path = tmp_path / "big.txt"
    path.write_text(adversarial_text(21, 200_000), encoding="utf-8")
    (doc,) = read_corpus(path)
    asked, prefix = [], TextFile.prefix

    def recorded_prefix(self, n):
        asked.append(n)
        return prefix(self, n)

    def no_whole_read(self):
        raise AssertionError("the whole file was read")

    monkeypatch.setattr(TextFile, "prefix", recorded_prefix)
    monkeypatch.setattr(TextFile, "read", no_whole_read)
    with Recording(tiny_tokenizer) as rec:
        got = corpus_rows(tiny_tokenizer, path, 128, 2048)
        (domain,) = build_domains([f"file:{path}"], tiny_tokenizer, 128, max_tokens=2048)
    monkeypatch.undo()
    assert 0 < max(rec.lengths) < len(doc) // 10 and 0 < max(asked) < len(doc) // 10, (rec.lengths, asked)
    want = bpb_rows_whole(tiny_tokenizer, [doc], 128, 2048)
    assert got[0].shape == (16, 128) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    want_rows = _cap_rows(text_rows_whole(tiny_tokenizer, [doc], 128), 2048)
    assert [len(r) for r in domain.rows] == [128] * 16
    assert all(torch.equal(a, b) for a, b in zip(domain.rows, want_rows))
