"""The optimizer groups of every registered memory design on every family (and of the MoE FFN), built on the meta
device, against the rules of the reference's grouping (model spec §1.6, families spec §6) that "every parameter in
exactly one group" (tests/test_registry_generic.py) does not imply: a lookup table is never a Muon matrix, and every
learning rate follows the batch-size LR scale."""

import dataclasses

import pytest
from torch import nn

from conftest import tiny_config
from nanochat.families import family_of, meta_device, param_groups
from nanochat.optim import OptimConfig
from test_registry_generic import DESIGN_FAMILY, _built_or_refused, _generic_config

CASES = [*DESIGN_FAMILY, ("moe-ffn", "nanochat")]


def _model(design: str, family: str):
    if design == "moe-ffn":
        config = tiny_config(mlp="moe", moe_experts=4, moe_topk=2, vocab_size=128, n_embd=64, n_head=2, n_kv_head=1,
                             sequence_len=16)
        with meta_device():
            return family_of(config).model_cls(config)
    return _built_or_refused(_generic_config(design, family))


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("lr", "initial_lr", "params")}


@pytest.mark.parametrize("design, family", CASES, ids=[f"{d}-{f}" for d, f in CASES])
def test_tables_are_adamw_and_every_lr_follows_the_batch_scale(design, family):
    model = _model(design, family)
    if model is None:  # a family without the FFN up-projection this design replaces (checked where it is refused)
        return
    groups = param_groups(model, OptimConfig())
    group_of = {id(p): g for g in groups for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    # a token-indexed table (any nn.Embedding: wte, memory tables, MoME's route table, STEM's) is trained by AdamW in
    # wte's or the memory-table group; a table left out of memory_tables() would fall to Muon by its shape (an
    # orthogonalised update of a vocabulary-sized table, and counted as backbone parameters)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    assert {id(p) for p in model.memory.memory_tables()} <= tables
    for i in tables:
        assert group_of[i]["kind"] == "adamw" and group_of[i]["name"] in ("wte", "memory_tables"), names[i]
    for g in groups:
        if g["kind"] == "muon":  # one stacked shape per group
            assert {tuple(p.shape) for p in g["params"]} == {tuple(g["params"][0].shape)} and g["params"][0].ndim == 2
        if g["name"] == "adam_extra":  # the shape-routed rest: matrices go to Muon
            assert all(p.ndim != 2 for p in g["params"]), [names[id(p)] for p in g["params"]]
    # sqrt(B / 2^19) multiplies every group's LR (the reference's batch_lr_scale: "every LR passed in"), and only
    # the LR: a group built without it would train at another LR than its flags say whenever B != 2^19
    scaled = param_groups(model, dataclasses.replace(OptimConfig(), lr_scale=0.25))
    assert [g["name"] for g in scaled] == [g["name"] for g in groups]
    for g, s in zip(groups, scaled):
        assert s["lr"] == pytest.approx(0.25 * g["lr"], rel=1e-12) and s["initial_lr"] == s["lr"], g["name"]
        assert _hyperparameters(s) == _hyperparameters(g), g["name"]
        assert [id(p) for p in s["params"]] == [id(p) for p in g["params"]], g["name"]
