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
from nanochat.memory.slot_index import arithmetic_rows, resolve_rows
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
    (["--mome-index", "mod"], "--mome-index mod without --mome-rows: N = ceil(V / --mome-slot-factor 1) needs the "
                              "vocab size, which is not known here; pass --mome-rows N"),
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


# -- --mome-slot-factor f: N = ceil(V / f) (the reference's --moe-ve-slot-factor, model notes §3.2) ----------------
@pytest.mark.parametrize("V,f,N", [(1000, 3, 334), (1000, 4, 250), (1000, 1, 1000), (439, 2, 220), (439, 4, 110),
                                   (500, 7, 72), (500, 500, 1), (32768, 2, 16384), (32768, 4, 8192)])
def test_slot_factor_gives_ceil_v_over_f_rows(V, f, N):
    """Without --mome-rows, N = ceil(V / f) with V the vocab the caller passes (the tokenizer's, unpadded: 439 rounds
    up to 440 rows at f = 2, not to the padded 448's 224); f = 1 (the default) gives N = V, as theirs."""
    assert resolve_rows("mod", 0, f, V) == N
    for extra in ([], ["--mome-index", "headmod", "--mome-dedicated-size", str(N - 1)] if N > 1 else None):
        if extra is None:
            continue
        argv = ["--memory", "mome", "--mome-index", "mod", *extra, "--mome-slot-factor", str(f)]
        options = memory_config_from_args(_args(*argv), V)["memory_options"]
        assert options["rows"] == N and "slot_factor" not in options  # the config records N, not f
    explicit = memory_config_from_args(_args("--memory", "mome", "--mome-index", "mod", "--mome-rows", str(N)), V)
    assert memory_config_from_args(_args("--memory", "mome", "--mome-index", "mod", "--mome-slot-factor", str(f)),
                                   V) == explicit


@pytest.mark.parametrize("argv,message", [
    (["--mome-index", "mod", "--mome-rows", "334", "--mome-slot-factor", "3"],
     "--mome-rows 334 and --mome-slot-factor 3 both set N (the reference uses the explicit size and ignores the "
     "factor); pass one of them"),
    (["--mome-slot-factor", "2"], "--mome-slot-factor only applies to --mome-index mod or headmod (got --mome-index "
                                  "token)"),
    (["--mome-index", "bigram", "--mome-slot-factor", "2"], "--mome-slot-factor only applies to --mome-index mod or "
                                                            "headmod (got --mome-index bigram)"),
    (["--mome-index", "grouped", "--mome-group-size", "2", "--mome-slot-factor", "2"],
     "(got --mome-index grouped) (grouped sizes its rows with --mome-group-size c: N = V / c)"),
    (["--mome-index", "mod", "--mome-slot-factor", "0"], "--mome-slot-factor must be an integer >= 1 (got 0)"),
    (["--mome-index", "headmod", "--mome-slot-factor", "4", "--mome-dedicated-size", "250"],
     "--mome-dedicated-size 250 must satisfy 0 < D < --mome-rows 250 for --mome-index headmod (tokens below D keep "
     "their own row, the rest share N - D rows) (N = ceil(V / --mome-slot-factor f) = ceil(1000 / 4) = 250)"),
])
def test_slot_factor_refusals_name_the_flag(argv, message):
    with pytest.raises(ValueError) as e:
        memory_config_from_args(_args("--memory", "mome", *argv), 1000)
    assert message in str(e.value)
    with pytest.raises(ValueError, match="--mome-slot-factor only applies to --memory mome"):
        memory_config_from_args(_args("--memory", "ve", "--mome-slot-factor", "2"), 1000)
    # --mome-rows with the default factor is the explicit size, as before
    assert memory_config_from_args(_args("--memory", "mome", "--mome-index", "mod", "--mome-rows", "40"),
                                   1000)["memory_options"]["rows"] == 40


def test_dry_run_plans_the_resolved_rows(tmp_path, capsys):
    """--dry-run builds the plan (parameters, FLOPs, plan.json's model_config) with N = ceil(V / f): the same plan as
    --mome-rows N, and V is the run's vocab (--vocab-size here)."""
    import json

    from scripts import base_train

    plans = {}
    for name, flags in (("factor", ["--mome-slot-factor", "3"]), ("rows", ["--mome-rows", "334"])):
        run_dir = tmp_path / name
        assert base_train.main(["--dry-run", "--depth", "2", "--vocab-size", "1000", "--memory", "mome",
                                "--mome-index", "headmod", "--mome-dedicated-size", "100", *flags,
                                "--run-dir", str(run_dir)]) == 0
        plans[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert json.loads((run_dir / "plan.json").read_text())["model_config"]["memory_options"]["rows"] == 334
    assert plans["factor"] == plans["rows"]
    assert plans["factor"]["params_memory"] == 334 * 6 * 128  # 1 memory layer (depth 2), M = 6, d = 128


def test_a_factor_run_records_n_for_resume_and_export(tmp_path):
    """A run started with --mome-slot-factor records N in its checkpoint: it loads, resumes with --mome-rows N in
    place of the factor (the same config), and exports the resolved S as their base_train writes it."""
    import shutil

    from nanochat import checkpoint as ckpt
    from nanochat.reference_format import reference_from_config
    from test_train_e2e import losses, train

    flags = ["--memory", "mome", "--mome-slots", "4", "--mome-index", "mod", "--num-iterations", "2",
             "--save-every", "1"]
    assert train(tmp_path / "full", *flags, "--mome-slot-factor", "3") == 0
    model, _ = ckpt.load_model(tmp_path / "full", 1)
    assert model.config.memory_options["rows"] == 86 == -(-256 // 3) and model.memory.rows == 86
    assert "slot_factor" not in model.config.memory_options
    assert tuple(model.memory.tables[0].weight.shape) == (86 * 4, 32)
    shutil.copytree(tmp_path / "full", tmp_path / "run")
    shutil.rmtree(ckpt.step_dir(tmp_path / "run", 2))
    (tmp_path / "run" / "summary.json").unlink()
    assert train(tmp_path / "run", *flags, "--mome-rows", "86", "--resume", "latest") == 0
    assert losses(tmp_path / "run") == losses(tmp_path / "full")
    their = reference_from_config(ckpt.load_model(tmp_path / "run")[0].config)[1]  # what export_reference writes
    assert (their["moe_ve_slot_mapping"], their["moe_ve_slot_vocab_size"]) == ("mod", 86)


def test_reference_meta_of_a_factor_run_imports_as_the_factor_run():
    """Their base_train resolves --moe-ve-slot-factor f into model_config's moe_ve_slot_vocab_size = ceil(V / f)
    (model notes §1.1 has no factor field; the CLI args, f and the 0 = derived size, go to user_config, which their
    loader does not read). That model_config imports as ours with --mome-slot-factor f, equal to --mome-rows
    ceil(V / f); a model_config carrying the factor itself is not theirs and is refused by the field's name."""
    from nanochat.reference_format import ReferenceFormatError, reference_from_config

    cfg = {**REFERENCE_DEFAULTS, "vocab_size": 500, "n_layer": 2, "n_head": 2, "n_kv_head": 2, "n_embd": 128,
           "window_pattern": "L", "moe_ve_enabled": True, "value_embeds_layers": [1], "moe_ve_setting": "0_2_4",
           "moe_ve_gate_nl": "sigmoid-norm", "moe_ve_router_input": "hidden", "moe_ve_balance_lr": 0.0,
           "moe_ve_bias_update": "none", "moe_ve_slot_mapping": "headmod", "moe_ve_slot_vocab_size": 167,
           "moe_ve_slot_dedicated_size": 40}  # f = 3: S = ceil(500 / 3)
    imported = config_from_reference("gpt", cfg)
    ours = memory_config_from_args(_args("--memory", "mome", "--mome-slots", "4", "--mome-index", "headmod",
                                         "--mome-slot-factor", "3", "--mome-dedicated-size", "40"), 500)
    assert MoMEOptions(**imported.memory_options) == MoMEOptions(**ours["memory_options"])
    assert imported.memory_options["rows"] == 167
    factor_run = tiny_config(vocab_size=500, memory="mome", memory_options=ours["memory_options"])
    assert reference_from_config(factor_run)[1]["moe_ve_slot_vocab_size"] == 167
    with pytest.raises(ReferenceFormatError) as e:
        config_from_reference("gpt", {**cfg, "moe_ve_slot_vocab_size": 0, "moe_ve_slot_factor": 3})
    assert str(e.value).startswith("model_config moe_ve_slot_factor=3: not a field of their GPTConfig (their loader "
                                   "would reject it): their base_train resolves --moe-ve-slot-factor f into "
                                   "moe_ve_slot_vocab_size = ceil(V / f)")


def _tokenizer_of(directory, vocab: int):
    """A byte-level tokenizer of exactly ``vocab`` tokens (256 bytes, then byte pairs, then the specials): no
    training, only its size matters here."""
    import itertools

    from nanochat.tokenizer import SPECIAL_TOKENS, Tokenizer

    pairs = (bytes(p) for p in itertools.product(range(256), repeat=2))
    merges = list(itertools.islice(pairs, vocab - 256 - len(SPECIAL_TOKENS)))
    Tokenizer({**{bytes([i]): i for i in range(256)}, **{m: 256 + i for i, m in enumerate(merges)}}).save(directory)
    return directory


def test_the_flag_checks_resolve_n_from_the_tokenizer_not_an_assumed_vocab(tmp_path, capsys):
    """Without --vocab-size, N = ceil(V / f) is the run's tokenizer's V from the first flag check on: a 40000-token
    tokenizer at f = 2 gives N = 20000, so D = 18000 is valid (with the paper's 32768 assumed, N would be 16384 and
    D refused naming a V the run does not have)."""
    import json

    from scripts import base_train

    tok = _tokenizer_of(tmp_path / "tok", 40000)
    argv = ["--dry-run", "--tokenizer-dir", str(tok), "--depth", "2", "--memory", "mome", "--mome-index", "headmod",
            "--mome-slot-factor", "2", "--mome-dedicated-size", "18000", "--run-dir", str(tmp_path / "run")]
    assert base_train.main(argv) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["model_config"]["memory_options"]["rows"] == 20000
    capsys.readouterr()
    argv[argv.index("18000")] = "20000"  # D = N: refused, with the tokenizer's V in the message
    assert base_train.main(argv) == 2
    assert "(N = ceil(V / --mome-slot-factor f) = ceil(40000 / 2) = 20000)" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--mome-topk", "7"], "--mome-topk 7 exceeds --mome-slots 6 (need K <= M)"),
    (["--mome-routing", "fixed-random", "--mome-balance", "bias"],
     "--mome-balance bias needs a learned top-K selection (not fixed-random, K < M)"),
])
def test_a_derived_n_is_explained_only_in_errors_about_n(argv, message):
    """The N = ceil(V / f) note belongs to the errors that name N (--mome-rows); any other error of a factor run is
    the same as without the factor, with no note about a number it does not involve."""
    with pytest.raises(ValueError) as e:
        memory_config_from_args(_args("--memory", "mome", "--mome-index", "mod", *argv), 1000)
    assert str(e.value).endswith(message)
