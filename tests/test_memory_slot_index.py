"""MoME's ``mod`` / ``headmod`` row indexers (the authors' slot mappings, reference model notes §3.2-3.4):
row ids against the spec's formulas written out per token, table shapes and parameter/FLOP accounting, flag
errors, and the import of their meta fields."""

import argparse

import pytest
import torch

from conftest import tiny_config
from mome_fixtures import DEDICATED, ROWS, VOCAB, mome_config, naive_row, random_block
from nanochat.gpt import GPTConfig, build_model, model_summary
from nanochat.memory import add_memory_args, memory_config_from_args
from nanochat.memory.mome import MoMEOptions
from nanochat.memory.slot_index import arithmetic_rows
from nanochat.reference_format import REFERENCE_DEFAULTS, config_from_reference


def spec_slot(mapping: str, tok: int, S: int, D: int) -> int:
    """Reference notes §3.4, in Python ints: mod: tok mod S; headmod: tok below D keeps its own slot, any other
    token maps to D + ((tok - D) mod (S - D))."""
    if mapping == "mod":
        return tok % S
    return tok if tok < D else D + (tok - D) % (S - D)


@pytest.mark.parametrize("index", ["mod", "headmod"])
def test_block_rows_equal_the_spec_for_every_token(tmp_path, index):
    """Every token id of the vocabulary, in one (B, T) batch, including D - 1, D, D + 1, N - 1, N and V - 1."""
    cfg = mome_config(tmp_path, 4, 2, index)
    block = random_block(cfg)
    tokens = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0)).view(4, VOCAB // 4)
    rows = block.prepare(tokens, None)[1]
    assert rows.dtype == torch.int64 and block.rows == ROWS
    want = [[naive_row(cfg, block, tokens, b, t) for t in range(tokens.size(1))] for b in range(tokens.size(0))]
    assert rows.tolist() == want
    assert rows.tolist() == [[spec_slot(index, int(x), ROWS, DEDICATED) for x in r] for r in tokens]
    by_token = dict(zip(tokens.flatten().tolist(), rows.flatten().tolist()))
    if index == "mod":
        assert (by_token[ROWS - 1], by_token[ROWS], by_token[VOCAB - 1]) == (ROWS - 1, 0, (VOCAB - 1) % ROWS)
    else:  # D - 1 keeps its row; D is the first token of the shared rows; the last token wraps around N - D rows
        assert (by_token[DEDICATED - 1], by_token[DEDICATED], by_token[DEDICATED + 1]) == (DEDICATED - 1, DEDICATED,
                                                                                          DEDICATED + 1)
        assert by_token[ROWS] == DEDICATED and by_token[VOCAB - 1] == DEDICATED + (VOCAB - 1 - DEDICATED) % (ROWS - DEDICATED)
    assert set(by_token.values()) == set(range(ROWS))  # every row is read by some token


@pytest.mark.parametrize("S,D", [(1, 0), (7, 0), (VOCAB, 0), (128, 0), (2, 1), (11, 10), (VOCAB, 95), (128, 100)])
def test_arithmetic_rows_edge_sizes(S, D):
    """One row, N = V (identity), N = padded V (rows past the vocabulary never read), D = N - 1 (one shared row)."""
    tokens = torch.arange(VOCAB).view(2, -1)
    for index in ("mod", "headmod") if D else ("mod",):
        rows = arithmetic_rows(tokens, index, S, D)
        assert rows.flatten().tolist() == [spec_slot(index, x, S, D) for x in range(VOCAB)]
        assert int(rows.min()) >= 0 and int(rows.max()) < S


def test_table_shapes_parameters_and_flops_at_d12(tmp_path):
    """N = S rows of M slots per memory layer; tables out of the FLOPs, routers in: the reference's mod/headmod row
    with S = ceil(V / 2) and E = 12 has the grouped c2 A2/12 row's shapes, parameters and FLOPs (paper Table 1)."""
    from nanochat.memory.slot_map import write_slot_map

    path = tmp_path / "c2.json"
    write_slot_map(path, [[i, i + 1] for i in range(0, 32768, 2)], 32768, 2)
    grouped = model_summary(GPTConfig.from_depth(12, memory="mome", memory_options=dict(
        index="grouped", group_size=2, slots=12, slot_map=str(path))))
    for opts in (dict(index="mod", rows=16384), dict(index="headmod", rows=16384, dedicated_size=1024)):
        s = model_summary(GPTConfig.from_depth(12, memory="mome", memory_options=dict(slots=12, **opts)))
        assert s["params_memory"] == 6 * 16384 * 12 * 128 == 150_994_944
        assert (s["params_total"], s["flops_per_token"]) == (grouped["params_total"], grouped["flops_per_token"])
    model = build_model(tiny_config(memory="mome", memory_options=dict(index="headmod", rows=100, dedicated_size=30)))
    assert [tuple(t.shape) for t in model.memory.memory_tables()] == [(100 * 6, 64)]  # 2 layers: memory at 1 only
    assert model.memory.rows == 100


def test_optimizer_groups_take_the_tables_like_the_token_index():
    from nanochat.optim import OptimConfig, build_param_groups

    model = build_model(tiny_config(memory="mome", n_layer=4, memory_options=dict(index="mod", rows=50)), seed=0)
    groups = {g["name"]: g for g in build_param_groups(model, OptimConfig())}
    assert {id(p) for p in groups["memory_tables"]["params"]} == {id(t.weight) for t in model.memory.tables}
    assert groups["memory_tables"]["weight_decay"] == 0.001


def _args(*argv):
    p = argparse.ArgumentParser()
    add_memory_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv,message", [
    (["--mome-index", "mod"], "--mome-index mod needs --mome-rows N >= 1"),
    (["--mome-index", "headmod", "--mome-rows", "40"], "--mome-dedicated-size 0 must satisfy 0 < D < --mome-rows 40"),
    (["--mome-index", "headmod", "--mome-rows", "40", "--mome-dedicated-size", "40"], "0 < D < --mome-rows 40"),
    (["--mome-index", "mod", "--mome-rows", "40", "--mome-dedicated-size", "4"],
     "--mome-dedicated-size only applies to --mome-index headmod (got --mome-index mod)"),
    (["--mome-rows", "40"], "--mome-rows only applies to --mome-index mod or headmod (got --mome-index token)"),
    (["--mome-index", "bigram", "--mome-rows", "40"], "--mome-rows only applies"),
    (["--mome-index", "mod", "--mome-rows", "-3"], "--mome-rows must be an integer >= 0"),
    (["--mome-index", "mod", "--mome-rows", "40", "--mome-group-size", "2"], "--mome-group-size only applies"),
])
def test_flag_errors_name_the_flag(argv, message):
    with pytest.raises(ValueError) as e:
        memory_config_from_args(_args("--memory", "mome", *argv))
    assert message in str(e.value)


def test_rows_beyond_the_padded_vocab_are_refused():
    with pytest.raises(ValueError, match=r"--mome-rows 513 exceeds the \(padded\) vocab size 512"):
        model_summary(tiny_config(memory="mome", memory_options=dict(index="mod", rows=513)))
    assert model_summary(tiny_config(memory="mome", memory_options=dict(index="mod", rows=512)))["params_memory"] > 0
    with pytest.raises(ValueError, match="--mome-dedicated-size"):
        MoMEOptions(index="headmod", rows=5, dedicated_size=-1)


@pytest.mark.parametrize("fields", [{"moe_ve_slot_mapping": "mod", "moe_ve_slot_vocab_size": 123},
                                    {"moe_ve_slot_mapping": "headmod", "moe_ve_slot_vocab_size": 123,
                                     "moe_ve_slot_dedicated_size": 37},
                                    {"moe_ve_slot_mapping": "mod", "moe_ve_slot_vocab_size": 0}])  # 0 = padded V
def test_imported_config_reads_the_slots_their_fields_define(fields):
    """Their meta fields -> our block -> the rows the spec's formula gives with S and D read from those fields
    (S = 0 means the padded vocab; a world-size-padded S is just another S here)."""
    cfg = {**REFERENCE_DEFAULTS, "vocab_size": 500, "n_layer": 2, "n_head": 2, "n_kv_head": 2, "n_embd": 128,
           "window_pattern": "L", "moe_ve_enabled": True, "value_embeds_layers": [1], "moe_ve_setting": "0_2_4",
           "moe_ve_gate_nl": "sigmoid-norm", "moe_ve_router_input": "hidden", "moe_ve_balance_lr": 0.0,
           "moe_ve_bias_update": "none", **fields}
    ours = config_from_reference("gpt", cfg)
    model = build_model(ours, seed=0)
    S, D = fields["moe_ve_slot_vocab_size"] or 512, fields.get("moe_ve_slot_dedicated_size", 0)
    assert tuple(model.memory.tables[0].weight.shape) == (S * 4, 64)
    tokens = torch.arange(500).view(4, 125)
    rows = model.memory.prepare(tokens, None)[1]
    assert rows.flatten().tolist() == [spec_slot(fields["moe_ve_slot_mapping"], x, S, D) for x in range(500)]
