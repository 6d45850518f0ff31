"""--mome-per-head-table (the authors' moe_ve_per_head_table; reference notes §3.3: routed rows (slot*H + h)*E + e,
S*H*E x d; shared expert (S*H, d)): table shapes and exact parameter counts, accounting (memory, FLOPs, active
parameters), the optimizer group, init, counts per (row, head, slot) unchanged, the default state dict unchanged.
The forward against the paper loop on every mix path: test_memory_mome_reference.py; KV decoding, the checkpoint
round trip, flag refusals and the CLI switch: test_memory_blocks.py; import/export: test_reference_import.py."""

import torch

from conftest import tiny_config
from mome_fixtures import counts_with_random_routers
from nanochat.gpt import GPTConfig, build_model, model_summary

PADDED_V, D, H, M = 512, 64, 2, 6  # tiny_config: vocab 512, n_embd 128 over 2 (KV) heads; default M = 6


def _model(**opts):
    return build_model(tiny_config(memory="mome", n_layer=4, memory_options=opts), seed=0)


def test_per_layer_tables_have_h_times_the_rows():
    m = _model(per_head_table=True, shared_expert=True).memory
    assert m.layers == (1, 3)
    assert [tuple(t.weight.shape) for t in m.tables] == [(PADDED_V * H * M, D)] * 2
    assert [tuple(t.weight.shape) for t in m.shared_experts] == [(PADDED_V * H, D)] * 2
    assert [id(p) for p in m.memory_tables()] == [id(t.weight) for t in [*m.tables, *m.shared_experts]]


def test_the_bigram_index_keeps_one_network_shared_per_head_table():
    m = _model(index="bigram", bigram_factor=2, per_head_table=True, shared_expert=True).memory
    assert tuple(m.table.weight.shape) == (2 * 512 * H * M, D) and not hasattr(m, "tables")
    assert tuple(m.shared_expert.weight.shape) == (2 * 512 * H, D)


def test_d12_counts_memory_params_but_not_flops():
    """d12 A2/6 (6 memory layers, padded V 32768, 6 KV heads, d 128): 6 x 32768 x 6 x 6 x 128 routed; +6 x 32768 x 6
    x 128 shared expert; FLOPs and backbone unchanged (tables are out of FLOPs, reference notes §3.3)."""
    def d12(**o):
        return model_summary(GPTConfig.from_depth(12, memory="mome", memory_options=o))

    shared, per_head = d12(), d12(per_head_table=True)
    assert per_head["params_memory"] == 6 * 32768 * 6 * 6 * 128 == 6 * shared["params_memory"] == 905_969_664
    assert per_head["params_total"] - shared["params_total"] == 5 * shared["params_memory"]
    assert per_head["params_backbone"] == shared["params_backbone"]
    assert per_head["flops_per_token"] == shared["flops_per_token"]
    with_expert = d12(per_head_table=True, shared_expert=True)
    assert with_expert["params_memory"] - per_head["params_memory"] == 6 * 32768 * 6 * 128
    bigram = d12(index="bigram", bigram_factor=6, per_head_table=True)  # one network table of 6V x H x M rows
    assert bigram["params_memory"] == 6 * 32768 * 6 * 6 * 128


def test_active_params_count_each_heads_own_slots():
    """Per layer each head reads K of its own M slots (H*K rows, where the shared table's heads overlap in at most
    M); the shared expert one row per head; the network-shared table min(M, L*K) per head."""
    def active(**o):
        return _model(**o).num_params()["params_active"]

    assert active(per_head_table=True) - active() == 2 * (H * 2 - min(M, H * 2)) * D  # H*K = 4 <= M: equal
    assert active(topk=5, per_head_table=True) - active(topk=5) == 2 * (H * 5 - M) * D
    assert active(per_head_table=True, shared_expert=True) - active(per_head_table=True) == 2 * H * D
    bigram = dict(index="bigram", bigram_factor=2)
    assert active(**bigram, topk=2, per_head_table=True) - active(**bigram, topk=2) == (H * 4 - 6) * D


def test_per_head_tables_join_the_memory_table_group_and_init_uniform():
    from nanochat.optim import OptimConfig, build_param_groups

    model = _model(per_head_table=True, shared_expert=True)
    groups = {g["name"]: g for g in build_param_groups(model, OptimConfig())}
    table_ids = {id(p) for p in groups["memory_tables"]["params"]}
    m = model.memory
    assert all(id(p) in table_ids for p in m.memory_tables())
    for w in m.memory_tables():
        assert w.abs().max() <= m.table_bound and w.abs().max() > 0.9 * m.table_bound


def test_counts_stay_per_row_head_slot():
    """The router and so the selections do not depend on the table layout: training counts (load, balance) and the
    final-eval slot-balance counts equal the shared table's."""
    counts = [counts_with_random_routers(per_head_table=per_head) for per_head in (False, True)]
    assert counts[1][2].shape == (2, PADDED_V, H, M)
    for a, b in zip(*counts):
        assert torch.equal(a, b)


def test_default_state_dict_and_options_are_unchanged():
    keys = set(_model().memory.state_dict())
    on = _model(per_head_table=True)
    assert set(on.memory.state_dict()) == keys  # same names, larger tables
    assert _model().memory.opts.per_head_table is False

