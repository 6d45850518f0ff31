"""The tiny trained run that base_eval's tests evaluate, and the command line they evaluate it with.

``tiny_run`` is module-scoped: each test file that takes it (``tiny_run = base_eval_fixtures.tiny_run``) builds its
own (~1 s), so no file sees the reports or locks another file's tests left in it."""

import pytest

from _eval_helpers import LM_ROWS, MC_ROWS, write_bundle
from conftest import sigterm_after, tiny_config

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards hex jolly plumbers by the river".split()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A checkpoint of a tiny GPT + a 300-token BPE tokenizer + a 2-shard data dir, wired through meta.json."""
    from nanochat.checkpoint import save_checkpoint
    from nanochat.dataset import write_manifest, write_text_shard
    from nanochat.gpt import build_model
    from nanochat.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("run")
    docs = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(40 + i % 13)) for i in range(200)]
    tok = Tokenizer.train_from_iterator(iter(docs + ["xyz ABC abcd mno q zyx efg ABD"] * 5), vocab_size=300)
    tok.save(root / "tok")
    (root / "data").mkdir()
    write_text_shard(root / "data" / "train_000.parquet", docs[:150])
    write_text_shard(root / "data" / "val_000.parquet", docs[150:])
    write_manifest(root / "data", "test", ["train_000.parquet"], ["val_000.parquet"], source="test")
    model = build_model(tiny_config(vocab_size=300, sequence_len=64), seed=0)
    save_checkpoint(root / "run", 7, model, {"tokenizer_dir": str(root / "tok"), "data_dir": str(root / "data")})
    bundle = write_bundle(root / "bundle", {"mc": ("multiple_choice", 1, " ", MC_ROWS),
                                            "lm": ("language_modeling", 1, "\nAnswer: ", LM_ROWS)},
                          {"mc": 25, "lm": 0, "gone": 50}, total_tasks=["gone"])
    (root / "ood.txt").write_text(" ".join(WORDS) * 3)
    return root, tok, model, bundle


def _eval_args(root, bundle, out, *extra):
    return ["--run", str(root / "run"), "--bundle", str(bundle), "--eval-tokens", "256", "--device-batch-size", "3",
            "--bpb-corpus", f"ood={root / 'ood.txt'}", "--no-progress", "--device-type", "cpu", "--dtype", "float32",
            "--out-dir", str(out), *extra]


def _count_calls(monkeypatch, module, name: str) -> list:
    return sigterm_after(monkeypatch, module, name, 10**9)
