"""Memory/routing analyses on tiny randomly-initialised models saved as run directories (fast, CPU)."""

import csv
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from nanochat.analysis import Domain, RoutingAccumulator, iter_captured, pad_rows, single_token_at, text_rows
from nanochat.routing_metrics import audit, membership_distribution

# Words that become ONE token (with and without their leading space) in the hand-built tokenizer below.
WORDS = ["bank", "Bank", "river", "money", "python", "the", "at", "on", "she", "her", "he", "a", "cell", "bug",
         "drive", "apple", "deposited", "salary", "grassy", "picnic", "had", "took", "out", "loan", "from", "They"]


def make_tokenizer(out_dir):
    """A deterministic byte-level BPE: every byte, plus prefix chains so that " word" and "word" of WORDS are
    single tokens (tiktoken merges the lowest-ranked pair, so the chain ' b', ' ba', ' ban', ' bank' works)."""
    from nanochat.tokenizer import Tokenizer

    ranks = {bytes([i]): i for i in range(256)}
    for w in WORDS:
        for text in (" " + w, w):
            b = text.encode()
            for n in range(2, len(b) + 1):
                ranks.setdefault(b[:n], len(ranks))
    tok = Tokenizer(ranks)
    tok.save(out_dir)
    return tok


def make_run(tmp_path, memory="mome", seed=0, family="nanochat", **options):
    """A run dir with one checkpoint of a tiny random model whose routers and gates are NOT at their zero init
    (so routing and gamma vary across tokens). ``family`` picks the backbone (nanochat.families)."""
    from nanochat.checkpoint import save_checkpoint
    from nanochat.families import FAMILIES, build_model

    tok_dir = tmp_path / "tok"
    tok = make_tokenizer(tok_dir)
    opts = {"mome": dict(slots=6, topk=2), "bigram": dict(factor=2)}.get(memory, {})
    opts.update(options)
    geometry = dict(vocab_size=tok.vocab_size, n_layer=4, n_embd=64, n_head=2, n_kv_head=2, memory=memory,
                    memory_options=opts, sequence_len=64)
    if family == "nanochat":
        cfg = tiny_config(**geometry)
    else:  # GQA with 4 query heads over the same 2 KV heads, so the memory layout matches the nanochat case
        cfg = FAMILIES[family].config_cls(**{**geometry, "n_head": 4}, head_dim=16, ffn_hidden=128)
    model = build_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "memory" in name or "c_proj" in name:  # un-zero the zero-inits: routers, gates, bigram table
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    run = tmp_path / f"run_{memory}"
    save_checkpoint(run, 1, model, {"tokenizer_dir": str(tok_dir)})
    return run, model, tok


def write_text(path, n=6):
    path.write_text("\n".join(["She deposited her salary at the bank. They had a picnic on the grassy river bank."] * n))
    return path


# -- analyze_memory -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("memory", ["mome", "ve", "bigram"])
def test_analyze_memory_outputs_and_gamma_equal_direct_computation(tmp_path, memory):
    from scripts import analyze_memory

    run, model, tok = make_run(tmp_path, memory)
    text = write_text(tmp_path / "notes.txt")
    out = tmp_path / "out"
    assert analyze_memory.main(["--run", str(run), "--corpus", f"file:{text}", "--out-dir", str(out),
                                "--batch-size", "2", "--no-progress"]) == 0
    res = json.loads((out / "memory_use.json").read_text())
    layers = res["layers"]
    assert layers == [1, 3]
    assert res["injection"] == {"mome": "value", "ve": "value", "bigram": "residual"}[memory]
    dom = res["domains"]["notes"]
    gamma, norm = torch.tensor(dom["gamma"]), torch.tensor(dom["inject_norm"])
    assert gamma.shape == norm.shape == (2, 2)  # layers x heads
    # direct computation with forward hooks on the gate modules (independent of the capture code path)
    rows = text_rows(tok, [text.read_text()], model.max_seq_len)
    ids, mask = pad_rows(rows, tok.bos_token_id)
    mask &= ids != tok.bos_token_id
    seen = {}
    hooks = [g.register_forward_hook(lambda m, i, o, li=li: seen.__setitem__(li, o.detach()))
             for li, g in enumerate(model.memory.gates)]
    model.eval()
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    direct = torch.stack([seen[li][mask].mean(0) for li in range(2)]).double()
    assert torch.allclose(gamma.double(), direct, atol=1e-5)
    assert dom["tokens"] == int(mask.sum())
    assert (norm > 0).all()
    with open(out / "memory_use.csv") as f:
        recs = list(csv.DictReader(f))
    assert len(recs) == 4 and {(int(r["layer"]), int(r["head"])) for r in recs} == {(1, 0), (1, 1), (3, 0), (3, 1)}
    assert (out / "memory_gamma.png").stat().st_size > 0 and (out / "memory_inject_norm.png").stat().st_size > 0


@pytest.mark.parametrize("family,memory,options", [("mobilellm", "mome", dict(router_input="value")),
                                                   ("qwen3", "ve", {})])
def test_analysis_tools_run_on_family_checkpoints(tmp_path, family, memory, options):
    from scripts import analyze_memory, analyze_routing

    run, model, tok = make_run(tmp_path, memory, family=family, **options)
    assert type(model).__name__ == {"mobilellm": "Llama", "qwen3": "Qwen3"}[family]
    text = write_text(tmp_path / "notes.txt")
    assert analyze_memory.main(["--run", str(run), "--corpus", f"file:{text}", "--out-dir", str(tmp_path / "m"),
                                "--no-progress"]) == 0
    dom = json.loads((tmp_path / "m" / "memory_use.json").read_text())["domains"]["notes"]
    assert torch.tensor(dom["gamma"]).shape == (2, 2)  # memory layers 1, 3 x the 2 KV heads
    if memory == "mome":
        assert analyze_routing.main(["--run", str(run), "--corpus", f"file:{text}", "--reference", f"file:{text}",
                                     "--min-count", "4", "--out-dir", str(tmp_path / "r"), "--no-progress"]) == 0
        audit = json.loads((tmp_path / "r" / "routing_audit.json").read_text())["domains"]["notes"]
        assert audit["total_cells"] == 2 * 2 * 6  # memory layers x KV heads x slots


def test_analyze_memory_errors_name_the_flag(tmp_path, capsys):
    from scripts import analyze_memory

    run, _, _ = make_run(tmp_path, "ve")
    assert analyze_memory.main(["--run", str(run), "--corpus", "file:/nope.txt"]) == 2
    assert "--corpus file:/nope.txt" in capsys.readouterr().err
    assert analyze_memory.main(["--run", str(run), "--corpus", "bogus"]) == 2
    assert "--corpus 'bogus'" in capsys.readouterr().err
    assert analyze_memory.main(["--run", str(tmp_path / "missing"), "--corpus", "val"]) == 2
    assert "--run" in capsys.readouterr().err


# -- routing audit -------------------------------------------------------------------------------------------
def test_streaming_audit_equals_routing_metrics_audit(tmp_path):
    run, model, tok = make_run(tmp_path, "mome")
    rows = text_rows(tok, [write_text(tmp_path / "t.txt", 12).read_text()], model.max_seq_len)
    block = model.memory
    S, M = len(block.layers) * block.H, block.M
    acc = RoutingAccumulator(S, M, model.config.vocab_size)
    all_topk, all_w, all_tok = [], [], []
    for ids, mask, cap in iter_captured(model, rows, 3, tok.bos_token_id, progress=False):
        acc.update(ids, mask, cap)
        all_topk.append(cap["slots"][mask].reshape(-1, S, 2))
        all_w.append(cap["weights"][mask].reshape(-1, S, 2))
        all_tok.append(ids[mask])
    topk, w, toks = torch.cat(all_topk), torch.cat(all_w), torch.cat(all_tok)
    assert not (toks == tok.bos_token_id).any()
    ref = membership_distribution(topk[:5], M)  # any reference distribution
    want = audit(topk, w, toks, M, min_count=8, reference_weight_dist=ref)
    got = acc.audit(min_count=8, reference_weight=ref)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_analyze_routing_audit_and_words(tmp_path):
    from scripts import analyze_routing

    run, model, tok = make_run(tmp_path, "mome")
    text, other = write_text(tmp_path / "a.txt"), tmp_path / "b.txt"
    other.write_text("money money python cell bug drive apple the river " * 20)
    out = tmp_path / "out"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("finance\tShe deposited her salary at the bank\nfinance\tHe took out a loan from the bank\n"
                       "river\tThey had a picnic on the grassy river bank\n"
                       "multi\tthe bankrupt banker\nnone\tno target here\n")
    assert analyze_routing.main(["--run", str(run), "--corpus", f"file:{text}", f"file:{other}", "--reference",
                                 f"file:{text}", "--min-count", "4", "--words", "bank", "--prompts", str(prompts),
                                 "--out-dir", str(out), "--no-progress"]) == 0
    res = json.loads((out / "routing_audit.json").read_text())
    assert res["domains"]["a"]["jsd_mean"] == pytest.approx(0.0, abs=1e-12)  # the reference itself
    assert res["domains"]["b"]["total_cells"] == 2 * 2 * 6
    md = (out / "routing_audit.md").read_text()
    assert "| a |" in md and "Mean/max JSD vs a" in md
    routes = json.loads((out / "semantic_routes.json").read_text())["routes"]
    assert [r["label"] for r in routes] == ["finance", "finance", "river"]
    for r in routes:  # one slot set (K distinct slots) per head per memory layer
        assert len(r["slots"]) == 2 and all(len(h) == 2 and len(set(h)) == 2 for lay in r["slots"] for h in lay)
    table = (out / "semantic_routes.md").read_text()
    assert table.count("| She deposited her salary at the bank | finance |") == 2  # one line per memory layer
    assert (out / "semantic_routes.png").stat().st_size > 0
    # the selected slots equal a direct forward at the target position
    ids = [tok.bos_token_id] + tok.encode("She deposited her salary at the bank")
    model.memory.capture = {}
    with torch.no_grad():
        model(torch.tensor([ids]))
    direct = model.memory.capture[1]["slots"][0, -1]  # (H, K) at the last token (" bank")
    model.memory.capture = None
    assert sorted(routes[0]["slots"][0][0]) == sorted(direct[0].tolist())


def test_single_token_locator(tmp_path):
    tok = make_tokenizer(tmp_path)
    text = "They had a picnic on the river bank"
    ids, i = single_token_at(tok, text, text.index("bank"), len(text))
    assert i is not None and tok.decode([ids[i]]) == " bank"
    ids, i = single_token_at(tok, "bank on it", 0, 4)
    assert tok.decode([ids[i]]) == "bank"
    text = "the bankrupt one"  # the whole word " bankrupt" is " bank" + "rupt": not one token
    assert single_token_at(tok, text, 4, 12)[1] is None
    text = "an elephant"  # not in the vocab: several tokens
    assert single_token_at(tok, text, 3, 11)[1] is None


def test_domain_rows_skip_bos_and_padding(tmp_path):
    run, model, tok = make_run(tmp_path, "ve")
    rows = [torch.tensor([tok.bos_token_id, 5, 6, 7]), torch.tensor([tok.bos_token_id, 8])]
    (ids, mask, cap), = list(iter_captured(model, rows, 4, tok.bos_token_id, progress=False))
    assert int(mask.sum()) == 4 and cap["gamma"].shape == (2, 4, 2, 2)
    assert Domain("x", rows).num_tokens == 6


# -- bench/latency.py ----------------------------------------------------------------------------------------
def test_latency_bench_runs_tiny(tmp_path, capsys):
    from conftest import load_bench

    bench = load_bench("latency")
    out = tmp_path / "lat.json"
    assert bench.main(["--widths", "64", "--head-dim", "32", "--mem-layers", "2", "--vocab-size", "512",
                       "--reps", "2", "--warmup", "1", "--context", "8", "--seq-len", "8", "--mode", "both",
                       "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["decode", "forward"]
    assert set(rows[0]["designs"]) == {"ve", "bigram", "mome", "mome-hidden"}
    assert "MoME (hidden-state injection)" in capsys.readouterr().out
    from nanochat.memory import MEMORY_BLOCKS

    assert "mome-hidden" not in MEMORY_BLOCKS  # registered only while the benchmark runs


def test_latency_bench_family_archs(tmp_path, capsys):
    from conftest import load_bench

    bench = load_bench("latency")
    out = tmp_path / "lat.json"
    assert bench.main(["--archs", "qwen3_0p6b", "--mem-layers", "2", "--vocab-size", "256", "--reps", "1",
                       "--warmup", "0", "--context", "4", "--seq-len", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["arch"], r["width"], r["n_head"]) for r in rows] == [("qwen3_0p6b", 1024, 16)]
    assert "qwen3_0p6b" in capsys.readouterr().out
    cfg = bench.make_config(bench.parse_args(["--archs", "qwen3_0p6b"]), 1024, 2, "mome", "qwen3_0p6b")
    assert (cfg.family, cfg.n_kv_head, cfg.head_dim, cfg.ffn_hidden, cfg.memory_layers) == ("qwen3", 8, 128, 3072, (0, 1))
    with bench.hidden_variant_registered():  # hidden-state injection on GQA: C/d groups of head_dim channels
        with torch.device("meta"):
            from nanochat.families import FAMILIES

            model = FAMILIES["mobilellm"].model_cls(
                bench.make_config(bench.parse_args([]), 960, 2, "mome-hidden", "mobilellm350"))
        assert (model.memory.H, model.memory.d) == (15, 64)
    with pytest.raises(SystemExit):
        bench.parse_args(["--archs", "nanochat,qwen3_0p6b"])


def test_hidden_injection_variant_adds_to_residual_not_values():
    from conftest import load_bench

    bench = load_bench("latency")
    with bench.hidden_variant_registered():
        cfg = tiny_config(memory="mome-hidden", memory_options=dict(slots=4, topk=2), n_embd=64)
        from nanochat.gpt import build_model

        model = build_model(cfg, seed=0)
    x = torch.randn(1, 5, 64)
    ctx = model.memory.prepare(torch.randint(512, (1, 5)), None)
    v = torch.randn(1, 5, 2, 32)
    assert torch.equal(model.memory.value(1, x, v, ctx), v)
    y = model.memory.residual(1, x, ctx)
    assert y.shape == x.shape and not torch.allclose(y, x)  # gamma = 1 at init, table non-zero


def test_core_domains_and_task_balanced_average(tmp_path, monkeypatch, capsys):
    """The core: domains follow the run's --bundle and --core-max-per-task by default, as base_eval's CORE does
    (nanochat.eval_bundle.run_core_inputs): here its config.json records --bundle subset --core-max-per-task 2."""
    from nanochat import analysis
    from nanochat.eval_bundle import SUBSET_DIR
    from scripts import analyze_memory

    run, _, _ = make_run(tmp_path, "ve")
    (run / "config.json").write_text(json.dumps({"args": {"bundle": "subset", "core_max_per_task": 2}}))
    built, real = [], analysis.core_domains
    monkeypatch.setattr(analysis, "core_domains", lambda tok, bundle, which, seq_len, cap, flag: built.append(
        (bundle, which, cap)) or real(tok, bundle, which, seq_len, cap, flag))
    out = tmp_path / "out"
    assert analyze_memory.main(["--run", str(run), "--corpus", "core:copa", "core:piqa", "--out-dir", str(out),
                                "--no-progress"]) == 0
    assert built == [(SUBSET_DIR, "copa", 2), (SUBSET_DIR, "piqa", 2)]
    assert capsys.readouterr().out.count("CORE bundle subset (the run's bundle, its config.json); examples per task "
                                         "2 (the run's --core-max-per-task, its config.json)\n") == 1
    dom = json.loads((out / "memory_use.json").read_text())["domains"]
    assert set(dom) == {"copa", "piqa", "CORE"} and dom["CORE"]["tasks"] == ["copa", "piqa"]
    want = (torch.tensor(dom["copa"]["gamma"]) + torch.tensor(dom["piqa"]["gamma"])) / 2  # every task weighs 1
    assert torch.allclose(torch.tensor(dom["CORE"]["gamma"]), want)
    # the JSON says which bundle and cap it read (the printed line alone was lost with the terminal)
    assert json.loads((out / "memory_use.json").read_text())["core"] == {
        "bundle": str(SUBSET_DIR), "bundle_source": "the run's bundle, its config.json", "max_per_task": 2,
        "max_per_task_source": "the run's --core-max-per-task, its config.json"}
    assert analyze_memory.main(["--run", str(run), "--corpus", "core:nope", "--bundle", "subset"]) == 2


def test_the_routing_audit_json_says_which_core_bundle_and_cap_it_read(tmp_path, capsys):
    from nanochat.eval_bundle import SUBSET_DIR
    from scripts import analyze_routing

    run, _, _ = make_run(tmp_path, "mome")
    out, text = tmp_path / "out", f"file:{write_text(tmp_path / 'a.txt')}"
    common = ["--run", str(run), "--reference", text, "--min-count", "1", "--out-dir", str(out), "--no-progress"]
    assert analyze_routing.main([*common, "--corpus", "core:copa", "--bundle", "subset", "--max-per-task", "2"]) == 0
    assert json.loads((out / "routing_audit.json").read_text())["core"] == {
        "bundle": str(SUBSET_DIR), "bundle_source": "--bundle", "max_per_task": 2, "max_per_task_source":
        "--max-per-task"}
    assert analyze_routing.main([*common, "--corpus", text]) == 0
    assert json.loads((out / "routing_audit.json").read_text())["core"] is None  # no core: domain, no bundle read


def test_analysis_flags_are_checked_and_errors_name_them(tmp_path, capsys):
    from scripts import analyze_memory, analyze_routing, wic_probe

    run, model, tok = make_run(tmp_path, "mome")
    text = write_text(tmp_path / "a.txt")
    base = ["--run", str(run), "--no-progress", "--out-dir", str(tmp_path / "o")]
    # a head out of range was an IndexError traceback; a negative head plotted "h-1"
    for sites in ("1:7", "1:-1"):
        assert analyze_routing.main([*base, "--words", "bank", "--sites", sites]) == 2
        assert f"--sites: head {sites.split(':')[1]} is not a KV head (0..1)" in capsys.readouterr().err
    # the default --reference val failed as "--corpus val" on a run without a data directory
    assert analyze_routing.main([*base, "--corpus", f"file:{text}"]) == 2  # the run's meta names no data dir
    assert "--reference val" in capsys.readouterr().err
    for main, extra in ((analyze_routing.main, ["--corpus", f"file:{text}"]),
                        (analyze_memory.main, ["--corpus", f"file:{text}"]),
                        (wic_probe.main, ["--wic", str(text)])):
        for flag, value in (("--batch-size", "0"), ("--device", "gpu")):
            with pytest.raises(SystemExit) as e:
                main([*base, *extra, flag, value])
            assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        analyze_routing.main([*base, "--corpus", f"file:{text}", "--min-count", "0"])
    assert "argument --min-count: must be an integer >= 1" in capsys.readouterr().err


def test_capture_error_names_what_is_missing_for_designs_with_memory_layers(monkeypatch):
    """The designs the analyses can capture come from the registry (a block that sets ``capture``), so a newly
    registered one is listed, and the error says what a block must provide (docs/extending.md)."""
    from nanochat.analysis import memory_block
    from nanochat.families import build_model
    from nanochat.memory import MEMORY_BLOCKS
    from nanochat.memory.base import MemoryBlock

    class CapturingProbe(MemoryBlock):
        uses_layers = True

        def __init__(self, config):
            super().__init__(config)
            self.capture = None

    monkeypatch.setitem(MEMORY_BLOCKS, "probe", CapturingProbe)
    model = build_model(tiny_config(memory="jtok"), seed=0)
    capturable = "ve, bigram, mome, engram, move_input, probe"
    with pytest.raises(ValueError) as e:
        memory_block(model)
    assert str(e.value) == (f"--memory jtok: the analyses cannot capture its memory layers (on this family they "
                            f"capture {capturable}): a design opts in by setting self.capture = None in its block's "
                            "__init__ and calling nanochat.memory.ve.record(self.capture, layer, gamma=..., "
                            "inject_norm=...) in its forward (docs/extending.md)")
    with pytest.raises(ValueError, match=f"^--memory base has no memory layers to analyse \\(needs {capturable}\\)$"):
        memory_block(build_model(tiny_config(), seed=0))
    assert memory_block(build_model(tiny_config(memory="probe"), seed=0)).layers == (1,)


def test_corpus_flag_accumulates_when_repeated():
    """`--corpus val --corpus core:all` (a repeated flag) analyses both corpora, like `--corpus val core:all`;
    argparse's plain nargs would keep only the last one, silently."""
    from scripts import analyze_memory, analyze_routing

    for argv, want in ((["--corpus", "val", "--corpus", "core:all"], ["val", "core:all"]),
                       (["--corpus", "val", "core:all"], ["val", "core:all"]),
                       (["--corpus", "file:x.txt"], ["file:x.txt"])):
        assert analyze_memory.parse_args(["--run", "r", *argv]).corpus == want
        assert analyze_routing.parse_args(["--run", "r", *argv]).corpus == want
    assert analyze_memory.parse_args(["--run", "r"]).corpus == ["val"]


def test_analysis_json_is_strict_json(tmp_path):
    """wic.json and the other outputs: NaN (a threshold cell with an empty class) becomes null, not bare NaN, which
    strict JSON readers refuse; tensors become lists."""
    import json

    from nanochat.analysis import write_json

    path = tmp_path / "out.json"
    write_json(path, {"a": float("nan"), "b": [1.5, float("inf")], "t": torch.tensor([[1.0, float("nan")]])})

    def refuse(name):
        raise ValueError(name)

    assert json.loads(path.read_text(), parse_constant=refuse) == {"a": None, "b": [1.5, None], "t": [[1.0, None]]}


def test_an_empty_corpus_file_is_an_error_not_statistics_of_zero_tokens(tmp_path, capsys):
    """An empty file became one [BOS] row with no analysed position: analyze_memory printed gamma 0.000 and the
    routing audit 1.000 effective slots over 0 tokens, exit 0 (and an empty --reference gave a JSD of nan)."""
    from scripts import analyze_memory, analyze_routing

    run, _, _ = make_run(tmp_path, "mome")
    empty, text = tmp_path / "empty.txt", write_text(tmp_path / "a.txt")
    empty.write_text("")
    out = tmp_path / "o"
    base = ["--run", str(run), "--no-progress", "--out-dir", str(out)]
    assert analyze_memory.main([*base, "--corpus", f"file:{empty}"]) == 2
    assert f"--corpus file:{empty}: domain 'empty' has no token to analyse" in capsys.readouterr().err
    assert analyze_routing.main([*base, "--corpus", f"file:{empty}", "--reference", ""]) == 2
    assert f"--corpus file:{empty}: domain 'empty' has no token to analyse" in capsys.readouterr().err
    assert analyze_routing.main([*base, "--corpus", f"file:{text}", "--reference", f"file:{empty}"]) == 2
    assert f"--reference file:{empty}: domain 'empty' has no token to analyse" in capsys.readouterr().err
    assert not out.exists()


def test_gate_means_over_no_position_are_nan_not_zero():
    from nanochat.analysis import GateAccumulator

    r = GateAccumulator(2, 3).result()
    assert r["tokens"] == 0 and all(v != v for row in r["gamma"] + r["inject_norm"] for v in row)


@pytest.mark.parametrize("flag,value", [("--max-tokens", "-5"), ("--max-per-task", "-7"), ("--step", "-1")])
def test_negative_counts_stop_at_the_flag(tmp_path, capsys, flag, value):
    """--max-tokens -5 read as "a domain produced no token rows", --max-per-task -7 as "all", --step -1 as a
    missing checkpoint step_-00001."""
    from scripts import analyze_memory, analyze_routing

    for main in (analyze_memory.main, analyze_routing.main):
        with pytest.raises(SystemExit) as e:
            main(["--run", str(tmp_path), "--corpus", "val", flag, value])
        assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["analyze_memory", "analyze_routing"])
def test_an_output_that_cannot_be_written_is_one_error_and_no_torn_file(tmp_path, capsys, monkeypatch, tool):
    """A full disk under --out-dir was an OSError traceback (exit 1), with a torn .csv left behind."""
    import builtins
    import errno
    import importlib

    module = importlib.import_module(f"scripts.{tool}")
    run, _, _ = make_run(tmp_path, "mome")
    text, out = write_text(tmp_path / "a.txt"), tmp_path / "o"
    real_open = builtins.open

    def full_open(path, mode="r", *a, **k):
        if "w" in mode and str(out) in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", full_open)
    argv = ["--run", str(run), "--no-progress", "--out-dir", str(out), "--corpus", f"file:{text}"]
    assert module.main(argv + (["--reference", ""] if tool == "analyze_routing" else [])) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write the outputs under --out-dir {out}") and "No space left" in err
    assert not [p for p in out.rglob("*") if p.is_file()]


@pytest.mark.parametrize("tool", ["analyze_memory", "analyze_routing", "wic_probe"])
def test_a_device_torch_cannot_see_stops_at_the_flag(tmp_path, capsys, tool):
    """--device cuda:99 (or cuda on a machine without one) was a torch traceback after the checkpoint was loaded."""
    import importlib

    main = importlib.import_module(f"scripts.{tool}").main
    extra = ["--wic", str(tmp_path / "w.tsv")] if tool == "wic_probe" else ["--corpus", "val"]
    with pytest.raises(SystemExit) as e:
        main(["--run", str(tmp_path), *extra, "--device", "cuda:99"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --device: cuda:99: no such device here" in err


@pytest.mark.parametrize("tool, busy", [("analyze_memory", "memory_use"), ("analyze_routing", "slot_audit")])
def test_ctrl_c_midway_is_one_line_exit_130_and_no_output(tmp_path, capsys, monkeypatch, tool, busy):
    """Ctrl-C during the forward passes was a KeyboardInterrupt traceback (exit 1 from the interpreter)."""
    import importlib

    module = importlib.import_module(f"scripts.{tool}")
    run, _, _ = make_run(tmp_path, "mome")
    text, out = write_text(tmp_path / "a.txt"), tmp_path / "o"

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(module, busy, interrupted)
    argv = ["--run", str(run), "--no-progress", "--out-dir", str(out), "--corpus", f"file:{text}"]
    assert module.main(argv + (["--reference", ""] if tool == "analyze_routing" else [])) == 130
    assert capsys.readouterr().err == f"interrupted: no partial output under --out-dir {out}\n"
    assert not [p for p in out.rglob("*") if p.is_file()] if out.exists() else True


@pytest.mark.parametrize("tool", ["analyze_memory", "analyze_routing"])
def test_a_failed_bundle_download_is_one_error_line(tmp_path, capsys, offline_bundle, tool):
    """Offline, --corpus core:all without --bundle ended in a DownloadError traceback (exit 1)."""
    import importlib

    run, _, _ = make_run(tmp_path, "mome")
    main = importlib.import_module(f"scripts.{tool}").main
    assert main(["--run", str(run), "--no-progress", "--out-dir", str(tmp_path / "o"), "--corpus", "core:all"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --corpus core:all: ") and "--bundle subset" in err and "Traceback" not in err


@pytest.mark.parametrize("names", [
    ("wic_sites.csv", "wic_routing.png", "wic_gate.png", "wic_gate_mean.png", "wic.json"),  # scripts/wic_probe.py
    ("routing_audit.json", "routing_audit.md", "routing_audit.csv"),  # scripts/analyze_routing.py --corpus
    ("semantic_routes.json", "semantic_routes.md", "semantic_routes.csv", "semantic_routes.png"),  # --words
    ("memory_use.json", "memory_use.csv", "memory_gamma.png", "memory_inject_norm.png"),  # scripts/analyze_memory.py
])
def test_the_json_of_a_staged_set_is_moved_in_last(tmp_path, monkeypatch, names):
    """The .json (run, step, settings and every number) says a set is complete: a kill between two renames must
    not leave a new one beside the older files of its set (in name order wic.json came before the maps)."""
    from pathlib import Path

    from nanochat.analysis import staged_outputs

    out, moved, real_replace = tmp_path / "out", [], Path.replace

    def replace(self, target):
        moved.append(Path(target).name)
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    with staged_outputs(out) as stage:
        for name in names:
            (stage / name).write_text(name)
    assert moved[-1].endswith(".json") and sorted(moved) == sorted(names)
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # the stage folder is gone


@pytest.mark.parametrize("tool, where", [("analyze_memory", "forward"), ("analyze_memory", "accumulator"),
                                         ("analyze_routing", "forward"), ("analyze_routing", "accumulator"),
                                         ("wic_probe", "forward")])
def test_ctrl_c_with_progress_bars_leaves_the_interrupt_line_on_its_own(tmp_path, capsys, monkeypatch, tool, where):
    """base_eval's line was glued to its task's bar ('0/6 [00:00<?, ?it/s]base_eval: interrupted'): that bar was
    advanced by hand and held by a name, so it stayed open while the handler printed. These bars are iterated, and
    tqdm closes a bar in a finally when its iteration ends, which unwinding does: Ctrl-C in the forward (inside
    iter_captured's loop) or in its consumer (outside it) clears the line before the message. A consumer that kept
    iter_captured's generator in a variable would keep its bar open; this test then fails (checked)."""
    import importlib

    from tqdm import tqdm

    import nanochat.analysis as analysis

    module = importlib.import_module(f"scripts.{tool}")
    run, _, _ = make_run(tmp_path, "mome")
    calls = []

    def second_call_interrupts(real):
        def wrapped(*a, **k):
            calls.append(1)
            if len(calls) == 2:  # the bar has been drawn; a signal arrives mid-loop
                raise KeyboardInterrupt
            return real(*a, **k)
        return wrapped
    if where == "forward":
        monkeypatch.setattr(module if tool == "wic_probe" else analysis, "run_captured",
                            second_call_interrupts(analysis.run_captured))
    else:
        acc = analysis.GateAccumulator if tool == "analyze_memory" else analysis.RoutingAccumulator
        monkeypatch.setattr(acc, "update", second_call_interrupts(acc.update))
    out, text = tmp_path / "o", write_text(tmp_path / "notes.txt")
    extra = {"wic_probe": ["--wic", str(Path(__file__).parent / "fixtures" / "wic_synthetic.tsv")],
             "analyze_memory": ["--corpus", f"file:{text}"],
             "analyze_routing": ["--corpus", f"file:{text}", "--reference", ""]}[tool]
    assert module.main(["--run", str(run), "--batch-size", "1", "--out-dir", str(out), *extra]) == 130
    *drawn, cleared, message = capsys.readouterr().err.split("\r")
    assert "%|" in drawn[-1] and cleared.strip() == "" and message.startswith("interrupted"), (drawn, message)
    assert not [bar for bar in tqdm._instances if not bar.disable]


@pytest.mark.parametrize("tool", ["analyze_memory", "analyze_routing", "wic_probe"])
def test_a_synthetic_data_run_is_refused_naming_the_flag_as_base_eval_does(tmp_path, capsys, tool):
    """load_run said "no tokenizer in ..." for a run trained with --synthetic-data (it records none); the analyses
    now name the flag, in base_eval's wording (nanochat.checkpoint.check_not_synthetic), before loading the weights."""
    import importlib

    from nanochat.checkpoint import save_checkpoint
    from nanochat.families import build_model

    run = tmp_path / "syn"
    save_checkpoint(run, 3, build_model(tiny_config()), {"config": {"args": {"synthetic_data": True}}})
    extra = ["--wic", str(Path(__file__).parent / "fixtures" / "wic_synthetic.tsv")] if tool == "wic_probe" \
        else ["--corpus", "val"]
    assert importlib.import_module(f"scripts.{tool}").main(["--run", str(run), *extra, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --run {run} step 3 was trained with --synthetic-data (random token ids of no "
                          "tokenizer): this tool reads text in the run's own tokenizer, so analyze a run trained on "
                          "real data; this run's val bpb on the synthetic stream is in its summary.json") \
        and err.count("\n") == 1, err
