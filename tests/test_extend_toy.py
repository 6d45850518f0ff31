"""docs/extending.md's promise, checked end to end: a memory design and a backbone family registered at run time
(the registries only, as a new module plus its registry lines would) train with base_train and evaluate with
base_eval, with no other file knowing about them. The toy design scales the attention values by a learned
per-token scalar, v <- v * (1 + s_l[x_t]); the toy family is MobileLLM with a 4C SwiGLU FFN."""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).parent))
from base_eval_fixtures import WORDS  # noqa: E402

from nanochat import memory as memory_registry  # noqa: E402
from nanochat.families import FAMILIES, Family  # noqa: E402
from nanochat.llama import Llama, LlamaConfig  # noqa: E402
from nanochat.memory.base import MemoryBlock  # noqa: E402


@dataclass
class UnigramScaleOptions:
    init: float = 0.0

    def __post_init__(self):
        if not -1.0 < self.init:
            raise ValueError(f"--unigram-scale-init {self.init}: need > -1 (1 + s scales the values)")


class UnigramScale(MemoryBlock):
    Options = UnigramScaleOptions
    uses_layers = True

    def __init__(self, config):
        super().__init__(config)
        self.layer_pos = {layer: i for i, layer in enumerate(self.layers)}
        self.tables = nn.ParameterList(nn.Parameter(torch.empty(config.padded_vocab_size, 1)) for _ in self.layers)

    def init_weights(self):
        for table in self.tables:
            nn.init.constant_(table, self.opts.init)

    def memory_tables(self):
        return list(self.tables)

    def prepare(self, idx, state):
        return idx

    def value(self, layer, xn, v, ctx):
        pos = self.layer_pos.get(layer)
        if pos is None:
            return v
        return v * (1 + self.tables[pos][ctx].to(v.dtype)[..., None])  # (B, T, 1) -> (B, T, 1, 1) over (H_kv, d)


@dataclass
class WideLLMConfig(LlamaConfig):
    family: str = "widellm"


class WideLLM(Llama):
    pass


@pytest.fixture
def toys(monkeypatch):
    monkeypatch.setitem(memory_registry.MEMORY_BLOCKS, "unigram_scale", UnigramScale)
    monkeypatch.setattr(memory_registry, "BLOCK_FLAGS", [*memory_registry.BLOCK_FLAGS, (
        "unigram_scale", "--unigram-scale-init", "init", dict(type=float, default=0.0, help="initial s"))])
    monkeypatch.setitem(FAMILIES, "widellm", Family(WideLLMConfig, WideLLM, lambda c: 4 * c, True))


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from nanochat.dataset import write_manifest, write_text_shard
    from nanochat.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("toy")
    docs = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(30 + i % 11)) for i in range(120)]
    Tokenizer.train_from_iterator(iter(docs), vocab_size=300).save(root / "tok")
    (root / "data").mkdir()
    write_text_shard(root / "data" / "train_000.parquet", docs[:100])
    write_text_shard(root / "data" / "val_000.parquet", docs[100:])
    write_manifest(root / "data", "test", ["train_000.parquet"], ["val_000.parquet"], source="test")
    return root


def test_a_design_and_a_family_registered_at_run_time_train_and_evaluate(toys, tiny_data, tmp_path):
    from nanochat.checkpoint import load_model
    from scripts import base_eval, base_train

    run = tmp_path / "run"
    assert base_train.main([
        "--model-type", "widellm", "--memory", "unigram_scale", "--unigram-scale-init", "0.25",
        "--data-dir", str(tiny_data / "data"), "--tokenizer-dir", str(tiny_data / "tok"), "--depth", "2",
        "--model-dim", "64", "--head-dim", "32", "--max-seq-len", "32", "--device-batch-size", "4",
        "--total-batch-size", "128", "--num-iterations", "3", "--eval-every", "-1", "--eval-tokens", "128",
        "--no-final-core", "--device-type", "cpu", "--run-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["step"] == 3
    # one table of padded V (300 -> 320) x 1 on the default layer (1 of 0..1), one entry read per token
    assert summary["params_memory"] == 320 and summary["params_active"] == summary["params_backbone"] + 1

    model, _ = load_model(run, 3)
    assert type(model) is WideLLM and type(model.memory) is UnigramScale
    assert model.config.ffn_hidden == 4 * 64 and model.config.memory_options == {"init": 0.25}
    table = model.memory.tables[0].detach()
    assert table.shape == (320, 1) and torch.any(table != 0.25)  # built at --unigram-scale-init, then trained

    assert base_eval.main(["--run", str(run), "--eval", "bpb", "--eval-tokens", "128", "--no-progress",
                           "--device-type", "cpu"]) == 0
    bpb = json.loads((run / "eval" / "step_000003" / "bpb.json").read_text())
    assert bpb["splits"]["val"] == pytest.approx(summary["val_bpb"], rel=1e-6)  # the run's own final number
