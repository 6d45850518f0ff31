"""bench/step.py at toy sizes: the sections run, the designs really are compared at equal table memory, and the
layer harness is the model's own memory layer. No timing assertions (timings are the benchmark's output)."""

import json

import pytest
import torch

from conftest import load_bench
from nanochat.gpt import norm
from nanochat.memory import mome_mix as mix_paths

CPU = ["--device", "cpu"]  # train_step's default is cuda, refused at parsing where torch sees no GPU: these tests
# parse its other flags


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setattr(mix_paths, "MIX", mix_paths.MIX)  # the benchmark flips this module switch per case
    return load_bench("step")


def test_step_bench_sections_run_at_equal_table_memory(bench, tmp_path, capsys, monkeypatch):
    # a quarter of the d12 width (6 heads of 32): Polar Express on 768-wide Muon matrices was ~15 s of 2 cores
    monkeypatch.setattr(bench, "LAYER", dict(n_embd=192, n_head=6, n_kv_head=6))
    out = tmp_path / "step.json"
    bench.main(["--sections", "layer,hook,mscale", "--vocab-size", "256", "--tokens", "32", "--reps", "1",
                "--warmup", "0", "--out", str(out)])
    result = json.loads(out.read_text())
    labels = ["Base", "VE", "Bigram", "MoME A2/6 token", "MoME A2/12 c2 grouped", "MoME A2/6 bigram-idx",
              "MoME A2/6 token, plain mix", "MoME A2/6 token, bag mix", "MoME A2/6 token, row mix",
              "MoME A2/6 bigram-idx, plain mix", "MoME A2/6 bigram-idx, bag mix"]
    for kind in ("layer", "hook"):
        rows = result[kind]
        assert list(rows) == labels
        assert rows["Base"]["table_params"] == 0
        # per memory layer V x H*d entries for every memory design (V = 256, H*d = 192)
        assert {rows[lbl]["table_params"] for lbl in labels[1:]} == {256 * 192}
        for lbl in labels:
            want = rows[lbl]["step"]["median"] / rows["VE"]["step"]["median"]
            assert rows[lbl]["ratio_to_VE"]["step"] == pytest.approx(want)
            assert rows[lbl]["fwd_bwd"]["n"] == 1
        assert rows["VE"]["ratio_to_VE"] == {c: 1.0 for c in ("forward", "backward", "optimizer", "fwd_bwd", "step")}
    assert sorted(result["mscale"], key=int) == ["6", "12", "24", "48"]
    printed = capsys.readouterr().out
    assert "one d12-shaped transformer layer with memory" in printed and "memory hook + c_v only" in printed


def test_step_bench_family_section(bench, tmp_path, capsys, monkeypatch):
    # 3 layers, each a memory layer (the section's 6 have memory on 1, 3, 5): the same 3 tables per design, half
    # the layers to step
    small = dict(n_layer=3, n_embd=96, n_head=6, n_kv_head=3, ffn_hidden=128, memory_layers=(0, 1, 2))
    monkeypatch.setattr(bench, "FAMILY_FULL", {"mobilellm": dict(small, head_dim=64), "qwen3": dict(small, head_dim=96)})
    out = tmp_path / "step.json"
    bench.main(["--sections", "family", "--vocab-size", "256", "--full-tokens", "32", "--reps", "1", "--warmup", "0",
                "--out", str(out)])
    result = json.loads(out.read_text())
    for fam, d in (("mobilellm", 64), ("qwen3", 96)):
        rows = result[f"family_{fam}"]
        assert list(rows) == ["Base", "STEM", "VE", "MoME A1/3", "MoME A2/6"]
        F = bench.FAMILY_FULL[fam]["ffn_hidden"]
        # 3 memory layers: STEM V x F, VE V x H_kv*d = MoME A1/3 V x 3 x d, A2/6 twice that
        assert [rows[k]["table_params"] for k in rows] == [0, 3 * 256 * F, 3 * 256 * 3 * d, 3 * 256 * 3 * d,
                                                            3 * 256 * 6 * d]
        assert rows["Base"]["ratio_to_Base"]["step"] == 1.0
    printed = capsys.readouterr().out  # the headings name the models built, not the section's default size
    assert "### small qwen3 model (depth 3, C=96, 6/3 heads), 32 tokens" in printed and "C=384" not in printed


def test_step_bench_rejects_unknown_section(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--sections", "layer,speed"])
    assert "--sections: unknown ['speed']" in capsys.readouterr().err


def test_layer_harness_is_the_models_memory_layer(bench):
    """The harness runs the model's Block with the memory hooks exactly as GPT.forward runs a memory layer."""
    from nanochat.gpt import GPTConfig, build_model

    cfg = GPTConfig(n_layer=1, vocab_size=128, n_embd=64, n_head=2, n_kv_head=2, sequence_len=8, memory="mome",
                    memory_layers=(0,), memory_options={"slots": 4, "topk": 2})
    model = build_model(cfg, seed=0)
    torch.manual_seed(1)
    for p in [*model.memory.routers.parameters(), *model.blocks[0].attn.c_proj.parameters()]:
        p.data.normal_(std=0.1)  # non-zero: the top-K depends on the hidden state and the values reach the output
    harness = bench.LayerHarness(cfg)
    harness.load_state_dict({"block." + k: v for k, v in model.blocks[0].state_dict().items()}
                            | {"memory." + k: v for k, v in model.memory.state_dict().items()})
    idx = torch.randint(0, 128, (2, 8))
    x0 = norm(model.wte(idx))
    x = model.resid_lambdas[0] * x0 + model.x0_lambdas[0] * x0  # GPT.forward's input mix of layer 0
    cos_sin = model.rope_cos[:, :8], model.rope_sin[:, :8]
    want = model.blocks[0](x, cos_sin, model.memory, model.memory.prepare(idx, None), None)
    (got,) = harness(idx, x)
    assert torch.allclose(got, want, atol=1e-6)
    no_memory = bench.build_memory(GPTConfig(n_layer=1, vocab_size=128, n_embd=64, n_head=2, n_kv_head=2))
    assert not torch.allclose(got, model.blocks[0](x, cos_sin, no_memory, None, None), atol=1e-4)


def test_step_bench_profile_prints_op_table(bench, capsys):
    bench.main(["--profile", "MoME A2/6 token", "--sections", "hook", "--vocab-size", "256", "--tokens", "32",
                "--reps", "1", "--warmup", "1"])
    out = capsys.readouterr().out
    assert "MoME A2/6 token (hook harness), 1 steps profiled" in out and "Self CPU" in out and "aten::" in out
    with pytest.raises(SystemExit, match="not a design"):
        bench.main(["--profile", "MoME", "--vocab-size", "256"])


def test_train_step_bench_runs_each_design_in_its_own_process(tmp_path, capsys):
    bench = load_bench("train_step")
    out = tmp_path / "ts.json"
    bench.main(["--device", "cpu", "--designs", "ve,mome", "--depth", "1", "--seq-len", "16", "--vocab-size", "256",
                "--device-batch-size", "2", "--grad-accum", "2", "--steps", "2", "--warmup", "1", "--mix", "auto,row",
                "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"ve", "mome@auto", "mome@row"} and not any("error" in r for r in rows.values())
    assert rows["mome@row"]["mix"] == "row" and rows["mome@auto"]["mix"] == "auto" and rows["ve"]["mix"] == "auto"
    assert rows["mome@auto"]["mome_kernels"] == "torch" and "run on cuda only" in rows["mome@auto"]["mome_kernels_reason"]
    rows["mome"] = rows["mome@row"]
    for r in rows.values():
        assert r["tokens_per_step"] == 2 * 16 * 2 and r["tok_per_sec"] > 0 and r["step_ms_min"] <= r["step_ms"]
    # depth 1: one head of 128, one memory layer; VE is V x H*d, MoME A2/6 is V x 6 x d
    assert rows["ve"]["params_memory"] == 256 * 128 and rows["mome"]["params_memory"] == 256 * 6 * 128
    table = capsys.readouterr().out
    assert "| VE |" in table and "| MoME A2/6 token |" in table and "| MoME A2/6 token (row mix) |" in table
    with pytest.raises(SystemExit):
        bench.parse_args([*CPU, "--mix", "auto,fused"])


def test_train_step_bench_kernels_are_base_trains_flag_recorded_and_labelled():
    """--mome-kernels is base_train's flag (its choices, default auto); the older torch row sum (--row-sum reduce,
    bench only) goes with the torch kernels alone. The resolved kernels are in the JSON row, and in the MoME label
    when asked for."""
    bench = load_bench("train_step")
    assert bench.parse_args(CPU).mome_kernels == "auto" and bench.parse_args(CPU).row_sum == "unrolled"
    for name in mix_paths.MOME_KERNELS:
        assert bench.parse_args([*CPU, "--mome-kernels", name]).mome_kernels == name
    assert bench.parse_args([*CPU, "--mome-kernels", "torch", "--row-sum", "reduce"]).row_sum == "reduce"
    for bad in (["--mome-kernels", "triton"], ["--row-sum", "reduce"], ["--mome-kernels", "row", "--row-sum", "reduce"],
                ["--fuse-inject"], ["--row-sum", "triton"]):
        with pytest.raises(SystemExit):
            bench.parse_args([*CPU, *bad])
    row = {"label": "MoME A2/6 token", "step_ms": 10.0, "step_ms_min": 9.0, "step_ms_max": 11.0, "tok_per_sec": 1.0,
           "mfu": None, "peak_mem_gb": None, "mix": "auto", "topk": "auto", "row_sum": "unrolled",
           "mome_kernels": "fused", "mome_kernels_requested": "auto"}
    assert "| MoME A2/6 token |" in bench.table({"mome": row})
    asked = {**row, "mome_kernels": "row", "mome_kernels_requested": "row"}
    assert "| MoME A2/6 token (row kernels) |" in bench.table({"mome": asked})
    reduce = {**row, "mome_kernels": "torch", "mome_kernels_requested": "torch", "row_sum": "reduce"}
    assert "| MoME A2/6 token (torch kernels, reduce row sum) |" in bench.table({"mome": reduce})


def test_train_step_bench_old_row_sum_unrolled_is_not_silently_the_fused_kernels():
    """Before --mome-kernels, --row-sum unrolled meant "never the kernels" (LOG: now --mome-kernels torch). It was
    still accepted alone and then ran --mome-kernels auto (fused on CUDA): an old command measured the kernels it
    asked to leave out. The other old flags (--row-sum triton, --[no-]fuse-inject) are refused; so is this one."""
    bench = load_bench("train_step")
    with pytest.raises(SystemExit):
        bench.parse_args([*CPU, "--row-sum", "unrolled"])
    assert bench.parse_args([*CPU, "--mome-kernels", "torch", "--row-sum", "unrolled"]).row_sum == "unrolled"


@pytest.mark.parametrize("flags, resolved, want", [
    (["--mome-kernels", "row"], ("row", ""), ("triton", False)),
    (["--mome-kernels", "torch", "--row-sum", "reduce"], ("torch", ""), ("reduce", True)),
    ([], ("torch", "why"), ("unrolled", True))])
def test_train_step_bench_installs_the_resolved_kernels(flags, resolved, want, monkeypatch, kernel_globals):
    """A design process resolves --mome-kernels as base_train does (mome_triton.resolve_kernels: stood in for here,
    as on a GPU) and installs it with mome_mix.set_kernels; the bench-only row sum through mome_mix.set_path."""
    from nanochat.memory import mome_triton

    bench = load_bench("train_step")
    for name in ("MIX", "TOPK_BY_ARGMAX"):
        monkeypatch.setattr(mix_paths, name, getattr(mix_paths, name))
    asked = []
    monkeypatch.setattr(mome_triton, "resolve_kernels", lambda name, device: asked.append(name) or resolved)
    args = bench.parse_args(["--device", "cpu", "--one", "mome", "--depth", "1", "--seq-len", "16", "--vocab-size",
                             "256", "--device-batch-size", "2", "--grad-accum", "1", "--steps", "1", "--warmup", "0",
                             "--topk", "topk", *flags])
    row = bench.measure_one(args)
    assert asked == [args.mome_kernels] and (mix_paths.ROW_SUM, mix_paths.FUSE_INJECT) == want
    assert mix_paths.TOPK_BY_ARGMAX is False and mix_paths.MIX is None
    assert (row["mome_kernels"], row["mome_kernels_reason"], row["row_sum"]) == (*resolved, args.row_sum)


def test_train_step_bench_shared_table_kernel_flag_parses_and_needs_the_kernels():
    """--shared-table-kernel: off by default, on alone, or off/on/both; it needs the kernels (not --mome-kernels
    torch); a design process takes on or off. The label names the kernel path that ran."""
    bench = load_bench("train_step")
    assert bench.parse_args(CPU).shared_table_kernel == "off"
    assert bench.parse_args([*CPU, "--shared-table-kernel", "--mome-kernels", "row"]).shared_table_kernel == "on"
    assert bench.parse_args([*CPU, "--shared-table-kernel", "both"]).shared_table_kernel == "both"
    for bad in (["--shared-table-kernel", "--mome-kernels", "torch"], ["--shared-table-kernel", "yes"],
                ["--shared-table-kernel", "both", "--one", "mome-bigram"]):
        with pytest.raises(SystemExit):
            bench.parse_args([*CPU, *bad])
    off = bench.parse_args([*CPU, "--shared-table-kernel", "off", "--mome-kernels", "torch"])
    assert off.shared_table_kernel == "off"
    row = {"label": "MoME A2/6 bigram-idx n6", "step_ms": 10.0, "step_ms_min": 9.0, "step_ms_max": 11.0,
           "tok_per_sec": 1.0, "mfu": None, "peak_mem_gb": None, "mix": "row", "topk": "auto", "row_sum": "unrolled",
           "mome_kernels": "fused", "mome_kernels_requested": "auto", "shared_table_kernel": True,
           "kernel_path": "fused"}
    assert "| MoME A2/6 bigram-idx n6 (row mix, shared-table fused kernels) |" in bench.table({"mome-bigram": row})
    assert "shared-table" not in bench.table({"mome-bigram": {**row, "shared_table_kernel": False}})


def _bigram_process_args(bench, monkeypatch, *flags):
    """A tiny mome-bigram design process on the CPU with the kernels installed as on a GPU (the CPU added to their
    devices, --mome-kernels resolved to fused); the globals it sets are restored after the test."""
    from nanochat.memory import mome_triton

    for name in ("MIX", "TOPK_BY_ARGMAX", "SHARED_TABLE_KERNEL"):
        monkeypatch.setattr(mix_paths, name, getattr(mix_paths, name))
    monkeypatch.setattr(mome_triton, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(mome_triton, "resolve_kernels", lambda name, device: ("fused", ""))
    return bench.parse_args(["--device", "cpu", "--one", "mome-bigram", "--depth", "1", "--seq-len", "16",
                             "--vocab-size", "256", "--device-batch-size", "2", "--grad-accum", "1", "--steps", "1",
                             "--warmup", "0", *flags])


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_train_step_bench_shared_table_kernel_installed_and_recorded(on, monkeypatch, kernel_globals):
    """A mome-bigram design process switches mome_mix.SHARED_TABLE_KERNEL by the flag and records it with the
    kernel path that ran (the CPU added to the kernels' devices and --mome-kernels resolved to fused, as on a
    GPU): fused for the shared table with the flag, torch without it."""
    bench = load_bench("train_step")
    row = bench.measure_one(_bigram_process_args(bench, monkeypatch, *(["--shared-table-kernel"] if on else [])))
    assert mix_paths.SHARED_TABLE_KERNEL is on
    assert (row["shared_table_kernel"], row["kernel_path"]) == (on, "fused" if on else "torch")


def test_train_step_bench_plans_the_shared_table_kernel_runs():
    """Only the shared-table designs take the switch; "both" runs each of them off and on (keyed +stk), per mix."""
    bench = load_bench("train_step")
    args = bench.parse_args([*CPU, "--designs", "ve,mome,mome-bigram", "--mix", "auto,row",
                             "--shared-table-kernel", "both"])
    assert bench.plan_runs(args) == [
        ("ve", "auto", "off", "ve"), ("mome", "auto", "off", "mome@auto"), ("mome", "row", "off", "mome@row"),
        ("mome-bigram", "auto", "off", "mome-bigram@auto"), ("mome-bigram", "auto", "on", "mome-bigram@auto+stk"),
        ("mome-bigram", "row", "off", "mome-bigram@row"), ("mome-bigram", "row", "on", "mome-bigram@row+stk")]
    args = bench.parse_args([*CPU, "--designs", "mome,mome-bigram-n24", "--shared-table-kernel"])
    assert bench.plan_runs(args) == [("mome", "auto", "off", "mome"),
                                     ("mome-bigram-n24", "auto", "on", "mome-bigram-n24")]
    assert bench.design_of("mome-bigram@row+stk") == "mome-bigram"


def test_train_step_bench_both_passes_each_process_its_switch(tmp_path, monkeypatch):
    """--shared-table-kernel both: the shared-table design's two processes get off and on (the last flag wins
    over the forwarded "both"), in the same round, reversed in the next; each row under its key."""
    import subprocess

    bench = load_bench("train_step")
    one = {"step_ms": 10.0, "step_ms_min": 9.0, "step_ms_max": 11.0, "tokens_per_step": 64, "tok_per_sec": 6400.0,
           "mfu": None, "peak_mem_gb": None, "label": "x", "params_memory": 0, "mix": "auto", "topk": "auto"}
    switches = []

    def fake_run(cmd, **kw):
        args = bench.parse_args(cmd[2:])  # what the design process parses
        switches.append((args.one, args.shared_table_kernel))
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(one) + "\n", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    out = tmp_path / "ts.json"
    bench.main(["--device", "cpu", "--designs", "ve,mome-bigram", "--shared-table-kernel", "both", "--rounds", "2",
                "--out", str(out)])
    first = [("ve", "off"), ("mome-bigram", "off"), ("mome-bigram", "on")]
    assert switches == first + first[::-1]
    assert list(json.loads(out.read_text())["rows"]) == ["ve", "mome-bigram", "mome-bigram+stk"]


def test_train_step_bench_rounds_take_the_median_of_round_medians():
    bench = load_bench("train_step")
    rounds = [{"step_ms": ms, "step_ms_min": ms - 1, "step_ms_max": ms + 1, "tokens_per_step": 1000, "mfu": 40.0 * 100 / ms,
               "peak_mem_gb": gb, "label": "VE"} for ms, gb in ((100.0, 3.0), (110.0, 2.0), (90.0, 2.5))]
    row = bench.merge_rounds(rounds)
    assert row["step_ms"] == 100.0 and row["tok_per_sec"] == pytest.approx(10_000.0) and row["mfu"] == pytest.approx(40.0)
    assert (row["step_ms_min"], row["step_ms_max"], row["peak_mem_gb"]) == (89.0, 111.0, 3.0)
    assert row["round_step_ms"] == [100.0, 110.0, 90.0]
    # a failed round is recorded beside the good ones, not instead of them
    partial = bench.merge_rounds(rounds[:1] + [{"error": "OOM"}])
    assert partial["step_ms"] == 100.0 and partial["failed_rounds"] == ["OOM"]
    assert bench.merge_rounds([{"error": "OOM"}, {"error": "OOM again"}]) == {"error": "OOM"}
    with pytest.raises(SystemExit):
        bench.parse_args([*CPU, "--rounds", "0"])


def test_train_step_bench_writes_what_it_has_after_every_process(tmp_path, monkeypatch):
    """A device call killed at its time limit lost every row: the JSON was only written after the last process."""
    import subprocess

    bench = load_bench("train_step")
    out = tmp_path / "ts.json"
    one = {"step_ms": 10.0, "step_ms_min": 9.0, "step_ms_max": 11.0, "tokens_per_step": 64, "tok_per_sec": 6400.0,
           "mfu": None, "peak_mem_gb": None, "label": "VE", "params_memory": 0}
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the time limit's kill
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(one) + "\n", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--device", "cpu", "--designs", "ve,mome", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["complete"] is False and list(saved["rows"]) == ["ve"] and saved["rows"]["ve"]["step_ms"] == 10.0


def test_train_step_bench_profile_dir_writes_every_kernel_as_json(tmp_path, monkeypatch, kernel_globals):
    """--profile-dir: beside the op table, every op of the --profile-steps profiled steps (on CPU: the host ops'
    self time; on CUDA: the device kernels) with its category, as bench/profile_diff.py reads it. The design
    process's command line run in this process (`--one`: what main starts a process for; a process per design is
    test_train_step_bench_runs_each_design_in_its_own_process's, --profile-dir passed on to it
    test_train_step_bench_profiles_in_the_first_round_only's): one torch start-up less."""
    bench = load_bench("train_step")
    kernel_table = load_bench("kernel_table")
    prof = tmp_path / "prof"
    for name in ("MIX", "TOPK_BY_ARGMAX"):  # the design process sets them; kernel_globals restores the rest
        monkeypatch.setattr(mix_paths, name, getattr(mix_paths, name))
    bench.main(["--device", "cpu", "--designs", "mome", "--depth", "1", "--seq-len", "16", "--vocab-size", "256",
                "--device-batch-size", "2", "--grad-accum", "1", "--steps", "1", "--warmup", "1",
                "--profile-dir", str(prof), "--profile-steps", "2", "--out", str(tmp_path / "ts.json"),
                "--one", "mome", "--mix", "auto", "--shared-table-kernel", "off", "--no-compile"])
    assert sorted(p.name for p in prof.iterdir()) == ["mome_auto_auto.json", "mome_auto_auto.txt"]
    assert "2 steps profiled" in (prof / "mome_auto_auto.txt").read_text()
    doc = json.loads((prof / "mome_auto_auto.json").read_text())
    assert (doc["design"], doc["label"], doc["device"], doc["time"], doc["steps"]) == (
        "mome", "MoME A2/6 token", "cpu", "self_cpu", 2)
    assert doc["step_ms"] > 0 and doc["profiled_step_ms"] > 0 and doc["tokens_per_step"] == 2 * 16
    kernels = doc["kernels"]
    assert all(set(k) == {"name", "category", "calls", "total_us"} for k in kernels)
    assert all(k["category"] in kernel_table.CATEGORIES and k["calls"] >= 1 for k in kernels)
    assert doc["total_us"] == pytest.approx(sum(k["total_us"] for k in kernels))
    assert [k["total_us"] for k in kernels] == sorted((k["total_us"] for k in kernels), reverse=True)
    cats = {k["category"] for k in kernels}
    assert {"gemm", "optimizer"} <= cats  # the model's matmuls, and MuonAdamW's step
    # the optimizer annotation once per profiled step (the timed and warm-up steps are not in the profile)
    assert [k["calls"] for k in kernels if k["name"].startswith("Optimizer.step")] == [2]
    assert doc["optimizer_windows"] == 2
    bad = load_bench("profile_diff").main([str(prof / "mome_auto_auto.json"), str(prof / "mome_auto_auto.json")])
    assert bad == 0  # the JSON is what profile_diff reads


def test_train_step_bench_profiles_of_the_shared_table_kernel_off_and_on_are_two_files(tmp_path, monkeypatch,
                                                                                       kernel_globals):
    """--shared-table-kernel both runs a design off and on in one round: with --profile-dir the on run writes
    <stem>_stk (the off run's file stays; '+' is no name the device tool returns), labelled and recorded as such."""
    bench = load_bench("train_step")
    docs = {}
    for flags in ([], ["--shared-table-kernel", "on"]):
        args = _bigram_process_args(bench, monkeypatch, "--profile-dir", str(tmp_path), "--profile-steps", "1",
                                    *flags)
        assert "profile_error" not in bench.measure_one(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mome-bigram_auto_auto.json", "mome-bigram_auto_auto.txt", "mome-bigram_auto_auto_stk.json",
        "mome-bigram_auto_auto_stk.txt"]
    for name in ("mome-bigram_auto_auto", "mome-bigram_auto_auto_stk"):
        doc = json.loads((tmp_path / f"{name}.json").read_text())
        docs[name] = (doc["label"], doc["shared_table_kernel"], doc["kernel_path"])
    assert docs == {"mome-bigram_auto_auto": ("MoME A2/6 bigram-idx n6", False, "torch"),
                    "mome-bigram_auto_auto_stk": ("MoME A2/6 bigram-idx n6 +stk", True, "fused")}


def test_train_step_bench_a_failed_profile_keeps_the_timed_row(tmp_path, monkeypatch, capsys, kernel_globals):
    """The profile comes after the timed steps: an error there (say, no device events read) is recorded with the
    row and said on stderr, and the design's timing still comes back."""
    bench = load_bench("train_step")

    def no_events(*_):
        raise RuntimeError("the profiler recorded no device events")

    monkeypatch.setattr(bench, "write_profile", no_events)
    row = bench.measure_one(_bigram_process_args(bench, monkeypatch, "--profile-dir", str(tmp_path)))
    assert row["step_ms"] > 0 and row["profile_error"] == "RuntimeError: the profiler recorded no device events"
    assert "profile of mome-bigram failed: RuntimeError: the profiler recorded no device events" in (
        capsys.readouterr().err)


def test_train_step_bench_profiles_in_the_first_round_only(tmp_path, monkeypatch):
    """Every profiled step is device time: with --rounds the later rounds' processes do not profile again."""
    import subprocess

    bench = load_bench("train_step")
    one = {"step_ms": 10.0, "step_ms_min": 9.0, "step_ms_max": 11.0, "tokens_per_step": 64, "tok_per_sec": 6400.0,
           "mfu": None, "peak_mem_gb": None, "label": "VE", "params_memory": 0, "mix": "auto", "topk": "auto"}
    calls = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(
        cmd, 0, stdout=json.dumps(one) + "\n", stderr=""))
    bench.main(["--device", "cpu", "--designs", "ve,mome", "--rounds", "2", "--profile-dir", str(tmp_path),
                "--out", str(tmp_path / "ts.json")])
    profile_dirs = [bench.parse_args(cmd[2:]).profile_dir for cmd in calls]
    assert profile_dirs == [str(tmp_path)] * 2 + [""] * 2
    with pytest.raises(SystemExit):
        bench.parse_args([*CPU, "--profile-steps", "0"])


def test_train_step_bench_design_processes_keep_the_callers_pythonpath(tmp_path, monkeypatch):
    """dev/gpu/run_all.sh puts the carried wheels (/tmp/site) on PYTHONPATH: the design processes replaced it with
    the repo alone, so they imported the image's packages while the parent and the tests took the carried ones."""
    import os
    import subprocess

    bench = load_bench("train_step")
    one = {"step_ms": 10.0, "step_ms_min": 9.0, "step_ms_max": 11.0, "tokens_per_step": 64, "tok_per_sec": 6400.0,
           "mfu": None, "peak_mem_gb": None, "label": "VE", "params_memory": 0, "mix": "auto", "topk": "auto"}
    paths = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, env, **kw: paths.append(env["PYTHONPATH"]) or
                        subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(one) + "\n", stderr=""))
    for caller in (f".{os.pathsep}/tmp/site", None):
        if caller is None:
            monkeypatch.delenv("PYTHONPATH", raising=False)
        else:
            monkeypatch.setenv("PYTHONPATH", caller)
        bench.main(["--device", "cpu", "--designs", "ve", "--out", str(tmp_path / "ts.json")])
    assert paths == [f"{bench.REPO}{os.pathsep}.{os.pathsep}/tmp/site", str(bench.REPO)]


@pytest.mark.slow  # 22 s: one process per design; the designs' training is tested in their own files
def test_train_step_bench_runs_the_appendix_designs(tmp_path, capsys):
    """Every appendix design builds and steps through the trainer's train_step in the bench (Engram's d24-sized
    prime tables are too large for a smoke test: its training is tested in tests/test_engram.py)."""
    bench = load_bench("train_step")
    out = tmp_path / "ts.json"
    designs = ["jtok", "jtokm", "move_input", "moe", "moe-mome"]
    bench.main(["--device", "cpu", "--designs", ",".join(designs), "--depth", "2", "--seq-len", "16",
                "--vocab-size", "256", "--device-batch-size", "2", "--grad-accum", "1", "--steps", "1", "--warmup", "1",
                "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == set(designs) and not any("error" in r for r in rows.values()), rows
    assert rows["moe"]["params_memory"] == 0 and rows["moe-mome"]["params_memory"] > 0
    assert "| MoE-FFN E6/K2 +1 shared |" in capsys.readouterr().out
    assert set(bench.parse_args([*CPU, "--designs", "all"]).designs.split(",")) == set(bench.DESIGNS)


def test_dist_optim_bench_counts_collectives_old_and_new(tmp_path):
    from conftest import REPO, run_torchrun

    out = tmp_path / "dist.json"
    # depth 4: 4 same-shape matrices per Muon group, so buckets are fewer than parameters (at depth 1 they are not)
    r = run_torchrun(REPO / "bench" / "dist_optim.py", 2, ["--depth", "4", "--vocab-size", "512", "--steps", "1",
                                                          "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    old, new = res["old"][0], res["new"][0]
    assert old["collectives"] == old["params"]  # one all-reduce per parameter
    assert new["collectives"] < old["collectives"]
    assert max(x["state_mb"] for x in res["new"]) < 0.75 * max(x["state_mb"] for x in res["old"])
    assert "| new |" in r.stdout


def test_peak_memory_columns_name_their_binary_units(bench):
    """train_step's peak_mem_gb is torch.cuda.max_memory_allocated() / 2**30 and step.py's peak_mb is bytes / 2**20:
    the tables say GiB and MiB (33.8 GiB is 36.3 GB, 7% more than a "33.8 GB" column reads)."""
    ts = load_bench("train_step")
    row = {"label": "VE", "step_ms": 10.0, "step_ms_min": 9.0, "step_ms_max": 11.0, "tok_per_sec": 1.0, "mfu": None,
           "peak_mem_gb": 36_259_840_000 / 2**30, "mix": "auto", "topk": "auto"}
    head, _, cells = ts.table({"ve": row}).splitlines()
    assert "| peak GiB |" in head and "| 33.8 |" in cells
    step = {"label": "VE", "table_params": 0, "ratio_to_VE": {k: 1.0 for k in ("step", "fwd_bwd", "forward", "backward",
                                                                               "optimizer")}}
    step["ratio_to_Base"] = step["ratio_to_VE"]
    step.update({k: {"median": 1.0, "min": 1.0, "max": 1.0} for k in ("forward", "backward", "optimizer", "step")})
    head = bench.step_table({"VE": step}, {"VE": {"peak_mb": 512.0, "ratio_to_VE": 1.0}}).splitlines()[0]
    assert "| peak MiB | peak/VE |" in head


def test_train_step_bench_never_times_the_compile():
    """A compiled design's first step compiles (40-60 s on a GPU): with --warmup 0 it was a timed step, the
    row's max (and, with --steps 1 or 2, its median) a compile time. --steps 0 crashed each design process on an
    empty median. Both are refused when parsing; eager runs may skip the warm-up (the CPU tests do)."""
    bench = load_bench("train_step")
    for bad in (["--compile", "--warmup", "0"], ["--steps", "0"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args([*CPU, *bad])
    assert bench.parse_args([*CPU, "--warmup", "0"]).warmup == 0
    assert bench.parse_args([*CPU, "--compile", "--warmup", "1"]).compile is True


def test_step_bench_never_times_the_compile(bench):
    """As train_step: with --compile the first step of each case compiles, so --warmup 0 would time it."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--compile", "--warmup", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--reps", "0"])
    assert bench.parse_args(["--warmup", "0"]).warmup == 0 and bench.parse_args(["--compile"]).warmup == 3
