"""Engram (spec appendix_adaptations §3.4): the hash against Python big ints, the module against a naive per-token
reference of its equations, causality, cached decoding, Base equality at init, primes, the d24 parameter count,
optimizer groups and FLOPs, the compression normaliser, training through base_train and the checkpointed map."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from nanochat import checkpoint as ckpt
from nanochat.engine import generate, generate_uncached
from nanochat.gpt import GPTConfig, build_model, model_summary
from nanochat.kv_cache import KVCache
from nanochat.memory.engram import EngramMemory, ascending_primes, compression_map, is_prime, normalize_token
from nanochat.optim import OptimConfig, build_param_groups
from nanochat.tokenizer import Tokenizer
from scripts import base_train

# tiny tables: N = 3, K = 2 heads of 16 per order (d_mem = 64), primes from 101
OPTS = {"compression": "identity", "dim": 64, "heads": 2, "first_prime": 101}


def _model(layers=(0, 1), nonzero=True, **opts):
    model = build_model(tiny_config(memory="engram", memory_options={**OPTS, **opts}, memory_layers=layers), seed=0)
    if nonzero:  # W_V and the conv start at zero: make them non-trivial so the tests can fail
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for f in model.memory.fusions:
                f.value.weight.copy_(0.05 * torch.randn(f.value.weight.shape, generator=g))
                f.conv_weight.copy_(0.5 * torch.randn(f.conv_weight.shape, generator=g))
    return model


def _scramble(mem, seed=5):
    """A non-identity compression map (many-to-one) and pad, to exercise P."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        mem.compression.copy_(torch.randint(0, 300, mem.compression.shape, generator=g))
        mem.pad_id.fill_(int(mem.compression[7]))


def reference_ids(mem, tokens: list[int]) -> list[list[list[list[int]]]]:
    """z[t][module][order-2][head] with Python ints: x' = P[x], XOR of products, mod p (spec §3.4 test 1)."""
    N, P = mem.opts.max_order, mem.compression.tolist()
    xs = [P[x] for x in tokens]
    pad = int(mem.pad_id)
    out = []
    for t in range(len(xs)):
        back = [xs[t - j] if t - j >= 0 else pad for j in range(N)]  # x'_t, x'_{t-1}, ...
        per_module = []
        for m, layer in enumerate(mem.layers):
            half = (2**63 - 1) // mem.padded_vocab // 2
            r = np.random.default_rng(mem.opts.seed + 10007 * layer).integers(0, half, size=N, dtype=np.int64)
            mult = [2 * int(v) + 1 for v in r]
            orders = []
            for n in range(2, N + 1):
                mix = 0
                for j in range(n):
                    mix ^= back[j] * mult[j]
                orders.append([mix % p for p in mem.head_sizes[m][n - 2]])
            per_module.append(orders)
        out.append(per_module)
    return out


def test_hash_matches_python_big_ints():
    mem = _model().memory
    _scramble(mem)
    tokens = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1))
    rows = mem.hash_rows(tokens, None)  # (B, T, n_mod, N-1, K)
    assert rows.shape == (2, 20, 2, 2, 2) and rows.dtype == torch.long
    z = rows - mem.offsets
    for b in range(2):
        assert z[b].tolist() == reference_ids(mem, tokens[b].tolist())
    sizes, offsets = mem.primes.expand_as(rows), mem.offsets.expand_as(rows)
    assert bool((z >= 0).all()) and bool((z < sizes).all())
    assert bool((rows >= offsets).all()) and bool((rows < offsets + sizes).all())  # inside its head's row range
    assert int(offsets.max() + sizes.max()) <= mem.table.num_embeddings
    # the module's multipliers are the NumPy-seeded ones (seed + 10007 * layer)
    half = (2**63 - 1) // mem.padded_vocab // 2
    for m, layer in enumerate(mem.layers):
        r = np.random.default_rng(10007 * layer).integers(0, half, size=3, dtype=np.int64)
        assert mem.multipliers[m].tolist() == [2 * int(v) + 1 for v in r]


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)


def reference_residual(mem, layer, tokens, x):
    """Y for one sequence, position by position (spec §3.4 test 2): e_t from the tables, gate, V~, the conv as an
    explicit sum y_t = sum_i w_i * norm(V~)_{t - N (kernel-1-i)}, Y = SiLU(y) + V~. Returns (Y, V~)."""
    m = mem.layer_pos[layer]
    f, N, kernel = mem.fusions[m], mem.opts.max_order, mem.opts.kernel
    ids = reference_ids(mem, tokens)
    T, C = x.shape
    offsets = mem.offsets[m].tolist()
    v_gated = []
    for t in range(T):
        e = torch.cat([mem.table.weight[offsets[n][k] + ids[t][m][n][k]]
                       for n in range(N - 1) for k in range(mem.opts.heads)])  # (d_mem,)
        key, value = f.key.weight @ e, f.value.weight @ e
        a = float((rms(x[t]) * rms(key)).sum()) / math.sqrt(C)
        alpha = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(a), 1e-6)), a)))
        v_gated.append(alpha * value)
    normed = [rms(v) for v in v_gated]
    w = f.conv_weight[:, 0, :]  # (C, kernel)
    out = []
    for t in range(T):
        y = torch.zeros(C)
        for i in range(kernel):
            s = t - N * (kernel - 1 - i)
            if s >= 0:
                y = y + w[:, i] * normed[s]
        out.append(F.silu(y) + v_gated[t])
    return torch.stack(out), torch.stack(v_gated)


@torch.no_grad()
def test_module_matches_naive_per_token_reference():
    mem = _model().memory
    _scramble(mem)
    tokens = torch.randint(0, 512, (2, 14), generator=torch.Generator().manual_seed(2))
    x = torch.randn(2, 14, 128, generator=torch.Generator().manual_seed(4))
    ctx = mem.prepare(tokens, None)
    for layer in mem.layers:
        y = mem.residual(layer, x, ctx) - x
        for b in range(2):
            ref, _ = reference_residual(mem, layer, tokens[b].tolist(), x[b])
            torch.testing.assert_close(y[b], ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_zero_conv_gives_v_tilde():
    mem = _model().memory
    for f in mem.fusions:
        f.conv_weight.zero_()
    tokens = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(2))
    x = torch.randn(1, 12, 128, generator=torch.Generator().manual_seed(4))
    y = mem.residual(1, x, mem.prepare(tokens, None)) - x
    _, v_gated = reference_residual(mem, 1, tokens[0].tolist(), x[0])
    assert v_gated.abs().max() > 1e-3
    torch.testing.assert_close(y[0], v_gated, atol=1e-6, rtol=1e-5)


def test_analysis_capture_sees_the_gate():
    from nanochat.analysis import run_captured

    model = _model().eval()
    cap = run_captured(model, torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(1)))
    assert cap["gamma"].shape == cap["inject_norm"].shape == (2, 10, 2, 1)  # (B, T, modules, one gate)
    assert bool(((cap["gamma"] > 0) & (cap["gamma"] < 1)).all()) and bool((cap["inject_norm"] > 0).all())


@torch.no_grad()
def test_causal():
    model = _model().eval()
    a = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(6))
    b = a.clone()
    b[:, 13:] = torch.randint(0, 512, (1, 11), generator=torch.Generator().manual_seed(7))
    la, lb = model(a), model(b)
    assert torch.equal(la[:, :13], lb[:, :13])
    assert not torch.allclose(la[:, 13:], lb[:, 13:])


@torch.no_grad()
def test_cached_decoding_equals_full_forward():
    model = _model().eval()
    _scramble(model.memory)
    seq = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(8))
    full = model(seq)
    cache = KVCache.for_model(model, batch_size=2, max_len=20)
    parts, pos = [], 0
    for size in (5, 1, 1, 2, 1, 3, 1, 1, 1, 1, 1, 1, 1):  # chunks shorter than the carried history too
        parts.append(model(seq[:, pos:pos + size], kv_cache=cache))
        pos += size
    assert pos == 20 and set(cache.memory_state) == {"engram_prev", "engram_v0", "engram_v1"}
    assert cache.memory_state["engram_v0"].shape == (2, (4 - 1) * 3, 128)  # (kernel - 1) * dilation rows of V~
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    prompt = seq[0, :7].tolist()
    assert generate(model, prompt, max_tokens=10, temperature=0.0)[0] == generate_uncached(model, prompt, 10)


@torch.no_grad()
def test_equals_base_at_init():
    cfg = dict(memory_options={**OPTS, "compression": "identity"})
    engram = build_model(tiny_config(memory="engram", **cfg), seed=0)
    base = build_model(tiny_config(), seed=0)
    assert engram.memory.fusions[0].key.weight.abs().max() > 0 and engram.memory.table.weight.abs().max() > 0
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(9))
    assert torch.equal(engram(tokens), base(tokens))


def test_primes_distinct_ascending_from_the_start():
    assert ascending_primes(10, 4) == [11, 13, 17, 19] and ascending_primes(13, 2) == [13, 17]
    sieve = [n for n in range(2, 5000) if all(n % d for d in range(2, int(n**0.5) + 1))]
    assert [n for n in range(5000) if is_prime(n)] == sieve
    cfg = GPTConfig(sequence_len=2048, vocab_size=32768, n_layer=24, n_head=12, n_kv_head=12, n_embd=1536,
                    memory="engram")
    with torch.device("meta"):
        mem = EngramMemory(cfg)
    flat = [p for module in mem.head_sizes for order in module for p in order]
    assert len(flat) == 32 and flat == sorted(set(flat)) and flat[0] >= 195_131
    assert (flat[0], flat[-1], sum(flat) * 96) == (195_131, 195_493, 599_989_056)


def test_d24_parameter_count_and_flops():
    cfg = GPTConfig(sequence_len=2048, vocab_size=32768, n_layer=24, n_head=12, n_kv_head=12, n_embd=1536,
                    memory="engram")
    s = model_summary(cfg)
    assert (s["params_total"], s["params_memory"]) == (1_389_579_120, 599_989_056)
    base = model_summary(GPTConfig(sequence_len=2048, vocab_size=32768, n_layer=24, n_head=12, n_kv_head=12,
                                   n_embd=1536))
    C = 1536
    assert s["flops_per_token"] - base["flops_per_token"] == 6 * 2 * (2 * C * C + 4 * C)  # W_K, W_V, conv counted
    assert round(6e19 / (s["flops_per_token"] * 1_048_576)) == 10_712  # the spec's step count
    assert EngramMemory.default_layers(24) == (1, 11) and EngramMemory.default_layers(12) == (1, 5)
    assert all(len(set(EngramMemory.default_layers(n))) == 2 for n in range(2, 30))


def test_optimizer_groups():
    model = _model(nonzero=False)
    groups = build_param_groups(model, OptimConfig())
    by_param = {id(p): g for g in groups for p in g["params"]}
    mem = model.memory
    assert by_param[id(mem.table.weight)]["name"] == "memory_tables"
    assert by_param[id(mem.table.weight)]["weight_decay"] == 0.0
    for f in mem.fusions:
        assert by_param[id(f.key.weight)]["kind"] == by_param[id(f.value.weight)]["kind"] == "muon"
        assert by_param[id(f.conv_weight)]["kind"] == "adamw" and f.conv_weight.ndim == 3
    base = build_model(tiny_config(), seed=0)
    extra = sum(p.numel() for f in mem.fusions for p in f.parameters())
    assert model.estimate_flops() - base.estimate_flops() == 6 * extra  # the table is excluded


@pytest.mark.parametrize("flags,message", [
    (["--engram-heads", "0"], "--engram-heads must be an integer >= 1"),
    (["--engram-max-order", "1"], "--engram-max-order must be an integer >= 2"),
    (["--engram-dim", "100"], "--engram-dim 100 must be divisible by"),
    (["--memory-layers", "1,99"], "--memory-layers 1,99"),
])
def test_flag_errors(tmp_path, capsys, flags, message):
    argv = ["--depth", "4", "--memory", "engram", *flags, "--dry-run", "--run-dir", str(tmp_path)]
    assert base_train.main(argv) == 2
    assert message in capsys.readouterr().err


def test_normaliser():
    assert normalize_token("  Hello\tWorld \n") == "hello world"
    assert normalize_token("Café") == "cafe" and normalize_token("ÉCOLE") == "ecole"
    assert normalize_token("ＡＢＣ") == "abc" and normalize_token("ﬁne") == "fine"  # NFKC
    assert normalize_token("   ") == " " and normalize_token("\n\n") == " " and normalize_token(" ") == " "
    pieces = [b"Cafe", "café".encode(), b" cafe", b"\xc3", b"\xa9", b"  ", b"\t", "\u0301".encode(), b"x"]
    assert compression_map(pieces) == [0, 0, 0, 1, 2, 3, 3, 4, 5]


def test_bind_tokenizer_and_checkpoint_keep_the_map(tmp_path):
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b" the": 256, b"The": 257, b"the": 258, "é".encode(): 259})
    tok = Tokenizer(ranks)  # vocab 260 + 9 specials
    cfg = tiny_config(vocab_size=tok.vocab_size, memory="engram", memory_options={**OPTS, "compression": "tokenizer"})
    model = build_model(cfg, seed=0)
    with pytest.raises(ValueError, match="--engram-compression identity"):
        model.memory.check_ready()  # what the trainer asks before the first step
    with pytest.raises(ValueError, match="--engram-compression identity"):
        model(torch.zeros(1, 4, dtype=torch.long))  # no silent identity map
    with pytest.raises(ValueError, match="--engram-compression identity"):
        model.memory.bind_tokenizer(None)
    model.memory.bind_tokenizer(tok)
    P = model.memory.compression.tolist()
    expect = compression_map([tok.decode_bytes([t]) for t in range(tok.vocab_size)])
    assert P[: tok.vocab_size] == expect and len(P) == cfg.padded_vocab_size
    assert P[256] == P[257] == P[258] != P[ord("T")]  # " the", "The", "the" share one id
    assert P[ord("A")] == P[ord("a")] and P[259] == P[ord("e")]  # case and accents folded
    assert int(model.memory.pad_id) == P[tok.bos_token_id]
    assert model.memory.stats()["memory/engram/compressed_ids"] == len(set(expect)) < tok.vocab_size
    assert len(set(P)) == len(set(expect)) + cfg.padded_vocab_size - tok.vocab_size  # padding ids kept apart
    ckpt.save_checkpoint(tmp_path, 1, model, {})
    loaded, _ = ckpt.load_model(tmp_path, 1)
    assert loaded.memory.compression.tolist() == P and int(loaded.memory.pad_id) == P[tok.bos_token_id]
    tokens = torch.randint(0, tok.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(tokens), model(tokens))  # loaded without a tokenizer, the map came with it


def test_trains_through_base_train(tmp_path, capsys):
    tiny = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32",
            "--max-seq-len", "32", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core",
            "--device-batch-size", "4", "--total-batch-size", "256", "--memory", "engram",
            "--engram-heads", "2", "--engram-first-prime", "257"]
    run = tmp_path / "r"
    assert base_train.main([*tiny, "--run-dir", str(tmp_path / "bad"), "--num-iterations", "2"]) == 2
    assert "--engram-compression identity" in capsys.readouterr().err
    assert base_train.main([*tiny, "--engram-compression", "identity", "--run-dir", str(run),
                            "--num-iterations", "12", "--save-every", "12"]) == 0
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if r["kind"] == "train"]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.03 and max(losses[-3:]) < min(losses[:3]), losses
    model, meta = ckpt.load_model(run, 12)
    assert meta["model_config"]["memory"] == "engram" and model.memory.layers == (0, 1)
    assert model.memory.fusions[0].value.weight.abs().max() > 0  # W_V left zero: the memory learned
    assert model.memory.fusions[0].conv_weight.abs().max() > 0


def test_real_tokenizer_map_reaches_the_checkpoint(tmp_path, embedded_data_dir, tiny_tokenizer_dir):
    """base_train builds P from the run's tokenizer (bind_tokenizer) and the checkpoint carries it."""
    run = tmp_path / "real"
    argv = ["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir), "--depth", "2",
            "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "32", "--device-batch-size", "2",
            "--total-batch-size", "64", "--eval-tokens", "128", "--eval-every", "-1", "--no-final-core",
            "--num-iterations", "2", "--memory", "engram", "--engram-heads", "2", "--engram-first-prime", "1031",
            "--run-dir", str(run)]
    assert base_train.main(argv) == 0
    tok = Tokenizer.load(tiny_tokenizer_dir)
    expect = compression_map([tok.decode_bytes([t]) for t in range(tok.vocab_size)])
    model, _ = ckpt.load_model(run, 2)
    P = model.memory.compression.tolist()
    assert P[: tok.vocab_size] == expect and len(set(expect)) < tok.vocab_size  # a real, many-to-one map
    assert int(model.memory.pad_id) == P[tok.bos_token_id]


@pytest.mark.slow  # ~50 s of compilation on 2 CPU cores
def test_compiles_fullgraph_in_training_mode():
    model = _model()
    ref = _model()
    model.train()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    data = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = compiled(data[:, :-1], data[:, 1:])
    loss.backward()
    ref_loss = ref(data[:, :-1], data[:, 1:])
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
    for p, q in ((model.memory.table.weight, ref.memory.table.weight),
                 (model.memory.fusions[0].conv_weight, ref.memory.fusions[0].conv_weight)):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
