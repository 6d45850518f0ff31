"""Registry-driven checks: every ``MEMORY_BLOCKS`` design and every ``FAMILIES`` family is covered the moment it is
registered (docs/extending.md). Tiny dims, depth 2, vocab 128, no training loop: the file runs in seconds."""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from conftest import MEMORY_OPTION_SETS, tiny_config
from nanochat import families
from nanochat.families import FAMILIES, Family, build_model, config_from_args, config_from_dict, param_groups
from nanochat.gpt import GPT, GPTConfig
from nanochat.memory import BLOCK_FLAGS, MEMORY_BLOCKS
from nanochat.optim import OptimConfig
from nanochat.train_args import parse_args


# -- a family is its own config and model class, whatever its FFN ----------------------------------------------
@dataclass
class VariantGPTConfig(GPTConfig):
    family: ClassVar[str] = "gpt-variant"


class VariantGPT(GPT):
    pass


class ForgotFamilyConfig(GPTConfig):  # inherits family "nanochat": registered under another key, it is refused
    pass


@pytest.fixture
def variant_family(monkeypatch):
    monkeypatch.setitem(FAMILIES, "gpt-variant", Family(VariantGPTConfig, VariantGPT, None, True))


def test_a_nanochat_gpt_variant_family_builds_trains_and_loads_its_own_classes(variant_family):
    args = parse_args(["--model-type", "gpt-variant", "--synthetic-data", "--vocab-size", "128", "--depth", "2",
                       "--model-dim", "64", "--head-dim", "32"])  # the parser's choices are read from FAMILIES
    config = config_from_args(args, 128, dict(memory="base", memory_layers=[], memory_options={}))
    assert type(config) is VariantGPTConfig
    model = build_model(config, seed=0)
    assert type(model) is VariantGPT
    groups = param_groups(model, OptimConfig())
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(p) for p in model.parameters())
    d = config.to_dict()
    assert d["family"] == "gpt-variant"
    assert config_from_dict(d) == config and type(config_from_dict(d)) is VariantGPTConfig
    assert "family" not in tiny_config().to_dict()  # the nanochat GPT's meta.json is as it was
    assert type(config_from_dict(tiny_config().to_dict())) is GPTConfig


def test_a_family_whose_config_names_another_family_is_refused(monkeypatch):
    monkeypatch.setitem(FAMILIES, "forgot", Family(ForgotFamilyConfig, GPT, None, True))
    with pytest.raises(ValueError, match="'forgot'.*ForgotFamilyConfig.family is 'nanochat'"):
        families.check_families()
    with pytest.raises(ValueError, match="'forgot'.*ForgotFamilyConfig.family is 'nanochat'"):
        families.family_of(ForgotFamilyConfig())


@dataclass
class ExplicitHeadConfig(families.Qwen3Config):
    family: str = "explicit-head"


def test_head_size_flags_follow_the_registry_rule_not_a_family_name(monkeypatch):
    """--num-heads with a --head-dim that C/H contradicts: refused where d = C/H, kept where d = --head-dim."""
    from nanochat.train_args import check_geometry

    monkeypatch.setitem(FAMILIES, "explicit-head", Family(ExplicitHeadConfig, families.Qwen3, lambda c: 3 * c, False))
    args = parse_args(["--model-type", "qwen3", "--model-dim", "64", "--num-heads", "3", "--head-dim", "16"])
    for name, refused in (("explicit-head", False), ("qwen3", False), ("mobilellm", True), ("nanochat", True)):
        args.model_type = name
        if refused:
            with pytest.raises(ValueError, match="--model-dim 64 must split into --num-heads 3 heads of even size"):
                check_geometry(args)
        else:
            check_geometry(args)


# -- every registered design -------------------------------------------------------------------------------------
# BLOCK_FLAGS keys that memory_config_from_args resolves into another option before the block sees them
RESOLVED_BEFORE_THE_BLOCK = {("mome", "slot_factor"): "rows"}


# ids lead with the design, so ``pytest -k <design>`` selects its flag rows too (a flag is hyphenated: --move-rank)
@pytest.mark.parametrize("block, flag, key, kwargs", BLOCK_FLAGS, ids=[f"{row[0]}:{row[1]}" for row in BLOCK_FLAGS])
def test_block_flag_default_is_the_options_default(block, flag, key, kwargs):
    """An unset flag must build what the block's Options build (and what a config without the key loads as);
    memory_config_from_args also takes "equals the default" to mean "not given" for another block's flags."""
    assert block in MEMORY_BLOCKS, f"{flag}: BLOCK_FLAGS names an unregistered design {block!r}"
    defaults = {f.name: f.default for f in dataclasses.fields(MEMORY_BLOCKS[block].Options)}
    if (block, key) in RESOLVED_BEFORE_THE_BLOCK:
        assert key not in defaults and RESOLVED_BEFORE_THE_BLOCK[block, key] in defaults
        return
    assert key in defaults, f"{flag}: {MEMORY_BLOCKS[block].Options.__name__} has no field {key!r}"
    assert kwargs["default"] == defaults[key] and type(kwargs["default"]) is type(defaults[key]), \
        f"{flag} default {kwargs['default']!r} != {MEMORY_BLOCKS[block].Options.__name__}.{key} {defaults[key]!r}"


# Options fields that memory_config_from_args derives from other flags (no flag of their own)
DERIVED_OPTIONS = {("mome", "slot_map_sha256")}


@pytest.mark.parametrize("design", list(MEMORY_BLOCKS))
def test_every_option_has_a_flag_row(design):
    """An Options field without a BLOCK_FLAGS row cannot be set from the command line or a config row: base_train
    would always build its default, and argparse would only say "unrecognized arguments" for the flag."""
    rows = {key for block, _, key, _ in BLOCK_FLAGS if block == design}
    missing = [f.name for f in dataclasses.fields(MEMORY_BLOCKS[design].Options)
               if f.name not in rows and (design, f.name) not in DERIVED_OPTIONS]
    assert not missing, (f"--memory {design}: {MEMORY_BLOCKS[design].Options.__name__} field(s) {missing} have no "
                         f"BLOCK_FLAGS row in nanochat/memory/__init__.py: add (\"{design}\", \"--<prefix>-<option>\", "
                         f"\"<field>\", dict(type=..., default=<the field's default>, help=...)) for each")


def test_reference_numerics_refuse_a_family_the_authors_code_lacks(variant_family):
    from nanochat.numerics import apply_numerics

    model = build_model(VariantGPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2,
                                         n_embd=32), seed=0)
    with pytest.raises(ValueError, match="--numerics reference: .*--model-type gpt-variant.*--numerics ours"):
        apply_numerics(model, "reference")
    assert apply_numerics(model, "ours") == {"numerics": "ours"}


MOE = dict(mlp="moe", moe_experts=4, moe_topk=2, moe_shared=1)


def test_a_gpt_variant_family_compares_its_moe_width_as_resolved(variant_family):
    """init_from resolves moe_hidden 0 (4C/(S+K), 192 at C=128) on any config with the MoE FFN fields, not only the
    family named nanochat: a --resume/--init-from that spells the width out is the same model."""
    from nanochat.init_from import config_differences

    auto = tiny_config(family="gpt-variant", **MOE).to_dict()
    spelled = tiny_config(family="gpt-variant", **MOE, moe_hidden=192).to_dict()
    other = tiny_config(family="gpt-variant", **MOE, moe_hidden=256).to_dict()
    assert auto["family"] == "gpt-variant"
    assert config_differences(auto, spelled) == [] and config_differences(spelled, auto) == []
    assert config_differences(auto, other) == ["moe_hidden 192 (source, from the default 0) vs 256 (this run)"]


@pytest.mark.parametrize("argv, name", [
    (["--depth", "4"], "d4-base"),
    (["--depth", "12", "--mlp", "moe", "--memory", "mome"], "d12-moe-mome"),
    (["--model-type", "mobilellm", "--depth", "4", "--memory", "ve"], "mobilellm-d4-ve"),
    (["--model-type", "qwen3-0.6b", "--memory", "stem"], "qwen3-0.6b-stem"),
    (["--model-type", "gpt-variant", "--depth", "2", "--mlp", "moe"], "gpt-variant-d2-moe-base"),
])
def test_default_run_names_lead_with_the_family_except_nanochat(variant_family, argv, name):
    """d<depth> is the nanochat family's own name; any other family, a registered GPT variant too, leads with its
    --model-type, so its runs never land in the runs/ directory of a nanochat run of the same depth."""
    from nanochat.train_setup import resolve_run_dir

    args = parse_args(argv)
    assert resolve_run_dir(args).name == name and args.run_name == name


DRY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--model-dim", "64", "--head-dim", "32",
       "--max-seq-len", "32", "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "2",
       "--eval-every", "-1", "--no-final-core", "--dry-run"]


@pytest.mark.parametrize("argv, printed", [
    (["--model-type", "mobilellm", "--memory", "ve"],
     ["presets: mobilellm tables of --memory ve: --memory-lr 0.1, --memory-beta2 0.95"]),
    (["--model-type", "mobilellm", "--memory", "ve", "--memory-lr", "0.2"],
     ["presets: mobilellm tables of --memory ve: --memory-lr 0.1 (overridden: 0.2), --memory-beta2 0.95"]),
    (["--model-type", "mobilellm", "--memory", "bigram"],
     ["presets: no table preset for --memory bigram on mobilellm (it has presets for --memory ve, mome, stem)"]),
    (["--model-type", "qwen3", "--memory", "stem", "--head-dim", "16"],
     ["presets: qwen3 recipe: --warmup-ratio 0.01",
      "presets: qwen3 tables of --memory stem: --memory-lr 0.3, --memory-beta2 0.95, --memory-wd 0.0"]),
    (["--memory", "ve"], []),
    (["--model-type", "mobilellm", "--memory", "base"], []),  # no tables: no memory AdamW to speak of
])
def test_dry_run_says_which_presets_applied(tmp_path, capsys, argv, printed):
    from scripts import base_train

    assert base_train.main([*DRY, "--run-dir", str(tmp_path), *argv]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines() if "presets:" in line]
    assert [line[: len(want)] for line, want in zip(lines, printed)] == printed and len(lines) == len(printed)


def test_every_registered_design_has_a_test_option_set():
    """tests/conftest.py MEMORY_OPTION_SETS[name] is each design's entry here and in the bf16 step tests (GPU,
    CUDA autocast emulation): a new design without one would go untested there."""
    missing = [name for name in MEMORY_BLOCKS if MEMORY_OPTION_SETS.get(name, {}).get("memory") != name]
    assert not missing, f"add these designs to tests/conftest.py MEMORY_OPTION_SETS (key = design name): {missing}"


def _option_set(design: str) -> dict:
    if MEMORY_OPTION_SETS.get(design, {}).get("memory") != design:
        pytest.fail(f"--memory {design} has no test option set: add {design!r}: dict(memory={design!r}, "
                    "memory_options={...}) to tests/conftest.py MEMORY_OPTION_SETS (docs/extending.md)")
    return MEMORY_OPTION_SETS[design]


def _generic_config(design: str, family: str):
    opts = _option_set(design)
    return tiny_config(family=family, memory=design, memory_options=dict(opts.get("memory_options", {})),
                       vocab_size=128, n_embd=64, n_head=2, n_kv_head=1, sequence_len=16)


def _built_or_refused(config, device=None):
    """The model of ``config``, or None where the family refuses the design for the one documented reason: the block
    replaces FFN up-projections and the family's FFN has none (the refusal must name --memory and say so)."""
    from nanochat.families import meta_device

    try:
        if device is None:
            with meta_device():
                return families.family_of(config).model_cls(config)
        return build_model(config, device=device, seed=0)
    except ValueError as e:
        assert FAMILIES[config.family].ffn_rule is None and "up-projection" in str(e), e
        assert f"--memory {config.memory}" in str(e)
        return None


def _unique(params) -> list:
    return list({id(p): p for p in params}.values())


DESIGN_FAMILY = [(d, f) for d in MEMORY_BLOCKS for f in FAMILIES]


@pytest.mark.parametrize("design, family", DESIGN_FAMILY, ids=[f"{d}-{f}" for d, f in DESIGN_FAMILY])
def test_parameter_accounting_on_the_meta_device(design, family):
    config = _generic_config(design, family)
    model = _built_or_refused(config)
    if model is None:
        return
    memory = model.memory
    tables, scalars, params = _unique(memory.memory_tables()), _unique(memory.scalar_params()), _unique(model.parameters())
    owned = {id(p) for p in memory.parameters()}
    assert {id(p) for p in tables + scalars} <= owned and not {id(p) for p in tables} & {id(p) for p in scalars}
    assert len(tables) == len(memory.memory_tables())  # a table listed twice would count twice
    counts = model.num_params()
    n_tables = sum(p.numel() for p in tables)
    assert counts["params_total"] == sum(p.numel() for p in params)
    assert counts["params_memory"] == n_tables
    assert counts["params_backbone"] == counts["params_total"] - n_tables
    active = memory.active_table_params()
    assert (0 < active <= n_tables) if tables else active == 0
    assert counts["params_active"] == counts["params_total"] - n_tables + active  # dense FFN: no inactive experts
    assert families.model_summary(config) == {**counts, "flops_per_token": model.estimate_flops()}


# built for real (slower than the meta device): each design on its option set's family, and every family with MoME
# (tables, routers, buffers)
BUILT = sorted({(d, MEMORY_OPTION_SETS.get(d, {}).get("family", "nanochat")) for d in MEMORY_BLOCKS}
               | {("mome", f) for f in FAMILIES})


@pytest.mark.parametrize("design, family", BUILT, ids=[f"{d}-{f}" for d, f in BUILT])
def test_forward_groups_and_checkpoint_round_trip(tmp_path, design, family):
    """A forward of the right shape, every trainable parameter in exactly one optimizer group (frozen ones in
    none), and a save/load that gives back the same class, config and state, bit for bit."""
    from nanochat import checkpoint as ckpt

    config = _generic_config(design, family)
    model = _built_or_refused(config, device="cpu")
    if model is None:
        return
    idx = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    assert model(idx[:, :-1]).shape == (2, 8, 128)
    groups = param_groups(model, OptimConfig())
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    loss, aux = model(idx[:, :-1], idx[:, 1:], return_aux=True)
    assert loss.shape == aux.shape == () and torch.isfinite(loss) and torch.isfinite(aux)
    ckpt.save_checkpoint(tmp_path, 1, model, {})
    loaded, _ = ckpt.load_model(tmp_path, 1)
    assert type(loaded) is type(model) and type(loaded.config) is type(config) and loaded.config == model.config
    state, back = model.state_dict(), loaded.state_dict()
    assert state.keys() == back.keys()
    assert all(state[k].dtype == back[k].dtype and torch.equal(state[k], back[k]) for k in state)
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))


def _hook_shape_mismatch(block, config, idx, layer, hook, args):
    """'' if block.<hook>(layer, *args, ctx) returns the shape the backbone expects, else what went wrong."""
    want = (*idx.shape, config.ffn_hidden) if hook == "ffn_up" else args[-2].shape  # the hooked tensor, before ctx
    try:
        out = getattr(block, hook)(layer, *args)
    except Exception as e:  # the backbone would raise the same from deep inside its forward: name the hook instead
        return f"{type(block).__name__}.{hook}(layer {layer}) raised {type(e).__name__}: {e}"
    if not isinstance(out, torch.Tensor) or out.shape != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"{type(block).__name__}.{hook}(layer {layer}) returned {got}, the backbone needs {tuple(want)}"
    return ""


@pytest.mark.parametrize("design, family", BUILT, ids=[f"{d}-{f}" for d, f in BUILT])
def test_every_hook_returns_the_shape_the_backbone_needs(design, family):
    """Each forward hook called alone on inputs of the documented shapes (nanochat/memory/base.py), B != T != H so
    that a wrong broadcast changes the shape: a block that returns the wrong shape fails here naming the hook and
    the layer, not with a broadcast error deep inside the backbone's forward."""
    config = _generic_config(design, family)
    model = _built_or_refused(config, device="cpu")
    if model is None:
        return
    block, (B, T) = model.memory, (3, 5)
    idx = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    x, h, dm = (torch.randn(B, T, config.n_embd, generator=gen) for _ in range(3))
    v = torch.randn(B, T, config.n_kv_head, config.head_dim, generator=gen)
    with torch.no_grad():
        ctx = block.prepare(idx, None)
        calls = [(layer, hook, args) for layer in range(config.n_layer)
                 for hook, args in (("residual", (x, ctx)), ("value", (x, v, ctx)), ("mlp_out", (h, dm, ctx)))]
        calls += [(layer, "ffn_up", (x, ctx)) for layer in range(config.n_layer) if block.owns_ffn_up(layer)]
        wrong = [m for layer, hook, args in calls if (m := _hook_shape_mismatch(block, config, idx, layer, hook, args))]
    assert not wrong, "\n".join(wrong)
