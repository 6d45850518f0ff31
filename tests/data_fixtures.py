"""Reusable data fixtures: the embedded corpus prepared once per session and a tiny tokenizer trained on it.

Use from any test module with::

    from data_fixtures import embedded_data_dir, tiny_tokenizer_dir, tiny_tokenizer  # noqa: F401 (fixtures)

or call the plain functions (prepare_embedded / train_tiny_tokenizer) yourself.
"""

from pathlib import Path

import pytest

TINY_VOCAB = 1024


def prepare_embedded(data_dir: Path) -> Path:
    """Prepare the shipped embedded corpus as parquet shards + manifest in ``data_dir`` (a few seconds)."""
    from scripts.prepare_data import build_text_dataset, embedded_sources

    build_text_dataset(embedded_sources(), Path(data_dir), "embedded", "data/embedded")
    return Path(data_dir)


def train_tiny_tokenizer(data_dir: Path, out_dir: Path, vocab_size: int = TINY_VOCAB, max_chars: int = 3_000_000):
    """Train a small BPE on the train split of ``data_dir`` and save it to ``out_dir``; returns the Tokenizer."""
    from nanochat.tokenizer import Tokenizer
    from scripts.tok_train import capped_texts

    tok = Tokenizer.train_from_iterator(capped_texts(data_dir, "train", max_chars, 10_000), vocab_size=vocab_size)
    tok.save(out_dir)
    return tok


def write_numbered_docs(data_dir: Path, n_docs: int, row_group_size: int, val_docs: int, dataset: str = "synthetic",
                        max_words: int = 60) -> Path:
    """``n_docs`` documents "docNNN w w ..." (2..``max_words`` random words), half in each of two train shards of
    ``row_group_size``-document row groups, and the first ``val_docs`` as the val shard; manifest of ``dataset``."""
    import random

    from nanochat.dataset import write_manifest, write_text_shard

    rng = random.Random(0)
    words = ["the", "sea", "whale", "ship"]
    docs = [f"doc{i:03d} " + " ".join(rng.choice(words) for _ in range(rng.randint(2, max_words)))
            for i in range(n_docs)]
    write_text_shard(data_dir / "t0.parquet", docs[:n_docs // 2], row_group_size=row_group_size)
    write_text_shard(data_dir / "t1.parquet", docs[n_docs // 2:], row_group_size=row_group_size)
    write_text_shard(data_dir / "v0.parquet", docs[:val_docs], row_group_size=row_group_size)
    write_manifest(data_dir, dataset, ["t0.parquet", "t1.parquet"], ["v0.parquet"], source="test")
    return data_dir


@pytest.fixture(scope="session")
def embedded_data_dir(tmp_path_factory) -> Path:
    return prepare_embedded(tmp_path_factory.mktemp("embedded_data"))


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory, embedded_data_dir) -> Path:
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    train_tiny_tokenizer(embedded_data_dir, out)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from nanochat.tokenizer import Tokenizer

    return Tokenizer.load(tiny_tokenizer_dir)
