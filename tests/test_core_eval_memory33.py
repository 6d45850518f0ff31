"""CORE's batch scoring and bpb's per-position losses hold at most one row's float32 log-softmax besides the model's
logits (session 33), with the losses, argmax and judged results of the full-batch computation they replaced."""

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).parent))
from _eval_helpers import LM_ROWS, MC_ROWS, SCHEMA_ROWS, CharTok, SuccessorModel, tiny_gpt  # noqa: E402
from conftest import tiny_config  # noqa: E402

from nanochat import core_eval as ce  # noqa: E402
from nanochat.eval_bundle import TaskSpec  # noqa: E402
from nanochat.families import build_model  # noqa: E402
from nanochat import loss_eval  # noqa: E402
from nanochat.numerics import apply_numerics  # noqa: E402

TASKS = {  # uneven rows in each batch; MC has options that are token prefixes of others (empty regions)
    "multiple_choice": (TaskSpec("mc", "", "multiple_choice", 1, " "),
                        MC_ROWS + [{"query": "q", "choices": ["ab", "abcde"], "gold": 0},
                                   {"query": "q", "choices": ["abcde", "ab"], "gold": 1}]),
    "schema": (TaskSpec("sc", "", "schema", 1, " "),
               SCHEMA_ROWS + [{"context_options": ["ab", "abcdef", "xy"], "continuation": "BCD", "gold": 0}]),
    "language_modeling": (TaskSpec("lm", "", "language_modeling", 1, " "),
                          LM_ROWS + [{"context": "mno pq", "continuation": "r"}]),
}


def padded_logits(model, batch, pad_id, autocast_ctx):
    """(ids, logits) of the batch as _score_batch pads it (right, with ``pad_id``)."""
    rows = [r for ex in batch for r in ex.rows]
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    with torch.no_grad(), autocast_ctx or torch.autocast("cpu", enabled=False):
        return ids, model(ids)


def full_batch_verdicts(logits, ids, batch, task_type, reference):
    """What _score_batch computed before session 33: the losses and argmax of every position of the batch at once,
    then ``_judge``. Returns (verdicts, losses, preds)."""
    logits = logits.float()
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
    losses, preds = losses.view(ids.size(0), ids.size(1) - 1), logits[:, :-1].argmax(dim=-1)
    out, r0 = [], 0
    for ex in batch:
        r1 = r0 + len(ex.rows)
        out.append(ce._judge(task_type, losses[r0:r1], preds[r0:r1], ids[r0:r1], ex, reference))
        r0 = r1
    return out, losses, preds


@functools.cache
def make_model(name: str, numerics: str):
    model = tiny_gpt(seq_len=256) if name == "gpt" else SuccessorModel()
    if numerics == "reference":
        if name == "gpt":
            apply_numerics(model, "reference")
        else:
            model.core_crop_len = 10_000  # the mark reference_scoring reads (apply_numerics needs a family)
    return model


@pytest.mark.parametrize("numerics", ["ours", "reference"])
@pytest.mark.parametrize("name, autocast", [("gpt", None), ("gpt", "bf16"), ("successor", None)])
@pytest.mark.parametrize("task_type", list(TASKS))
def test_scores_and_verdicts_equal_the_full_batch_computation(task_type, name, autocast, numerics):
    task, rows = TASKS[task_type]
    model = make_model(name, numerics)
    batch = [ce.prepare_example(CharTok(), rows[i], task, ce.fewshot_for(rows, i, task.num_fewshot))
             for i in range(len(rows))]
    assert len({len(r) for ex in batch for r in ex.rows}) > 1  # uneven rows: padding in the batch
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else None
    ids, logits = padded_logits(model, batch, CharTok.bos_token_id, ctx)
    expected, full_losses, full_preds = full_batch_verdicts(logits, ids, batch, task_type, numerics == "reference")
    assert ce._score_batch(model, batch, task_type, CharTok.bos_token_id, "cpu", ctx) == expected

    regions = [(s, e) for ex in batch for s, e in zip(ex.starts, ex.ends)]
    losses, preds = ce.region_scores(logits, ids, regions)
    assert losses.shape == preds.shape == (ids.size(0), ids.size(1) - 1) and losses.dtype == torch.float32
    scored = torch.zeros_like(losses, dtype=torch.bool)
    for r, (s, e) in enumerate(regions):
        scored[r, s - 1 : e - 1] = True
    assert scored.any()
    torch.testing.assert_close(losses[scored], full_losses[scored], rtol=1.3e-6, atol=1e-5)
    assert torch.equal(preds[scored], full_preds[scored])
    assert losses[~scored].isnan().all() and (preds[~scored] == -1).all()  # nothing else is computed


def test_the_verdicts_compared_include_right_and_wrong_ones():
    """The successor model gets some examples of each task right and some wrong, so the equality above is no
    comparison of all-False lists."""
    for task, rows in TASKS.values():
        batch = [ce.prepare_example(CharTok(), rows[i], task, ce.fewshot_for(rows, i, 1)) for i in range(len(rows))]
        verdicts = ce._score_batch(SuccessorModel(), batch, task.task_type, 0, "cpu", None)
        assert set(verdicts) == {True, False}, task.task_type


# -- the memory bound ---------------------------------------------------------------------------------------
class NewFloatTensors(TorchDispatchMode):
    """Counts the float32 tensors that ops create (outputs with storage of their own, not views of an input) with
    more than ``numel`` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() > self.numel
                    and t.untyped_storage().data_ptr() not in inputs):
                self.count += 1
        return out


def big_float_tensors(fn, numel: int) -> int:
    with torch.no_grad(), NewFloatTensors(numel) as mode:
        fn()
    return mode.count


ROWS, T, V = 8, 48, 4096


def wide_vocab_model(family="nanochat"):
    return build_model(tiny_config(family=family, sequence_len=T, vocab_size=V, n_embd=64), seed=0).eval()


def test_core_scoring_adds_no_float_tensor_beyond_one_row():
    """Past two rows' worth of floats, _score_batch creates only what the forward itself creates: the full-batch
    computation added a float32 copy of all positions and its log-softmax (both (ROWS, T-1, V))."""
    model = wide_vocab_model()
    g = torch.Generator().manual_seed(0)
    lengths = [T, T - 5, T, T - 20, T - 1, T, T - 9, T]
    rows = [[0] + torch.randint(1, V, (n - 1,), generator=g).tolist() for n in lengths]
    # every region is the whole row (start 1): the largest a row's log-softmax can be
    batch = [ce.Prepared(rows[i : i + 2], [1, 1], lengths[i : i + 2], 0) for i in range(0, ROWS, 2)]
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    two_rows = 2 * T * V
    in_forward = big_float_tensors(lambda: model(ids), two_rows)
    assert in_forward >= 1  # the logits (the mode sees them)
    assert big_float_tensors(lambda: ce._score_batch(model, batch, "multiple_choice", 0, "cpu", None),
                             two_rows) == in_forward


@pytest.mark.parametrize("family", ["nanochat", "mobilellm"])
def test_bpb_adds_no_float_tensor_beyond_one_row(family):
    """The same for evaluate_bpb: the family's forward with targets took the whole batch's log-softmax."""
    model = wide_vocab_model(family)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(1, V, (ROWS, T), generator=g), torch.randint(1, V, (ROWS, T), generator=g)
    two_rows = 2 * T * V
    in_forward = big_float_tensors(lambda: model(x), two_rows)
    assert in_forward >= 1
    assert big_float_tensors(lambda: loss_eval.evaluate_bpb(model, [(x, y)], torch.ones(V, dtype=torch.long)),
                             two_rows) == in_forward


@pytest.mark.parametrize("family", ["nanochat", "mobilellm", "qwen3"])
def test_token_losses_equal_the_family_loss(family):
    """bpb's per-position losses are the family's forward(targets, loss_reduction="none"), ignored targets 0."""
    model = wide_vocab_model(family)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(1, V, (3, T), generator=g), torch.randint(1, V, (3, T), generator=g)
    y[1, 5:9] = -1
    with torch.no_grad():
        expected = model(x, targets=y, loss_reduction="none").view(3, T)
        got = loss_eval.token_losses(model(x), y)
    assert got.shape == (3, T) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1.3e-6, atol=1e-5)
    assert (got[1, 5:9] == 0).all()
    token_bytes = torch.randint(0, 3, (V,), generator=g)
    tb = token_bytes[y.clamp(min=0)] * (y >= 0)
    naive = expected[tb > 0].double().sum().item() / (torch.log(torch.tensor(2.0)).item() * tb.sum().item())
    assert loss_eval.evaluate_bpb(model, [(x, y)], token_bytes) == pytest.approx(naive, rel=1e-6)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "cpu_bf16"])
def test_nanochat_forward_without_grad_softcaps_in_place(autocast):
    """Evaluation's forward (no grad) applies the logit softcap in place: one float32 logits-sized tensor, not three
    (the logits, logits / 15 and tanh's output were alive at once: the nanochat GPT's CORE/bpb peak); the logits are
    bitwise those of the out-of-place form a training forward uses."""
    model = wide_vocab_model()
    ids = torch.randint(0, V, (ROWS, T), generator=torch.Generator().manual_seed(1))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with ctx:
        assert big_float_tensors(lambda: model(ids), ROWS * T * V - 1) == 1
        with torch.no_grad():
            evaluated = model(ids)
        with torch.enable_grad():
            trained = model(ids)
    assert trained.requires_grad and not evaluated.requires_grad
    assert torch.equal(evaluated, trained.detach())


def test_padded_vocab_forward_without_grad_matches_training_form():
    """A vocab that is not a multiple of the head's padding: the float32 head's logits are a strided slice; the
    no-grad forward (and its loss with targets) equals the out-of-place training form's."""
    from nanochat.gpt import VOCAB_PAD_MULTIPLE

    vocab = 3 * VOCAB_PAD_MULTIPLE + 5
    model = build_model(tiny_config(sequence_len=T, vocab_size=vocab, n_embd=64), seed=0).eval()
    ids = torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        evaluated, loss = model(ids), model(ids, targets=ids, loss_reduction="none")
    trained = model(ids)
    assert evaluated.is_contiguous() and evaluated.shape == (2, T, vocab)
    assert torch.equal(evaluated, trained.detach())
    assert torch.equal(loss, F.cross_entropy(trained.detach().view(-1, vocab), ids.view(-1), reduction="none"))
