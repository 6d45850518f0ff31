"""The row-mix Triton kernel pairs on the shared bigram-indexed MoME table (``mome_mix.SHARED_TABLE_KERNEL``, off by
default): the rows ``prepare`` gathers once, flattened to a (B*T*M, d) table read at ids 0..B*T-1, through
``mome_row_mix_inject`` (FUSE_INJECT on) or ``mome_row_mix`` (off) in every memory layer, with the torch row mix's
loss and gradients (the shared table's, the routers', the gates', v's through every weight upstream).

* always: the ops' CPU math (the CPU added to KERNEL_DEVICES), eager in fp32 and bf16 autocast, compiled fullgraph;
  ``kernel_path`` with the switch on and off; the switch's setter;
* triton with ``TRITON_INTERPRET=1``: the real kernels in the model (tests/test_mome_triton*.py's wrappers);
* marker ``gpu`` (CUDA): the compiled model with the switch on and off, fp32 and bf16 autocast.

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest tests/test_mome_shared_kernel.py
    python -m pytest -m gpu tests/test_mome_shared_kernel.py                                        # on a GPU
"""

import pytest
import torch

from conftest import tiny_config
from memory_grads import BF16_REL, FP32_REL, assert_grads_close, reach_the_memory
from nanochat.gpt import build_model
from nanochat.kv_cache import KVCache
from nanochat.memory import mome as mome_module
from nanochat.memory import mome_mix as mix_paths
from nanochat.memory import mome_triton as mt
from test_mome_triton import (_cuda_model, _fp32_matmuls, _InterpretedRowMix, _loss_and_grads,
                              assert_as_close_as, assert_compiled_equals_eager, assert_equal_to_fp32_rounding,
                              compiled_run_with, needs_cuda, needs_interpreter)
from test_mome_triton_inject import _InterpretedInject

BIGRAM = {"slots": 4, "topk": 2, "index": "bigram", "bigram_factor": 2}
OPTIONS = {"bigram": BIGRAM, "bigram_full_routing": {**BIGRAM, "topk": 4},
           "bigram_shared_expert": {**BIGRAM, "shared_expert": True}}
B, T = 2, 16


def _model(opts, n_layer=2):
    """A tiny model with the shared table, random routers and gates (real selections, gamma away from 1), gradients
    reaching the memory (tests/memory_grads.py) and a batch of repeated tokens (repeated bigram rows: the gather's
    backward sums over tokens)."""
    model = build_model(tiny_config(memory="mome", memory_options=opts, n_layer=n_layer), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in model.memory.routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        for gate in model.memory.gates:
            gate.proj.weight.copy_(0.3 * torch.randn(gate.proj.weight.shape, generator=g))
    reach_the_memory(model, g)
    idx = torch.randint(0, 40, (B, T + 1), generator=g)
    return model, idx[:, :-1], idx[:, 1:]


def _spy(monkeypatch):
    """Record every call of both kernel wrappers: (which, its table's shape, its row ids, the dtype it stores,
    unique_rows)."""
    calls = []
    real_row, real_inject = mome_module.kernel_row_mix, mome_module.kernel_row_mix_inject

    def row_mix(table, row, w, out_dtype, unique_rows):
        calls.append(("row", tuple(table.shape), row.clone(), out_dtype, unique_rows))
        return real_row(table, row, w, out_dtype, unique_rows)

    def inject(table, row, w, gamma, v, unique_rows):
        calls.append(("fused", tuple(table.shape), row.clone(), v.dtype, unique_rows))
        return real_inject(table, row, w, gamma, v, unique_rows)

    monkeypatch.setattr(mome_module, "kernel_row_mix", row_mix)
    monkeypatch.setattr(mome_module, "kernel_row_mix_inject", inject)
    return calls


def _on_and_off(monkeypatch, name, autocast, fuse=True):
    """(loss, grads) with the switch off (the torch row mix on the gathered rows), then on, and the kernel calls
    of the second run; the CPU added to KERNEL_DEVICES, FUSE_INJECT = fuse."""
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(mix_paths, "FUSE_INJECT", fuse)
    model, x, y = _model(OPTIONS[name])
    calls = _spy(monkeypatch)
    assert mix_paths.SHARED_TABLE_KERNEL is False  # the default
    want = _loss_and_grads(model, x, y, autocast)
    assert calls == []
    monkeypatch.setattr(mix_paths, "SHARED_TABLE_KERNEL", True)
    got = _loss_and_grads(model, x, y, autocast)
    return model, want, got, calls


def _assert_rows_in_calls(model, calls, kind, dtype):
    """One call per memory layer, each on the gathered rows as a (B*T*M, d) table at ids 0..B*T-1 declared unique
    (the backward stores its table gradient), never on the shared table itself."""
    M, d = model.memory.M, model.memory.d
    assert [(c[0], c[1], c[3], c[4]) for c in calls] == [(kind, (B * T * M, d), dtype, True)] * len(model.memory.layers)
    assert all(torch.equal(c[2], torch.arange(B * T).view(B, T)) for c in calls)
    assert model.memory.table.weight.shape[0] > B * T * M  # the shared table: not what the kernels got


def _assert_fp32_equal(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert "memory.table.weight" in want[1]
    assert_grads_close(got[1], want[1], FP32_REL)


@pytest.mark.parametrize("name", ["bigram", "bigram_full_routing"])
def test_fused_pair_on_the_gathered_rows_equals_the_torch_row_mix_fp32(name, monkeypatch):
    model, want, got, calls = _on_and_off(monkeypatch, name, False)
    _assert_rows_in_calls(model, calls, "fused", torch.float32)
    _assert_fp32_equal(got, want)


def test_fused_pair_on_the_gathered_rows_rounds_as_the_torch_path_bf16(monkeypatch):
    """bf16 autocast: the same loss bit for bit (mem, gamma, their product and the sum each rounded to bf16, as
    the eager injection); gradients within 1e-2 norm-wise (d_gamma sums fp32 products where autograd rounds them
    to bf16 first), as the per-layer fused pair's test."""
    model, want, got, calls = _on_and_off(monkeypatch, "bigram", True)
    _assert_rows_in_calls(model, calls, "fused", torch.bfloat16)
    assert torch.equal(got[0], want[0])
    assert_grads_close(got[1], want[1], BF16_REL)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_row_mix_pair_on_the_gathered_rows_equals_the_torch_row_mix(autocast, monkeypatch):
    """FUSE_INJECT off: the row-mix pair stores mem in v's dtype (the fp32 mix rounded once, as ``mem.to(v.dtype)``
    in the torch path), so fp32 and bf16 autocast alike give the torch path's loss and gradients to fp32 rounding."""
    model, want, got, calls = _on_and_off(monkeypatch, "bigram", autocast, fuse=False)
    _assert_rows_in_calls(model, calls, "row", torch.bfloat16 if autocast else torch.float32)
    _assert_fp32_equal(got, want)


def test_shared_expert_takes_the_row_mix_pair_in_the_tables_dtype(monkeypatch):
    """With a shared expert (added to mem before the cast) the fused pair is off, as per layer: the row-mix pair,
    storing the table's dtype (fp32) under bf16 autocast too."""
    model, want, got, calls = _on_and_off(monkeypatch, "bigram_shared_expert", True)
    _assert_rows_in_calls(model, calls, "row", torch.float32)
    _assert_fp32_equal(got, want)


def test_switch_on_compiles_fullgraph_with_the_eager_results(monkeypatch):
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(mix_paths, "SHARED_TABLE_KERNEL", True)
    # one layer, the memory layer (tiny_config's 2 layers have memory on layer 1 alone): the same memory path in the
    # graph without a plain layer to compile (the four such tests: 96 -> 83 s, cold inductor cache: dev/LOG.md)
    model, x, y = _model(BIGRAM, n_layer=1)
    calls = assert_compiled_equals_eager(model, x, y, lambda: _spy(monkeypatch))
    assert [c[0] for c in calls] == ["fused"] * len(model.memory.layers)  # traced once per memory layer


def test_kernel_path_reports_the_shared_tables_kernels(monkeypatch):
    model, _, _ = _model(BIGRAM)
    assert model.memory.kernel_path() == "torch"  # the CPU: KERNEL_DEVICES is CUDA only
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    assert model.memory.kernel_path() == "torch"  # the switch off (the default)
    monkeypatch.setattr(mix_paths, "SHARED_TABLE_KERNEL", True)
    assert model.memory.kernel_path() == "fused"
    with monkeypatch.context() as m:
        m.setattr(mix_paths, "FUSE_INJECT", False)
        assert model.memory.kernel_path() == "row"
    for setting, value in (("ROW_SUM", "unrolled"), ("MIX", "plain")):  # --mome-kernels torch; a forced K-row mix
        with monkeypatch.context() as m:
            m.setattr(mix_paths, setting, value)
            assert model.memory.kernel_path() == "torch"
    per_head, _, _ = _model({**BIGRAM, "per_head_table": True})
    assert per_head.memory.kernel_path() == "torch"  # per-head rows (B, T, H, M, d): not the kernels' layout


def test_switch_off_or_per_head_never_calls_the_kernels(monkeypatch):
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    calls = _spy(monkeypatch)
    model, x, y = _model({**BIGRAM, "per_head_table": True})
    monkeypatch.setattr(mix_paths, "SHARED_TABLE_KERNEL", True)
    _loss_and_grads(model, x, y, False)
    monkeypatch.setattr(mix_paths, "SHARED_TABLE_KERNEL", False)
    _loss_and_grads(_model(BIGRAM)[0], x, y, False)
    assert calls == []


@pytest.mark.parametrize("interpreted", [False, pytest.param(True, marks=needs_interpreter)],
                         ids=["op_math", "interpreted"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "row"])
def test_kv_cache_decoding_with_the_switch_on_gives_the_uncached_logits(fuse, interpreted, monkeypatch):
    """Eval under no_grad: a prefill of 6 tokens, then one token per forward (T = 1: the kernels get B*M rows at
    ids 0..B-1) through the KV cache and the bigram hash's carried state, with the switch on, equal the full
    sequence's logits with the switch off (the torch row mix); every memory layer of every forward took a kernel
    (the ops' CPU math, or the real kernels interpreted)."""
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(mix_paths, "FUSE_INJECT", fuse)
    model, x, _ = _model(BIGRAM)
    model.eval()
    with torch.no_grad():
        want = model(x[:, :9])
        calls = _spy(monkeypatch)
        if interpreted:
            monkeypatch.setattr(mt, "mome_row_mix_inject_op", _InterpretedInject.apply)
            monkeypatch.setattr(mt, "mome_row_mix_op", _InterpretedRowMix.apply)
        monkeypatch.setattr(mix_paths, "SHARED_TABLE_KERNEL", True)
        cache = KVCache.for_model(model, batch_size=B, max_len=9)
        got = [model(x[:, :6], kv_cache=cache)] + [model(x[:, t:t + 1], kv_cache=cache) for t in range(6, 9)]
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=1e-5, atol=1e-5)
    M, d, layers = model.memory.M, model.memory.d, len(model.memory.layers)
    assert [(c[0], c[1]) for c in calls] == ([("fused" if fuse else "row", (B * 6 * M, d))] * layers
                                             + [("fused" if fuse else "row", (B * M, d))] * 3 * layers)
    assert all(torch.equal(c[2], torch.arange(c[1][0] // M).view(B, -1)) for c in calls)


def test_set_shared_table_kernel_takes_a_bool_only(monkeypatch):
    monkeypatch.setattr(mix_paths, "SHARED_TABLE_KERNEL", False)
    mix_paths.set_shared_table_kernel(True)
    assert mix_paths.SHARED_TABLE_KERNEL is True and mix_paths.shared_table_kernel() is True
    with pytest.raises(ValueError, match="takes True or False, got 1"):
        mix_paths.set_shared_table_kernel(1)
    assert mix_paths.SHARED_TABLE_KERNEL is True
    monkeypatch.setattr(mix_paths, "SHARED_TABLE_KERNEL", "yes")
    with pytest.raises(ValueError, match="SHARED_TABLE_KERNEL must be True or False, got 'yes'"):
        mix_paths.shared_table_kernel()


@needs_interpreter
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "row"])
def test_interpreted_kernels_on_the_gathered_rows_equal_the_torch_row_mix(fuse, monkeypatch):
    """The real Triton kernels (interpreted, CPU tensors) in every memory layer of the shared table, eager fp32:
    the torch row mix's loss and gradients."""
    monkeypatch.setattr(mt, "KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(mix_paths, "FUSE_INJECT", fuse)
    model, x, y = _model(BIGRAM)
    want = _loss_and_grads(model, x, y, False)
    calls = _spy(monkeypatch)
    monkeypatch.setattr(mt, "mome_row_mix_inject_op", _InterpretedInject.apply)
    monkeypatch.setattr(mt, "mome_row_mix_op", _InterpretedRowMix.apply)
    monkeypatch.setattr(mix_paths, "SHARED_TABLE_KERNEL", True)
    got = _loss_and_grads(model, x, y, False)
    _assert_rows_in_calls(model, calls, "fused" if fuse else "row", torch.float32)
    _assert_fp32_equal(got, want)


def _cuda_compiled_run(model, x, y, on, autocast, monkeypatch):
    """compiled_run_with SHARED_TABLE_KERNEL = on (the defaults otherwise: the fused pair) and both kernels' spy."""
    return compiled_run_with(model, x, y, autocast, monkeypatch, {"SHARED_TABLE_KERNEL": on}, _spy)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_cuda_compiled_shared_table_kernels_against_the_torch_row_mix(autocast, monkeypatch):
    """Compiled fullgraph on CUDA (TF32 off), the switch off then on: fp32 the same loss and gradients to float
    rounding (the atomics' order is free); bf16 autocast each against the fp32 eager model, the kernels no further
    from it than the torch row mix, as the per-layer fused pair's test (tests/test_mome_triton_inject.py)."""
    model, x, y = _cuda_model(BIGRAM)
    with _fp32_matmuls():
        ref = _loss_and_grads(model, x, y, False)
        runs = [_cuda_compiled_run(model, x, y, on, autocast, monkeypatch) for on in (False, True)]
    (off, n_off), (on, n_on) = runs
    assert (n_off, n_on) == (0, len(model.memory.layers))
    if autocast:
        assert_as_close_as(on, off, ref)
    else:
        assert_equal_to_fp32_rounding(on, off)
