"""MoVE-Input (RECONSTRUCTED, spec appendix_adaptations.md §5): per-token reference, precompute property, hash,
decoding, the d24 parameter total, init equivalence and training."""

import json
import math

import pytest
import torch

from conftest import tiny_config
from nanochat.engine import generate, generate_uncached
from nanochat.gpt import GPTConfig, build_model, model_summary
from nanochat.kv_cache import KVCache
from nanochat.memory.hashing import HASH_CUR, HASH_PREV
from nanochat.memory.move_input import MoVEOptions, bigram_experts

OPTS = {"experts": 5, "rank": 8}


def _model(n_layer=4, **opts):
    model = build_model(tiny_config(memory="move_input", n_layer=n_layer, memory_options={**OPTS, **opts}), seed=0)
    with torch.no_grad():  # non-zero Bexp and W_gamma (zero at init), so the expert and the gate both matter
        g = torch.Generator().manual_seed(1)
        for p in [*model.memory.expert_out, *(gate.weight for gate in model.memory.gates)]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _ids(B, T, seed=2, vocab=512):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def py_expert(cur: int, prev: int, E: int) -> int:
    return ((HASH_CUR * cur) ^ (HASH_PREV * prev)) % E


def rms(v: torch.Tensor) -> torch.Tensor:
    return v / torch.sqrt(v.pow(2).mean() + torch.finfo(v.dtype).eps)


def test_residual_equals_a_per_token_python_loop():
    model = _model()
    mem = model.memory
    idx = _ids(2, 9)
    x = torch.randn(2, 9, 128, generator=torch.Generator().manual_seed(3))
    ctx = mem.prepare(idx, None)
    H, hd = 2, 64
    for layer in mem.layers:
        pos = mem.layer_pos[layer]
        table, gate = mem.tables[pos].weight, mem.gates[pos].weight
        out = mem.residual(layer, x, ctx)
        for b in range(2):
            for t in range(9):
                cur = int(idx[b, t])
                prev = int(idx[b, t - 1]) if t > 0 else cur  # rows start with BOS: b_0 = (x_0, x_0)
                k = py_expert(cur, prev, OPTS["experts"])
                u = 0.5 * (table[prev] + table[cur])
                m = mem.expert_out[k] @ torch.relu(mem.expert_in[k] @ rms(u)).square()
                gamma = 2 * torch.sigmoid(gate @ rms(x[b, t]))
                want = x[b, t] + torch.cat([gamma[h] * m[h * hd:(h + 1) * hd] for h in range(H)])
                torch.testing.assert_close(out[b, t], want, rtol=1e-5, atol=1e-5)
        assert not torch.equal(out, x)
    assert torch.equal(mem.residual(0, x, ctx), x)  # layer 0 is not a memory layer


def test_precompute_property_pre_gate_vector_is_a_function_of_the_bigram():
    """MoVE's point: every expanded token's vector can be tabulated offline. Build the table by calling the expert
    on isolated (prev, cur) pairs, then check the vectors the batched forward uses at every position."""
    model = _model()
    mem = model.memory
    idx = torch.randint(0, 6, (3, 16), generator=torch.Generator().manual_seed(4))  # 6 ids: bigrams repeat
    ctx = mem.prepare(idx, None)
    for layer in mem.layers:
        table = {}
        for p in range(6):
            for c in range(6):
                pair = mem.prepare(torch.tensor([[c]]), {"prev_token": torch.tensor([p])})
                table[p, c] = mem.expert_output(mem.pooled(layer, pair["prev"], pair["cur"]), pair["expert"])[0, 0]
        batched = mem.expert_output(mem.pooled(layer, ctx["prev"], ctx["cur"]), ctx["expert"])  # (B, T, C)
        for b in range(3):
            for t in range(16):
                key = (int(ctx["prev"][b, t]), int(idx[b, t]))
                torch.testing.assert_close(batched[b, t], table[key], rtol=1e-5, atol=1e-5)
        # pooling is symmetric, so (p, c) and (c, p) share a vector exactly when they hash to the same expert
        keys = {(frozenset(pc), py_expert(pc[1], pc[0], OPTS["experts"])) for pc in table}
        assert len({tuple(v.tolist()) for v in table.values()}) == len(keys) > 21


def test_expert_hash_is_fixed():
    idx = torch.tensor([[5, 7, 9, 1000, 32767], [0, 1, 2, 3, 4]])
    prev, expert = bigram_experts(idx, 12, None)
    assert prev.tolist() == [[5, 5, 7, 9, 1000], [0, 0, 1, 2, 3]]
    want = [[py_expert(c, p, 12) for c, p in zip(row_c, row_p)] for row_c, row_p in zip(idx.tolist(), prev.tolist())]
    assert expert.tolist() == want == [[2, 4, 8, 7, 7], [0, 1, 1, 1, 1]]  # literal: the same on every run/device
    state = {"prev_token": torch.tensor([11, 12])}  # decoding: the carried token replaces the row's own
    prev, expert = bigram_experts(idx[:, :2], 12, state)
    assert prev[:, 0].tolist() == [11, 12] and expert[0, 0] == py_expert(5, 11, 12)
    assert state["prev_token"].tolist() == [7, 1]
    _, one = bigram_experts(idx, 1, None)
    assert one.eq(0).all()  # E = 1: a single expert, no reserved row


@pytest.mark.parametrize("memory_layers", [(), (0, 2)])
def test_kv_decoding_equals_full_forward(memory_layers):
    model = build_model(tiny_config(memory="move_input", memory_layers=memory_layers, n_layer=3,
                                    memory_options=OPTS), seed=0).eval()
    with torch.no_grad():
        for p in model.memory.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    idx = _ids(2, 12)
    full = model(idx)
    cache = KVCache.for_model(model, batch_size=2, max_len=12)
    parts = [model(idx[:, :5], kv_cache=cache), model(idx[:, 5:8], kv_cache=cache)]  # chunked prefill
    parts += [model(idx[:, t : t + 1], kv_cache=cache) for t in range(8, 12)]  # token-by-token decode
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_engine_cached_greedy_equals_uncached():
    model = _model(n_layer=2)
    prompt = _ids(1, 7, seed=5)[0].tolist()
    assert generate(model, prompt, max_tokens=10, temperature=0.0)[0] == generate_uncached(model, prompt, max_tokens=10)


def test_d24_parameter_total_and_flops():
    s = model_summary(GPTConfig.from_depth(24, memory="move_input"))  # meta device
    assert s["params_total"] == 1_386_700_848  # spec §2: bb + 12 V C + 12 (2 r C) + 12 H C
    assert s["params_memory"] == 12 * 32768 * 1536
    assert s["params_active"] == s["params_total"] - s["params_memory"] + 12 * 2 * 1536  # two rows per layer
    base = model_summary(GPTConfig.from_depth(24))
    assert s["flops_per_token"] - base["flops_per_token"] == 6 * (12 * 2 * 64 * 1536 + 12 * 12 * 1536)
    assert abs(round(6e19 / (s["flops_per_token"] * 1048576)) - 10827) <= 35  # spec §1: within 35 steps of base


def test_parameter_groups():
    from nanochat.optim import OptimConfig, build_param_groups

    model = _model()
    groups = {g["name"]: g for g in build_param_groups(model, OptimConfig())}
    mem = model.memory
    assert [p.shape for p in groups["memory_tables"]["params"]] == [(512, 128)] * 2
    assert groups["memory_tables"]["weight_decay"] == 0.001
    muon = {id(p) for g in groups.values() if g["kind"] == "muon" for p in g["params"]}
    experts = [*mem.expert_in, *mem.expert_out, *(g.weight for g in mem.gates)]
    assert len(experts) == 2 * 5 + 2 and all(id(p) in muon for p in experts)
    assert [tuple(p.shape) for p in (mem.expert_in[0], mem.expert_out[0], mem.gates[0].weight)] == \
        [(8, 128), (128, 8), (2, 128)]


def test_at_init_equals_base_exactly():
    idx = _ids(2, 32)
    base = build_model(tiny_config(), seed=7)
    move = build_model(tiny_config(memory="move_input"), seed=7)
    assert torch.equal(base(idx), move(idx))


def test_only_the_routed_expert_gets_gradient():
    model = _model(experts=12)
    mem = model.memory
    idx = torch.tensor([[3, 3, 3, 3]])  # one bigram (3, 3) everywhere: one expert
    model(idx, idx).backward()
    k = py_expert(3, 3, 12)
    for j in range(12):
        assert (mem.expert_in[j].grad.abs().sum() > 0) == (j == k), j
        assert (mem.expert_out[j].grad.abs().sum() > 0) == (j == k), j


def test_option_errors_name_the_flag():
    with pytest.raises(ValueError, match="--move-experts"):
        MoVEOptions(experts=0)
    with pytest.raises(ValueError, match="--move-rank"):
        model_summary(tiny_config(memory="move_input", memory_options={"rank": 1.5}))


def test_tiny_run_trains_with_decreasing_loss(tmp_path):
    """base_train end to end (synthetic random-walk rows): the loss falls and the memory moved."""
    from nanochat import checkpoint as ckpt
    from scripts import base_train

    run = tmp_path / "r"
    argv = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
            "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core",
            "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "30", "--save-every", "30",
            "--memory", "move_input", "--move-experts", "4", "--move-rank", "8", "--run-dir", str(run)]
    assert base_train.main(argv) == 0
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if r["kind"] == "train"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses
    summary = json.loads((run / "summary.json").read_text())
    assert math.isfinite(summary["val_bpb"])
    weights = torch.load(ckpt.step_dir(run, 30) / "model.pt")
    assert weights["memory.expert_out.0"].abs().sum() > 0 and weights["memory.gates.0.weight"].abs().sum() > 0


@pytest.mark.slow  # ~1 min of compilation on 2 CPU cores
def test_compiles_fullgraph_in_training_mode():
    """No graph breaks and no host syncs: the masked expert dispatch has static shapes."""
    model = build_model(tiny_config(memory="move_input", memory_options=OPTS), seed=0).train()
    ref = build_model(tiny_config(memory="move_input", memory_options=OPTS), seed=0).train()
    data = _ids(2, 17)
    loss = torch.compile(model, fullgraph=True, dynamic=False)(data[:, :-1], data[:, 1:])
    loss.backward()
    torch.testing.assert_close(loss, ref(data[:, :-1], data[:, 1:]), rtol=1e-4, atol=1e-4)
    assert model.memory.expert_in[0].grad is not None
