"""Peak host memory and time of the rows of a large single-document --bpb-corpus (the paper's enwik9 is 1 GB, one
document): read and encoded whole (as before: read_corpus, then every token) vs read and encoded only as far as
--eval-tokens needs (as base_eval's corpus_rows now: corpus_documents' TextFile, Tokenizer.encode_prefix).

    python bench/big_corpus.py --mode whole   --size-mb 200 --eval-tokens 65536
    python bench/big_corpus.py --mode prefix  --size-mb 200 --eval-tokens 65536

One mode per process (the peak is the process's). The synthetic corpus (--path, written once if missing) is the
embedded Gutenberg books (data/embedded) repeated to --size-mb as one document, with enwik9-like markup every few
paragraphs; the tokenizer (--tokenizer-dir, trained once if missing: --vocab-size on its first 2 MB) is saved
beside it. Phases: read (read_corpus: the text; corpus_documents: nothing yet), rows (bpb_rows_from_text).
Printed: one JSON line with the peak resident set (VmHWM) after each phase, the resident set before, the seconds
of each phase and a hash of the rows (equal in both modes, or the prefix encoding is wrong).
"""

import argparse
import hashlib
import json
import lzma
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.proc_mem import resident_mib  # noqa: E402
from nanochat.loss_eval import bpb_rows_from_text, corpus_documents, read_corpus  # noqa: E402
from nanochat.tokenizer import Tokenizer  # noqa: E402


def write_corpus(path: Path, size_mb: int) -> None:
    books = [lzma.decompress(p.read_bytes()).decode("utf-8") for p in sorted((REPO / "data/embedded").glob("*.xz"))]
    paragraphs = [p for b in books for p in b.split("\n\n") if p.strip()]
    target, n, i = size_mb * 1_000_000, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while n < target:
            chunk = f"  <page>\n    <title>Page {i}</title>\n    <id>{i}</id>\n    <text xml:space=\"preserve\">" \
                + "\n\n".join(paragraphs[(i * 7 + j) % len(paragraphs)] for j in range(6)) + "</text>\n  </page>\n"
            f.write(chunk)
            n += len(chunk.encode("utf-8"))
            i += 1


class WholeDocument:
    """The tokenizer without encode_prefix: bpb_rows_from_text then encodes every document whole (as before)."""

    def __init__(self, tok):
        self.tok, self.bos_token_id = tok, tok.bos_token_id

    def encode(self, text):
        return self.tok.encode(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["whole", "prefix"], required=True)
    ap.add_argument("--size-mb", type=int, default=200)
    ap.add_argument("--eval-tokens", type=int, default=65536)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--path", type=Path, default=Path("/tmp/big_corpus_bench/corpus.txt"))
    ap.add_argument("--tokenizer-dir", type=Path, default=None)
    args = ap.parse_args()
    tok_dir = args.tokenizer_dir or args.path.parent / f"tokenizer_{args.vocab_size}"
    if not args.path.is_file():
        args.path.parent.mkdir(parents=True, exist_ok=True)
        write_corpus(args.path, args.size_mb)
    if not (tok_dir / "tokenizer.json").is_file():
        with open(args.path, encoding="utf-8") as f:
            head = f.read(2_000_000)
        Tokenizer.train_from_iterator(iter(head.split("\n\n")), vocab_size=args.vocab_size).save(tok_dir)
    tok = Tokenizer.load(tok_dir)
    before = resident_mib()
    t0 = time.perf_counter()
    docs = corpus_documents(args.path) if args.mode == "prefix" else read_corpus(args.path)
    read_s, after_read = time.perf_counter() - t0, resident_mib()
    t0 = time.perf_counter()
    x, y = bpb_rows_from_text(tok if args.mode == "prefix" else WholeDocument(tok), docs, args.seq_len,
                              max_tokens=args.eval_tokens)
    rows_s, after_rows = time.perf_counter() - t0, resident_mib()
    print(json.dumps({"mode": args.mode, "file_mb": round(args.path.stat().st_size / 1e6, 1),
                      "eval_tokens": args.eval_tokens, "rows": list(x.shape), "rss_before_mb": round(before["VmRSS"]),
                      "peak_after_read_mb": round(after_read["VmHWM"]),
                      "peak_after_rows_mb": round(after_rows["VmHWM"]),
                      "read_s": round(read_s, 2), "rows_s": round(rows_s, 2),
                      "rows_sha256": hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16]}))


if __name__ == "__main__":
    main()
