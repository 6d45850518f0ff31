"""CUDA-only tests (marker ``gpu``; skipped with the reason on machines without CUDA).

Run on a GPU machine with ``python -m pytest -m gpu tests/test_gpu.py``: a bf16-autocast training step of every
memory block, ``torch.compile(fullgraph=True)`` of a MoME model, the trainer's resume on CUDA, and the
``--attention fa2/fa3`` paths where FlashAttention-2 (``flash_attn``) / FlashAttention-3 (``flash_attn_interface``
or the ``kernels`` package, Hopper only) can be loaded (skipped, with the reason, where not).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import MEMORY_OPTION_SETS, REPO, tiny_config
from nanochat.common import autocast_context
from nanochat.gpt import build_model
from nanochat.memory import mome_mix as mix_paths
from nanochat.optim import build_optimizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu there)")]

MEMORIES = MEMORY_OPTION_SETS


def _batch(seed=0, B=4, T=32, V=512):
    idx = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(seed))
    return idx[:, :-1].cuda(), idx[:, 1:].cuda()


def _randomize_routers(model):
    """Zero-initialised routers tie every top-K choice; random ones exercise real selections."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in getattr(model.memory, "routers", []):
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        for block in model.blocks:
            block.attn.c_proj.weight.copy_(0.02 * torch.randn(block.attn.c_proj.weight.shape, generator=g))


@pytest.mark.parametrize("name", list(MEMORIES))
def test_bf16_autocast_train_step_every_memory_block(name):
    cfg = tiny_config(**MEMORIES[name])
    model = build_model(cfg, device="cuda", seed=0)
    _randomize_routers(model)
    ref = build_model(cfg, device="cpu", seed=0)
    ref.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    x, y = _batch()
    opt = build_optimizer(model)
    with autocast_context("cuda", "bfloat16"):
        loss = model(x, y)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    assert all(torch.isfinite(p.grad.to_dense() if p.grad.is_sparse else p.grad).all() for p in model.parameters())
    ref_loss = ref(x.cpu(), y.cpu())  # fp32 on the CPU: bf16 autocast changes the loss by well under 1%
    assert abs(loss.item() - ref_loss.item()) < 0.01 * ref_loss.item(), (loss.item(), ref_loss.item())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    model.memory.after_optimizer_step()
    assert torch.isfinite(opt.grad_norm) and opt.grad_norm > 0
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "wte.weight" in moved and "lm_head.weight" in moved
    if model.memory.memory_tables():
        assert any(n.startswith("memory.") and "weight" in n for n in moved)
    for st in opt.state.values():  # every optimizer state tensor lives on the GPU (the fused AdamW needs it)
        assert all(v.is_cuda for v in st.values()), {k: v.device for k, v in st.items()}


@pytest.mark.parametrize("mix", ["bag", "plain", "row"])
@pytest.mark.parametrize("index", ["token", "bigram", "headmod"])
def test_compile_fullgraph_mome_matches_eager(mix, index, monkeypatch):
    """fp32 (TF32 off): compiled and eager compute the same function to float rounding. (Under bf16 autocast the
    router gradient of two fusions differs by ~10%: it is a small difference of saturated sigmoid slopes.)"""
    monkeypatch.setattr(mix_paths, "MIX", mix)
    tf32 = torch.backends.cuda.matmul.allow_tf32  # a property of torch's cuBLAS module: monkeypatch cannot set it
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        _compare_compiled_with_eager(index)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _compare_compiled_with_eager(index):
    torch._dynamo.reset()
    opts = {"token": {"slots": 6, "topk": 2}, "bigram": MEMORIES["mome_bigram_index"]["memory_options"],
            "headmod": {"slots": 6, "topk": 2, "index": "headmod", "rows": 100, "dedicated_size": 30}}[index]
    model = build_model(tiny_config(memory="mome", memory_options=opts), device="cuda", seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # routers at the scale training gives them: logits O(1), no saturated sigmoids
        for router in model.memory.routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=g) / router.weight.size(1) ** 0.5)
        for block in model.blocks:
            block.attn.c_proj.weight.copy_(0.02 * torch.randn(block.attn.c_proj.weight.shape, generator=g))
    x, y = _batch(1)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    eager_loss = model(x, y)
    eager_loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = compiled(x, y)
    loss.backward()
    assert abs(loss.item() - eager_loss.item()) < 1e-5 * eager_loss.item()
    for n, p in model.named_parameters():
        err = (p.grad - eager_grads[n]).norm() / eager_grads[n].norm().clamp_min(1e-12)
        assert err < 1e-4, (n, float(err))


def test_argmax_topk_on_cuda_selects_what_topk_selects():
    scores = torch.randn(64, 2048, 6, 6, device="cuda", dtype=torch.bfloat16)
    want = scores.topk(2, dim=-1, sorted=False).indices.sort(-1).values
    got = torch.compile(mix_paths.topk_indices)(scores, 2).sort(-1).values
    vals = scores.gather(-1, got)
    # bf16 has ties; where a tie picks another index the selected values must still be the top-2 values
    assert torch.equal(vals.sort(-1).values, scores.gather(-1, want).sort(-1).values)


def _train(run_dir, *extra):
    cmd = [sys.executable, "-m", "scripts.base_train", "--synthetic-data", "--vocab-size", "512", "--depth", "2",
           "--aspect-ratio", "64", "--head-dim", "64", "--max-seq-len", "64", "--device-batch-size", "4",
           "--total-batch-size", "512", "--num-iterations", "6", "--save-every", "3", "--eval-tokens", "512",
           "--eval-every", "-1", "--no-final-core", "--memory", "mome", "--dtype", "float32", "--no-compile",
           "--run-dir", str(run_dir), *extra]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_on_cuda_continues_the_run(tmp_path):
    """--resume on CUDA: loader and RNG state stay on the CPU, optimizer state (with the fused AdamW step
    counts) goes to the GPU. CUDA scatter-adds are not bit-deterministic, so losses agree to ~1e-4."""
    full = _train(tmp_path / "full")
    part = tmp_path / "part"
    _train(part)
    (part / "summary.json").unlink()
    import shutil

    shutil.rmtree(part / "checkpoints" / "step_000006")
    resumed = _train(part, "--resume")
    a = {r["step"]: r["loss"] for r in full if r["kind"] == "train"}
    b = {r["step"]: r["loss"] for r in resumed if r["kind"] == "train"}
    assert a.keys() == b.keys() == set(range(1, 7))
    for s in a:
        assert abs(a[s] - b[s]) < 1e-4 * abs(a[s]), (s, a[s], b[s])
    summary = json.loads((part / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["step"] == 6


@pytest.mark.parametrize("window_pattern", ["L", "S"])  # S: layer 0 sees 16 keys back (window_size (16, 0)) of 32
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_flash_attention_path_matches_sdpa(monkeypatch, backend, window_pattern):
    from nanochat import gpt

    try:
        flash = gpt.resolve_attention(backend, "cuda")
    except ValueError as e:  # the package is not installed, or this GPU cannot run it: the message says which
        pytest.skip(str(e))
    cfg = tiny_config(**MEMORIES["mome"], n_kv_head=1, window_pattern=window_pattern)  # GQA: 2 query heads, 1 KV
    model = build_model(cfg, device="cuda", seed=0)
    _randomize_routers(model)  # and c_proj: attention reaches the logits
    x, _ = _batch(2)
    with torch.no_grad(), autocast_context("cuda", "bfloat16"):
        sdpa = model(x)
        monkeypatch.setattr(gpt, "_ATTENTION", flash)
        out = model(x)
    assert ((out - sdpa).norm() / sdpa.norm()) < 2e-2


def test_attention_auto_is_resolved_and_recorded_on_cuda(tmp_path):
    """auto = fa3 on a Hopper GPU with FA3 installed, else sdpa: what the trainer resolved is in summary.json."""
    from nanochat.gpt import resolve_attention

    _train(tmp_path / "r", "--attention", "auto")
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["attention"] == resolve_attention("auto", "cuda").name


def test_mome_kernels_are_resolved_recorded_and_agree_on_cuda(tmp_path):
    """--mome-kernels auto (fused where triton imports) and torch on CUDA: the path the model took is in
    summary.json, and the two paths (one function; fp32 atomics in a free order) train to the same losses."""
    from nanochat.memory import mome_triton

    runs = {name: _train(tmp_path / name, "--mome-kernels", name) for name in ("auto", "torch")}
    for name, want in (("auto", "fused" if mome_triton.triton is not None else "torch"), ("torch", "torch")):
        assert json.loads((tmp_path / name / "summary.json").read_text())["mome_kernels"] == want
    a, b = ({r["step"]: r["loss"] for r in runs[name] if r["kind"] == "train"} for name in ("auto", "torch"))
    assert a.keys() == b.keys() == set(range(1, 7))
    for step in a:
        assert abs(a[step] - b[step]) < 1e-4 * abs(a[step]), (step, a[step], b[step])


# -- the MobileLLM and Qwen3 families (nanochat.families) -------------------------------------------------------
FAMILY_BLOCKS = {"base": ("base", {}), "stem": ("stem", {}), "ve": ("ve", {}),
                 "mome_value": ("mome", {"slots": 3, "topk": 1, "router_input": "value"}),
                 "mome_hidden": ("mome", {"slots": 4, "topk": 2})}


def _family_config(family, block, tie=True):
    from nanochat.families import FAMILIES

    memory, opts = FAMILY_BLOCKS[block]
    return FAMILIES[family].config_cls(sequence_len=32, vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=128,
                                       head_dim=48 if family == "qwen3" else 32, ffn_hidden=256,
                                       tie_embeddings=tie, memory=memory, memory_options=opts)


@pytest.mark.parametrize("family", ["mobilellm", "qwen3"])
@pytest.mark.parametrize("block", list(FAMILY_BLOCKS))
def test_bf16_autocast_train_step_every_family(family, block):
    """bf16 autocast on CUDA vs fp32 on the CPU (same weights), then one step of the family's optimizer groups
    (SDPA attention: GQA, Qwen3's head_dim 48 != C/H)."""
    from nanochat.families import build_model as build_family, param_groups
    from nanochat.optim import MuonAdamW, OptimConfig

    cfg = _family_config(family, block, tie=family == "qwen3")
    model = build_family(cfg, device="cuda", seed=0)
    ref = build_family(cfg, device="cpu", seed=0)
    ref.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    x, y = _batch()
    opt = MuonAdamW(param_groups(model, OptimConfig()))
    with autocast_context("cuda", "bfloat16"):
        loss = model(x, y)
    loss.backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]
    ref_loss = ref(x.cpu(), y.cpu())
    assert abs(loss.item() - ref_loss.item()) < 0.01 * ref_loss.item(), (loss.item(), ref_loss.item())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert torch.isfinite(opt.grad_norm) and opt.grad_norm > 0
    assert not torch.equal(before["wte.weight"], model.wte.weight)
    if model.memory.memory_tables():
        assert not torch.equal(before["memory.tables.0.weight"], model.memory.tables[0].weight)


@pytest.mark.parametrize("family", ["mobilellm", "qwen3"])
def test_family_compile_fullgraph_and_cached_decoding_on_cuda(family):
    from nanochat.engine import generate, generate_uncached
    from nanochat.families import build_model as build_family

    torch._dynamo.reset()
    model = build_family(_family_config(family, "mome_hidden"), device="cuda", seed=0)
    x, y = _batch(3)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with autocast_context("cuda", "bfloat16"):
        eager, comp = model(x, y), compiled(x, y)
    assert abs(comp.item() - eager.item()) < 2e-3 * eager.item()
    prompt = x[0, :6].tolist()
    assert generate(model.float(), prompt, max_tokens=6, temperature=0.0)[0] == generate_uncached(model, prompt, 6)


# -- CUDA-only branches of the start-up, data, checkpoint and optimizer code (their device-independent logic is
# tested on the CPU in tests/test_cuda_branches.py) ---------------------------------------------------------------
def test_compute_init_turns_on_expandable_segments():
    """compute_init sets PYTORCH_CUDA_ALLOC_CONF before the first CUDA call; the allocator reads it when it starts
    (a fresh process: this one's allocator is running already). Two signals, either may be missing in a torch
    version: the allocator's parsed settings, and each memory segment's is_expandable."""
    code = ("import torch\nfrom nanochat.common import compute_init\n_, d = compute_init('cuda')\n"
            "x = torch.ones(1 << 20, device=d)\n"
            "get = getattr(torch._C, '_accelerator_getAllocatorSettings', None)\n"
            "print(get() if get else 'n/a')\n"
            "print([s.get('is_expandable') for s in torch.cuda.memory._snapshot()['segments']])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**env, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    settings, flags = r.stdout.splitlines()[-2:]
    flags = json.loads(flags.replace("True", "true").replace("False", "false").replace("None", "null"))
    assert settings == "n/a" or "expandable_segments:True" in settings, r.stdout
    assert flags and False not in flags and (settings != "n/a" or all(flags)), r.stdout


def test_rows_to_device_copies_strided_rows_to_cuda():
    """Eval rows of one rank (rows[rank::world]) are a strided view: pinned and copied without blocking, the
    inputs and targets are still those rows."""
    from nanochat.common import rows_to_device

    rows = torch.arange(8 * 5).view(8, 5)
    x, y = rows_to_device(rows[1::2], torch.device("cuda"))
    torch.cuda.synchronize()
    assert x.is_cuda and y.is_cuda and x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x.cpu(), rows[1::2, :-1]) and torch.equal(y.cpu(), rows[1::2, 1:])


def test_rng_state_saved_by_a_process_with_more_gpus_restores_on_this_one():
    """--resume-new-world-size onto a node with fewer GPUs: the saved state lists more CUDA states than this
    process has devices (torch's set_rng_state_all raised IndexError); the visible ones are restored."""
    from nanochat import checkpoint as ckpt

    state = ckpt.rng_state()
    saved = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    torch.cuda.manual_seed_all(123)
    state["cuda"] = saved + [saved[0]]
    ckpt.set_rng_state(state)
    assert all(torch.equal(torch.cuda.get_rng_state(i), s) for i, s in enumerate(saved))


def test_polar_express_iterates_in_bf16_on_cuda():
    """The default on CUDA is the bf16 branch, which tests/test_cuda_branches.py checks on the CPU."""
    from nanochat.optim import polar_express

    G = torch.randn(3, 96, 64, generator=torch.Generator().manual_seed(0))
    got = polar_express(G.cuda())
    assert got.dtype == torch.bfloat16 and got.is_cuda
    ref = polar_express(G)  # fp32 on the CPU
    assert ((got.float().cpu() - ref).norm() / ref.norm()) < 0.1
    sv = torch.linalg.svdvals(got.float())
    assert sv.max() < 1.2 and sv.min() > 0.8, (sv.min(), sv.max())


def test_mome_defaults_on_cuda_take_the_cuda_paths(monkeypatch):
    """MIX / TOPK_BY_ARGMAX None on CUDA: top-K by masked argmax (ties go to the lowest slots), the row mix and the
    value injection through the fused Triton kernels for a per-layer table (the plain K-row mix if triton is
    missing; never embedding_bag), the row mix for the shared bigram-indexed table, and dense table gradients in
    eager training (the sparse ones are CPU-only)."""
    monkeypatch.setattr(mix_paths, "MIX", None)
    monkeypatch.setattr(mix_paths, "TOPK_BY_ARGMAX", None)
    ties = mix_paths.topk_indices(torch.zeros(3, 6, device="cuda"), 2)
    assert torch.equal(ties.cpu(), torch.tensor([[0, 1]] * 3))

    def no_bag(*args, **kwargs):
        raise AssertionError("the embedding_bag mix ran on CUDA with MIX None")

    monkeypatch.setattr(mix_paths, "mome_mix_fused", no_bag)
    from nanochat.memory import mome_triton

    for name, row_mix in (("mome", mome_triton.triton is not None), ("mome_bigram_index", True)):
        model = build_model(tiny_config(**MEMORIES[name]), device="cuda", seed=0)
        _randomize_routers(model)
        model.train()
        assert model.memory._row_mix(model.memory._table(0)) == row_mix
        assert model.memory._kernel_row_mix(model.memory._table(0)) == (name == "mome" and row_mix)
        assert model.memory._fused_inject(model.memory._table(0)) == (name == "mome" and row_mix)
        x, y = _batch()
        model(x, y).backward()
        for table in model.memory.memory_tables():
            assert table.grad is not None and not table.grad.is_sparse, name


@pytest.mark.parametrize("index", ["token", "bigram", "headmod"])
def test_slot_balance_counts_on_cuda_equal_the_per_token_loop(tmp_path, index, monkeypatch):
    """The final eval's MoME slot-balance counting on CUDA (int32 index_add_, the argmax top-K, the plain and the
    row mix) against the per-token loop of tests/test_slot_balance.py, in float64 (no top-K ties)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from mome_fixtures import mome_config, random_block
    from nanochat.slot_balance import with_slot_balance
    from test_slot_balance import naive_balance, naive_counts

    monkeypatch.setattr(mix_paths, "MIX", None)  # the CUDA defaults
    monkeypatch.setattr(mix_paths, "TOPK_BY_ARGMAX", None)
    cfg = replace(mome_config(tmp_path, 4, 2, index), memory_layers=(0, 1))
    block = random_block(cfg).double().eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 12, (3, 16), generator=g)  # few distinct tokens: rows are revisited
    xn = {layer: torch.randn(3, 16, cfg.n_embd, generator=g, dtype=torch.float64) for layer in block.layers}
    v = torch.randn(3, 16, cfg.n_kv_head, cfg.head_dim, generator=g, dtype=torch.float64)
    want = naive_balance([naive_counts(cfg, block, layer, tokens, xn[layer]) for layer in block.layers])
    block = block.cuda()

    def forward():
        ctx = block.prepare(tokens.cuda(), None)
        return [block.value(layer, xn[layer].cuda(), v.cuda(), ctx) for layer in block.layers]

    _, got = with_slot_balance(SimpleNamespace(memory=block), forward)
    assert got == pytest.approx(want, rel=1e-12) and want["maxvio"] > 0


def test_samples_and_slot_balance_of_a_compiled_bf16_run_on_cuda(tmp_path):
    """--sample-every decodes with the uncompiled model between compiled bf16 steps (rank 0, eval mode, train mode
    restored), and the final evaluation reports the MoME slot balance (val: synthetic data has no train rows)."""
    records = _train(tmp_path / "run", "--dtype", "bfloat16", "--compile", "--sample-every", "3")
    samples = [r for r in records if r["kind"] == "sample"]
    assert [r["step"] for r in samples] == [3, 6] and all(len(r["samples"]) == 7 for r in samples)
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 7))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stop_reason"] == "completed"
    assert 0 < summary["val_mome_maxvio"] <= 5 and 0 < summary["val_mome_abs_load_dev"] <= 5 / 6
