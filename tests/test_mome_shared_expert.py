"""--mome-shared-expert (the authors' always-on shared expert, "1_K_E"; reference notes §3.3, §3.7, §3.9):
table shapes and exact parameter counts, accounting (memory, FLOPs, active parameters), the optimizer group,
load statistics without it, and the default (off) model unchanged. The forward against the
paper loop: test_memory_mome_reference.py; KV decoding, the checkpoint round trip and the CLI switch:
test_memory_blocks.py."""

import torch

from conftest import tiny_config
from mome_fixtures import counts_with_random_routers
from nanochat.gpt import GPTConfig, build_model, model_summary

PADDED_V, D = 512, 64  # tiny_config: vocab 512 (already a multiple of 64), n_embd 128 over 2 heads


def _model(**opts):
    return build_model(tiny_config(memory="mome", n_layer=4, memory_options=opts), seed=0)


def test_per_layer_shared_experts_are_n_by_d_tables_beside_the_routed_ones():
    m = _model(shared_expert=True).memory
    assert m.layers == (1, 3) and [tuple(t.weight.shape) for t in m.shared_experts] == [(PADDED_V, D)] * 2
    assert not hasattr(m, "shared_expert")
    assert [p.shape for p in m.memory_tables()] == [(PADDED_V * 6, D)] * 2 + [(PADDED_V, D)] * 2


def test_the_bigram_index_shares_one_shared_expert_across_layers():
    """The network-shared routed table comes with one network-shared shared expert (reference notes §3.1)."""
    m = _model(index="bigram", bigram_factor=2, shared_expert=True).memory
    assert tuple(m.shared_expert.weight.shape) == (2 * 512, D) and not hasattr(m, "shared_experts")
    assert [p.shape for p in m.memory_tables()] == [(2 * 512 * 6, D), (2 * 512, D)]


def test_d12_counts_memory_params_but_not_flops():
    """d12 (6 memory layers, padded V 32768, d 128): +6 x 32768 x 128 per-layer, +6V x 128 once for n6 bigram;
    tables are excluded from FLOPs (reference notes §3.3), so the FLOP target is unchanged."""
    def d12(**o):
        return model_summary(GPTConfig.from_depth(12, memory="mome", memory_options=o))

    for opts, added in (({}, 6 * 32768 * 128), ({"index": "bigram", "bigram_factor": 6}, 6 * 32768 * 128)):
        off, on = d12(**opts), d12(**opts, shared_expert=True)
        assert on["params_memory"] - off["params_memory"] == added == 25_165_824
        assert on["params_total"] - off["params_total"] == added
        assert on["params_backbone"] == off["params_backbone"]
        assert on["flops_per_token"] == off["flops_per_token"]


def test_active_params_add_one_row_per_shared_expert_table():
    for opts, rows in (({}, 2), ({"index": "bigram", "bigram_factor": 2}, 1)):
        off, on = _model(**opts).num_params(), _model(**opts, shared_expert=True).num_params()
        assert on["params_active"] - off["params_active"] == rows * D


def test_shared_experts_join_the_memory_table_group():
    from nanochat.optim import OptimConfig, build_param_groups

    model = _model(shared_expert=True)
    groups = {g["name"]: g for g in build_param_groups(model, OptimConfig())}
    table_ids = {id(p) for p in groups["memory_tables"]["params"]}
    assert all(id(t.weight) in table_ids for t in model.memory.shared_experts)


def test_init_is_the_routed_tables_uniform_bound():
    m = _model(shared_expert=True).memory
    for t in m.shared_experts:
        w = t.weight
        assert w.abs().max() <= m.table_bound and w.abs().max() > 0.9 * m.table_bound and w.std() > 0


def test_load_statistics_count_routed_selections_only():
    """Same routers, with and without the shared expert: the same per-(head, slot) load (§3.9: no shared-expert
    counts)."""
    loads = [counts_with_random_routers(shared_expert=shared) for shared in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(*loads))
    assert loads[0][0].sum() == 2 * 2 * 16 * 2 * 2  # L * B * T * H * K: the routed choices only


def test_default_mome_state_dict_is_unchanged():
    """Off (every paper run): no parameter, state-dict key or option value beyond the routed design's."""
    model = _model()
    keys = set(model.memory.state_dict())
    assert keys == {"tables.0.weight", "tables.1.weight", "routers.0.weight", "routers.0.bias", "routers.1.weight",
                    "routers.1.bias", "gates.0.proj.weight", "gates.1.proj.weight"}
    bigram = set(_model(index="bigram", bigram_factor=2).memory.state_dict())
    assert bigram == {"table.weight"} | {k for k in keys if not k.startswith("tables.")}
    on = set(_model(shared_expert=True).memory.state_dict())
    assert on - keys == {"shared_experts.0.weight", "shared_experts.1.weight"}

