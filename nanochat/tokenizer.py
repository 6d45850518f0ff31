"""Byte-level BPE tokenizer: trained with ``rustbpe``, served with ``tiktoken``.

On disk a tokenizer directory holds three files (no pickles, so any tiktoken version can read them):

* ``tokenizer.json``  header: format version, split pattern, special tokens with their ids, vocab size.
* ``tokenizer.bpe``   one ``<base64 token bytes> <rank>`` line per mergeable token (tiktoken's own format).
* ``token_bytes.pt``  int32 tensor (vocab_size,): raw UTF-8 byte length of every token, 0 for specials
                      (used by bits-per-byte evaluation; raw bytes, not a str round-trip, so partial UTF-8
                      tokens are counted correctly).

The vocabulary is ``num_merges + 256`` BPE tokens followed by the 9 nanochat special tokens, so at the default
vocab of 32768 the BPE part has 32759 tokens and ``<|bos|>`` is id 32759.
"""

import base64
import hashlib
import json
import os
import re
import shlex
from pathlib import Path

import torch

from nanochat.jsonfile import read_json_object, write_atomic, write_bytes_atomic

# GPT-4's split pattern except that numbers are grouped 1-2 digits at a time (nanochat's choice: fewer
# number tokens are wasted at small vocab sizes).
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = [
    "<|bos|>",  # document delimiter, prepended to every document
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
]
DEFAULT_VOCAB_SIZE = 32768
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte + the specials
FORMAT_VERSION = "mome-nanochat-bpe-v1"
HEADER_FILE, RANKS_FILE, TOKEN_BYTES_FILE = "tokenizer.json", "tokenizer.bpe", "token_bytes.pt"
REPO_ROOT = Path(__file__).resolve().parents[1]


# A cut of a text where encoding the prefix gives exactly the first tokens of encoding the whole text: right after an
# ASCII letter followed by an ASCII non-letter (c with text[c-1] in [A-Za-z], text[c] ASCII and not a letter).
# tiktoken splits the text with SPLIT_PATTERN (leftmost-first matches, one after another from 0; every position
# starts a match: letters, digits, punctuation and whitespace each have an alternative) and BPE-merges each piece
# alone, so it is enough that both texts split into the same pieces up to c and that c ends a piece of the whole
# text. A match attempt at p < c can test position c only after consuming position c-1 (every alternative consumes
# contiguously; the one lookahead, (?!\S), looks one character ahead inside a whitespace alternative, and no
# whitespace or punctuation alternative can consume a letter). The only alternatives that consume a letter are the
# contraction '(?i:[sdmt]|ll|ve|re) and [^\r\n\p{L}\p{N}]?+\p{L}+, and at c they test only "is text[c] one of
# l/v/e/r (any case)" or "is text[c] a letter": false for an ASCII non-letter and false at the end of the prefix.
# So every path of every attempt before c succeeds or fails alike in both texts (same pieces), and the piece
# holding text[c-1] ends at c in both (no alternative goes on past a letter into a non-letter). ASCII on both sides
# keeps \p{L} (the regex engine's Unicode tables) and case folding out of it.
_CUT = re.compile(r"[A-Za-z](?=[\x00-\x40\x5b-\x60\x7b-\x7f])")


def prefix_cut(text: str, at_least: int) -> int | None:
    """The first safe cut (the argument above) at or after ``at_least`` characters; None when the text has none
    there (``at_least`` at or past its end included): then only the whole text encodes to its own tokens."""
    if at_least >= len(text):
        return None
    m = _CUT.search(text, max(0, at_least - 1))
    return m.end() if m else None


class TokenizerError(ValueError):
    """A tokenizer directory is missing, incomplete or inconsistent."""


class Tokenizer:
    """A tiktoken Encoding built from mergeable ranks + special tokens appended after them."""

    def __init__(self, mergeable_ranks: dict[bytes, int], pattern: str = SPLIT_PATTERN,
                 special_tokens: list[str] = SPECIAL_TOKENS):
        import tiktoken

        ranks = sorted(mergeable_ranks.values())
        if ranks != list(range(len(ranks))):
            raise TokenizerError("mergeable ranks must be exactly 0..n-1 (the tokenizer files are corrupt)")
        if len(ranks) < 256:
            raise TokenizerError(f"a byte-level BPE needs all 256 byte tokens, got {len(ranks)} ranks")
        missing = [b for b in range(256) if bytes([b]) not in mergeable_ranks]
        if missing:  # tiktoken would panic on the first text holding one of them
            raise TokenizerError(f"not a byte-level BPE: no token for the single byte(s) "
                                 f"[{', '.join(f'0x{b:02x}' for b in missing[:8])}{', ...' * (len(missing) > 8)}]")
        n = len(mergeable_ranks)
        self.mergeable_ranks = dict(mergeable_ranks)
        self.pattern = pattern
        self.special_tokens = {name: n + i for i, name in enumerate(special_tokens)}
        self.enc = tiktoken.Encoding(
            name="mome-nanochat-bpe", pat_str=pattern, mergeable_ranks=self.mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self.vocab_size = n + len(special_tokens)
        self.bos_token_id = self.special_tokens["<|bos|>"]
        self._fingerprint: str | None = None
        self.directory: Path | None = None  # where ``load`` read it (resolved): reused, not reread, for that directory

    # ---- training -------------------------------------------------------------------------------------
    @classmethod
    def train_from_iterator(cls, texts, vocab_size: int = DEFAULT_VOCAB_SIZE, pattern: str = SPLIT_PATTERN):
        """Train with rustbpe on an iterator of strings; ``vocab_size`` includes the special tokens."""
        import rustbpe

        if vocab_size < MIN_VOCAB_SIZE:
            raise TokenizerError(f"--vocab-size must be >= {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} "
                                 f"specials), got {vocab_size}")
        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(texts, vocab_size - len(SPECIAL_TOKENS), pattern=pattern)
        ranks = {bytes(tok): rank for tok, rank in trainer.get_mergeable_ranks()}
        tok = cls(ranks, pattern=trainer.get_pattern())
        if tok.vocab_size != vocab_size:
            # rustbpe stops early when the corpus has no more pairs to merge; say so instead of shipping a
            # tokenizer whose size silently differs from the model config.
            raise TokenizerError(f"training produced {tok.vocab_size} tokens instead of --vocab-size {vocab_size}: "
                                 "the training text is too small for this vocab; use more text or a smaller vocab")
        tok._trainer = trainer  # kept so tests can compare tiktoken ids with the trainer's own encoder
        return tok

    # ---- encoding -------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ordinary encoding: special-token text inside documents is treated as plain text; no BOS is added."""
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str], num_threads: int = 4) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=num_threads)

    def encode_prefix(self, text, min_tokens: int) -> list[int]:
        """A prefix of ``encode(text)`` holding at least ``min_tokens`` tokens (all of it when it is shorter),
        encoding only a prefix of ``text`` (at a ``prefix_cut``), grown until it holds enough tokens: a 1 GB
        document costs the tokens the caller keeps, not ~250M. ``text``: a str, or a document read lazily (an
        object whose ``prefix(n)`` is its first n characters, fewer only at its end, and ``read()`` all of it, as
        nanochat.loss_eval.TextFile). Exact only for SPLIT_PATTERN (prefix_cut's argument); any other split
        pattern encodes the whole text."""
        if self.pattern != SPLIT_PATTERN:
            return self.encode(text if isinstance(text, str) else text.read())
        head_of = (lambda n: text[:n]) if isinstance(text, str) else text.prefix
        want = 5 * min_tokens + 1024  # characters: ~4 per token in English text at a 32K vocab, plus a margin
        while True:
            head = head_of(2 * want)  # room for a cut at or after want
            cut = prefix_cut(head, want)
            if cut is None:
                if len(head) < 2 * want:  # the whole text, with no cut past want: encode it all
                    return self.encode(head)
                want *= 2  # no cut in [want, 2 want): look further
                continue
            toks = self.encode(head[:cut])  # cut < len(head): head[cut] is text[cut], so the cut is the text's
            if len(toks) >= min_tokens:
                return toks
            # the next prefix from the characters per token seen so far, 25% over, so it grows >= 1.25x a round
            want = max(cut + 1, int(cut * 1.25 * min_tokens / max(1, len(toks))))

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.enc.decode_bytes(ids)

    def encode_special(self, name: str) -> int:
        if name not in self.special_tokens:
            raise KeyError(f"unknown special token {name!r}; known: {sorted(self.special_tokens)}")
        return self.special_tokens[name]

    def token_bytes(self) -> torch.Tensor:
        """int32 (vocab_size,): raw byte length of each token, 0 for special tokens."""
        lengths = torch.zeros(self.vocab_size, dtype=torch.int32)
        for tok, rank in self.mergeable_ranks.items():
            lengths[rank] = len(tok)
        return lengths

    def fingerprint(self) -> str:
        """sha256 of what decides the token ids (merges, split pattern, special tokens), not of the files'
        paths: a resumed run must tokenize exactly as the checkpoint's run did. Hashed once per tokenizer (they
        are never changed once built): a run asks for it in its data set-up and again in each source check."""
        if self._fingerprint is None:
            self._fingerprint = self._token_ids_sha256()
        return self._fingerprint

    def _token_ids_sha256(self) -> str:
        h = hashlib.sha256(json.dumps([self.pattern, self.special_tokens]).encode())
        for tok, rank in sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1]):
            h.update(b"%d:" % rank + tok)
        return h.hexdigest()

    # ---- persistence ----------------------------------------------------------------------------------
    def save(self, directory) -> None:
        """Write the three tokenizer files; each is written to a temp name and renamed (no half files). The header
        (tokenizer.json, what marks a directory as holding a tokenizer) goes first and comes back last: a save
        stopped midway (Ctrl-C, a kill, a full disk) leaves no tokenizer, never a mix of new and old files."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / HEADER_FILE).unlink(missing_ok=True)
        header = {"format": FORMAT_VERSION, "pattern": self.pattern, "vocab_size": self.vocab_size,
                  "num_mergeable": len(self.mergeable_ranks), "special_tokens": self.special_tokens}
        lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}"
                 for tok, rank in sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1])]
        write_bytes_atomic(directory / RANKS_FILE, ("\n".join(lines) + "\n").encode("ascii"))
        token_bytes = self.token_bytes()
        write_atomic(directory / TOKEN_BYTES_FILE, lambda tmp: torch.save(token_bytes, tmp))
        write_bytes_atomic(directory / HEADER_FILE, (json.dumps(header, indent=2) + "\n").encode("utf-8"))

    @classmethod
    def load(cls, directory) -> "Tokenizer":
        directory = Path(directory)
        header_path, ranks_path = directory / HEADER_FILE, directory / RANKS_FILE
        for p in (header_path, ranks_path):
            if not p.is_file():
                raise TokenizerError(f"tokenizer file {p} is missing; train one with {tok_train_hint(directory)}")
        header = _read_header(header_path)
        try:
            lines = ranks_path.read_text(encoding="ascii").splitlines()
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{ranks_path} is not a tokenizer ranks file ({e}); retrain with "
                                 f"{tok_train_hint(directory)}") from e
        ranks = {}
        for lineno, line in enumerate(lines, 1):
            try:
                b64, rank = line.split()
                ranks[base64.b64decode(b64, validate=True)] = int(rank)
            except ValueError as e:
                raise TokenizerError(f"{ranks_path}:{lineno}: malformed line {line!r}; retrain with "
                                     f"{tok_train_hint(directory)}") from e
        specials = sorted(header["special_tokens"], key=header["special_tokens"].get)
        tok = cls(ranks, pattern=header["pattern"], special_tokens=specials)
        if tok.vocab_size != header["vocab_size"] or tok.special_tokens != header["special_tokens"]:
            raise TokenizerError(f"{directory}: header says vocab {header['vocab_size']} but the files give "
                                 f"{tok.vocab_size}; retrain with {tok_train_hint(directory)}")
        tok.directory = directory.resolve()
        return tok


HEADER_TYPES = {"format": str, "pattern": str, "vocab_size": int, "special_tokens": dict}


def _read_header(path: Path) -> dict:
    """tokenizer.json, checked: a JSON object with the format version and every key the loader needs."""
    retrain = f"retrain with {tok_train_hint(path.parent)}"
    header = read_json_object(path, TokenizerError, retrain)
    if header.get("format") != FORMAT_VERSION:
        raise TokenizerError(f"{path}: unknown format {header.get('format')!r} (expected {FORMAT_VERSION!r}); "
                             f"{retrain}")
    for key, kind in HEADER_TYPES.items():
        if not isinstance(header.get(key), kind):
            raise TokenizerError(f"{path}: {key!r} is missing or not a {kind.__name__}; {retrain}")
    specials = header["special_tokens"]
    if not all(isinstance(k, str) and isinstance(v, int) for k, v in specials.items()) or "<|bos|>" not in specials:
        raise TokenizerError(f"{path}: 'special_tokens' must map token names (with <|bos|>) to ids; {retrain}")
    return header


def tok_train_hint(directory, vocab_size: int | None = None) -> str:
    """The tok_train command that (re)trains the tokenizer in ``directory``, for the library's errors, which do not
    know the runs it serves: it names the flags to fill in (the vocab size where the files give it), as tok_train's
    defaults (fineweb-edu, DEFAULT_VOCAB_SIZE) may be another corpus and size; --overwrite exactly where tok_train
    refuses without it (a tokenizer.json there). base_train, which knows its run, gives its own
    (nanochat.train_setup.tok_train_command)."""
    overwrite = " --overwrite" if (Path(directory) / HEADER_FILE).is_file() else ""
    vocab, what = (vocab_size, "") if vocab_size is not None else ("N", ", N their vocab size")
    return (f"`python -m scripts.tok_train --data-dir DATA_DIR --vocab-size {vocab} --output-dir "
            f"{shlex.quote(str(directory))}{overwrite}` (DATA_DIR: the prepared data of the runs it serves{what}; "
            f"tok_train's defaults are fineweb-edu and {DEFAULT_VOCAB_SIZE})")


def default_tokenizer_dir() -> Path:
    return Path(os.environ.get("NANOCHAT_TOKENIZER_DIR") or (REPO_ROOT / "tokenizer"))


def get_tokenizer(tokenizer_dir=None) -> Tokenizer:
    directory = Path(tokenizer_dir) if tokenizer_dir is not None else default_tokenizer_dir()
    if not (directory / HEADER_FILE).is_file():
        raise TokenizerError(f"no tokenizer in {directory} (missing {HEADER_FILE}); train one with "
                             f"{tok_train_hint(directory)} or point NANOCHAT_TOKENIZER_DIR at an existing tokenizer "
                             "directory")
    return Tokenizer.load(directory)


def get_token_bytes(tokenizer_dir=None, device="cpu", vocab_size: int | None = None) -> torch.Tensor:
    """token_bytes.pt of a tokenizer directory, checked (1-D integers, ``vocab_size`` entries when given)."""
    directory = Path(tokenizer_dir) if tokenizer_dir is not None else default_tokenizer_dir()
    path = directory / TOKEN_BYTES_FILE
    if not path.is_file():
        raise TokenizerError(f"{path} is missing; retrain with {tok_train_hint(directory, vocab_size)}")
    try:
        token_bytes = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # truncated or foreign file: UnpicklingError, RuntimeError, EOFError, ...
        raise TokenizerError(f"{path} is not a token-bytes tensor ({type(e).__name__}: {e}); retrain with "
                             f"{tok_train_hint(directory, vocab_size)}") from e
    if not torch.is_tensor(token_bytes) or token_bytes.ndim != 1 or token_bytes.is_floating_point():
        raise TokenizerError(f"{path} must hold a 1-D integer tensor (byte length per token); retrain with "
                             f"{tok_train_hint(directory, vocab_size)}")
    if vocab_size is not None and len(token_bytes) != vocab_size:
        raise TokenizerError(f"{path} has {len(token_bytes)} entries but the tokenizer has {vocab_size} tokens; "
                             f"retrain with {tok_train_hint(directory, vocab_size)}")
    return token_bytes


def check_vocab_matches(tokenizer: Tokenizer, vocab_size: int, source: str, meta: dict | None = None) -> None:
    """Raise if a model (config/checkpoint named by ``source``) expects a different vocab than the tokenizer, or
    (given the checkpoint's ``meta`` with a recorded fingerprint) was trained with other merges of the same size."""
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"tokenizer vocab size {tokenizer.vocab_size} does not match vocab_size {vocab_size} "
                         f"of {source}; use the tokenizer the model was trained with (--tokenizer-dir or "
                         "NANOCHAT_TOKENIZER_DIR) or retrain the tokenizer with --vocab-size matching the model")
    trained = (meta or {}).get("tokenizer_sha256")
    if trained is None:
        return
    mine = tokenizer.fingerprint()  # hashes every merge: once
    if trained != mine:
        raise ValueError(f"the tokenizer is not the one {source} was trained with (same vocab size, other merges, "
                         f"pattern or special tokens; sha256 {mine[:12]} vs {trained[:12]}); "
                         f"use the training run's tokenizer ({meta.get('tokenizer_dir')}) via --tokenizer-dir")
