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
