"""Bits per byte: tokenizer-independent loss.

bpb = sum of target NLL (nats) / (ln 2 * sum of UTF-8 bytes of the same targets). Targets with 0 bytes (BOS and
other special tokens) and ignored targets (< 0) count in neither sum, so the number does not depend on how many
special tokens a loader inserts. Out-of-domain corpora use a document-reset protocol (``bpb_rows_from_text``).
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanochat.common import is_dist
from nanochat.eval_resume import stop_voted


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Float32 cross-entropy of each position, (B, T), of logits (B, T, V) against targets (B, T) (-1: ignored, 0).

    The family's ``forward(x, targets=y, loss_reduction="none")`` gives the same numbers, but takes the log-softmax
    of the whole batch at once (as many floats as the logits: 4.3 GB more at 16 rows x 2048 x 32768); row by row,
    what this adds to the logits is one row's."""
    return torch.stack([F.cross_entropy(logits[b].float(), targets[b], ignore_index=-1, reduction="none")
                        for b in range(logits.size(0))])


@torch.no_grad()
def evaluate_bpb(model, batches, token_bytes: torch.Tensor, autocast_ctx=None) -> float:
    """``batches`` yields (inputs, targets) LongTensors of shape (B, T); ``token_bytes[id]`` = UTF-8 bytes of id.
    A stop signal ends it with ``Interrupted``, on every rank at the same batch (``stop_voted``)."""
    nats, nbytes, device = 0.0, 0, next(model.parameters()).device
    for x, y in stop_voted(batches, device):
        with autocast_ctx if autocast_ctx is not None else nullcontext():
            loss = token_losses(model(x), y).view(-1)
        y = y.reshape(-1)
        valid = y >= 0
        tb = token_bytes.to(y.device)[y.clamp(min=0)] * valid  # ignored targets weigh 0 bytes
        counted = tb > 0
        # Sum per batch in float64 on the host: 20M tokens of ~2.5 nats would lose digits in float32.
        nats += loss[counted].double().sum().item()
        nbytes += int(tb.sum().item())
    sums = torch.tensor([nats, float(nbytes)], dtype=torch.float64, device=device)
    if is_dist():
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    nats, nbytes = sums[0].item(), sums[1].item()
    if nbytes == 0:
        raise ValueError("evaluate_bpb: no target with a positive byte count (no batches, or all targets special "
                         "or ignored; is --eval-tokens too small?)")
    return nats / (math.log(2) * nbytes)


# -- out-of-domain corpora (document-reset protocol) -------------------------------------------------------
@dataclass(frozen=True)
class TextFile:
    """The one document of a plain-text corpus file, read only as far as asked: ``prefix(n)`` is exactly the first
    n characters of ``read()`` (all of it when shorter). Decoded as a whole read decodes it (UTF-8, a leading BOM
    dropped, bad bytes replaced, universal newlines): TextIOWrapper's incremental decoders carry a character split
    between reads, or a \r before a \n, over to the next read."""

    path: Path

    def _open(self):
        return open(self.path, encoding="utf-8-sig", errors="replace")  # -sig: a leading BOM is no text

    def read(self) -> str:
        with self._open() as f:
            return f.read()

    def prefix(self, n: int) -> str:
        parts, got = [], 0
        with self._open() as f:
            while got < n:  # read(k) gives at most k characters: ask again until n or the end of the file
                # at most 1M characters a read: read(k) has the buffered reader allocate ~k bytes up front (a
                # MemoryError for a budget's k far beyond a short file)
                part = f.read(min(n - got, 1 << 20))
                if not part:
                    break
                parts.append(part)
                got += len(part)
        return "".join(parts)


def corpus_documents(path) -> list:
    """Documents of a corpus file: .jsonl -> the "text" field of every line (str); any other file -> one document,
    a TextFile (read only as far as ``encode_document`` needs: enwik9 is 1 GB of one document)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--bpb-corpus file {path} does not exist")
    if path.suffix != ".jsonl":
        return [TextFile(path)]
    from nanochat.dataset import read_jsonl_texts

    return read_jsonl_texts(path)


def read_corpus(path) -> list[str]:
    """``corpus_documents``' documents, each read whole."""
    return [d.read() if isinstance(d, TextFile) else d for d in corpus_documents(path)]


def encode_document(tokenizer, text: "str | TextFile", need: int | None = None) -> list[int]:
    """``tokenizer.encode(text)``, or with ``need`` a prefix of it holding at least ``need`` tokens (all of it when
    it is shorter): a tokenizer with ``encode_prefix`` (nanochat's BPE) then reads and encodes only as much of the
    text as that takes, so a 1 GB single-document corpus (enwik9) costs the tokens kept, not ~250M Python ints."""
    if need is not None and hasattr(tokenizer, "encode_prefix"):
        return tokenizer.encode_prefix(text, need)
    return list(tokenizer.encode(text if isinstance(text, str) else text.read()))


def bpb_rows_from_text(tokenizer, documents: list, seq_len: int, max_tokens: int | None = None):
    """Rows for document-reset bpb: every document (str or TextFile) is tokenised as [BOS] + tokens and cut into
    windows of ``seq_len`` predictions. A window sees only its own document (no cross-document context); the first
    window starts at BOS; a short last window is padded (inputs with BOS, targets with -1 = ignored). Each document
    token is a target exactly once. ``max_tokens`` caps the number of rows to max_tokens // seq_len (>= 1); a
    document is then encoded only as far as the rows still missing need (``encode_document``), same rows.

    Returns (inputs, targets), LongTensors of shape (N, seq_len)."""
    bos = tokenizer.bos_token_id
    max_rows = max(1, max_tokens // seq_len) if max_tokens else None
    inputs, targets = [], []
    for doc in documents:
        need = None if max_rows is None else (max_rows - len(inputs)) * seq_len  # the last row's target is token need
        toks = [bos] + encode_document(tokenizer, doc, need)
        for s in range(0, len(toks) - 1, seq_len):
            x, y = toks[s : s + seq_len], toks[s + 1 : s + seq_len + 1]
            inputs.append(x + [bos] * (seq_len - len(x)))
            targets.append(y + [-1] * (seq_len - len(y)))
            if max_rows is not None and len(inputs) >= max_rows:
                return torch.tensor(inputs, dtype=torch.long), torch.tensor(targets, dtype=torch.long)
    if not inputs:
        raise ValueError("bpb_rows_from_text: the corpus produced no tokens to score")
    return torch.tensor(inputs, dtype=torch.long), torch.tensor(targets, dtype=torch.long)


def iter_row_batches(inputs: torch.Tensor, targets: torch.Tensor, batch_size: int, rank: int = 0,
                     world_size: int = 1, device="cpu"):
    """(inputs, targets) batches over rows rank, rank+W, ... (so the union over ranks is every row once); none for a
    rank past the last row (a short corpus on many ranks), which still takes part in evaluate_bpb's votes and sum."""
    idx = torch.arange(inputs.size(0))[rank::world_size]  # arange(rank, N, W) raises for rank > N
    for i in range(0, len(idx), batch_size):
        sel = idx[i : i + batch_size]
        yield inputs[sel].to(device), targets[sel].to(device)
