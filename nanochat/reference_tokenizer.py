"""The authors' tokenizer files <-> ours (reference spec: training §2.4, checkpoint names).

Their tokenizer is a pickled ``tiktoken.Encoding`` (``tokenizer.pkl``) plus ``token_bytes.pt``. Unpickling runs
whatever the file says, so ``read_reference_tokenizer`` uses a restricted unpickler that resolves exactly two
globals -- ``tiktoken.core.Encoding`` (to a stand-in that only records its state dict; no tiktoken code runs on
the file's data) and ``_codecs.encode`` (protocol-2 pickles spell ``bytes`` through it) -- and refuses any other
global with an error naming it, before anything is called.

Their ``token_bytes`` counts the UTF-8 length of ``decode([id])`` (0 for specials), so a token that is a partial
UTF-8 sequence decodes to U+FFFD and counts 3 bytes; ours counts raw bytes. ``reference_token_bytes`` computes
their convention from any tokenizer (used by ``--numerics reference`` in base_eval and by the exporter).
"""

import codecs
import io
import pickle
from pathlib import Path

import torch

from nanochat.jsonfile import write_atomic, write_bytes_atomic
from nanochat.tokenizer import Tokenizer, TokenizerError

REFERENCE_ENCODING_NAME = "rustbpe"  # the name their tok_train gives the Encoding
STATE_KEYS = {"name", "pat_str", "mergeable_ranks", "special_tokens"}
OPTIONAL_STATE_KEYS = {"explicit_n_vocab"}
PICKLE_PROTOCOL = 4  # fixed so that exported files do not depend on the Python version
TOKEN_BYTES_NAME, PKL_NAME = "token_bytes.pt", "tokenizer.pkl"
REFERENCE_TOKENIZER_FILES = (TOKEN_BYTES_NAME, PKL_NAME)  # what write_reference_tokenizer writes, in that order


class _EncodingState:
    """Stand-in for tiktoken.core.Encoding inside the restricted unpickler: keeps the state, runs nothing."""

    def __setstate__(self, state):
        self.state = state


def _latin1_encode(text, encoding="latin1"):
    """``_codecs.encode`` as protocol-2 pickles use it for bytes (str -> latin1 bytes); nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _Refused(f"_codecs.encode({type(text).__name__}, {encoding!r}) is not allowed")
    return codecs.encode(text, "latin1")


class _Refused(pickle.UnpicklingError):
    pass


class _TokenizerUnpickler(pickle.Unpickler):
    ALLOWED = {("tiktoken.core", "Encoding"): _EncodingState, ("tiktoken", "Encoding"): _EncodingState,
               ("_codecs", "encode"): _latin1_encode}

    def find_class(self, module, name):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise _Refused(
                f"refusing to load global {module}.{name}: a tokenizer pickle may only hold a tiktoken Encoding"
            ) from None

    def persistent_load(self, pid):
        raise _Refused("refusing a persistent id: a tokenizer pickle may only hold a tiktoken Encoding")


def _check_state(state, path) -> dict:
    if isinstance(state, str):
        raise TokenizerError(f"{path}: pickles the registered tiktoken encoding {state!r} by name, not a BPE "
                             "vocabulary; the authors' tokenizer is a custom 'rustbpe' Encoding")
    if not isinstance(state, dict) or not STATE_KEYS <= set(state) or set(state) - STATE_KEYS - OPTIONAL_STATE_KEYS:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise TokenizerError(f"{path}: unexpected tiktoken Encoding state {keys}; expected keys {sorted(STATE_KEYS)}")
    ranks, specials = state["mergeable_ranks"], state["special_tokens"]
    if not isinstance(state["pat_str"], str):
        raise TokenizerError(f"{path}: pat_str must be a string")
    if not isinstance(ranks, dict) or not all(isinstance(k, bytes) and type(v) is int for k, v in ranks.items()):
        raise TokenizerError(f"{path}: mergeable_ranks must map bytes to int")
    if not isinstance(specials, dict) or not all(isinstance(k, str) and type(v) is int for k, v in specials.items()):
        raise TokenizerError(f"{path}: special_tokens must map str to int")
    return state


def unpickle_encoding_state(data: bytes, path="<bytes>") -> dict:
    """The state dict of a pickled tiktoken Encoding, read without executing the pickle (see module doc)."""
    try:
        obj = _TokenizerUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise TokenizerError(f"{path}: {e}") from None
    except Exception as e:  # truncated or malformed stream
        raise TokenizerError(f"{path}: not a readable tokenizer pickle ({type(e).__name__}: {e})") from None
    if not isinstance(obj, _EncodingState) or not hasattr(obj, "state"):
        raise TokenizerError(f"{path}: holds a {type(obj).__name__}, expected a pickled tiktoken Encoding")
    return _check_state(obj.state, path)


def tokenizer_from_state(state: dict, path="<state>") -> Tokenizer:
    """Our Tokenizer with the same ranks, split pattern and special tokens (which must follow the ranks)."""
    ranks, specials = state["mergeable_ranks"], state["special_tokens"]
    n = len(ranks)
    names = sorted(specials, key=specials.get)
    if [specials[s] for s in names] != list(range(n, n + len(names))):
        raise TokenizerError(f"{path}: special token ids {sorted(specials.values())} do not follow the "
                             f"{n} mergeable ranks contiguously; cannot represent this vocabulary")
    if "<|bos|>" not in specials:
        raise TokenizerError(f"{path}: no <|bos|> special token (have {names})")
    tok = Tokenizer(ranks, pattern=state["pat_str"], special_tokens=names)
    if tok.special_tokens != specials:  # cannot happen after the checks above; keeps the claim honest
        raise TokenizerError(f"{path}: special tokens changed in conversion")
    return tok


def read_reference_tokenizer(pkl_path) -> Tokenizer:
    path = Path(pkl_path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer pickle {path} is missing")
    return tokenizer_from_state(unpickle_encoding_state(path.read_bytes(), path), path)


def reference_token_bytes(tok: Tokenizer) -> torch.Tensor:
    """int32 (vocab,): UTF-8 length of decode([id]) (U+FFFD for partial sequences), 0 for specials."""
    out = torch.zeros(tok.vocab_size, dtype=torch.int32)
    for token, rank in tok.mergeable_ranks.items():
        out[rank] = len(token.decode("utf-8", errors="replace").encode("utf-8"))
    return out


def read_reference_token_bytes(path, tok: Tokenizer) -> dict:
    """Check their token_bytes.pt against ``reference_token_bytes(tok)``; returns a summary for the import log."""
    path = Path(path)
    try:
        tb = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise TokenizerError(f"{path}: not a readable token_bytes tensor ({type(e).__name__}: {e})") from None
    if not isinstance(tb, torch.Tensor) or tb.shape != (tok.vocab_size,) or tb.is_floating_point():
        desc = f"{tb.dtype} {tuple(tb.shape)}" if isinstance(tb, torch.Tensor) else type(tb).__name__
        raise TokenizerError(f"{path}: expected an integer tensor of shape ({tok.vocab_size},), got {desc}")
    expected = reference_token_bytes(tok)
    bad = (tb.to(torch.int64) != expected.to(torch.int64)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise TokenizerError(f"{path}: {bad.numel()} entries differ from the UTF-8 length of each decoded token "
                             f"(first: id {i} has {int(tb[i])}, expected {int(expected[i])}); "
                             "--numerics reference could not reproduce their bits per byte")
    raw = tok.token_bytes()
    return {"path": str(path), "matches_reference_rule": True,
            "ids_differing_from_raw_bytes": int((expected != raw).sum())}


def write_reference_tokenizer(tok: Tokenizer, directory) -> bool:
    """``tokenizer.pkl`` (a tiktoken Encoding named like theirs) and ``token_bytes.pt`` in their convention.
    Returns False when the directory already holds this very tokenizer (runs exported into one base dir share
    it); a different tokenizer there is an error."""
    import tiktoken

    directory = Path(directory)
    enc = tiktoken.Encoding(name=REFERENCE_ENCODING_NAME, pat_str=tok.pattern, mergeable_ranks=tok.mergeable_ranks,
                            special_tokens=tok.special_tokens)
    data = pickle.dumps(enc, protocol=PICKLE_PROTOCOL)
    pkl = directory / PKL_NAME
    if pkl.exists():
        if pkl.read_bytes() == data and (directory / TOKEN_BYTES_NAME).is_file():
            return False
        raise FileExistsError(f"{pkl} already holds a different tokenizer; export into a new directory")
    directory.mkdir(parents=True, exist_ok=True)
    # temp files of their own: two exports into one base dir may write this shared tokenizer at once
    token_bytes = reference_token_bytes(tok)
    write_atomic(directory / TOKEN_BYTES_NAME, lambda tmp: torch.save(token_bytes, tmp))
    write_bytes_atomic(pkl, data)  # last: its presence means the directory is complete
    return True
