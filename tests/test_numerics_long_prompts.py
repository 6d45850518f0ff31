"""--numerics reference on CORE prompts longer than the context T: no crop before the rotary table's end, and each
nanochat L layer limited to T keys (S to T//2), as the authors' evaluation runs them; --numerics ours unchanged."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import base_eval_fixtures  # noqa: E402
from _eval_helpers import LM_ROWS, CharTok, SuccessorModel  # noqa: E402
from base_eval_fixtures import _count_calls, _eval_args  # noqa: E402
from conftest import sigterm_after, tiny_config  # noqa: E402

from nanochat import core_eval as ce  # noqa: E402
from nanochat.eval_bundle import TaskSpec  # noqa: E402
from nanochat.numerics import apply_numerics  # noqa: E402

tiny_run = base_eval_fixtures.tiny_run

T = 16
PATTERN = "SL"  # 3 layers: S, L, L (the last is always L)


def _model(seed=0):
    """A tiny GQA GPT with S and L layers whose attention really mixes context (weights moved off the zero init)."""
    from nanochat.gpt import build_model

    cfg = tiny_config(sequence_len=T, vocab_size=CharTok.vocab_size, n_layer=3, n_head=4, n_kv_head=2, n_embd=64,
                      window_pattern=PATTERN)
    model = build_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def _naive_attention(windows):
    """Attention written out from the spec's rule: query row sees key col iff 0 <= row - col <= windows[layer]
    (None: no upper bound), GQA by repeating each KV head for its H/H_kv query heads."""

    def attend(q, k, v, kv_cache=None, layer_idx=0, window=None):
        assert kv_cache is None
        n = q.size(1)
        rep = q.size(2) // k.size(2)
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.size(-1))
        dist = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        w = windows[layer_idx]
        visible = (dist >= 0) & (dist <= (n if w is None else w))
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.einsum("bhij,bjhd->bihd", F.softmax(scores, dim=-1), v)

    return attend


def test_reference_windows_equal_naive_masked_attention(monkeypatch):
    """T+50 tokens: the reference forward equals a naive forward with the mask row-col <= T (L) / T//2 (S); ours
    (no limit on L) differs beyond position T only."""
    from nanochat import gpt

    model = _model()
    info = apply_numerics(model, "reference")
    assert info["attention_windows"] == f"L {T} keys before each query, S {T // 2}"
    idx = torch.randint(1, CharTok.vocab_size, (2, T + 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(idx)
        monkeypatch.setattr(gpt, "causal_attention", _naive_attention((T // 2, T, T)))
        naive = model(idx)
        monkeypatch.setattr(gpt, "causal_attention", _naive_attention((T // 2, None, None)))
        unlimited = model(idx)
    assert got.shape == (2, T + 50, CharTok.vocab_size)
    torch.testing.assert_close(got, naive, rtol=1e-5, atol=1e-5)
    # up to position T an L window of T keys reaches every key: the two agree there, and differ beyond
    torch.testing.assert_close(got[:, : T + 1], unlimited[:, : T + 1], rtol=1e-5, atol=1e-5)
    assert (got[:, T + 1 :] - unlimited[:, T + 1 :]).abs().max() > 1e-2


def test_ours_keeps_windows_and_crop():
    from nanochat.gpt import build_model

    model = _model()
    assert apply_numerics(model, "ours") == {"numerics": "ours"}
    assert [b.attn.window for b in model.blocks] == [T // 2, None, None]
    assert not hasattr(model, "core_crop_len") and ce.crop_length(model) == (T, "max_seq_len")
    apply_numerics(model, "reference")
    assert [b.attn.window for b in model.blocks] == [T // 2, T, T]
    assert ce.crop_length(model) == (model.rotary_len, "rotary_len") and model.rotary_len == 10 * T
    # an all-L model says nothing of S
    all_l = build_model(tiny_config(sequence_len=T), seed=0)
    assert apply_numerics(all_l, "reference")["attention_windows"] == f"L {T} keys before each query"


@pytest.mark.parametrize("model_type", ["mobilellm-125m", "qwen3-0.6b"])
def test_families_are_uncropped_with_full_causal_attention(model_type):
    """Their MobileLLM/Qwen3 attend to the whole causal prefix at any length (families spec §2.3, §3.2)."""
    from nanochat.families import build_model
    from nanochat.train_args import parse_args
    from scripts.base_train import model_config

    args = parse_args(["--model-type", model_type, "--depth", "2", "--model-dim", "64", "--num-heads", "4",
                       "--num-kv-heads", "2", "--head-dim", "16", "--max-seq-len", str(T), "--vocab-size", "320"])
    model = build_model(model_config(args, 320), seed=0).eval()
    idx = torch.randint(0, 320, (1, T + 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        apply_numerics(model, "ours")
        before = model(idx)
        info = apply_numerics(model, "reference")
        after = model(idx)
    assert info["attention_windows"] == "full causal at any length, as theirs"
    assert ce.crop_length(model) == (model.rotary_len, "rotary_len")
    if model_type.startswith("mobilellm"):  # fp32 RoPE tables: nothing else changed
        assert torch.equal(before, after)


class BosFirstModel(SuccessorModel):
    """The successor model while a row starts with BOS; with any other first token it boosts the wrong token, so
    every verdict flips once a prompt is cropped."""

    def forward(self, idx, targets=None, loss_reduction="mean"):
        logits = super().forward(idx)
        wrong = torch.roll(logits, shifts=1, dims=-1)
        return torch.where((idx[:, :1] == CharTok.bos_token_id)[..., None], logits, wrong)


def test_core_crop_follows_the_numerics():
    """Prompts longer than max_seq_len: ours crops them (the first token is no longer BOS); under reference
    (core_crop_len set) they are scored whole, and only the rotary table's end makes them too long."""
    task = TaskSpec("lm", "", "language_modeling", 2, " ")
    whole = ce.evaluate_task(SuccessorModel(), CharTok(), LM_ROWS, task, progress=False)
    assert whole.correct >= 1  # something for the crop to flip
    ours = BosFirstModel(max_seq_len=9)
    assert ce.evaluate_task(ours, CharTok(), LM_ROWS, task, progress=False) == (0, 3, 0)
    ref = BosFirstModel(max_seq_len=9)
    ref.core_crop_len = 10_000
    assert ce.evaluate_task(ref, CharTok(), LM_ROWS, task, progress=False) == whole
    ref.core_crop_len = 2
    assert ce.evaluate_task(ref, CharTok(), LM_ROWS, task, progress=False) == (0, 3, 3)
    ex = ce.Prepared([list(range(10))], [7], [10], 0)
    with pytest.raises(ce.RegionTooLong, match="does not fit into rotary_len=3"):
        ce.crop_left(ex, 3, "task x example 0", "rotary_len")


def test_reference_core_scores_the_whole_prompt_on_a_gpt():
    """A real GPT under reference numerics: the CORE forward gets the whole 0-shot prompt (longer than T, BOS
    first) and its logits are those of the uncropped row, which differ from the cropped row's."""
    row = {"context": "abcdefghijklmnopqrstuvwxyz abcdefghijkl", "continuation": "ABC"}
    task = TaskSpec("lm", "", "language_modeling", 0, " ")
    seen = {}
    for mode in ("ours", "reference"):
        model = _model()
        apply_numerics(model, mode)
        hook = model.register_forward_hook(lambda m, args, out, mode=mode: seen.update({mode: (args[0], out)}))
        ce.evaluate_task(model, CharTok(), [row], task, progress=False)
        hook.remove()
    ids, logits = seen["reference"]
    full = [CharTok.bos_token_id] + CharTok().encode(row["context"] + " " + row["continuation"])
    assert ids.tolist() == [full] and len(full) > T + 20
    with torch.no_grad():
        cropped = model(ids[:, -T:])
        assert torch.equal(logits, model(ids))
    assert (logits[:, -4:] - cropped[:, -4:]).abs().max() > 1e-3  # the scored positions see beyond T
    assert seen["ours"][0].tolist() == [full[-T:]]


def test_partial_results_of_one_numerics_are_not_reused_by_the_other(tiny_run, tmp_path, monkeypatch, capsys):
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"

    def interrupted_then(first: str, second: str) -> list:
        with monkeypatch.context() as m:
            sigterm_after(m, ce, "evaluate_task", 1)
            assert main(_eval_args(root, bundle, out, "--eval", "core", "--numerics", first)) == 143
        with monkeypatch.context() as m:
            tasks = _count_calls(m, ce, "evaluate_task")
            assert main(_eval_args(root, bundle, out, "--eval", "core", "--numerics", second)) == 0
        return [a[3].label for a in tasks]

    assert interrupted_then("ours", "reference") == ["mc", "lm"]
    assert "computed with other settings (numerics {'numerics': 'ours'} -> {'numerics': 'reference'" in \
        capsys.readouterr().out
    report = json.loads((out / "core.json").read_text())
    assert report["numerics"] == "reference" and report["core_crop"].startswith("left to the rotary table's 640")
    assert interrupted_then("reference", "ours") == ["mc", "lm"]
    assert interrupted_then("reference", "reference") == ["lm"]  # the same settings: mc is reused


def test_core_md_names_the_limit_of_each_numerics(tmp_path):
    results = ce.summarize_core({"lm": {"accuracy": 0.5, "n": 4, "too_long": 1}}, {"lm": 0.0}, ["lm"])
    ce.write_core_report(results, tmp_path / "ours", {"numerics": "ours"})
    ce.write_core_report(results, tmp_path / "ref", {"numerics": "reference", "core_crop": "left to ..."})
    assert "Examples longer than the model's context, counted as incorrect: lm 1." in \
        (tmp_path / "ours" / "core.md").read_text()
    assert "Examples longer than the rotary table, counted as incorrect: lm 1." in \
        (tmp_path / "ref" / "core.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu there)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_windows_on_cuda_equal_naive_masked_attention(monkeypatch, dtype):
    """The CPU test's check on CUDA's attention path (SDPA with the explicit window mask), in fp32 and under bf16
    autocast: the reference windows beyond T have never run on a GPU otherwise."""
    from nanochat import gpt

    model = _model().cuda()
    apply_numerics(model, "reference")
    idx = torch.randint(1, CharTok.vocab_size, (2, T + 50), generator=torch.Generator().manual_seed(1)).cuda()

    def on_device(windows):  # the naive mask, computed in fp32 on the CPU from the same q, k, v
        attend = _naive_attention(windows)

        def run(q, k, v, kv_cache=None, layer_idx=0, window=None):
            return attend(q.float().cpu(), k.float().cpu(), v.float().cpu(), kv_cache, layer_idx, window).to(
                q.device, q.dtype)
        return run

    tf32 = torch.backends.cuda.matmul.allow_tf32  # fp32 compared at fp32 precision; monkeypatch cannot undo it
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            got = model(idx).float()
            monkeypatch.setattr(gpt, "causal_attention", on_device((T // 2, T, T)))
            naive = model(idx).float()
            monkeypatch.setattr(gpt, "causal_attention", on_device((T // 2, None, None)))
            unlimited = model(idx).float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    if dtype == torch.float32:  # this one also catches a window off by one
        torch.testing.assert_close(got, naive, rtol=1e-4, atol=1e-4)
        return
    # bf16: rounding inside the attention differs between the two paths, so this bound only catches masks far off
    # (no window: on the CPU under bf16 autocast, rounding gave 0.14 max / 0.020 mean beyond T, no window 1.74 /
    # 0.22; a window of T + 1 passes it, which the fp32 case fails)
    err, wrong = (got - naive)[:, T + 1:].abs(), (naive - unlimited)[:, T + 1:].abs()
    assert err.max() < 0.5 * wrong.max() and err.mean() < 0.25 * wrong.mean(), (err.max(), wrong.max())
