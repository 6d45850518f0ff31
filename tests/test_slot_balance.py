"""The final evaluation's MoME slot balance (nanochat/slot_balance.py): per (layer, row, head) MaxVio and absolute
load deviation over visited sites, against a per-token Python loop over the paper's routing equations."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from _slot_balance_worker import balance, eval_rows, tiny_mome, window
from conftest import tiny_config
from mome_fixtures import mome_config, naive_row, random_block
from nanochat.dataloader import iter_eval_batches
from nanochat.gpt import build_model
from nanochat.slot_balance import slot_balance, with_slot_balance


@torch.no_grad()
def naive_counts(cfg, block, layer, tokens, xn, bias=True) -> dict:
    """{(row, head): [selections of each slot]} of one memory layer: hidden-input router logits, plus the
    selection bias on sigmoid scores with --mome-balance bias, top-K by a full sort, in Python."""
    o, pos = block.opts, block.layer_pos[layer]
    M, K, H = o.slots, o.topk, cfg.n_kv_head
    router = block.routers[pos]
    counts = {}
    for b in range(tokens.size(0)):
        for t in range(tokens.size(1)):
            n = naive_row(cfg, block, tokens, b, t)
            for i in range(H):
                logits = router.weight.view(H, M, -1)[i] @ xn[b, t] + router.bias.view(H, M)[i]
                scores = [float(s) for s in torch.sigmoid(logits)]
                if o.balance == "bias" and bias:
                    scores = [s + float(block.router_bias[pos, n, i, a]) for a, s in enumerate(scores)]
                site = counts.setdefault((n, i), [0] * M)
                for a in sorted(range(M), key=lambda a: -scores[a])[:K]:
                    site[a] += 1
    return counts


def naive_balance(per_layer: list[dict]) -> dict:
    """The authors' definitions, site by site: mean over visited sites, then over layers."""
    maxvio, dev = [], []
    for counts in per_layer:
        vs, ds = [], []
        for c in counts.values():
            total, M = sum(c), len(c)
            mean = total / M
            vs.append((max(c) - mean) / mean)
            ds.append(max(abs(x / total - 1 / M) for x in c))
        maxvio.append(sum(vs) / len(vs))
        dev.append(sum(ds) / len(ds))
    return {"maxvio": sum(maxvio) / len(maxvio), "abs_load_dev": sum(dev) / len(dev)}


@pytest.mark.parametrize("index,extra", [("token", {}), ("bigram", {}), ("token", {"balance": "bias"})])
def test_collected_balance_equals_the_per_token_loop(tmp_path, index, extra):
    cfg = replace(mome_config(tmp_path, 4, 2, index, **extra), memory_layers=(0, 1))
    block = random_block(cfg).double().eval()
    if extra:  # a selection bias large enough to change some choices: the counts must follow it
        with torch.no_grad():
            block.router_bias.copy_(torch.randn(block.router_bias.shape, generator=torch.Generator().manual_seed(4)))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 12, (3, 16), generator=g)  # few distinct tokens: rows are revisited
    xn = {layer: torch.randn(3, 16, cfg.n_embd, generator=g, dtype=torch.float64) for layer in block.layers}
    v = torch.randn(3, 16, cfg.n_kv_head, cfg.head_dim, generator=g, dtype=torch.float64)

    def forward():
        ctx = block.prepare(tokens, None)
        return [block.value(layer, xn[layer], v, ctx) for layer in block.layers]

    _, got = with_slot_balance(SimpleNamespace(memory=block), forward)
    want = naive_balance([naive_counts(cfg, block, layer, tokens, xn[layer]) for layer in block.layers])
    assert got == pytest.approx(want, rel=1e-12) and want["maxvio"] > 0
    if extra:  # the test can tell: the bias changed the counts
        assert want != naive_balance([naive_counts(cfg, block, layer, tokens, xn[layer], bias=False)
                                      for layer in block.layers])
    assert block.eval_loads is None  # counting stopped, the counters freed


def test_unvisited_rows_do_not_count_and_layers_average_equally():
    loads = torch.tensor([[[[2, 0, 0, 0]], [[1, 1, 1, 1]], [[0, 0, 0, 0]]],  # layer 0: MaxVio 3 and 0, dev .75 and 0
                          [[[0, 0, 0, 0]], [[0, 0, 0, 0]], [[3, 1, 0, 0]]]],  # layer 1: MaxVio 2, dev .5
                         dtype=torch.int32)  # (L=2, N=3, H=1, M=4)
    # per layer over its visited sites (1.5, .375 and 2, .5), then over the layers: not over all three sites
    assert slot_balance(loads) == pytest.approx({"maxvio": 1.75, "abs_load_dev": 0.4375}, rel=1e-15)
    assert slot_balance(torch.zeros(2, 3, 1, 4, dtype=torch.int32)) == {}


def test_collecting_leaves_the_forward_bit_identical_and_full_routing_is_balanced():
    model = tiny_mome()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(idx)
        counted, balance = with_slot_balance(model, lambda: model(idx))
    assert torch.equal(plain, counted) and balance["maxvio"] > 0
    full = tiny_mome(M=3, K=3)
    with torch.no_grad():  # K == M reads every slot: balanced by construction, reported as 0
        assert with_slot_balance(full, lambda: full(idx))[1] == {"maxvio": 0.0, "abs_load_dev": 0.0}
        assert with_slot_balance(full, lambda: None)[1] == {}  # no forward, no visited site
        base = build_model(tiny_config(vocab_size=64, n_embd=64, n_head=2, n_kv_head=2, sequence_len=16), seed=0)
        assert with_slot_balance(base, lambda: base(idx))[1] == {}  # no MoME routing: no keys


def test_two_ranks_report_the_balance_of_all_rows(gloo_checks):
    """Each gloo rank scores its share of the rows; both report what one process gets over all of them (the
    counts are summed over the ranks before the metric), not the balance of their own share. The same for the
    training window of --mome-maxvio-window (the ranks' forwards make one optimizer step). The ranks are
    tests/_slot_balance_worker.py's in the session's shared 2-rank launch (conftest.gloo_checks)."""
    rows = eval_rows()
    whole = balance(rows), window(rows)
    assert len(whole[1]) == 3
    for rank in range(2):
        assert torch.load(gloo_checks / f"slot_balance.rank{rank}.pt") == whole
        assert balance(rows[rank::2]) != whole[0] and window(rows[rank::2]) != whole[1]  # the sum matters


def test_final_eval_and_base_eval_report_the_balance_of_each_split(tmp_path, capsys, embedded_data_dir,
                                                                    tiny_tokenizer_dir):
    """A tiny MoME run writes {split}_mome_maxvio / _abs_load_dev into summary.json and the final metrics record
    and prints them; base_eval of its checkpoint (same rows, batch and dtype) writes the same numbers to bpb.json."""
    from scripts import base_eval, base_train

    run = tmp_path / "run"
    common = ["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir)]
    assert base_train.main([*common, "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len",
                            "32", "--device-batch-size", "4", "--total-batch-size", "128", "--eval-tokens", "512",
                            "--eval-every", "-1", "--no-final-core", "--num-iterations", "2", "--memory", "mome",
                            "--mome-slots", "4", "--run-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    printed = capsys.readouterr().out
    for split in ("val", "train"):
        for key in (f"{split}_mome_maxvio", f"{split}_mome_abs_load_dev"):
            assert summary[key] > 0 and final[key] == summary[key], key
        assert f"final {split} MoME slot MaxVio {summary[f'{split}_mome_maxvio']:.6f}" in printed
        assert f"| {split} MoME slot MaxVio / abs. load deviation | {summary[f'{split}_mome_maxvio']:.4f} / " \
            in (run / "report.md").read_text()
    assert base_eval.main(["--run", str(run), "--eval", "bpb", "--eval-tokens", "512", "--device-batch-size", "4",
                           "--device-type", "cpu"]) == 0
    bpb = json.loads(next((run / "eval").glob("step_*/bpb.json")).read_text())
    for split in ("val", "train"):
        assert bpb["splits"][split] == summary[f"{split}_bpb"]
        assert bpb["mome_slot_balance"][split] == {"maxvio": summary[f"{split}_mome_maxvio"],
                                                   "abs_load_dev": summary[f"{split}_mome_abs_load_dev"]}


@pytest.mark.slow
def test_a_compiled_model_counts_like_the_eager_one():
    """The trainer's final eval and base_eval collect with the uncompiled model; a compiled one recompiles once
    with the counting traced (the guard on ``eval_loads is None``) and gets the same counts and outputs (40 s on 2 cores)."""
    rows = eval_rows()
    model = tiny_mome()
    compiled = torch.compile(model, dynamic=False)
    with torch.no_grad():
        plain = [compiled(x) for x, _ in iter_eval_batches(rows, 2)]
        counted, got = with_slot_balance(compiled, lambda: [compiled(x) for x, _ in iter_eval_batches(rows, 2)])
    assert got == balance(rows) and all(torch.equal(a, b) for a, b in zip(plain, counted))
