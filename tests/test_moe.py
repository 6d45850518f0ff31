"""Sparse MoE FFN (--mlp moe; spec appendix_adaptations §6): equations against a naive per-token reference,
dropless dispatch, loss-free balancing (one and two processes), parameter/FLOP accounting at d24, optimizer
routing, compilation, flags, and training through base_train."""

import importlib.util
import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import load_bench, tiny_config
from cuda_autocast import CudaAutocastPolicy
from nanochat import checkpoint as ckpt
from nanochat import moe as moe_module
from nanochat.families import config_from_dict
from nanochat.gpt import GPTConfig, build_model, model_summary
from nanochat.kv_cache import KVCache
from nanochat.moe import MoEFFN, moe_hidden_size
from nanochat.optim import OptimConfig, build_param_groups
from scripts import base_train
from test_train_e2e import TINY, losses, weights

MOE = dict(mlp="moe")
MOME_A2_12 = dict(memory="mome", memory_options={"slots": 12, "topk": 2})
D24_DENSE = 780_140_592


def moe_layer(seed=0, **kw) -> MoEFFN:
    """A tiny MoE layer (C=64) with random router, random non-zero c_proj and a random selection bias."""
    cfg = tiny_config(n_embd=64, mlp="moe", **kw)
    with torch.device("meta"):
        layer = MoEFFN(cfg, 0)
    layer.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.init_weights(3 ** 0.5 / 8)
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.size(1) ** 0.5)  # O(1) activations and outputs
        layer.bias.copy_(0.2 * torch.randn(layer.E, generator=g))
    return layer


def relu2(x, fc, proj):
    return F.relu(x @ fc.T).square() @ proj.T


def naive_reference(layer: MoEFFN, x: torch.Tensor) -> torch.Tensor:
    """Per token, float64: every expert evaluated, top-K of s + b picked by a Python sort, weights s / sum_sel s,
    plus the shared experts."""
    W = {n: p.detach().double() for n, p in layer.named_parameters()}
    b = layer.bias.double()
    out = torch.zeros(x.shape[:-1] + (x.size(-1),), dtype=torch.float64)
    for t in range(x.size(0)):
        u = x[t].double()
        s = torch.sigmoid(W["router.weight"] @ u)
        every = [relu2(u, W[f"experts.{i}.c_fc.weight"], W[f"experts.{i}.c_proj.weight"]) for i in range(layer.E)]
        chosen = sorted(range(layer.E), key=lambda i: -(s[i] + b[i]).item())[: layer.K]
        y = sum(s[i] / sum(s[j] for j in chosen) * every[i] for i in chosen)
        for j in range(len(layer.shared)):
            y = y + relu2(u, W[f"shared.{j}.c_fc.weight"], W[f"shared.{j}.c_proj.weight"])
        out[t] = y
    return out


@pytest.fixture(params=[False, True], ids=["looped", "grouped"])
def dispatch(request, monkeypatch):
    monkeypatch.setattr(moe_module, "GROUPED_MM", request.param)
    return request.param


# -- equations -------------------------------------------------------------------------------------------------
def test_matches_naive_per_token_reference(dispatch):
    layer = moe_layer()
    x = torch.randn(3, 20, 64, generator=torch.Generator().manual_seed(1))
    want = naive_reference(layer, x.view(-1, 64)).view(3, 20, 64)
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
    # the bias really changed some choices (else the reference would not test selection by s + b)
    s = torch.sigmoid(layer.router(x.view(-1, 64)))
    assert not torch.equal(s.topk(2).indices.sort().values, (s + layer.bias).topk(2).indices.sort().values)


def test_two_shared_experts_and_k3_match_the_reference(dispatch):
    layer = moe_layer(seed=3, moe_experts=5, moe_topk=3, moe_shared=2, moe_hidden=48)
    assert (len(layer.experts), len(layer.shared), layer.hidden) == (5, 2, 48)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(layer(x[None])[0].double(), naive_reference(layer, x), rtol=1e-5, atol=1e-5)


def test_bias_shift_that_keeps_the_selection_keeps_the_output():
    layer = moe_layer()
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(4))
    before = layer(x)
    with torch.no_grad():
        layer.bias += 0.75  # the same shift for every expert: the order of s + b, so the choice, is unchanged
    assert torch.equal(layer(x), before)  # the bias never enters the weights
    with torch.no_grad():
        layer.bias[0] += 10.0  # now expert 0 is always chosen: a different output
    assert not torch.allclose(layer(x), before)


def test_segmentation_identity_with_a_forced_pair(dispatch, monkeypatch):
    """Router forced to experts (1, 4) with weights 1: the layer is a dense relu^2 MLP of width 3h made of the
    shared expert's and the two experts' c_fc rows and c_proj columns (spec §6.3.3)."""
    layer = moe_layer()
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(5))
    pair = torch.tensor([1, 4]).expand(24, 2)
    monkeypatch.setattr(layer, "route", lambda u: (pair, torch.ones(24, 2)))
    parts = [layer.shared[0], layer.experts[1], layer.experts[4]]
    fc = torch.cat([p.c_fc.weight for p in parts], dim=0)  # (3h, C)
    proj = torch.cat([p.c_proj.weight for p in parts], dim=1)  # (C, 3h)
    assert fc.shape == (3 * layer.hidden, 64)
    torch.testing.assert_close(layer(x), relu2(x, fc, proj), rtol=1e-5, atol=1e-5)
    # the same through the real gate: a huge bias forces the pair, a zero router makes s = 1/2 (weights 1/2 each)
    monkeypatch.undo()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.bias.copy_(torch.tensor([0.0, 9.0, 0.0, 0.0, 9.0, 0.0]))
    half = torch.cat([parts[0].c_proj.weight, 0.5 * parts[1].c_proj.weight, 0.5 * parts[2].c_proj.weight], dim=1)
    torch.testing.assert_close(layer(x), relu2(x, fc, half), rtol=1e-5, atol=1e-5)


def test_init_outputs_zero_and_hidden_rule():
    model = build_model(tiny_config(**MOE), seed=0)
    layer = model.blocks[0].mlp
    assert isinstance(layer, MoEFFN) and layer.hidden == moe_hidden_size(128, 1, 2) == 192  # 4*128/3 -> x64
    assert moe_hidden_size(1536, 1, 2) == 2048 and moe_hidden_size(768, 1, 2) == 1024
    assert moe_hidden_size(1536, 1, 2, hidden=100) == 100
    assert all(torch.all(e.c_proj.weight == 0) for e in (*layer.experts, *layer.shared))
    bound = (3 / 128) ** 0.5
    assert layer.router.weight.abs().max() <= bound and layer.router.weight.std() > bound / 3  # uniform, not zero
    assert torch.all(layer(torch.randn(2, 5, 128)) == 0)  # attention-only at init, like the dense model
    assert "blocks.0.mlp.bias" in model.state_dict()  # persistent: checkpoints carry the selection bias
    assert "blocks.0.mlp.balance_counts" not in model.state_dict()


# -- balancing -------------------------------------------------------------------------------------------------
def test_counts_stats_and_bias_update_sign():
    layer = moe_layer(moe_balance_lr=0.01)
    with torch.no_grad():
        layer.bias.zero_()
        layer.balance_counts.zero_()
        layer.load_counts.zero_()
    x = torch.randn(2, 30, 64, generator=torch.Generator().manual_seed(6))
    layer.eval()
    layer(x)
    assert layer.balance_counts.sum() == 0  # eval forwards do not count
    layer.train()
    layer(x)
    layer(x[:, :10])  # a second micro-step adds up
    sel = torch.cat([layer.route(x.view(-1, 64))[0], layer.route(x[:, :10].reshape(-1, 64))[0]])
    naive = torch.tensor([(sel == e).sum().item() for e in range(6)], dtype=torch.float32)
    assert torch.equal(layer.balance_counts, naive) and naive.sum() == 80 * 2
    stats = layer.stats()
    frac = naive / naive.sum()
    assert [stats[f"moe/load/layer0/expert{e}"] for e in range(6)] == pytest.approx(frac.tolist())
    assert stats["moe/maxvio/layer0"] == pytest.approx((naive.max() / naive.mean() - 1).item())
    assert layer.stats() == {}  # reset at every log step
    layer.after_optimizer_step()
    assert torch.equal(layer.bias, 0.01 * torch.sign(naive.mean() - naive))  # under-loaded experts go up
    assert layer.balance_counts.sum() == 0
    assert (layer.bias > 0).any() and (layer.bias < 0).any()


def test_bias_update_identical_on_two_gloo_ranks(gloo_checks):
    # tests/_moe_balance_worker.py, in the session's shared 2-rank launch (conftest.gloo_checks)
    ranks = [torch.load(gloo_checks / f"moe_balance.rank{i}.pt") for i in range(2)]
    for layer in range(2):
        c0, c1 = ranks[0]["counts"][layer], ranks[1]["counts"][layer]
        assert not torch.equal(c0, c1)  # different rows per rank: the all-reduce matters
        total = c0 + c1
        want = 0.01 * torch.sign(total.mean() - total)
        assert torch.equal(ranks[0]["bias"][layer], want) and torch.equal(ranks[1]["bias"][layer], want)
        assert not torch.equal(want, 0.01 * torch.sign(c0.mean() - c0))  # rank 0 alone would have moved differently
        assert ranks[0]["counts_after"][layer].sum() == 0


# -- accounting ------------------------------------------------------------------------------------------------
def test_d24_stored_and_active_counts():
    moe = model_summary(GPTConfig.from_depth(24, **MOE))
    assert (moe["params_total"], moe["params_active"], moe["params_memory"]) == (1_384_341_552, 780_361_776, 0)
    both = model_summary(GPTConfig.from_depth(24, **MOE, **MOME_A2_12))
    assert (both["params_total"], both["params_active"]) == (1_990_981_872, 783_040_752)
    mome = model_summary(GPTConfig.from_depth(24, **MOME_A2_12))
    assert (mome["params_total"], mome["params_active"]) == (1_386_780_912, 782_819_568)  # caption: 782.8M
    dense = model_summary(GPTConfig.from_depth(24))
    assert dense["params_total"] == dense["params_active"] == D24_DENSE


def test_active_memory_entries_per_block():
    """A token reads <= min(M, H*K) distinct d-wide slots per MoME layer (+ its H*M logits row with token-only
    routing); VE/Bigram/JTok one row per table, JTok-M K rows per layer, Engram d_mem per module."""
    cfg = dict(n_layer=4, n_head=2, n_kv_head=2)  # C = 128, d = 64, memory layers 1 and 3
    mome = model_summary(tiny_config(**cfg, memory="mome", memory_options={"slots": 6, "topk": 2}))
    assert mome["params_total"] - mome["params_active"] == mome["params_memory"] - 2 * min(6, 2 * 2) * 64
    few = model_summary(tiny_config(**cfg, memory="mome", memory_options={"slots": 3, "topk": 2}))
    assert few["params_total"] - few["params_active"] == few["params_memory"] - 2 * 3 * 64
    tok = model_summary(tiny_config(**cfg, memory="mome", memory_options={"slots": 6, "topk": 2,
                                                                         "routing": "token-only"}))
    assert tok["params_total"] - tok["params_active"] == tok["params_memory"] - 2 * 4 * 64 - 2 * 6
    # the shared bigram-indexed table: every layer reads the same row n_t, min(M, L*H*K) distinct slots in all
    for M, distinct in ((6, 6), (12, 2 * 2 * 2)):
        shared = model_summary(tiny_config(**cfg, memory="mome", memory_options={"slots": M, "topk": 2,
                                                                                "index": "bigram"}))
        assert shared["params_total"] - shared["params_active"] == shared["params_memory"] - distinct * 64
    backbone = model_summary(tiny_config(**cfg))["params_total"]
    ve = model_summary(tiny_config(**cfg, memory="ve"))
    assert ve["params_active"] == ve["params_total"] - ve["params_memory"] + 2 * 128  # one (H*d)-wide row per layer
    bigram = model_summary(tiny_config(**cfg, memory="bigram"))
    assert bigram["params_active"] == bigram["params_total"] - bigram["params_memory"] + 128  # one shared row
    jtok = model_summary(tiny_config(**cfg, memory="jtok"))
    assert jtok["params_active"] == jtok["params_total"] - jtok["params_memory"] + 2 * 128
    jtokm = model_summary(tiny_config(**cfg, memory="jtokm", memory_layers=(1, 3),
                                      memory_options={"experts": 4, "topk": 3}))
    assert jtokm["params_active"] == jtokm["params_total"] - jtokm["params_memory"] + 2 * 3 * 128
    engram = model_summary(tiny_config(**cfg, memory="engram", memory_options={"compression": "identity",
                                                                               "first_prime": 101}))
    assert engram["params_active"] == engram["params_total"] - engram["params_memory"] + 2 * 128  # d_mem = C
    assert ve["params_total"] - ve["params_memory"] > backbone  # the gates are counted as backbone, not memory


def test_flops_count_active_experts_only():
    B = 1_048_576
    moe, dense = model_summary(GPTConfig.from_depth(24, **MOE)), model_summary(GPTConfig.from_depth(24))
    assert moe["flops_per_token"] - dense["flops_per_token"] == 6 * 24 * 6 * 1536  # only the routers differ
    assert moe["flops_per_token"] == 5_286_150_144  # spec §6.2 F6 (stored experts would give 8,910,028,800)
    assert round(6e19 / (moe["flops_per_token"] * B)) == 10_825
    both = model_summary(GPTConfig.from_depth(24, **MOE, **MOME_A2_12))
    assert round(6e19 / (both["flops_per_token"] * B)) == 10_792


def test_dry_run_prints_stored_and_active(tmp_path, capsys):
    assert base_train.main(["--dry-run", "--depth", "24", "--mlp", "moe", "--target-flops", "6e19",
                            "--total-batch-size", "1048576", "--run-dir", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out.strip().splitlines()[-1])
    assert (plan["params_total"], plan["params_active"], plan["num_iterations"]) == (1_384_341_552, 780_361_776,
                                                                                     10_825)
    assert "params_active: 780,361,776" in out
    saved = json.loads((tmp_path / "p" / "plan.json").read_text())["model_config"]
    assert saved["mlp"] == "moe" and saved["moe_experts"] == 6 and saved["moe_topk"] == 2


# -- optimizer and gradients -----------------------------------------------------------------------------------
def test_muon_gets_every_expert_matrix_and_the_router():
    model = build_model(tiny_config(**MOE, **dict(memory="mome", memory_options={"slots": 4, "topk": 2})), seed=0)
    groups = build_param_groups(model, OptimConfig())
    kind = {id(p): g["kind"] for g in groups for p in g["params"]}
    for name, p in model.named_parameters():
        if ".mlp." in name:
            assert p.ndim == 2 and kind[id(p)] == "muon", name
    muon = {g["name"] for g in groups if g["kind"] == "muon"}
    assert {"muon_192x128", "muon_128x192", "muon_6x128"} <= muon  # c_fc, c_proj of all 7 experts; router


def test_every_expert_gets_gradient():
    model = build_model(tiny_config(**MOE), seed=0)
    with torch.no_grad():
        for block in model.blocks:
            for e in (*block.mlp.experts, *block.mlp.shared):
                e.c_proj.weight.normal_(std=0.05)
    g = torch.Generator().manual_seed(0)
    model(torch.randint(0, 512, (4, 32), generator=g), targets=torch.randint(0, 512, (4, 32), generator=g)).backward()
    for name, p in model.named_parameters():
        if ".mlp." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bf16_grouped_path_traces_as_one_graph():
    """In bf16 (the CUDA training dtype) the layer is one graph, counting included: no graph break, no host sync
    (dynamo + AOTAutograd with fullgraph=True; the inductor codegen is the slow test below)."""
    torch._dynamo.reset()
    layer = moe_layer()
    layer.train()
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(7))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    outs = []
    for m in (layer, compiled):
        layer.zero_grad()
        layer.balance_counts.zero_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        out.float().square().sum().backward()
        outs.append((out, layer.balance_counts.clone(), [p.grad.clone() for p in layer.parameters()]))
    assert outs[0][0].dtype == torch.bfloat16 and torch.equal(outs[1][0], outs[0][0])
    assert torch.equal(outs[1][1], outs[0][1]) and outs[1][1].sum() == 32 * 2  # counted inside the graph
    for a, b in zip(outs[1][2], outs[0][2]):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_grouped_path_keeps_the_compute_dtype_when_autocast_runs_square_in_fp32(monkeypatch):
    """CUDA autocast runs square (pow) in fp32 and CPU autocast does not (tests/cuda_autocast.py emulates CUDA's
    policy): on the H100 (2026-11-26) the grouped path's second GEMM got an fp32 activation against bf16 weights
    and raised."""
    monkeypatch.setattr(moe_module, "GROUPED_MM", True)
    layer = moe_layer()
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(7))
    sel, _ = layer.route(x.view(-1, 64))
    counts = torch.bincount(sel.reshape(-1), minlength=layer.E)
    xs = x.view(-1, 64).bfloat16()[torch.argsort(sel.reshape(-1), stable=True) // layer.K]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = moe_module._grouped_experts(layer.experts, xs, counts, torch.bfloat16)
        want_layer = layer(x)
        with CudaAutocastPolicy():
            got = moe_module._grouped_experts(layer.experts, xs, counts, torch.bfloat16)
            got_layer = layer(x)
    # bf16 x bf16 is exact in fp32, so squaring in fp32 and rounding once equals squaring in bf16
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    # the layer's output is fp32 under CUDA's policy: the sum over the K routed outputs runs in fp32 there
    assert got_layer.dtype == torch.float32 and want_layer.dtype == torch.bfloat16
    torch.testing.assert_close(got_layer, want_layer.float(), rtol=1e-2, atol=1e-2)


def test_looped_experts_run_eager_under_compile_even_when_first_called_there(monkeypatch):
    """The looped path reads the segment lengths on the host (counts.tolist()); traced, dynamo would break there and
    compile the rest specialised on those lengths (a recompile per routing). Its compile exclusion is applied
    lazily (no torch._dynamo import when nanochat.moe loads), so check the case that laziness must survive: the
    function's first call ever is inside a compiled forward (a fresh copy of the module's function)."""
    spec = importlib.util.spec_from_file_location("moe_fresh_copy", moe_module.__file__)
    fresh = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, fresh)  # dynamo looks traced functions' globals up there
    spec.loader.exec_module(fresh)
    monkeypatch.setattr(moe_module, "_looped_experts", fresh._looped_experts)
    torch._dynamo.reset()
    layer = moe_layer()  # fp32: the looped path
    compiling = []
    for expert in layer.experts:
        expert.register_forward_hook(lambda *_: compiling.append(torch.compiler.is_compiling()))
    compiled = torch.compile(layer, backend="eager")
    g = torch.Generator().manual_seed(3)
    for _ in range(3):  # a new routing each time
        x = torch.randn(2, 16, 64, generator=g)
        torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
    torch._dynamo.reset()
    assert len(compiling) == 2 * 3 * layer.E and not any(compiling)  # every expert call ran eagerly


@pytest.mark.slow  # ~80 s of inductor compilation on 2 CPU cores
def test_compiled_model_matches_eager_on_cpu():
    """fp32 (looped experts: one graph break per MoE layer) and bf16 autocast (grouped GEMMs, no break)."""
    torch._dynamo.reset()
    model = build_model(tiny_config(**MOE, n_layer=1, sequence_len=16), seed=0)
    with torch.no_grad():
        for e in (*model.blocks[0].mlp.experts, *model.blocks[0].mlp.shared):
            e.c_proj.weight.normal_(std=0.05)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 512, (2, 16), generator=g), torch.randint(0, 512, (2, 16), generator=g)
    compiled = torch.compile(model, fullgraph=False)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            grads = []
            for m in (model, compiled):
                model.zero_grad()
                loss = m(x, targets=y)
                loss.backward()
                grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grads[1][0], grads[0][0], **tol)
        for a, b in zip(grads[1][1], grads[0][1]):
            torch.testing.assert_close(a, b, **tol)
    torch._dynamo.reset()


# -- flags and configs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--moe-experts", "8"], "--moe-experts: only for --mlp moe"),
    (["--mlp", "moe", "--moe-topk", "3", "--moe-experts", "2"], "--moe-topk 3 exceeds --moe-experts 2"),
    (["--mlp", "moe", "--moe-topk", "1"], "--moe-topk 1"),
    (["--mlp", "moe", "--moe-shared", "-1"], "--moe-shared must be an integer >= 0"),
    (["--mlp", "moe", "--moe-balance-lr", "-1"], "--moe-balance-lr must be a finite number >= 0"),
    (["--mlp", "moe", "--model-type", "mobilellm"], "--mlp: the MoE FFN is a --model-type nanochat option"),
    (["--mlp", "moe", "--model-type", "qwen3-0.6b"], "--model-type qwen3 has a SwiGLU FFN"),
])
def test_flag_errors(tmp_path, capsys, flags, message):
    assert base_train.main(["--dry-run", "--run-dir", str(tmp_path / "p"), *flags]) == 2
    assert message in capsys.readouterr().err



@pytest.mark.parametrize("value", [float("inf"), float("nan"), True])
def test_moe_balance_lr_must_be_a_finite_number(value):
    # inf: inf * 0 on every expert whose sign is 0 made the routing bias NaN after one update; True: a step of 1
    with pytest.raises(ValueError, match="--moe-balance-lr must be a finite number >= 0"):
        moe_module.check_mlp_config(_moe_fields(moe_balance_lr=value))


def _moe_fields(**changes):
    """The FFN fields check_mlp_config reads, without building a GPTConfig (whose own checks would run first)."""
    fields = dict(mlp="moe", moe_experts=4, moe_topk=2, moe_shared=0, moe_hidden=0, moe_balance_lr=0.0)
    return types.SimpleNamespace(**{**fields, **changes})

def test_configs_without_ffn_fields_load_as_dense():
    dense = GPTConfig(n_layer=2)
    assert "mlp" not in dense.to_dict() and not any(k.startswith("moe_") for k in dense.to_dict())
    old = {k: v for k, v in dense.to_dict().items()}  # a meta.json written before the MoE option existed
    assert config_from_dict(old) == dense and config_from_dict(old).mlp == "dense"
    moe = GPTConfig(n_layer=2, mlp="moe", moe_hidden=64, moe_balance_lr=0.0)
    assert config_from_dict(moe.to_dict()) == moe
    with pytest.raises(ValueError, match="--mlp 'sparse' is unknown; allowed: dense, moe"):
        GPTConfig(mlp="sparse")


def test_reference_export_refuses_moe():
    from nanochat.reference_format import ReferenceFormatError, reference_from_config

    with pytest.raises(ReferenceFormatError, match="--mlp moe has no counterpart in the authors' code"):
        reference_from_config(tiny_config(**MOE))


# -- training through base_train -------------------------------------------------------------------------------
# [moe_mome] is slow: the same 30-step MoE run with a MoME memory beside it; the MoE claims are [moe]'s, and MoME
# beside the MoE FFN through base_train, its memory/* and moe/* records in one train record, is
# test_train_e2e::test_resume_is_bit_exact's (default suite)
@pytest.mark.parametrize("memory", [[], pytest.param(["--memory", "mome", "--mome-slots", "4"],
                                                     marks=pytest.mark.slow)], ids=["moe", "moe_mome"])
def test_trains_on_cpu_with_decreasing_loss(tmp_path, memory):
    run = tmp_path / "r"
    batch = ["--device-batch-size", "4", "--total-batch-size", "256"]
    assert base_train.main([*TINY, *batch, "--run-dir", str(run), "--num-iterations", "30", "--mlp", "moe",
                            "--moe-hidden", "32", "--moe-balance-lr", "0.01", *memory]) == 0
    loss = losses(run)
    first, last = sum(loss[s] for s in range(1, 4)) / 3, sum(loss[s] for s in range(28, 31)) / 3
    assert last < first - 0.1, (first, last)  # measured 5.54 -> 5.39 (moe)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert all(f"moe/maxvio/layer{i}" in train[-1] and f"moe/load/layer{i}/expert5" in train[-1] for i in range(2))
    if memory:
        assert "memory/maxvio/layer1" in train[-1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["params_active"] < summary["params_total"]
    w = weights(run, 30)
    assert w["blocks.0.mlp.bias"].abs().sum() > 0  # the balancing bias moved and was saved
    for i in range(2):  # every expert left its zero-init output projection: each one was trained
        assert all(w[f"blocks.{i}.mlp.{part}.c_proj.weight"].abs().sum() > 0
                   for part in ["shared.0", *(f"experts.{e}" for e in range(6))])


def test_resume_is_bit_exact_with_the_saved_bias(tmp_path):
    flags = [*TINY, "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "6", "--save-every",
             "3", "--mlp", "moe", "--moe-hidden", "32", "--moe-balance-lr", "0.05", "--run-dir", str(tmp_path / "r")]
    assert base_train.main(flags) == 0
    full = losses(tmp_path / "r")
    assert weights(tmp_path / "r", 3)["blocks.1.mlp.bias"].abs().sum() > 0
    import shutil
    shutil.rmtree(ckpt.step_dir(tmp_path / "r", 6))
    assert base_train.main([*flags, "--resume"]) == 0
    assert losses(tmp_path / "r") == full  # the selection bias came back from the checkpoint


def test_kv_cache_decoding_equals_the_full_forward():
    model = build_model(tiny_config(**MOE, **dict(memory="mome")), seed=0)
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.bias.normal_(std=0.1)
            for e in (*block.mlp.experts, *block.mlp.shared):
                e.c_proj.weight.normal_(std=0.05)
    model.eval()
    idx = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    full = model(idx)
    cache = KVCache.for_model(model, batch_size=2, max_len=12)
    parts = [model(idx[:, :5], kv_cache=cache)] + [model(idx[:, t : t + 1], kv_cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_bench_runs_every_design():
    out = load_bench("moe").main(["--device", "cpu", "--tokens", "64", "--width", "64", "--reps", "1", "--warmup", "0"])
    assert set(out["designs"]) == {"dense", "moe_grouped", "moe_looped"} and out["hidden"] == 64
    assert out["designs"]["dense"]["ratio_to_dense"] == 1.0 and all(d["ms"] > 0 for d in out["designs"].values())
    assert moe_module.GROUPED_MM is None  # the bench leaves the module's dispatch choice as it found it


# -- CUDA ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu there)")
def test_cuda_bf16_grouped_path_compiles_fullgraph_and_matches_eager():
    model = build_model(tiny_config(**MOE), device="cuda", seed=0)
    with torch.no_grad():
        for block in model.blocks:
            for e in (*block.mlp.experts, *block.mlp.shared):
                e.c_proj.weight.normal_(std=0.05)
    x = torch.randint(0, 512, (4, 32), device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, got = model(x, targets=x), compiled(x, targets=x)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    got.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if ".mlp." in n)
