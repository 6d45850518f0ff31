"""base_train --init-from RUN_DIR[:STEP]: a run that starts from another run's weights (nanochat/init_from.py)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from nanochat import checkpoint as ckpt
from nanochat.download import file_sha256
from scripts import base_train
from test_train_e2e import losses, train

MOME = ["--memory", "mome", "--mome-slots", "4", "--mome-topk", "2"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A trained tiny MoME run (synthetic data) with checkpoints at steps 2 and 3: its routers are no longer zero."""
    run = tmp_path_factory.mktemp("init_from") / "source"
    assert train(run, *MOME, "--num-iterations", "3", "--save-every", "2") == 0
    return run


def record_first_step(monkeypatch) -> dict:
    """Patch base_train's train_step to keep, at the first step, the weights it starts from and its micro-batches."""
    first, real = {}, base_train.train_step

    def recording(model, optimizer, loader, *a, **k):
        if first:
            return real(model, optimizer, loader, *a, **k)
        first["weights"] = {name: t.detach().clone() for name, t in model.state_dict().items()}
        first["batches"] = []

        class Tap:
            def __next__(self):
                first["batches"].append(next(loader))
                return first["batches"][-1]

        return real(model, optimizer, Tap(), *a, **k)

    monkeypatch.setattr(base_train, "train_step", recording)
    return first


def assert_starts_from(first: dict, source_run, step: int) -> None:
    """The weights of the first step are the source checkpoint's, tensor for tensor, bit for bit."""
    saved = torch.load(ckpt.step_dir(source_run, step) / "model.pt")
    assert sorted(first["weights"]) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(first["weights"][name], tensor), name


def source_loss(source_run, step: int, batches) -> float:
    """The loss train_step reports for these micro-batches, computed with the source checkpoint's model: the same
    forward on the same rows and the same float64 mean, so an exact match is expected (same process, threads)."""
    model, _ = ckpt.load_model(source_run, step)
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for x, y in batches:
            total += model.train()(x, targets=y).double()
    return (total / len(batches)).item()


def test_weights_and_first_loss_are_the_sources_and_runs_repeat(tmp_path, source, monkeypatch):
    first = record_first_step(monkeypatch)
    flags = [*MOME, "--num-iterations", "2", "--seed", "7", "--init-from", f"{source}:2"]
    assert train(tmp_path / "a", *flags) == 0
    assert_starts_from(first, source, 2)
    assert losses(tmp_path / "a")[1] == source_loss(source, 2, first["batches"])
    # provenance: the same record in config.json, every checkpoint's meta and summary.json
    record = json.loads((tmp_path / "a" / "config.json").read_text())["init_from"]
    assert record == {"spec": f"{source}:2", "run_dir": str(source.resolve()), "step": 2, "reason": "periodic",
                      "model_sha256": file_sha256(ckpt.step_dir(source, 2) / "model.pt")}
    assert ckpt.load_meta(tmp_path / "a", 2)["config"]["init_from"] == record
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["init_from"] == record
    assert json.loads((source / "summary.json").read_text())["init_from"] is None  # a scratch run says so
    assert f"--init-from `{source.resolve()}` step 2" in (tmp_path / "a" / "report.md").read_text()
    assert "random init (--seed 42)" in (source / "report.md").read_text()
    # everything else is fresh: this run's step count and schedule, and the same flags give the same floats
    assert train(tmp_path / "b", *flags) == 0
    assert losses(tmp_path / "b") == losses(tmp_path / "a") and list(losses(tmp_path / "a")) == [1, 2]


def test_resume_continues_bit_exactly_without_reading_the_source_again(tmp_path, source, capsys):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    run = tmp_path / "run"
    flags = [*MOME, "--num-iterations", "4", "--save-every", "2", "--init-from", str(src), "--resume", "auto"]
    assert train(run, *flags) == 0  # --resume auto without a checkpoint: starts from the source
    full = losses(run)
    shutil.rmtree(ckpt.step_dir(run, 4))  # "killed" after the step-2 checkpoint
    (ckpt.step_dir(src, 3) / "model.pt").write_bytes(b"gone")  # a resume must not read the source
    assert train(run, *flags) == 0
    assert losses(run) == full
    shutil.rmtree(src)  # the requeue command's dry run (speedrun preflight) does not need the source either
    capsys.readouterr()
    assert train(run, *flags, "--dry-run") == 0
    assert "not read: --resume continues this run's checkpoints" in capsys.readouterr().out
    for other in ([*MOME, "--num-iterations", "4", "--init-from", f"{src}:2", "--resume"],
                  [*MOME, "--num-iterations", "4", "--resume"]):
        assert train(run, *other) == 2
        err = capsys.readouterr().err
        assert f"the checkpoint's run started from {src.resolve()} step 3" in err, err
    assert losses(run) == full


@pytest.mark.parametrize("extra,needle", [
    (["--mome-slots", "6"], "memory_options.slots 4 (source) vs 6 (this run)"),
    (["--depth", "3"], "n_layer 2 (source) vs 3 (this run)"),
    (["--mome-gate", "softmax"],
     "memory_options.gate 'sigmoid-norm' (source, from the default 'auto') vs 'softmax' (this run)"),
])
def test_other_architecture_is_refused_before_training_and_by_dry_run(tmp_path, source, capsys, extra, needle):
    run = tmp_path / "r"
    for dry in ([], ["--dry-run"]):
        assert train(run, *MOME, *extra, "--num-iterations", "2", "--init-from", str(source), *dry) == 2
        err = capsys.readouterr().err
        assert needle in err and str(ckpt.step_dir(source, 3)) in err, err
        assert not (run / "metrics.jsonl").exists() and not (run / "plan.json").exists()


def test_dry_run_checks_the_source(tmp_path, source, capsys):
    def dry(spec) -> tuple[int, str]:
        rc = train(tmp_path / "r", *MOME, "--num-iterations", "2", "--init-from", str(spec), "--dry-run")
        out = capsys.readouterr()
        return rc, out.out + out.err

    rc, out = dry(source)
    assert rc == 0 and f"init from: {source.resolve()} step 3 (architecture and tokenizer match)" in out
    (tmp_path / "r" / "plan.json").unlink()
    assert dry(f"{source}:2")[0] == 0
    (tmp_path / "r" / "plan.json").unlink()
    # the gate the source's auto resolved to (sigmoid-norm at K = 2), spelled out: the same architecture
    assert train(tmp_path / "r", *MOME, "--mome-gate", "sigmoid-norm", "--num-iterations", "2", "--init-from",
                 str(source), "--dry-run") == 0
    assert "(architecture and tokenizer match)" in capsys.readouterr().out
    (tmp_path / "r" / "plan.json").unlink()
    for spec, needle in ((tmp_path / "missing", "no such run directory"),
                         (f"{source}:5", "no checkpoint step_000005 in"),
                         (ckpt.step_dir(source, 3) / "model.pt", "is a file, not a run directory"),
                         (tmp_path, "holds no checkpoint"),
                         (tmp_path / "r", "is this run's own --run-dir")):
        rc, out = dry(spec)
        assert rc == 2 and f"error: --init-from {spec}: " in out and needle in out, out
    assert "(available steps: [2, 3])" in dry(f"{source}:5")[1]
    assert not (tmp_path / "r" / "plan.json").exists()


def test_grouped_mome_source_without_its_slot_map_file(tmp_path, capsys):
    """The source checkpoint carries its slot map: the file may be gone; a different file is refused."""
    from nanochat.memory.slot_map import write_slot_map

    path = tmp_path / "map.json"
    pairs = [[i, i + 128] for i in range(128)]  # not the identity grouping: a zero or default map would differ
    write_slot_map(path, pairs, 256, 2)
    flags = ["--memory", "mome", "--mome-index", "grouped", "--mome-group-size", "2", "--mome-slots", "4",
             "--mome-slot-map", str(path), "--num-iterations", "1"]
    assert train(tmp_path / "src", *flags) == 0
    path.unlink()
    assert train(tmp_path / "a", *flags, "--init-from", str(tmp_path / "src")) == 0
    model, _ = ckpt.load_model(tmp_path / "a")
    assert model.memory.slot_map.tolist() == [i % 128 for i in range(256)]
    write_slot_map(path, [[2 * i, 2 * i + 1] for i in range(128)], 256, 2)  # another map under the same name
    capsys.readouterr()
    assert train(tmp_path / "b", *flags, "--init-from", str(tmp_path / "src")) == 2
    assert "memory_options.slot_map_sha256" in capsys.readouterr().err
    # run "a" started without the file, so it records no hash to compare: its map is compared with the file's
    assert train(tmp_path / "c", *flags, "--init-from", str(tmp_path / "a")) == 2
    assert "map.json holds another map than the one in the checkpoint" in capsys.readouterr().err


def on_imported(data_dir, imported) -> list[str]:
    """Flags of a one-step run on ``data_dir`` from ``imported``, an import of make_their_files' "mome_token"."""
    return ["--data-dir", str(data_dir), "--depth", "4", "--model-dim", "64", "--num-heads", "2", "--max-seq-len",
            "64", "--memory", "mome", "--mome-slots", "6", "--device-batch-size", "2", "--total-batch-size", "128",
            "--eval-tokens", "128", "--eval-every", "-1", "--no-final-core", "--no-final-train-bpb",
            "--num-iterations", "1", "--init-from", str(imported)]


def test_the_authors_imported_checkpoint_is_a_source(tmp_path, monkeypatch, capsys, embedded_data_dir,
                                                      tiny_tokenizer_dir, source):
    """An import of their files (weights only, no training state; its tokenizer inside the run dir) trains on."""
    from nanochat.tokenizer import Tokenizer
    from reference_fixtures import make_their_files
    from scripts import import_reference

    their, _, tok = make_their_files(tmp_path, "mome_token")
    imported = tmp_path / "imported"
    assert import_reference.main([str(their), "--run-dir", str(imported)]) == 0
    common = on_imported(embedded_data_dir, imported)
    first = record_first_step(monkeypatch)
    assert base_train.main([*common, "--tokenizer-dir", str(imported / "tokenizer"), "--run-dir",
                            str(tmp_path / "a")]) == 0
    assert_starts_from(first, imported, 5)
    assert losses(tmp_path / "a")[1] == source_loss(imported, 5, first["batches"])
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["init_from"]["reason"] == "imported"
    capsys.readouterr()
    # other tokenizers: another vocab (dry run), the same vocab with two merges swapped (before training)
    assert base_train.main([*common, "--tokenizer-dir", str(tiny_tokenizer_dir), "--run-dir", str(tmp_path / "b"),
                            "--dry-run"]) == 2
    assert "vocab size 1024 does not match vocab_size 439 of --init-from source" in capsys.readouterr().err
    ranks = dict(tok.mergeable_ranks)
    (a, ra), (b, rb) = sorted(ranks.items(), key=lambda kv: kv[1])[300:302]
    ranks[a], ranks[b] = rb, ra
    Tokenizer(ranks, pattern=tok.pattern, special_tokens=list(tok.special_tokens)).save(tmp_path / "swapped")
    assert base_train.main([*common, "--tokenizer-dir", str(tmp_path / "swapped"), "--run-dir",
                            str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "the tokenizer is not the one --init-from source" in err and "via --tokenizer-dir" in err
    assert not (tmp_path / "c" / "metrics.jsonl").exists()
    assert train(tmp_path / "d", "--init-from", str(imported), "--dry-run") == 2  # synthetic data: no tokenizer
    assert "this run has none (--synthetic-data)" in capsys.readouterr().err
    assert base_train.main(["--tokenizer-dir", str(tiny_tokenizer_dir), "--depth", "2", "--aspect-ratio", "32",
                            "--head-dim", "32", "--max-seq-len", "32", *MOME, "--init-from", str(source),
                            "--run-dir", str(tmp_path / "e"), "--dry-run"]) == 2  # the other way round
    assert "records no tokenizer (trained on --synthetic-data" in capsys.readouterr().err


TWO_RANK_FLAGS = [*MOME, "--num-iterations", "2"]  # + --init-from SOURCE, in the launch and its 1-process reference


@pytest.fixture(scope="module")
def two_rank_launch(source, tmp_path_factory):
    """The module's 2-process gloo runs, in one torchrun launch of _init_from_worker (a start-up is ~4 s of the CI's
    2 cores): run 0 the other-copy check (its rank<r>.json in ``copies``), run 1 base_train from ``source`` (its
    run dir ``w2``); the runs after a failed one are not started. Returns (the launch's result, copies, w2)."""
    from conftest import REPO, run_torchrun
    from test_train_dist import BATCH
    from test_train_e2e import TINY

    tmp = tmp_path_factory.mktemp("init_from_w2")
    other, copies, w2 = tmp / "other", tmp / "copies", tmp / "w2"
    shutil.copytree(source, other)  # rank 1 is shown the step-2 weights under the step-3 path
    shutil.copy(ckpt.step_dir(source, 2) / "model.pt", ckpt.step_dir(other, 3) / "model.pt")
    copies.mkdir()
    r = run_torchrun(REPO / "tests" / "_init_from_worker.py", 2,
                     ["--copies", str(source), str(other), str(copies), "--next-run",
                      *TINY, *BATCH, *TWO_RANK_FLAGS, "--init-from", str(source), "--run-dir", str(w2)])
    return r, copies, w2


# 2 processes (in two_rank_launch): the per-rank hash of the handle each rank loads from, in every CI run
def test_two_processes_start_from_the_same_weights(tmp_path, source, two_rank_launch):
    """Under torchrun rank 0 checks the source and every rank loads it: the losses equal the 1-process run's up
    to the gradient-average summation order (test_train_dist.assert_losses_close)."""
    from test_train_dist import BATCH, assert_losses_close

    assert train(tmp_path / "w1", *TWO_RANK_FLAGS, "--init-from", str(source), batch=BATCH) == 0
    r, _, w2 = two_rank_launch
    assert r.returncode == 0, r.stderr[-3000:]
    assert_losses_close(losses(w2), losses(tmp_path / "w1"), {1, 2})
    assert json.loads((w2 / "config.json").read_text())["init_from"]["step"] == 3


def test_another_context_length_is_a_fine_tune_not_an_error(tmp_path, source, monkeypatch, capsys):
    """No weight depends on the context length: a run at 64 tokens starts from the 32-token source's weights."""
    first = record_first_step(monkeypatch)
    assert train(tmp_path / "a", *MOME, "--max-seq-len", "64", "--num-iterations", "1", "--init-from",
                 str(source)) == 0
    assert_starts_from(first, source, 3)
    assert first["batches"][0][0].shape[1] == 64
    assert "context 64 tokens, the source trained at 32" in capsys.readouterr().out


def test_spec_parsing(tmp_path):
    from nanochat.init_from import parse_spec, resume_differences

    assert parse_spec("runs/a:000002") == (Path("runs/a"), "2")  # padded like the step_NNNNNN folders
    assert parse_spec("runs/a:latest") == (Path("runs/a"), "latest") and parse_spec("runs/a") == (Path("runs/a"), "latest")
    odd = tmp_path / "x:30"  # a run directory whose name ends in ':digits' is that directory
    odd.mkdir()
    assert parse_spec(str(odd)) == (odd, "latest") and parse_spec(f"{odd}:2") == (odd, "2")
    recorded = {"spec": f"{tmp_path}:000002", "run_dir": str(tmp_path.resolve()), "step": 2}
    assert resume_differences(recorded, f"{tmp_path}:000002") == []
    assert resume_differences(recorded, f"{tmp_path}:2") == [] and resume_differences(recorded, str(tmp_path)) == []
    assert resume_differences(recorded, f"{tmp_path}:3")


def test_continuing_on_the_sources_data_with_its_seed_says_it_rereads_it(tmp_path, monkeypatch, capsys,
                                                                        embedded_data_dir, tiny_tokenizer_dir):
    """The data order depends on the seed, the world size and the files only: a run started from a source on the
    same data and data seed reads the source's first batches again, and says so; another --data-seed does not."""
    common = ["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir), "--depth", "1",
              "--aspect-ratio", "64", "--head-dim", "32", "--max-seq-len", "64", "--device-batch-size", "2",
              "--total-batch-size", "128", "--eval-tokens", "128", "--eval-every", "-1", "--no-final-core",
              "--no-final-train-bpb", "--num-iterations", "1"]
    first = record_first_step(monkeypatch)
    assert base_train.main([*common, "--run-dir", str(tmp_path / "src")]) == 0
    source_batches = first.pop("batches")
    first.clear()
    capsys.readouterr()
    assert base_train.main([*common, "--run-dir", str(tmp_path / "a"), "--init-from", str(tmp_path / "src")]) == 0
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(first["batches"], source_batches))
    assert "NOTE: same data and data seed (42) as the source" in capsys.readouterr().out
    first.clear()
    assert base_train.main([*common, "--run-dir", str(tmp_path / "b"), "--init-from", str(tmp_path / "src"),
                            "--data-seed", "7"]) == 0
    assert not torch.equal(first["batches"][0][0], source_batches[0][0])
    assert "NOTE: same data" not in capsys.readouterr().out


# ---- model configs compare as the model resolves them (auto / 0 sentinels) -----------------------------------
def _nanochat(**kw) -> dict:
    from conftest import tiny_config

    return tiny_config(**kw).to_dict()


MOE_CFG = dict(mlp="moe", moe_experts=4, moe_topk=2, moe_shared=1)


@pytest.mark.parametrize("field,left,same,other,needle", [
    # 4C / (S + K) = 512 / 3 -> 192 (a multiple of 64): what MoEFFN builds for moe_hidden 0
    ("moe_hidden", _nanochat(**MOE_CFG), _nanochat(**MOE_CFG, moe_hidden=192), _nanochat(**MOE_CFG, moe_hidden=256),
     "moe_hidden 192 (source, from the default 0) vs 256 (this run)"),
    # auto is sigmoid-norm for K > 1 (MoMEOptions.gate_mode)
    ("gate", _nanochat(memory="mome", memory_options={"topk": 2}),
     _nanochat(memory="mome", memory_options={"topk": 2, "gate": "sigmoid-norm"}),
     _nanochat(memory="mome", memory_options={"topk": 2, "gate": "softmax"}),
     "memory_options.gate 'sigmoid-norm' (source, from the default 'auto') vs 'softmax' (this run)"),
    ("gate K=1", _nanochat(memory="mome", memory_options={"topk": 1}),
     _nanochat(memory="mome", memory_options={"topk": 1, "gate": "softmax"}),
     _nanochat(memory="mome", memory_options={"topk": 1, "gate": "sigmoid-norm"}),
     "memory_options.gate 'softmax' (source, from the default 'auto') vs 'sigmoid-norm' (this run)"),
    # Engram's d_mem 0 is n_embd (128 here)
    ("engram dim", _nanochat(memory="engram"), _nanochat(memory="engram", memory_options={"dim": 128}),
     _nanochat(memory="engram", memory_options={"dim": 64}),
     "memory_options.dim 128 (source, from the default 0) vs 64 (this run)"),
    # no --memory-layers: the block's default (alternating, ending at the last layer: [1] of 2); the order of an
    # explicit list does not matter (the block sorts it)
    ("layers", _nanochat(memory="ve"), _nanochat(memory="ve", memory_layers=[1]),
     _nanochat(memory="ve", memory_layers=[0]), "memory_layers [1] (source, from the default []) vs [0] (this run)"),
    ("layer order", _nanochat(memory="ve", n_layer=4, memory_layers=[3, 1]),
     _nanochat(memory="ve", n_layer=4, memory_layers=[1, 3]), _nanochat(memory="ve", n_layer=4, memory_layers=[1, 2]),
     "memory_layers [1, 3] (source, given as [3, 1]) vs [1, 2] (this run)"),
])
def test_sentinels_compare_as_the_values_they_resolve_to(field, left, same, other, needle):
    import re

    from nanochat.init_from import config_differences

    assert config_differences(left, same) == [] and config_differences(same, left) == []
    assert config_differences(left, other) == [needle]
    # the other way round: this run's side is the one written as the sentinel. A field left at its default said
    # "given as []" before session 25, as if a flag had given it
    name, ours, how, theirs = re.fullmatch(r"(\S+) (.+) \(source, (from the default .+|given as .+)\) vs (.+) "
                                           r"\(this run\)", needle).groups()
    assert config_differences(other, left) == [f"{name} {theirs} (source) vs {ours} (this run, {how})"]


def test_every_sentinel_default_is_resolved():
    """A config field or block option whose default stands for a derived value (auto, 0, empty) must be compared as
    what it resolves to, or be listed here as a real value: a new sentinel fails this test until it is handled."""
    import dataclasses

    from conftest import tiny_config
    from nanochat.init_from import _comparable
    from nanochat.memory import MEMORY_BLOCKS

    real_values = {"moe_balance_lr", "memory_options.seed", "memory_options.slot_map_sha256",  # 0 / "" mean that
                   "memory_options.rows", "memory_options.dedicated_size",  # 0 = not used (mod/headmod require > 0)
                   "memory_options.shared_expert", "memory_options.per_head_table",  # False = off (== 0 to Python)
                   "memory_options.maxvio_window"}  # 0 = off
    for memory, block in MEMORY_BLOCKS.items():
        opts = {"index": "grouped", "group_size": 2, "slot_map": "/no/map.json"} if memory == "mome" else {}
        config = tiny_config(memory=memory, memory_options=opts, **MOE_CFG)  # every FFN field in use
        written = {f"memory_options.{f.name}": f.default for f in dataclasses.fields(block.Options)}
        written.update({f.name: f.default for f in dataclasses.fields(config) if f.name != "memory_options"})
        if not block.uses_layers:
            real_values.add("memory_layers")  # no layers at all, not "the default layers"
        resolved = _comparable(config.to_dict())
        for key, default in written.items():
            if default in (0, "auto", "", ()) and key not in real_values and key in resolved:
                value = tuple(resolved[key]) if isinstance(resolved[key], list) else resolved[key]
                assert value != default, f"--memory {memory}: {key} left at {default!r} is compared as written"
        real_values.discard("memory_layers")


# ---- training-time settings stored in the model config --------------------------------------------------------
TRAINING_TIME = [  # (config, field, another value): each only steers training, never what the weights compute
    (dict(memory="mome", memory_options={"topk": 2, "slots": 4, "balance": "bias"}), "memory_options.balance_lr", 0.5),
    (dict(memory="mome", memory_options={"topk": 2, "slots": 4, "balance": "trust-region"}),
     "memory_options.balance_band", 1.2),
    (dict(memory="mome", memory_options={"topk": 2, "slots": 4, "balance": "trust-region"}),
     "memory_options.balance_min_visits", 32),
    (dict(memory="mome", memory_options={"topk": 2, "slots": 4}), "memory_options.maxvio_window", 3),  # logging
    (dict(memory="jtokm"), "memory_options.aux_weight", 0.5),
    (dict(**MOE_CFG), "moe_balance_lr", 0.5),
]


def _with(config: dict, field: str, value) -> dict:
    if field.startswith("memory_options."):
        return {**config, "memory_options": {**config.get("memory_options", {}), field.split(".")[1]: value}}
    return {**config, field: value}


@pytest.mark.parametrize("config,field,value", TRAINING_TIME, ids=[t[1] for t in TRAINING_TIME])
def test_a_training_time_setting_changes_no_forward(config, field, value):
    """The weights of one config loaded (strictly) into the model of the other give the same logits and LM loss: the
    setting is not part of the architecture (what --init-from may change and --resume may not)."""
    from conftest import tiny_config
    from nanochat.families import build_model
    from nanochat.init_from import compare_with_source, config_differences

    a, b = tiny_config(**config), tiny_config(**_with(config, field, value))
    assert a.to_dict() != b.to_dict()
    src = build_model(a, seed=3)
    with torch.no_grad():
        for p in src.parameters():  # zero-init projections and routers would hide the memory and routing paths
            if p.dim() > 1:
                torch.nn.init.uniform_(p, -0.3, 0.3)
        for name, buf in src.named_buffers():
            if name.endswith("bias"):  # a routing bias that is not all zero takes part in the choice
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(1)))
    dst = build_model(b)
    dst.load_state_dict(src.state_dict(), strict=True)
    idx = torch.randint(0, a.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(src.eval()(idx), dst.eval()(idx))
        assert torch.equal(src(idx, targets=idx), dst(idx, targets=idx))
    refused, allowed = compare_with_source(a.to_dict(), b)
    assert refused == [] and len(allowed) == 1 and allowed[0].startswith(f"{field} ") and "(this run)" in allowed[0]
    assert [d.split(" ")[0] for d in config_differences(a.to_dict(), b.to_dict(), theirs="checkpoint")] == [field]


def test_every_declared_training_time_setting_is_checked_above():
    from conftest import tiny_config
    from nanochat.init_from import training_settings
    from nanochat.llama import LlamaConfig
    from nanochat.memory import MEMORY_BLOCKS
    from nanochat.qwen3 import Qwen3Config

    declared = set(training_settings(LlamaConfig())) | set(training_settings(Qwen3Config()))
    declared |= {s for memory in MEMORY_BLOCKS for s in training_settings(tiny_config(memory=memory))}
    assert declared == {field for _, field, _ in TRAINING_TIME}


def test_another_balance_lr_than_the_sources_is_used_and_recorded_but_a_resume_keeps_its_own(tmp_path, capsys):
    """--init-from with another --mome-balance-lr: started, said, used by the bias update and recorded; a --resume of
    that run with yet another value is refused like any model-config change."""
    bias = [*MOME, "--mome-balance", "bias"]
    assert train(tmp_path / "src", *bias, "--num-iterations", "2") == 0  # --mome-balance-lr 0.001
    capsys.readouterr()
    flags = [*bias, "--mome-balance-lr", "0.5", "--num-iterations", "1", "--init-from", str(tmp_path / "src")]
    assert train(tmp_path / "a", *flags, "--dry-run") == 0
    assert "memory_options.balance_lr 0.001 (source) vs 0.5 (this run)" in capsys.readouterr().out
    (tmp_path / "a" / "plan.json").unlink()
    assert train(tmp_path / "a", *flags) == 0
    assert "memory_options.balance_lr 0.001 (source) vs 0.5 (this run)" in capsys.readouterr().out
    moved = (torch.load(ckpt.step_dir(tmp_path / "a", 1) / "model.pt")["memory.router_bias"]
             - torch.load(ckpt.step_dir(tmp_path / "src", 2) / "model.pt")["memory.router_bias"]).abs()
    assert ((moved == 0) | ((moved - 0.5).abs() < 1e-6)).all() and moved.max() > 0.49  # one step of 0.5
    for recorded in (json.loads((tmp_path / "a" / "config.json").read_text()),
                     ckpt.load_meta(tmp_path / "a", 1)):
        assert recorded["model_config"]["memory_options"]["balance_lr"] == 0.5
    resume = [*bias, "--mome-balance-lr", "0.001", "--num-iterations", "2", "--init-from", str(tmp_path / "src")]
    assert train(tmp_path / "a", *resume, "--resume") == 2
    assert "model config: memory_options.balance_lr 0.5 (checkpoint) vs 0.001 (this run)" in capsys.readouterr().err


def test_a_rank_reading_another_copy_of_the_source_stops_every_rank(source, two_rank_launch):
    """Every rank loads the source's model.pt itself (on a cluster maybe from its node's copy): the ranks compare
    the sha256 of what they read, and a rank that read another file stops them all, naming the ranks and the path.
    2 gloo ranks (run 0 of two_rank_launch); rank 1 is shown the step-2 weights under the step-3 path."""
    r, copies, _ = two_rank_launch
    # run 0 ended well on both ranks (the launch's code is then run 1's): each wrote what it saw, its last act
    assert all((copies / f"rank{rank}.json").is_file() for rank in (0, 1)), r.stderr[-3000:]
    seen = [json.loads((copies / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    path = ckpt.step_dir(source.resolve(), 3) / "model.pt"
    good, bad = file_sha256(path), file_sha256(ckpt.step_dir(source, 2) / "model.pt")
    assert seen[0]["same"] == seen[1]["same"] and seen[0]["same"]["model_sha256"] == good
    for rank in (0, 1):
        message = seen[rank]["rank 1 reads another copy"]
        assert message.startswith("ValueError: --init-from source") and str(path) in message, message
        assert f"rank 0 read sha256 {good[:12]}" in message and f"rank 1 read {bad[:12]}" in message, message


# ---- the bytes hashed are the bytes loaded ----------------------------------------------------------------------
def source_changed_after_hashing(monkeypatch, change) -> None:
    """Run ``change()`` right after the ranks have compared the sha256 of the source's model.pt, before the
    weights are loaded: the window in which another process could re-save or rewrite the source."""
    from nanochat import init_from

    real = init_from.same_file_on_every_rank

    def then_change(*a, **k):
        sha = real(*a, **k)
        change()
        return sha

    monkeypatch.setattr(init_from, "same_file_on_every_rank", then_change)


def test_a_source_resaved_after_hashing_still_loads_the_bytes_hashed(tmp_path, source, monkeypatch):
    """A checkpoint is (re)written by renaming a complete file into place; the model.pt that was hashed must be the
    one loaded, and the sha256 recorded must be that file's (not the replacement's)."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    hashed = ckpt.step_dir(src, 3) / "model.pt"
    sha, weights = file_sha256(hashed), torch.load(hashed)

    def resave_by_rename():  # the step-2 weights renamed over step 3's model.pt
        shutil.copy(ckpt.step_dir(src, 2) / "model.pt", hashed.with_suffix(".new"))
        os.replace(hashed.with_suffix(".new"), hashed)

    source_changed_after_hashing(monkeypatch, resave_by_rename)
    first = record_first_step(monkeypatch)
    assert train(tmp_path / "a", *MOME, "--num-iterations", "1", "--init-from", str(src)) == 0
    assert file_sha256(hashed) != sha  # the replacement happened
    assert sorted(first["weights"]) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(first["weights"][name], tensor), name
    assert json.loads((tmp_path / "a" / "config.json").read_text())["init_from"]["model_sha256"] == sha


def test_a_source_rewritten_in_place_after_hashing_is_refused(tmp_path, source, monkeypatch, capsys):
    """A copy over the file (``cp other model.pt``) rewrites it in place: the open file then reads the new bytes,
    so the run must stop, naming the file, rather than load weights other than the ones it hashed."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    target = ckpt.step_dir(src, 3) / "model.pt"
    # written long before the run starts, as a real source is: file times are kept in coarse ticks (a few ms)
    hour_ago = target.stat().st_mtime_ns - 3600 * 10**9
    os.utime(target, ns=(hour_ago, hour_ago))

    def rewrite_in_place():
        with open(target, "r+b") as f:
            f.write((ckpt.step_dir(src, 2) / "model.pt").read_bytes())
            f.truncate()

    source_changed_after_hashing(monkeypatch, rewrite_in_place)
    assert train(tmp_path / "a", *MOME, "--num-iterations", "1", "--init-from", str(src)) == 2
    err = capsys.readouterr().err
    assert f"--init-from source {target.resolve()} changed while it was read" in err, err
    assert not (tmp_path / "a" / "metrics.jsonl").exists()


def test_a_wrong_source_is_refused_before_the_eval_rows_and_the_model(tmp_path, source, monkeypatch, capsys,
                                                                       embedded_data_dir, tiny_tokenizer_dir):
    """Like a bad --resume, a wrong --init-from (no such run or step, another architecture, another tokenizer) fails
    in seconds: before the eval rows are tokenized and the model and optimizer are built."""
    def slow_work(*a, **k):
        raise AssertionError("the expensive set-up started before the --init-from checks")

    monkeypatch.setattr(base_train, "load_eval_rows", slow_work)
    monkeypatch.setattr(base_train, "build_model", slow_work)
    for spec, extra, needle in ((tmp_path / "missing", [], "no such run directory"),
                                (f"{source}:9", [], "no checkpoint step_000009"),
                                (source, ["--mome-slots", "6"], "memory_options.slots 4 (source) vs 6 (this run)")):
        assert train(tmp_path / "r", *MOME, *extra, "--num-iterations", "1", "--init-from", str(spec)) == 2
        assert needle in capsys.readouterr().err
    # a run on data (a tokenizer) from the synthetic-data source (none recorded)
    assert base_train.main(["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir),
                            "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "32", *MOME,
                            "--init-from", str(source), "--run-dir", str(tmp_path / "d")]) == 2
    assert "records no tokenizer (trained on --synthetic-data" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "d").exists()


def test_another_context_length_names_the_sliding_windows_it_changes(tmp_path):
    """S layers attend to sequence_len // 2 keys: at another context length the weights see other windows than the
    ones they were trained with; allowed (a fine-tune), but said."""
    from nanochat.gpt import GPTConfig
    from nanochat.init_from import check_source

    tiny = dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=32, vocab_size=64)
    source = {"model_config": GPTConfig(sequence_len=32, window_pattern="SL", **tiny).to_dict()}
    note = check_source(tmp_path, 3, source, GPTConfig(sequence_len=64, window_pattern="SL", **tiny), None, True)
    assert note.endswith("context 64 tokens, the source trained at 32 (the S layers' sliding window: 32 tokens, "
                         "trained with 16)")
    full = {"model_config": GPTConfig(sequence_len=32, **tiny).to_dict()}
    assert check_source(tmp_path, 3, full, GPTConfig(sequence_len=64, **tiny), None, True).endswith(
        "context 64 tokens, the source trained at 32")
