"""The authors' pickled tokenizer (restricted unpickler) and the opt-in ``--numerics reference`` evaluation mode."""

import os
import pickle

import pytest
import torch

from conftest import tiny_config
from reference_fixtures import make_their_files, write_their_tokenizer
from test_analysis import make_tokenizer

from nanochat.reference_tokenizer import (read_reference_tokenizer, reference_token_bytes, unpickle_encoding_state,
                                          write_reference_tokenizer)
from nanochat.tokenizer import TokenizerError

TEXT = "She deposited her salary at the bank. \u00e9t\u00e9 \u20ac 42 <|bos|>"


# -- tokenizer ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_their_pickle_converts_to_the_same_tokenizer(tmp_path, protocol):
    tok = make_tokenizer(tmp_path / "tok")
    write_their_tokenizer(tok, tmp_path / "theirs", protocol=protocol)
    ours = read_reference_tokenizer(tmp_path / "theirs" / "tokenizer.pkl")
    assert ours.mergeable_ranks == tok.mergeable_ranks and ours.special_tokens == tok.special_tokens
    assert ours.pattern == tok.pattern and ours.encode(TEXT) == tok.encode(TEXT)
    assert ours.bos_token_id == tok.bos_token_id


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # what a malicious "tokenizer.pkl" would do on an ordinary pickle.load
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(TokenizerError, match=r"refusing to load global (posix|os|nt)\.system"):
        read_reference_tokenizer(path)
    assert not marker.exists()
    # the same file through ordinary pickle WOULD run it: the test is not vacuous
    pickle.loads(path.read_bytes())
    assert marker.exists()


def test_other_pickles_are_refused_with_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(TokenizerError, match=r"refusing to load global builtins\.eval"):
        unpickle_encoding_state(b"cbuiltins\neval\n(S'1+1'\ntR.")
    with pytest.raises(TokenizerError, match="holds a dict, expected a pickled tiktoken Encoding"):
        unpickle_encoding_state(pickle.dumps({"mergeable_ranks": {}}))
    with pytest.raises(TokenizerError, match="not a readable tokenizer pickle"):
        unpickle_encoding_state(b"\x80\x04garbage")
    with pytest.raises(TokenizerError, match="registered tiktoken encoding 'gpt2' by name"):
        unpickle_encoding_state(_registered_by_name(monkeypatch))
    with pytest.raises(TokenizerError, match="persistent id"):
        unpickle_encoding_state(b"Px\n.")
    with pytest.raises(TokenizerError, match="tokenizer pickle .* is missing"):
        read_reference_tokenizer(tmp_path / "nope.pkl")


def _registered_by_name(monkeypatch) -> bytes:
    """What tiktoken writes for a registered encoding: only its name (registered here without downloading)."""
    import tiktoken
    import tiktoken.registry

    enc = tiktoken.Encoding(name="gpt2", pat_str=r"\S+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={})
    monkeypatch.setitem(tiktoken.registry.ENCODINGS, "gpt2", enc)
    return pickle.dumps(enc)


def test_special_tokens_must_follow_the_ranks(tmp_path):
    import tiktoken

    ranks = {bytes([i]): i for i in range(256)}
    enc = tiktoken.Encoding(name="rustbpe", pat_str=r"\S+", mergeable_ranks=ranks, special_tokens={"<|bos|>": 300})
    (tmp_path / "t.pkl").write_bytes(pickle.dumps(enc))
    with pytest.raises(TokenizerError, match=r"special token ids \[300\] do not follow the 256 mergeable ranks"):
        read_reference_tokenizer(tmp_path / "t.pkl")


def test_reference_token_bytes_and_export_round_trip(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    tb = reference_token_bytes(tok)
    raw = tok.token_bytes()
    assert tb.dtype == torch.int32 and tb.shape == (tok.vocab_size,)
    assert int(tb[ord("a")]) == 1 and all(int(tb[0x80 + i]) == 3 for i in range(128))  # lone high bytes: U+FFFD
    assert torch.equal(tb[tok.bos_token_id:], torch.zeros(9, dtype=torch.int32))
    assert int((tb != raw).sum()) == 128
    write_reference_tokenizer(tok, tmp_path / "export")
    back = read_reference_tokenizer(tmp_path / "export" / "tokenizer.pkl")
    assert back.encode(TEXT) == tok.encode(TEXT) and back.special_tokens == tok.special_tokens
    assert torch.equal(torch.load(tmp_path / "export" / "token_bytes.pt"), tb)


# -- numerics -----------------------------------------------------------------------------------------------
def _mome(**opts):
    from nanochat.gpt import build_model

    model = build_model(tiny_config(vocab_size=320, n_layer=4, n_embd=64, memory="mome",
                                    memory_options={"slots": 6, "topk": 2, **opts}), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "memory" in name or "c_proj" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model.eval()


def test_ours_is_the_default_and_changes_nothing():
    from nanochat.numerics import apply_numerics

    model = _mome()
    idx = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(idx)
        assert apply_numerics(model, "ours") == {"numerics": "ours"}
        assert torch.equal(model(idx), before) and model.memory.reference_gating is False
    with pytest.raises(ValueError, match="--numerics 'theirs' is unknown; allowed: ours, reference"):
        apply_numerics(model, "theirs")


def test_reference_rounds_rotary_tables_to_bf16():
    from nanochat.gpt import rotary_tables
    from nanochat.numerics import apply_numerics

    model = _mome()
    cos, sin = rotary_tables(model.rotary_len, model.config.head_dim)
    info = apply_numerics(model, "reference")
    assert info["rotary_tables"] == "bf16-rounded" and info["mome_gating"] == "topk-on-scores-in-router-dtype"
    assert torch.equal(model.rope_cos, cos.bfloat16().float()) and torch.equal(model.rope_sin, sin.bfloat16().float())
    assert not torch.equal(model.rope_cos, cos)


@pytest.mark.parametrize("model_type, rounded", [("mobilellm-125m", False), ("qwen3-0.6b", True)])
def test_reference_rotary_tables_follow_each_family(model_type, rounded):
    """The authors' MobileLLM keeps fp32 RoPE tables, their Qwen3 bf16 ones (families spec §8)."""
    from nanochat.families import build_model
    from nanochat.numerics import apply_numerics
    from nanochat.train_args import parse_args
    from scripts.base_train import model_config

    args = parse_args(["--model-type", model_type, "--depth", "2", "--model-dim", "64", "--num-heads", "4",
                       "--num-kv-heads", "2", "--head-dim", "16", "--max-seq-len", "32", "--vocab-size", "320"])
    model = build_model(model_config(args, 320), seed=0).eval()
    before = model.rope_cos.clone(), model.rope_sin.clone()
    info = apply_numerics(model, "reference")
    assert info["rotary_tables"] == ("bf16-rounded" if rounded else "fp32")
    for buf, old in zip((model.rope_cos, model.rope_sin), before):
        assert torch.equal(buf, old.bfloat16().float() if rounded else old)
    assert not torch.equal(before[0], before[0].bfloat16().float())  # the rounding is visible at all


def _their_route(logits, K, mode):
    """The authors' top-K rule written out from the spec (§3.6, §3.8), independently of nanochat.memory.mome."""
    p = torch.softmax(logits, -1) if mode.startswith("softmax") else torch.sigmoid(logits)
    if K == p.shape[-1]:
        w = p
        sel = None
    else:
        sel = torch.topk(p, K, dim=-1, sorted=False).indices
        w = torch.gather(p, -1, sel)
    if mode.endswith("norm"):
        w = w / (w.sum(-1, keepdim=True) + 1e-10)
    return sel, w


@pytest.mark.parametrize("opts", [{}, {"gate": "softmax", "topk": 1}, {"topk": 6}, {"router_input": "value"}])
def test_reference_gating_follows_their_rule_under_bf16_autocast(opts):
    from nanochat.numerics import apply_numerics

    model = _mome(**opts)
    apply_numerics(model, "reference")
    mem = model.memory
    xn = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))
    v = torch.randn(2, 16, 2, 32, generator=torch.Generator().manual_seed(4))
    idx = torch.randint(0, 320, (2, 16))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        sel, w, p = mem.route(0, xn, v, idx, idx, probs=False)
        router_in = xn if mem.opts.router_input == "hidden" else v
        logits = mem.routers[0](router_in).view(2, 16, 2, mem.M)
        assert logits.dtype == torch.bfloat16
        want_sel, want_w = _their_route(logits, mem.K, mem.mode)
    if want_sel is None:
        assert sel is None
    else:
        assert torch.equal(sel, want_sel)
    assert w.dtype == want_w.dtype and torch.equal(w, want_w)
    if mem.mode.startswith("sigmoid"):
        assert w.dtype == torch.bfloat16  # their sigmoid scores and weights stay in the autocast dtype
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx)  # the whole forward runs in this mode


def test_reference_gating_selects_the_same_slots_in_fp32():
    """Spec: in fp32 top-K on sigmoid(l) and on l pick the same set (no ties at these logit scales)."""
    from nanochat.numerics import apply_numerics

    ours, ref = _mome(), _mome()
    apply_numerics(ref, "reference")
    xn = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))
    v = torch.zeros(2, 16, 2, 32)
    idx = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        s0, w0, _ = ours.memory.route(0, xn, v, idx, idx)
        s1, w1, _ = ref.memory.route(0, xn, v, idx, idx)
    o0, o1 = s0.sort(-1), s1.sort(-1)
    assert torch.equal(o0.values, o1.values)
    torch.testing.assert_close(w0.gather(-1, o0.indices), w1.gather(-1, o1.indices), rtol=1e-6, atol=1e-7)


def test_reference_refuses_models_their_code_cannot_evaluate():
    from nanochat.numerics import apply_numerics

    with pytest.raises(ValueError, match="--mome-balance bias"):
        apply_numerics(_mome(balance="bias"), "reference")
    with pytest.raises(ValueError, match="--mome-routing token-only"):
        apply_numerics(_mome(routing="token-only"), "reference")


# -- the tools on an imported run ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from scripts import import_reference

    tmp = tmp_path_factory.mktemp("imported")
    src, source, tok = make_their_files(tmp, "mome_token")
    assert import_reference.main([str(src), "--run-dir", str(tmp / "run")]) == 0
    text = tmp / "notes.txt"
    text.write_text("\n".join(["She deposited her salary at the bank. They had a picnic on the river bank."] * 8))
    return tmp, source, tok, text


def test_base_eval_on_an_imported_run_both_numerics(imported):
    import json

    from nanochat.loss_eval import bpb_rows_from_text, evaluate_bpb, iter_row_batches, read_corpus
    from scripts import base_eval

    tmp, source, tok, text = imported
    res = {}
    for mode in ("ours", "reference"):
        out = tmp / f"eval_{mode}"
        assert base_eval.main(["--run", str(tmp / "run"), "--eval", "bpb", "--splits", "", "--bpb-corpus",
                               f"notes={text}", "--numerics", mode, "--device-type", "cpu", "--out-dir", str(out),
                               "--no-progress"]) == 0
        res[mode] = json.loads((out / "bpb.json").read_text())
        assert res[mode]["numerics"] == mode
    assert res["reference"]["rotary_tables"] == "bf16-rounded"
    x, y = bpb_rows_from_text(tok, read_corpus(text), source.max_seq_len)
    direct = evaluate_bpb(source, iter_row_batches(x, y, 16), tok.token_bytes())
    assert res["ours"]["corpora"]["notes"]["bpb"] == pytest.approx(direct, rel=1e-6)
    # same text, nearly the same NLL; only bf16 rotary rounding separates the two on an ASCII corpus
    assert res["reference"]["corpora"]["notes"]["bpb"] == pytest.approx(direct, rel=1e-2)


def test_sample_and_analyses_run_on_an_imported_run(imported, capsys, tmp_path):
    from scripts import analyze_memory, analyze_routing, build_slot_map, sample, wic_probe

    tmp, _, _, text = imported
    run = str(tmp / "run")
    with torch.inference_mode():
        sample.main(["--run", run, "--prompt", "She deposited", "--max-tokens", "5", "--temperature", "0",
                     "--device-type", "cpu"])
    assert "She deposited" in capsys.readouterr().out
    assert analyze_memory.main(["--run", run, "--corpus", f"file:{text}", "--out-dir", str(tmp_path / "m"),
                                "--no-progress"]) == 0
    assert analyze_routing.main(["--run", run, "--corpus", f"file:{text}", "--reference", f"file:{text}",
                                 "--min-count", "2", "--out-dir", str(tmp_path / "r"), "--no-progress"]) == 0
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "wic_synthetic.tsv")
    assert wic_probe.main(["--run", run, "--wic", fixture, "--bootstrap", "41", "--out-dir", str(tmp_path / "w"),
                           "--no-progress"]) == 0
    build_slot_map.main(["--checkpoint", run, "--group-size", "1", "--knn", "8", "--tokenizer-dir",
                         str(tmp / "run" / "tokenizer"), "--output", str(tmp_path / "k2.json")])
    assert (tmp_path / "k2.json").is_file()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu there)")
@pytest.mark.parametrize("opts", [{}, {"gate": "softmax", "topk": 1}])
def test_reference_gating_on_cuda_bf16(opts):
    """On CUDA their softmax scores autocast to fp32 and sigmoid ones stay bf16; the mode follows both. CUDA
    autocast also runs the normalising sum in fp32 (CPU autocast does not), so on CUDA the normalised weights are
    fp32 in both modes, theirs as ours (the H100 run of 2026-11-26 found the old bf16 expectation wrong)."""
    from nanochat.numerics import apply_numerics

    model = _mome(**opts).cuda()
    apply_numerics(model, "reference")
    mem = model.memory
    xn = torch.randn(2, 16, 64, device="cuda")
    idx = torch.randint(0, 320, (2, 16), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        sel, w, p = mem.route(0, xn, torch.zeros(2, 16, 2, 32, device="cuda"), idx, idx, probs=False)
        want_sel, want_w = _their_route(mem.routers[0](xn).view(2, 16, 2, mem.M), mem.K, mem.mode)
        ours = model(idx)
    assert torch.equal(sel, want_sel) and torch.equal(w, want_w) and w.dtype == want_w.dtype  # equal promotes
    assert p.dtype == (torch.float32 if mem.mode.startswith("softmax") else torch.bfloat16)
    assert torch.isfinite(ours).all()
