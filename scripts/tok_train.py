"""Train the byte-level BPE tokenizer on a prepared dataset's train split and save it.

    python -m scripts.prepare_data --dataset fineweb-edu --num-shards 100
    python -m scripts.tok_train --vocab-size 32768                      # --dataset fineweb-edu, as base_train
    python -m scripts.tok_train --vocab-size 4096 --dataset embedded --output-dir tokenizer/v4096

Writes tokenizer.json / tokenizer.bpe / token_bytes.pt to --output-dir (default: $NANOCHAT_TOKENIZER_DIR or
<repo>/tokenizer), prints the compression ratio (bytes per token) on held-out val text and, last, the data directory
it was trained on.
"""

import argparse
import sys
import time
from pathlib import Path

from nanochat.cli_types import int_at_least, positive_int
from nanochat.dataset import (DataError, check_dataset_name, check_default_dir_dataset, default_data_dir,
                              iter_documents)
from nanochat.jsonfile import written_path
from nanochat.run_dir import NotWritable, ensure_writable
from nanochat.terminal import replace_unencodable_output
from nanochat.tokenizer import (DEFAULT_VOCAB_SIZE, HEADER_FILE, MIN_VOCAB_SIZE, Tokenizer, TokenizerError,
                                default_tokenizer_dir, get_tokenizer)


def capped_texts(data_dir, split: str, max_chars: int, doc_cap: int):
    """Documents of ``split`` cropped to doc_cap chars each, stopping once max_chars have been yielded. A null
    document (a shard's missing text) is empty, as the loader reads it, and skipped like one."""
    total = 0
    for doc in iter_documents(data_dir, split):
        doc = (doc or "")[:doc_cap]
        if total + len(doc) > max_chars:
            doc = doc[:max_chars - total]
        if doc:
            yield doc
        total += len(doc)
        if total >= max_chars:
            return


def compression_ratio(tokenizer: Tokenizer, texts: list[str]) -> tuple[float, int, int]:
    """(bytes per token, total bytes, total tokens) of ``texts``."""
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(ids) for ids in tokenizer.encode_batch(texts))
    if n_tokens == 0:
        raise DataError("the held-out text is empty; cannot measure compression")
    return n_bytes / n_tokens, n_bytes, n_tokens


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default (base_train shows its defaults too) but None, whose
    meaning the flag's help spells out."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--vocab-size", type=int_at_least(MIN_VOCAB_SIZE), default=DEFAULT_VOCAB_SIZE,
                   help="total vocab including the 9 special tokens")
    p.add_argument("--data-dir", default=None, help="prepared dataset (default: $NANOCHAT_DATA_DIR/<--dataset>)")
    # the default is base_train's: a tokenizer trained here by default serves the runs base_train makes by default
    p.add_argument("--dataset", type=check_dataset_name, default="fineweb-edu",
                   help="which prepared dataset --data-dir defaults to, as in base_train: fineweb-edu, climbmix, "
                   "embedded, local or hf:ORG/NAME[:CONFIG]")
    p.add_argument("--max-chars", type=positive_int, default=2_000_000_000, help="training text budget (characters)")
    p.add_argument("--doc-cap", type=positive_int, default=10_000,
                   help="crop each training document to this many chars")
    p.add_argument("--eval-chars", type=positive_int, default=5_000_000, help="held-out val text used for the ratio")
    p.add_argument("--output-dir", default=None, help="tokenizer directory (default: $NANOCHAT_TOKENIZER_DIR "
                   "or <repo>/tokenizer)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a tokenizer already in --output-dir (runs trained with it can no longer use it)")
    return p.parse_args(argv)


class SaveError(Exception):
    """The trained tokenizer could not be written (e.g. a full disk); not an OSError of reading the data."""


def train(args, data_dir: Path, out_dir: Path) -> tuple[Tokenizer, float, tuple[float, int, int]]:
    """(tokenizer, training seconds, compression on val) after saving the tokenizer to ``out_dir``."""
    if (out_dir / HEADER_FILE).is_file() and not args.overwrite:
        raise TokenizerError(f"--output-dir {out_dir} already holds a tokenizer (vocab "
                             f"{get_tokenizer(out_dir).vocab_size}); runs trained with it need it: give another "
                             "--output-dir, or --overwrite to replace it")
    ensure_writable(out_dir, "--output-dir")  # before the (long) training, not after it
    t0 = time.time()
    tok = Tokenizer.train_from_iterator(capped_texts(data_dir, "train", args.max_chars, args.doc_cap),
                                        vocab_size=args.vocab_size)
    train_s = time.time() - t0
    try:
        tok.save(out_dir)
    except OSError as e:  # save drops tokenizer.json first: what is left there is no tokenizer, never a mix
        raise SaveError(f"could not write the tokenizer to --output-dir {out_dir}: {e.strerror or e} "
                        f"({written_path(e.filename, out_dir)}); no tokenizer is left there") from e
    # the temp files of saves killed midway went with the save: each write_atomic removes its own file's
    val_texts = list(capped_texts(data_dir, "val", args.eval_chars, args.doc_cap))
    return tok, train_s, compression_ratio(tok, val_texts)


def main(argv=None) -> int:
    """Exit 2 with one error line for bad data, flags or --output-dir, and for a tokenizer that cannot be saved (a
    full disk), as the other entry points do; 130 after Ctrl-C."""
    args = parse_args(argv)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir(args.dataset)
    out_dir = Path(args.output_dir) if args.output_dir else default_tokenizer_dir()
    try:
        if not args.data_dir:  # --dataset's default directory must hold its data; a --data-dir is read as it is
            check_default_dir_dataset(data_dir, args.dataset)
        tok, train_s, (ratio, n_bytes, n_tokens) = train(args, data_dir, out_dir)
    except (DataError, TokenizerError, NotWritable, SaveError, OSError) as e:  # OSError: an unreadable data file
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tok_train: interrupted; --output-dir {out_dir} holds the tokenizer it held before, or none if the "
              "save had begun", file=sys.stderr)
        return 130
    print(f"compression on held-out val: {ratio:.3f} bytes/token ({n_bytes:,} bytes -> {n_tokens:,} tokens)")
    print(f"trained vocab {tok.vocab_size} (bos id {tok.bos_token_id}) in {train_s:.1f}s on the train split of "
          f"{data_dir} -> {out_dir}")
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
