"""speedrun.sh's decisions, made before any download: GPU or CPU (with a fake nvidia-smi on PATH) and the
process x device-batch layout for 1-8 GPUs (arithmetic, then base_train --dry-run of the speedrun's own config)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from nanochat.checkpoint import CKPT_DIR
from nanochat.cli_types import flag_name
from nanochat.plan import choose_layout, grad_accum_steps
from scripts import speedrun_preflight as pre
from test_shell_locks import VENV_LOCK, failing_flock, venv_lock
from test_speedrun_override import write_checkpoint

SPEEDRUN = (REPO / "speedrun.sh").read_text()
SPEEDRUN_CONFIG = "configs/d12/mome_c1_m6.toml"
# 524,288 tokens = device batch x 2048 x processes x accum: only 1, 2, 4, 8 processes split it with 32 rows
EXPECTED = {1: (1, 32, 8), 2: (2, 32, 4), 3: (2, 32, 4), 4: (4, 32, 2), 5: (4, 32, 2), 6: (4, 32, 2),
            7: (4, 32, 2), 8: (8, 32, 1)}


@pytest.mark.parametrize("gpus", range(1, 9))
def test_layout_splits_the_speedrun_batch_on_any_gpu_count(gpus):
    nproc, device_batch, accum = choose_layout(524288, 2048, gpus, 32)
    assert (nproc, device_batch, accum) == EXPECTED[gpus]
    assert nproc * device_batch * 2048 * accum == 524288  # exact, as base_train requires
    assert grad_accum_steps(524288, device_batch, 2048, nproc) == accum
    for more in range(nproc + 1, gpus + 1):  # every larger process count is impossible with any device batch
        assert all(524288 % (b * 2048 * more) for b in range(1, 33))


def test_layout_prefers_processes_then_the_largest_device_batch():
    assert choose_layout(524288, 2048, 8, 24) == (8, 16, 2)  # 24 rows do not divide; 16 do
    assert choose_layout(3 * 2048 * 10, 2048, 3, 4) == (3, 2, 5)  # a total batch 3 GPUs can split uses all 3
    with pytest.raises(ValueError, match="not a multiple of --max-seq-len 2048"):
        choose_layout(524288 + 1, 2048, 2, 32)


@pytest.mark.parametrize("gpus", range(1, 9))
def test_layout_cli_dry_runs_the_speedrun_config(gpus, tmp_path, capsys):
    """What speedrun.sh runs before downloading: stdout is "NPROC DEVICE_BATCH" and plan.json is base_train's
    own plan for that world size."""
    flags = ["--config", SPEEDRUN_CONFIG, "--run-dir", str(tmp_path), "--resume", "auto"]
    assert pre.main(["layout", "--gpus", str(gpus), "--", *flags]) == 0
    out, err = capsys.readouterr()
    nproc, device_batch, accum = EXPECTED[gpus]
    assert out == f"{nproc} {device_batch}\n"
    assert f"524,288 tokens/step = {nproc} process(es) x device batch {device_batch} x 2048 tokens x grad accum " \
           f"{accum}" in err
    assert ("left idle" in err) == (nproc < gpus)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert (plan["world_size"], plan["device_batch_size"], plan["grad_accum_steps"]) == (nproc, device_batch, accum)


def test_layout_cli_stops_on_bad_flags(tmp_path, capsys):
    flags = ["--config", SPEEDRUN_CONFIG, "--run-dir", str(tmp_path), "--memory", "mome", "--mome-topk", "9"]
    assert pre.main(["layout", "--gpus", "2", "--", *flags]) == 2
    assert "base_train --dry-run failed" in capsys.readouterr().err


def test_speedrun_checks_the_layout_before_any_download():
    gpu_run = SPEEDRUN[SPEEDRUN.index("gpu_run() {"):SPEEDRUN.index("cpu_demo() {")]
    layout = gpu_run.index("scripts.speedrun_preflight layout")
    assert layout < gpu_run.index("scripts.prepare_data") < gpu_run.index("scripts.tok_train")
    assert SPEEDRUN_CONFIG in gpu_run
    assert 'train+=(--device-batch-size "$device_batch")' in gpu_run
    assert 'torchrun --standalone --nproc_per_node="$nproc" -m scripts.base_train "${train[@]}"' in gpu_run
    assert SPEEDRUN.index("scripts.speedrun_preflight mode") < SPEEDRUN.index('gpu) gpu_run "$ngpu"')
    assert "have_internet" not in SPEEDRUN and "gpu_count" not in SPEEDRUN  # the old per-shell detection is gone


def test_a_run_is_done_only_when_completed_with_its_final_evaluation_and_the_same_flags(tmp_path, capsys):
    """What lets `bash speedrun.sh` after a finished run skip it: summary.json "completed" (a stop during the final
    evaluation is "interrupted") and config.json's args (as base_train writes them, with the defaults it
    resolves) equal to the flags speedrun.sh would pass now."""
    from nanochat.train_args import parse_args

    run = tmp_path / "run"
    flags = ["--depth", "4", "--num-iterations", "20", "--core-max-per-task", "4", "--run-dir", str(run),
             "--resume", "auto"]
    assert "no summary.json" in pre.unfinished_run(run, flags)
    args = parse_args(flags)
    args.run_name, args.data_seed, args.compile = "d4-base", args.seed, False  # what base_train resolves
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"args": vars(args)}, default=str))
    summary = {"stop_reason": "interrupted", "step": 20, "num_iterations": 20, "interrupted_during": "final_eval"}
    (run / "summary.json").write_text(json.dumps(summary))
    assert "stop reason: interrupted" in pre.unfinished_run(run, flags)
    assert pre.main(["done", str(run), "--", *flags]) == 1
    (run / "summary.json").write_text(json.dumps({**summary, "stop_reason": "completed"}))
    assert pre.unfinished_run(run, flags) is None
    assert pre.main(["done", str(run), "--", *flags]) == 0
    more = [f if f != "20" else "30" for f in flags]  # DEMO_STEPS=30 after a 20-step demo
    assert pre.unfinished_run(run, more) == f"{run} completed with other flags (num_iterations)"
    assert pre.main(["done", str(run), "--", *more]) == 1
    assert "(core_max_per_task)" in pre.unfinished_run(run, [*flags, "--core-max-per-task", "8"])
    assert "(memory" in pre.unfinished_run(run, [*flags, "--memory", "mome"])
    (run / "summary.json").write_text('{"stop_reason": "compl')  # cut short: not done, and no traceback
    assert pre.main(["done", str(run), "--", *flags]) == 1
    assert "summary.json is not valid JSON" in capsys.readouterr().err


def test_a_run_finished_by_hand_with_resume_or_another_layout_is_done(tmp_path):
    """A run finished by hand with --resume (or on another GPU count: --device-batch-size, --keep-last) was "completed
    with other flags (device_batch_size, resume)", so speedrun.sh ran its final evaluation again; the
    layout and bookkeeping flags (results.SAME_RUN_IGNORED_ARGS) are ignored, the others (the seed too) count."""
    from nanochat.train_args import parse_args

    run = tmp_path / "run"
    flags = ["--depth", "4", "--num-iterations", "20", "--run-dir", str(run), "--resume", "auto"]
    by_hand = parse_args(["--depth", "4", "--num-iterations", "20", "--run-dir", str(run), "--resume",
                          "--device-batch-size", "8", "--keep-last", "3"])
    by_hand.run_name, by_hand.data_seed, by_hand.compile = "d4-base", by_hand.seed, False
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"stop_reason": "completed", "step": 20, "num_iterations": 20}))
    (run / "config.json").write_text(json.dumps({"args": vars(by_hand)}, default=str))
    assert pre.unfinished_run(run, flags) is None
    assert pre.unfinished_run(run, [*flags, "--matrix-lr", "0.05"]) == f"{run} completed with other flags (matrix_lr)"
    # another seed is another run, whatever scripts.results averages: the demo's Base and MoME would compare seeds
    by_hand.seed = 7
    (run / "config.json").write_text(json.dumps({"args": vars(by_hand)}, default=str))
    assert pre.unfinished_run(run, flags) == f"{run} completed with other flags (seed)"


def test_a_run_finished_with_trajectory_flags_speedrun_does_not_pass_is_not_done(tmp_path):
    """The done check compared only the flags speedrun.sh passes: a demo model finished by hand from another run's
    weights (--init-from) or with another --data-seed was "done", and its numbers went into the demo's report beside
    a model trained from scratch (base_train --resume refuses that run with speedrun's flags). A flag left at its
    default (None) now counts too, the data seed as base_train resolves it (= --seed); one an older config.json lacks
    is not compared, as before."""
    from nanochat.train_args import parse_args

    run = tmp_path / "run"
    flags = ["--depth", "4", "--num-iterations", "20", "--run-dir", str(run), "--resume", "auto"]
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"stop_reason": "completed", "step": 20, "num_iterations": 20}))

    def recorded(*extra, drop=()):
        args = parse_args([*flags, *extra])
        args.run_name, args.compile = "d4-base", False
        args.data_seed = args.seed if args.data_seed is None else args.data_seed
        (run / "config.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in drop}},
                                                    default=str))

    recorded()
    assert pre.unfinished_run(run, flags) is None
    recorded("--init-from", str(tmp_path / "other"))
    assert pre.unfinished_run(run, flags) == f"{run} completed with other flags (init_from)"
    recorded("--data-seed", "5")
    assert pre.unfinished_run(run, flags) == f"{run} completed with other flags (data_seed)"
    recorded("--target-flops", "1e12")
    assert "target_flops" in pre.unfinished_run(run, flags)
    recorded(drop=("init_from", "target_flops"))  # an older version's config.json, without these flags
    assert pre.unfinished_run(run, flags) is None


def test_a_run_finished_by_hand_with_resume_override_lr_is_done_one_started_with_other_lrs_is_not(tmp_path, capsys):
    """A non-finite stop under speedrun.sh advises its base_train command with --resume N --resume-override-lr and
    half the LRs; the run finished that way was "completed with other flags (matrix_lr, resume_override_lr)", so
    speedrun.sh sent it to base_train --resume auto, which refused it (exit 2) on every later start, and no report
    was written. A run whose LRs differ only by the overrides config.json records (lr_overrides), from speedrun's
    values, is done now, and the check says so; one started with other LRs is still another run."""
    from nanochat.train_args import parse_args

    run = tmp_path / "run"
    flags = ["--depth", "4", "--num-iterations", "20", "--run-dir", str(run), "--resume", "auto"]
    recipe = parse_args(flags)
    matrix, embedding = recipe.matrix_lr, recipe.embedding_lr
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"stop_reason": "completed", "step": 20, "num_iterations": 20}))

    def recorded(command, overrides):
        args = parse_args(command)
        args.run_name, args.data_seed, args.compile = "d4-base", args.seed, False
        (run / "config.json").write_text(json.dumps({"args": vars(args), "lr_overrides": overrides}, default=str))

    def resumed(step, **lrs):
        return [*flags[:-2], "--resume", str(step), "--resume-override-lr",
                *(x for k, v in lrs.items() for x in (flag_name(k), str(v)))]

    halved = {"step": 8, "changes": {"matrix_lr": {"checkpoint": matrix, "now": matrix / 2},
                                     "embedding_lr": {"checkpoint": embedding, "now": embedding / 2}}}
    recorded(resumed(8, matrix_lr=matrix / 2, embedding_lr=embedding / 2), [halved])
    assert pre.unfinished_run(run, flags) is None
    assert pre.main(["done", str(run), "--", *flags]) == 0
    assert (f"{run}: learning rates overridden by hand (--resume-override-lr): --matrix-lr {matrix} -> {matrix / 2} "
            f"from step 8, --embedding-lr {embedding} -> {embedding / 2} from step 8") in capsys.readouterr().err
    # halved twice (a second non-finite stop, the advice followed again): still from speedrun's values
    again = {"step": 12, "changes": {"matrix_lr": {"checkpoint": matrix / 2, "now": matrix / 4}}}
    recorded(resumed(12, matrix_lr=matrix / 4, embedding_lr=embedding / 2), [halved, again])
    assert pre.unfinished_run(run, flags) is None
    capsys.readouterr()  # the check says so for a finished run
    # started with other LRs: not this run, overridden on a resume or not
    recorded([*flags, "--matrix-lr", str(matrix * 2)], [])
    assert pre.unfinished_run(run, flags) == f"{run} completed with other flags (matrix_lr)"
    other_start = {"step": 8, "changes": {"matrix_lr": {"checkpoint": matrix * 2, "now": matrix / 2}}}
    recorded(resumed(8, matrix_lr=matrix / 2), [other_start])
    assert pre.unfinished_run(run, flags) == f"{run} completed with other flags (matrix_lr)"
    assert pre.main(["done", str(run), "--", *flags]) == 1
    assert "overridden" not in capsys.readouterr().err
    # an LR no recorded override explains (config.json's args edited, say), and the other flags, still count
    recorded(resumed(8, matrix_lr=matrix / 2, embedding_lr=embedding / 2), [other_start | {"changes": {}}])
    assert pre.unfinished_run(run, flags) == f"{run} completed with other flags (embedding_lr, matrix_lr)"
    recorded([*resumed(8, matrix_lr=matrix / 2, embedding_lr=embedding / 2), "--seed", "7"], [halved])
    assert pre.unfinished_run(run, flags) == f"{run} completed with other flags (data_seed, seed)"


def test_a_run_an_older_version_recorded_with_core_cap_0_is_done_with_all(tmp_path, capsys):
    """--core-max-per-task 0 meant all examples in the older versions that took it: a run they recorded with it is
    done for flags asking for all (-1, the default), as base_train --resume reads it (nanochat.train_resume); a
    real cap still differs, and 0 for a run not recorded with it is refused as base_train refuses it."""
    from nanochat.train_args import parse_args

    run = tmp_path / "run"
    flags = ["--depth", "4", "--num-iterations", "20", "--run-dir", str(run), "--resume", "auto"]
    args = parse_args(flags)
    args.run_name, args.data_seed, args.compile = "d4-base", args.seed, False
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"stop_reason": "completed", "step": 20, "num_iterations": 20}))
    (run / "config.json").write_text(json.dumps({"args": {**vars(args), "core_max_per_task": 0}}, default=str))
    assert pre.unfinished_run(run, flags) is None
    assert pre.main(["done", str(run), "--", *flags, "--core-max-per-task", "0"]) == 0
    assert "recorded with --core-max-per-task 0" in capsys.readouterr().err
    assert "(core_max_per_task)" in pre.unfinished_run(run, [*flags, "--core-max-per-task", "8"])
    (run / "config.json").write_text(json.dumps({"args": vars(args)}, default=str))  # recorded -1
    assert pre.main(["done", str(run), "--", *flags, "--core-max-per-task", "0"]) == 1
    assert "must be an integer >= 1, or -1 for all" in capsys.readouterr().err


def test_a_config_json_with_null_args_is_not_done_and_no_traceback(tmp_path, capsys):
    """A completed run whose config.json holds "args": null (a hand edit, another tool) crashed `done` with an
    AttributeError traceback in speedrun.sh's output; it is now a run not done (base_train --resume says what it
    finds), as a config.json with no "args" is."""
    run = tmp_path / "run"
    flags = ["--depth", "4", "--num-iterations", "20", "--run-dir", str(run), "--resume", "auto"]
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"stop_reason": "completed", "step": 20, "num_iterations": 20}))
    for config in ({"args": None}, {}):
        (run / "config.json").write_text(json.dumps(config))
        assert pre.unfinished_run(run, flags).startswith(f"{run} completed with other flags (")
        assert pre.main(["done", str(run), "--", *flags]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_mode_with_the_demo_flags_gives_the_dtype_and_each_models_state_in_one_line(tmp_path, monkeypatch, capsys):
    """speedrun.sh's one Python start before the demo (the mode, the dtype and both done checks were four): each
    model's done check is `done`'s, on its flags with the chosen --dtype added."""
    from nanochat.train_args import parse_args

    monkeypatch.setenv("SPEEDRUN_MODE", "cpu")
    demo = tmp_path / "demo"
    common = ["--depth", "4", "--num-iterations", "20", "--resume", "auto"]
    base, mome = [*common, "--run-dir", str(demo / "base")], [*common, "--memory", "mome", "--run-dir",
                                                               str(demo / "mome")]
    args = parse_args([*base, "--dtype", "float32"])
    args.run_name, args.data_seed, args.compile = "d4-base", args.seed, False
    (demo / "base").mkdir(parents=True)
    (demo / "base" / "summary.json").write_text(json.dumps({"stop_reason": "completed", "step": 20}))
    (demo / "base" / "config.json").write_text(json.dumps({"args": vars(args)}, default=str))
    argv = ["mode", "--demo-dir", str(demo), "--asked", "float32", "--", *base, "--", *mome]
    assert pre.main(argv) == 0
    assert capsys.readouterr().out == "cpu 0 float32 done train\n"
    assert pre.main([*argv[:4], "bfloat16", *argv[5:]]) == 0  # another dtype: not this run
    assert capsys.readouterr().out == "cpu 0 bfloat16 train train\n"
    assert pre.main(["mode"]) == 0 and capsys.readouterr().out == "cpu 0\n"  # without the demo's flags, as before
    with pytest.raises(SystemExit):
        pre.main(["mode", "--demo-dir", str(demo), "--", *base])
    assert "needs the two demo models' flags" in capsys.readouterr().err


def test_a_stop_under_speedrun_names_speedrun_and_the_runner_keeps_its_own_way(monkeypatch):
    """base_train stopped under speedrun.sh said "continue with --resume", then speedrun.sh "run 'bash speedrun.sh'
    again": two ways on, the first no speedrun user's. speedrun.sh names its command in CONTINUE_COMMAND_ENV and the
    stop names it (resume_way too: "running 'bash speedrun.sh' again reruns the final evaluation"), the refused-resume
    advice too (it said "drop --resume and add --overwrite", flags 'bash speedrun.sh' does not take), and under
    scripts.run the runner's way comes first."""
    from nanochat import run_control
    from nanochat.train_resume import RUNNER_AFRESH_ENV, how_to_start_afresh

    monkeypatch.delenv(RUNNER_AFRESH_ENV, raising=False)
    monkeypatch.delenv(run_control.CONTINUE_COMMAND_ENV, raising=False)
    assert run_control.how_to_continue() == "continue with --resume"
    monkeypatch.setenv(run_control.CONTINUE_COMMAND_ENV, "bash speedrun.sh")
    assert run_control.how_to_continue() == "continue by running 'bash speedrun.sh' again"
    assert run_control.resume_way() == "running 'bash speedrun.sh' again"
    # a refused resume: the way a speedrun.sh user can take (test_train_e2e runs it), not base_train's own flags
    afresh = how_to_start_afresh(Path("runs/x"))
    assert afresh.startswith("to start afresh instead, delete (or move) runs/x and run 'bash speedrun.sh' again; "
                             "to continue it instead, run 'bash speedrun.sh' again with what the run was trained with"),\
        afresh
    assert "--resume" not in afresh and "--overwrite" not in afresh and "--run-dir" not in afresh, afresh
    monkeypatch.delenv(run_control.CONTINUE_COMMAND_ENV)
    assert "drop --resume and add --overwrite" in how_to_start_afresh(Path("runs/x"))
    monkeypatch.setenv(run_control.CONTINUE_COMMAND_ENV, "bash speedrun.sh")
    monkeypatch.setenv(RUNNER_AFRESH_ENV, "python -m scripts.run configs/mini/base.toml -- --overwrite")
    assert run_control.how_to_continue() == "continue by running the same scripts.run command again"
    assert 'export NANOCHAT_CONTINUE_COMMAND="bash speedrun.sh"' in SPEEDRUN
    assert run_control.CONTINUE_COMMAND_ENV == "NANOCHAT_CONTINUE_COMMAND"


def demo_checkpoint(run, dtype):
    """A demo model's last checkpoint as list_steps and load_meta read it, recorded with ``dtype``."""
    step = run / CKPT_DIR / "step_000020"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 20, "model_config": {}, "config": {"args": {"dtype": dtype}}}))


@pytest.mark.parametrize("native,chosen", [(True, "bfloat16"), (False, "float32"), (None, "float32")])
def test_the_demo_dtype_is_bf16_only_on_a_cpu_with_native_bf16(tmp_path, monkeypatch, capsys, native, chosen):
    """No checkpoint yet: bf16 where the CPU multiplies it natively, float32 where it does not (bf16 ~60x slower)
    or cannot tell; DEMO_DTYPE (--asked) wins, and a forced bf16 on a slow CPU says it is slow."""
    from nanochat import common

    monkeypatch.setattr(common, "cpu_has_native_bf16", lambda: native)
    (tmp_path / "demo" / "data").mkdir(parents=True)  # the demo's data, no model yet
    # the dtype subcommand; speedrun.sh's `mode --demo-dir` makes the same choice (demo_dtype) in its one start
    assert pre.main(["dtype", str(tmp_path / "demo"), "--asked", ""]) == 0
    out, err = capsys.readouterr()
    assert out == f"{chosen}\n" and err.count("\n") == 1 and err.startswith(f"[speedrun] CPU demo dtype: {chosen} (")
    assert ("DEMO_DTYPE=float32 forces float32" if native else "DEMO_DTYPE=bfloat16 forces bf16") in err
    assert ("no AVX512-BF16 or AMX on this CPU: a bf16 matmul costs about" in err) == (native is False)
    assert ("cannot tell" in err) == (native is None)
    assert pre.demo_dtype(tmp_path / "missing") == (chosen, pre.demo_dtype(tmp_path / "demo")[1])  # a first demo
    for asked in ("bfloat16", "float32"):
        dtype, why = pre.demo_dtype(tmp_path / "demo", asked)
        assert dtype == asked and why.startswith("DEMO_DTYPE")
        assert ("a bf16 matmul costs about" in why) == (asked == "bfloat16" and native is False)


@pytest.mark.parametrize("native", [True, False])
def test_a_demo_with_a_checkpoint_continues_in_the_dtype_it_started_with(tmp_path, monkeypatch, native):
    """Started in bf16 on an AMX Xeon and continued on an AVX2 EPYC (or the other way round): the checkpoint's dtype,
    as base_train --resume requires; the first model with a checkpoint decides (base, then mome)."""
    from nanochat import common

    monkeypatch.setattr(common, "cpu_has_native_bf16", lambda: native)
    demo = tmp_path / "demo"
    started = "float32" if native else "bfloat16"
    demo_checkpoint(demo / "mome", started)
    (demo / "base" / CKPT_DIR).mkdir(parents=True)  # a model stopped before its first checkpoint: no say
    dtype, why = pre.demo_dtype(demo)
    assert (dtype, why) == (started, f"the dtype {demo / 'mome'} started with: a demo with a checkpoint continues "
                                     "with its flags")
    demo_checkpoint(demo / "base", "bfloat16")
    assert pre.demo_dtype(demo)[0] == "bfloat16"
    assert pre.demo_dtype(demo, "float32")[0] == "float32"  # forced: base_train then refuses the resume
    for run in ("base", "mome"):  # corrupt metadata is base_train's to report: the CPU decides meanwhile
        (demo / run / CKPT_DIR / "step_000020" / "meta.json").write_text("{")
    assert pre.demo_dtype(demo)[0] == ("bfloat16" if native else "float32")


def fake_nvidia_smi(bin_dir, gpus: int, fail: bool = False):
    """An nvidia-smi that lists ``gpus`` H100s (or fails like a machine whose driver is not loaded)."""
    bin_dir.mkdir(exist_ok=True)
    lines = "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})"\n' for i in range(gpus))
    body = ('echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9\n' if fail
            else f'case "$1" in\n  -L)\n{lines}  ;;\n  --query-gpu*) echo 550.54.15 ;;\nesac\n')
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)


def run_mode(monkeypatch, capsys, path, mode=None):
    monkeypatch.setenv("PATH", str(path))  # the probe runs nvidia-smi from PATH; python itself is sys.executable
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if mode is None:
        monkeypatch.delenv("SPEEDRUN_MODE", raising=False)
    else:
        monkeypatch.setenv("SPEEDRUN_MODE", mode)
    monkeypatch.setattr(pre, "have_internet", lambda: pytest.fail("no internet check when the GPUs are unusable"))
    code = pre.main(["mode"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.skipif(pre.probe().torch_gpus > 0, reason="needs a torch that cannot use CUDA (this one can)")
@pytest.mark.parametrize("built_for", [None, "13.0"])
def test_gpu_machine_with_cpu_torch_stops_with_advice(built_for, tmp_path, monkeypatch, capsys):
    """The advice names the cause: a CPU-only torch build, or a CUDA build that cannot start (the driver). The
    installed build is set here: CI's is CPU-only, the GPU machine image's a CUDA one."""
    monkeypatch.setattr(torch.version, "cuda", built_for)
    fake_nvidia_smi(tmp_path / "bin", 8)
    code, out, err = run_mode(monkeypatch, capsys, tmp_path / "bin")
    assert code == 2 and out == ""  # speedrun.sh stops here: no "cpu" for the shell to act on
    assert "nvidia-smi sees 8 GPU(s) but torch cannot use CUDA" in err
    if built_for is None:
        assert "CPU-only build" in err and "rm -rf .venv && bash speedrun.sh" in err
    else:
        assert "CPU-only" not in err
        assert f"is built for CUDA {built_for} but cannot initialise it with NVIDIA driver 550.54.15" in err
        assert "update the NVIDIA driver" in err
    assert "SPEEDRUN_MODE=cpu bash speedrun.sh" in err
    code, out, err = run_mode(monkeypatch, capsys, tmp_path / "bin", mode="cpu")  # the deliberate override
    assert (code, out) == (0, "cpu 0\n")


@pytest.mark.skipif(pre.probe().torch_gpus > 0, reason="needs a torch that cannot use CUDA (this one can)")
def test_machine_without_gpus_runs_the_cpu_demo(tmp_path, monkeypatch, capsys):
    (tmp_path / "empty").mkdir()
    code, out, err = run_mode(monkeypatch, capsys, tmp_path / "empty")
    assert (code, out) == (0, "cpu 0\n") and "nvidia-smi: not installed" in err
    fake_nvidia_smi(tmp_path / "broken", 0, fail=True)  # nvidia-smi installed, no driver: not a usable GPU box
    code, out, err = run_mode(monkeypatch, capsys, tmp_path / "broken")
    assert (code, out) == (0, "cpu 0\n") and "couldn't communicate with the NVIDIA driver" in err
    code, out, err = run_mode(monkeypatch, capsys, tmp_path / "empty", mode="gpu")
    assert code == 2 and "SPEEDRUN_MODE=gpu but no CUDA GPU is visible" in err
    code, out, err = run_mode(monkeypatch, capsys, tmp_path / "empty", mode="tpu")
    assert code == 2 and "SPEEDRUN_MODE must be gpu or cpu (got 'tpu')" in err


def probe(**kw):
    base = dict(smi_gpus=4, smi_status="ok", driver="470.57.02", torch_version="2.13.0+cu128", torch_cuda="12.8",
                torch_gpus=0, cuda_warning="CUDA initialization: The NVIDIA driver on your system is too old",
                visible_devices=None)
    return pre.Probe(**{**base, **kw})


def test_driver_too_old_and_hidden_devices_say_what_to_do():
    with pytest.raises(pre.Stop) as e:
        pre.decide_mode("", probe(), lambda: True)
    msg = str(e.value)
    assert "built for CUDA 12.8 but cannot initialise it with NVIDIA driver 470.57.02" in msg
    assert "driver on your system is too old" in msg and "update the NVIDIA driver" in msg
    assert "pip install torch==2.13.0 --index-url" in msg
    with pytest.raises(pre.Stop, match="CUDA_VISIBLE_DEVICES=''"):
        pre.decide_mode("", probe(visible_devices="", cuda_warning=None), lambda: True)


def test_usable_gpus_need_internet_or_an_explicit_mode():
    ok = probe(torch_gpus=4, cuda_warning=None)
    assert pre.decide_mode("", ok, lambda: True) == ("gpu", 4)
    with pytest.raises(pre.Stop, match="huggingface.co is unreachable"):  # no silent CPU demo on a GPU box
        pre.decide_mode("", ok, lambda: False)
    assert pre.decide_mode("gpu", ok, lambda: pytest.fail("SPEEDRUN_MODE=gpu skips the check")) == ("gpu", 4)
    assert pre.decide_mode("cpu", ok, lambda: True) == ("cpu", 0)
    assert pre.decide_mode("", probe(smi_gpus=8, torch_gpus=2, cuda_warning=None, visible_devices="0,1"),
                           lambda: True) == ("gpu", 2)


def test_cli_prints_one_line_for_the_shell(tmp_path):
    """The real entry point speedrun.sh calls, in a fresh interpreter with a fake nvidia-smi listing 2 GPUs."""
    import os
    import subprocess

    fake_nvidia_smi(tmp_path / "bin", 2)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "SPEEDRUN_MODE": ""}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run([sys.executable, "-m", "scripts.speedrun_preflight", "mode"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    if pre.probe().torch_gpus > 0:
        pytest.skip("this torch can use CUDA")
    assert r.returncode == 2 and r.stdout == "" and "nvidia-smi sees 2 GPU(s)" in r.stderr, r.stderr


# speedrun.sh's own shell logic, run on a copy of it whose steps are fakes: setup_env.sh and the venv's `python`
# record each step in FAKE_LOG; its base_train trains for FAKE_TRAIN_S seconds unless a SIGINT/SIGTERM comes, and
# then, like the real one, writes summary.json with stop_reason "interrupted" and exits 0; summary.json keeps its
# flags, which the fake `speedrun_preflight done` compares as the real one compares config.json's.
FAKE_PYTHON = r'''
import json, os, signal, sys, time
from pathlib import Path
args = sys.argv[1:]
module = args[1] if args[:1] == ["-m"] else args[0]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(" ".join(args) + "\n")
flag = lambda name: args[args.index(name) + 1]
if module == "scripts.speedrun_preflight" and os.environ.get("FAKE_REAL_PREFLIGHT") and \
        os.environ.get("FAKE_REAL_ONLY", args[2]) == args[2]:  # the real one on the run files (FAKE_REAL_ONLY's alone)
    os.execve(sys.executable, [sys.executable, *args], {**os.environ, "PYTHONPATH": os.environ["FAKE_REAL_PREFLIGHT"]})
elif module == "scripts.speedrun_preflight" and args[2] == "done":
    summary = Path(args[3]) / "summary.json"
    done = summary.is_file() and json.loads(summary.read_text()) == {"stop_reason": "completed", "signals": [],
                                                                      "flags": args[5:]}
    sys.exit(0 if done else 1)
elif module == "scripts.speedrun_preflight" and args[2] == "mode" and "--demo-dir" in args and \
        os.environ.get("FAKE_MODE", "cpu 0") == "cpu 0":  # "cpu 0 DTYPE BASE MOME"
    dtype = flag("--asked") or os.environ.get("FAKE_DTYPE", "bfloat16")  # DEMO_DTYPE, else this CPU's (FAKE_DTYPE)
    rest = args[args.index("--") + 1:]
    states = []
    for model in (rest[:rest.index("--")], rest[rest.index("--") + 1:]):
        summary = Path(model[model.index("--run-dir") + 1]) / "summary.json"
        done = summary.is_file() and json.loads(summary.read_text()) == {"stop_reason": "completed", "signals": [],
                                                                          "flags": ["--dtype", dtype, *model]}
        states.append("done" if done else "train")
    print("cpu 0", dtype, *states)
elif module == "scripts.speedrun_preflight":
    print(os.environ.get("FAKE_MODE", "cpu 0") if args[2] == "mode" else "1 32")  # mode; layout
elif module == "scripts.prepare_data" and os.environ.get("FAKE_PREP") == "signal-me":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finishes (exit 0) although speedrun.sh got a SIGTERM: as if
    os.kill(os.getppid(), signal.SIGTERM)  # the signal came between this step and the next
    time.sleep(0.3)
elif module == "scripts.prepare_data" and os.environ.get("FAKE_PREP") == "leave":  # a child that outlives the run
    import subprocess  # and keeps its descriptors
    left = subprocess.Popen(["sleep", "600"], close_fds=False, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    Path(os.environ["FAKE_LOG"] + ".left").write_text(str(left.pid))
elif module == "scripts.prepare_data" and os.environ.get("FAKE_PREP") == "slow":
    (Path(flag("--data-dir")) / "..").resolve().mkdir(parents=True, exist_ok=True)
    Path(os.environ["FAKE_LOG"] + ".prep").write_text(str(os.getpid()))
    time.sleep(30)  # a Ctrl-C ends it with KeyboardInterrupt (exit by SIGINT), a SIGTERM kills it
elif module == "scripts.tok_train":
    Path(flag("--output-dir")).mkdir(parents=True, exist_ok=True)
    (Path(flag("--output-dir")) / "tokenizer.json").write_text("{}")
elif module == "scripts.base_train":
    run, got = Path(flag("--run-dir")), []
    if os.environ.get("FAKE_TRAIN_EXIT"):  # a refusal before training, with nothing written (bad data, say)
        sys.exit(int(os.environ["FAKE_TRAIN_EXIT"]))
    if os.environ.get("FAKE_TRAIN_KILL"):  # killed by a signal speedrun.sh did not get (the OOM killer's SIGKILL)
        os.kill(os.getpid(), getattr(signal, os.environ["FAKE_TRAIN_KILL"]))
    if (run / "checkpoints").is_dir() and (run / "summary.json").is_file() and "--num-iterations" in args:
        saved = json.loads((run / "summary.json").read_text())["flags"]
        was, now = saved[saved.index("--num-iterations") + 1], flag("--num-iterations")
        old_dtype, dtype = saved[saved.index("--dtype") + 1], flag("--dtype")
        if (was, old_dtype) != (now, dtype):  # as the real one refuses a --resume (auto) of its checkpoint with
            # another step count or dtype
            print("error: --resume: the flags do not match the checkpoint's run (see its config.json):\n"
                  + (f"  num_iterations {was} (checkpoint) != {now}" if was != now else
                     f"  --dtype {old_dtype!r} (checkpoint) != {dtype!r}"), file=sys.stderr)
            sys.exit(2)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, frame: got.append(signal.Signals(s).name))
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run / "pid").write_text(str(os.getpid()))
    (run / "continue").write_text(os.environ.get("NANOCHAT_CONTINUE_COMMAND", "unset"))  # the way on it names
    end = time.time() + float(os.environ.get("FAKE_TRAIN_S", "0"))
    while time.time() < end and not got:
        time.sleep(0.02)
    time.sleep(0.2)  # "saving": a forwarded copy of the signal arrives meanwhile
    (run / "summary.json").write_text(json.dumps({"stop_reason": "interrupted" if got else "completed",
                                                 "signals": got, "flags": args[2:]}))
elif module == "scripts.report" and "--check-completed" in args:
    runs = [a for a in args[2:] if not a.startswith("--")]
    bad = [r for r in runs if json.loads((Path(r) / "summary.json").read_text())["stop_reason"] != "completed"]
    for r in bad:
        print(f"not completed: {r}", file=sys.stderr)
    sys.exit(1 if bad else 0)
elif module == "scripts.report":
    Path(flag("--output")).write_text("the report")
'''


STARTED = []  # the speedrun.sh sessions a test started: killed at its end, whatever it asserted


@pytest.fixture
def fake_speedrun(tmp_path):
    repo, fake_bin = tmp_path / "repo", tmp_path / "repo" / ".venv" / "bin"
    (repo / "scripts").mkdir(parents=True)
    fake_bin.mkdir(parents=True)
    shutil.copy(REPO / "speedrun.sh", repo / "speedrun.sh")
    for helper in (REPO / "scripts").glob("*.sh"):  # what speedrun.sh sources, if anything
        shutil.copy(helper, repo / "scripts" / helper.name)
    (repo / "scripts" / "setup_env.sh").write_text('echo setup_env >>"$FAKE_LOG"\n'
                                                   '[ "${FAKE_SETUP:-}" != slow ] || exec sleep 30\n')
    (fake_bin / "activate").write_text(f'PATH="{fake_bin}:$PATH"\n')
    (repo / ".venv" / ".setup_env.stamp").touch()  # what a finished install leaves
    (fake_bin / "python").write_text(f"#!{sys.executable}\n{FAKE_PYTHON}")
    (fake_bin / "python").chmod(0o755)
    (fake_bin / "torchrun").write_text('#!/bin/sh\nshift 2\nexec python "$@"\n')  # --standalone --nproc_per_node=N
    (fake_bin / "torchrun").chmod(0o755)
    env = {**os.environ, "SPEEDRUN_MODE": "cpu", "FAKE_LOG": str(tmp_path / "steps.log"), "FAKE_TRAIN_S": "30"}
    for name in ("DEMO_STEPS", "DEMO_CORE_MAX", "DEMO_DTYPE"):
        env.pop(name, None)
    yield repo, env
    while STARTED:
        proc = STARTED.pop()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the session: speedrun.sh and any step it left behind
        except ProcessLookupError:
            pass
        proc.communicate()


def start_speedrun(repo, env, **kw):
    # a session of its own, as a terminal's job is: its process group is the one a Ctrl-C signals
    proc = subprocess.Popen(["bash", str(repo / "speedrun.sh")], env={**env, **kw}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    STARTED.append(proc)
    return proc


def wait_for_training(repo, proc, model="base", run="runs/speedrun_cpu") -> int:
    pid_file = repo / run / model / "pid"
    for _ in range(500):
        if pid_file.is_file() and pid_file.read_text():
            return int(pid_file.read_text())
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    pytest.fail("the fake base_train never started")


REPORT = "scripts.report runs/speedrun_cpu/base runs/speedrun_cpu/mome"  # the demo's report (not a completion check)


def ran(log, module: str) -> list[str]:
    """The command lines of ``module``'s runs in a FAKE_LOG (its other lines name run dirs too: the done checks)."""
    return [line for line in Path(log).read_text().splitlines() if line.startswith(f"-m {module} ")] \
        if os.path.exists(log) else []


def alive(pid: int) -> bool:
    """Running (a zombie that init has yet to reap has finished)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("signum,group", [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True),
                                          (signal.SIGTERM, True)])
def test_a_stop_signal_reaches_the_training_step_and_the_demo_continues(fake_speedrun, signum, group):
    """`kill PID` (or a scheduler's SIGTERM) to speedrun.sh alone must stop the running step the way Ctrl-C (the
    whole process group) does: the step saves and exits, the demo exits 1 and says where, nothing is left running;
    the next speedrun.sh continues."""
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env)
    child = wait_for_training(repo, proc)
    try:
        (os.killpg if group else os.kill)(proc.pid, signum)
        out, err = proc.communicate(timeout=20)
        assert not alive(child), "the training step was left running after speedrun.sh exited"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
    summary = json.loads((repo / "runs" / "speedrun_cpu" / "base" / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["signals"][0] == signum.name
    assert proc.returncode == 1, (proc.returncode, err)
    # base_train's own "continue ..." line names speedrun.sh's command (run_control.how_to_continue), as speedrun.sh's
    assert (repo / "runs" / "speedrun_cpu" / "base" / "continue").read_text() == "bash speedrun.sh"
    assert "not completed: runs/speedrun_cpu/base" in err and "CPU demo interrupted" in err
    assert not any("mome" in line for line in ran(env["FAKE_LOG"], "scripts.base_train"))
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "CPU demo done" in out, err
    trained = ran(env["FAKE_LOG"], "scripts.base_train")
    assert [line.endswith("runs/speedrun_cpu/base") for line in trained] == [True, True, False]
    assert len(ran(env["FAKE_LOG"], "scripts.tok_train")) == 1


def test_a_signal_before_speedrun_records_the_step_still_reaches_it(fake_speedrun):
    """step() learns the step's pid ($!) only after the fork: a SIGTERM in between, with the step already running,
    set $stopped but reached no step, which trained on to its end (the flake of the test above under load). The
    window (microseconds; a loaded machine's scheduler can stretch it) is widened to 1 s by a sleep before `child=$!`."""
    repo, env = fake_speedrun
    script = repo / "speedrun.sh"
    text = script.read_text()
    assert text.count("child=$! ") == 1
    script.write_text(text.replace("child=$! ", "sleep 1; child=$! "))
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="5")
    child = wait_for_training(repo, proc)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
    summary = json.loads((repo / "runs" / "speedrun_cpu" / "base" / "summary.json").read_text())
    assert (summary["stop_reason"], summary["signals"]) == ("interrupted", ["SIGTERM"]), (summary, err)
    assert proc.returncode == 1 and "not completed: runs/speedrun_cpu/base" in err, (proc.returncode, err)


@pytest.mark.parametrize("stage", ["setup", "training"])
def test_a_second_speedrun_while_one_runs_is_refused_before_anything_runs(fake_speedrun, tmp_path, stage):
    """The refusal used to come after setup_env.sh and the mode probe (18 s; setup_env.sh re-installing .venv
    under the first one): it now comes first, naming what the first one runs (the mode, once it knows it)."""
    repo, env = fake_speedrun
    first = start_speedrun(repo, env, FAKE_SETUP="slow" if stage == "setup" else "")
    if stage == "training":
        wait_for_training(repo, first)
    else:
        for _ in range(500):
            if os.path.exists(env["FAKE_LOG"]):
                break
            time.sleep(0.02)
    try:
        second = start_speedrun(repo, env, FAKE_LOG=str(tmp_path / "second.log"))
        out, err = second.communicate(timeout=20)
        assert second.returncode == 2, (second.returncode, err)
        what = ("the CPU demo in runs/speedrun_cpu" if stage == "training" else
                f"in {repo} (pid {first.pid}; setting up)")
        assert f"[speedrun] another speedrun.sh is running {what}" in err, err
        assert not (tmp_path / "second.log").exists()  # not even setup_env.sh or the mode probe
        assert first.poll() is None  # the first one goes on
        if stage == "training":  # an install (test.sh's, a user's) waits for it; its steps hold no copy
            assert venv_lock(repo, "-x") == 75
    finally:
        os.kill(first.pid, signal.SIGTERM)
        first.communicate(timeout=20)


@pytest.mark.parametrize("rc,message", [(71, "flock: 10: No locks available"), (65, "flock: 10: Bad file descriptor")])
def test_a_lock_that_cannot_be_taken_is_no_other_speedrun(fake_speedrun, tmp_path, rc, message):
    """A file system without locks (or NFS's answer for a descriptor it cannot lock) is no speedrun.sh running:
    the run goes on unlocked and says so once a lock, where it used to refuse every start (exit 2)."""
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", PATH=failing_flock(tmp_path / "stub", rc, message))
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "CPU demo done" in out, err
    assert "another speedrun.sh is running" not in err
    assert out.splitlines()[:2] == [
        f"[speedrun] cannot lock runs/speedrun.lock (flock exit {rc}: {message}): not checking for another speedrun.sh",
        f"[speedrun] cannot lock {VENV_LOCK} (flock exit {rc}: {message}): not waiting for another run in this "
        "checkout"]
    assert (repo / "runs" / "speedrun.lock").read_text() == "the CPU demo in runs/speedrun_cpu (pid " \
        f"{proc.pid})\n"  # the holder line, written all the same


def test_a_step_left_running_does_not_hold_the_venv(fake_speedrun):
    """speedrun.sh holds .venv's lock shared while it runs; a process one of its steps left behind must not hold it
    after the run (an install would wait for it)."""
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", FAKE_PREP="leave")
    out, err = proc.communicate(timeout=20)
    left = int(Path(env["FAKE_LOG"] + ".left").read_text())
    try:
        assert proc.returncode == 0 and "CPU demo done" in out, err
        assert venv_lock(repo, "-x") == 0
    finally:
        os.kill(left, signal.SIGKILL)


def test_a_finished_demo_is_not_run_again(fake_speedrun, tmp_path):
    """`bash speedrun.sh` after a finished demo rebuilt the data and ran both final evaluations again (49 s of the
    91). Now it says it is done; with other flags (DEMO_STEPS) the runs are base_train's again (it refuses them:
    test_another_demo_steps_says_what_to_delete)."""
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "CPU demo done" in out, err
    # the time it gives is this invocation's (a stopped demo run again trained partly in earlier ones)
    assert "[speedrun] CPU demo done: report at runs/speedrun_cpu/report.md (this invocation: 0m" in out, out
    again = str(tmp_path / "again.log")
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", FAKE_LOG=again)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "[speedrun] CPU demo already done: report at runs/speedrun_cpu/report.md" in out
    assert "[speedrun] runs/speedrun_cpu/base already done (completed with its final evaluation)" in out
    assert "[speedrun] runs/speedrun_cpu/mome already done (completed with its final evaluation)" in out
    for module in ("scripts.prepare_data", "scripts.tok_train", "scripts.base_train", "scripts.report"):
        assert ran(again, module) == [], module
    # the mode, the dtype and both done checks were four Python starts of 2-3 s each (torch): now one, each time
    for log in (env["FAKE_LOG"], again):
        assert [line.split()[1] for line in Path(log).read_text().splitlines() if line != "setup_env"] in (
            ["scripts.speedrun_preflight"], ["scripts.speedrun_preflight", "scripts.prepare_data",
                                             "scripts.tok_train", "scripts.base_train", "scripts.report",
                                             "scripts.base_train", "scripts.report", "scripts.report"])


def test_another_demo_steps_says_what_to_delete(fake_speedrun, tmp_path):
    """The demo run again with another DEMO_STEPS: base_train --resume auto refuses the checkpoint of the other step
    count (exit 2), and speedrun.sh used to stop there with no hint. It now says what to delete; once deleted, the
    demo trains both models afresh on the data and tokenizer it kept."""
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0")
    assert proc.communicate(timeout=20) and proc.returncode == 0
    other = str(tmp_path / "other.log")
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", FAKE_LOG=other, DEMO_STEPS="30")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "already done" not in out, (out, err)
    assert "num_iterations 300 (checkpoint) != 30" in err
    # a condition the user can check above (its cause: it said "DEMO_STEPS or DEMO_DTYPE differs" of any refusal,
    # and a run continued by hand with other LRs is refused too, where neither setting helps)
    assert "[speedrun] if base_train refused to continue runs/speedrun_cpu/base because DEMO_STEPS or DEMO_DTYPE " \
           "differs from the run's (num_iterations or --dtype above), delete runs/speedrun_cpu/base and " \
           "runs/speedrun_cpu/mome to change DEMO_STEPS or DEMO_DTYPE (the data and tokenizer in runs/speedrun_cpu " \
           "are kept)" in err, err
    assert len(ran(other, "scripts.base_train")) == 1 and ran(other, REPORT) == []
    assert f'"$run/{CKPT_DIR}"' in SPEEDRUN  # where the real base_train keeps its checkpoints
    for model in ("base", "mome"):
        shutil.rmtree(repo / "runs" / "speedrun_cpu" / model)
    afresh = str(tmp_path / "afresh.log")
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", FAKE_LOG=afresh, DEMO_STEPS="30")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "CPU demo done" in out, err
    assert len(ran(afresh, "scripts.base_train")) == 2 and ran(afresh, "scripts.tok_train") == []


def test_a_refused_first_run_gets_no_resume_hint(fake_speedrun):
    """A base_train exit 2 with no checkpoint in the run dir (bad data, say) is no resume of another DEMO_STEPS."""
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", FAKE_TRAIN_EXIT="2")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "DEMO_STEPS" not in err, err
    assert len(ran(env["FAKE_LOG"], "scripts.base_train")) == 1


def test_a_demo_stopped_in_a_final_evaluation_continues_that_run_alone(fake_speedrun, tmp_path):
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0")
    assert proc.communicate(timeout=20) and proc.returncode == 0
    mome = repo / "runs" / "speedrun_cpu" / "mome" / "summary.json"
    summary = json.loads(mome.read_text())
    mome.write_text(json.dumps({**summary, "stop_reason": "interrupted", "interrupted_during": "final_eval"}))
    again = str(tmp_path / "again.log")
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", FAKE_LOG=again)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "CPU demo done" in out and "CPU demo already done" not in out, err
    assert [line.rsplit(" ", 1)[1] for line in ran(again, "scripts.base_train")] == ["runs/speedrun_cpu/mome"]
    assert len(ran(again, "scripts.prepare_data")) == 1 and len(ran(again, REPORT)) == 1
    (repo / "runs" / "speedrun_cpu" / "report.md").unlink()  # both done, no report: only the report is made
    proc = start_speedrun(repo, env, FAKE_LOG=str(tmp_path / "report.log"))
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and (repo / "runs" / "speedrun_cpu" / "report.md").is_file(), err
    assert ran(tmp_path / "report.log", "scripts.base_train") == ran(tmp_path / "report.log", "scripts.prepare_data")
    assert ran(tmp_path / "report.log", "scripts.base_train") == []


def test_a_demo_model_finished_by_hand_with_other_lrs_is_done_and_the_demo_reports(fake_speedrun, tmp_path):
    """After a non-finite stop the advice's command (--resume N --resume-override-lr, half the LRs) finishes the model
    by hand; `bash speedrun.sh` then sent it to base_train --resume auto, which refused it (the LRs differ: exit 2)
    every time, and the demo's report was never written. With the real done check on the run's files (config.json
    as base_train records such a run): both models are done, the overridden LRs are named, and the report is made."""
    from nanochat.train_args import parse_args

    repo, env = fake_speedrun
    env = {**env, "DEMO_DTYPE": "bfloat16"}  # the dtype the fake runs trained in, whatever this CPU's
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0")
    assert proc.communicate(timeout=20) and proc.returncode == 0
    demo = repo / "runs" / "speedrun_cpu"
    for model in ("base", "mome"):  # config.json as base_train writes it, from the flags speedrun.sh passed
        args = parse_args(json.loads((demo / model / "summary.json").read_text())["flags"])
        args.run_name, args.data_seed, args.compile, overrides = f"speedrun_cpu_{model}", args.seed, False, []
        if model == "base":  # finished by hand: --resume 40 --resume-override-lr --matrix-lr (half)
            overrides = [{"step": 40, "changes": {"matrix_lr": {"checkpoint": args.matrix_lr, "now": args.matrix_lr / 2}}}]
            args.matrix_lr, args.resume, args.resume_override_lr = args.matrix_lr / 2, "40", True
        (demo / model / "config.json").write_text(json.dumps({"args": vars(args), "lr_overrides": overrides},
                                                             default=str))
    (demo / "report.md").unlink()
    again = str(tmp_path / "again.log")
    proc = start_speedrun(repo, env, FAKE_LOG=again, FAKE_REAL_PREFLIGHT=str(REPO))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "CPU demo done: report at runs/speedrun_cpu/report.md" in out, (out, err)
    assert "[speedrun] runs/speedrun_cpu/base already done (completed with its final evaluation)" in out
    assert "[speedrun] runs/speedrun_cpu/mome already done (completed with its final evaluation)" in out
    matrix = parse_args(["--memory", "base"]).matrix_lr
    assert ("[speedrun] runs/speedrun_cpu/base: learning rates overridden by hand (--resume-override-lr): --matrix-lr "
            f"{matrix} -> {matrix / 2} from step 40; its report says so") in err, err
    assert "speedrun_cpu/mome: learning rates" not in err
    assert ran(again, "scripts.base_train") == [] and len(ran(again, REPORT)) == 1


def checkpoint_by_hand(run, flags, step, **lrs):
    """The checkpoint base_train writes when a run of ``flags`` is resumed from ``step`` by hand with
    --resume-override-lr and ``lrs`` ({key: new value}) and stops again (its meta.json: what the done check reads)."""
    from nanochat.train_args import parse_args

    args = vars(parse_args(flags))
    changes = {k: {"checkpoint": args[k], "now": v} for k, v in lrs.items()}
    args.update(lrs, resume=str(step), resume_override_lr=True)
    write_checkpoint(run, step + 5, args, [{"step": step, "changes": changes}])
    return changes


def test_a_demo_model_continued_by_hand_with_other_lrs_and_stopped_again_is_continued_with_them(fake_speedrun,
                                                                                                  tmp_path):
    """The advice's command (--resume N --resume-override-lr, half the LRs) stopped again before completing (Ctrl-C,
    a wall-time limit): `bash speedrun.sh` passed speedrun's LRs to base_train --resume auto, which refuses that
    checkpoint (exit 2), on every start. With the real check on the run's files it now passes the LRs the checkpoint
    records, says so, and the other model is left as it is."""
    repo, env = fake_speedrun
    env = {**env, "DEMO_DTYPE": "bfloat16"}
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0")
    assert proc.communicate(timeout=20) and proc.returncode == 0
    base = repo / "runs" / "speedrun_cpu" / "base"
    flags = json.loads((base / "summary.json").read_text())["flags"]
    (base / "summary.json").write_text(json.dumps({"stop_reason": "interrupted", "signals": [], "flags": flags}))
    changes = checkpoint_by_hand(base, flags, 40, matrix_lr=0.01, embedding_lr=0.15)
    (repo / "runs" / "speedrun_cpu" / "mome" / "summary.json").unlink()  # unfinished, no checkpoint by hand
    again = str(tmp_path / "again.log")
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", FAKE_LOG=again, FAKE_REAL_PREFLIGHT=str(REPO))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "CPU demo done" in out, (out, err)
    assert ("[speedrun] runs/speedrun_cpu/base: learning rates overridden by hand (--resume-override-lr): "
            f"--matrix-lr {changes['matrix_lr']['checkpoint']} -> 0.01 from step 40, --embedding-lr "
            f"{changes['embedding_lr']['checkpoint']} -> 0.15 from step 40; continuing with them") in err, err
    trained = ran(again, "scripts.base_train")
    assert [line.split(" --run-dir ")[1] for line in trained] == [
        "runs/speedrun_cpu/base --embedding-lr=0.15 --matrix-lr=0.01", "runs/speedrun_cpu/mome"], trained


def test_the_gpu_path_continues_a_run_continued_by_hand_with_other_lrs_with_them(fake_speedrun, tmp_path):
    """The same on the GPU path, its done check the real one (on the d12 config's flags)."""
    repo, env = fake_speedrun
    env = {**env, "FAKE_MODE": "gpu 1", "NANOCHAT_DATA_DIR": str(tmp_path / "data")}
    shutil.copytree(REPO / "configs" / "d12", repo / "configs" / "d12")
    run = repo / "runs" / "speedrun_d12_mome"
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0")
    assert proc.communicate(timeout=20) and proc.returncode == 0
    flags = json.loads((run / "summary.json").read_text())["flags"]
    (run / "summary.json").unlink()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(repo)  # the flags name the config file relative to the checkout
        checkpoint_by_hand(run, flags, 500, matrix_lr=0.01)
    again = str(tmp_path / "again.log")
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", FAKE_LOG=again, FAKE_REAL_PREFLIGHT=str(REPO),
                          FAKE_REAL_ONLY="done")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out, err)
    assert "runs/speedrun_d12_mome: learning rates overridden by hand (--resume-override-lr): --matrix-lr " in err
    trained = ran(again, "scripts.base_train")
    assert len(trained) == 1 and trained[0].endswith(" --device-batch-size 32 --matrix-lr=0.01"), trained


def test_the_demo_says_what_it_trains_and_for_how_long_as_measured(fake_speedrun, tmp_path):
    """The start line gave "10-16 min" (the default 300 steps on Xeons with native bf16) whatever DEMO_STEPS asked,
    next to the float32 the check had chosen, and said the same on a run that had only the MoME model left. It now
    names the steps and what is left, and gives the measured time as the 300-step bf16 demo's."""
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", FAKE_DTYPE="float32", DEMO_STEPS="20")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    start = [line for line in out.splitlines() if line.startswith("[speedrun] CPU demo in")]
    assert start == ["[speedrun] CPU demo in float32: tiny Base vs tiny MoME on the embedded corpus, 20 steps of 4,096 "
                     "tokens each, then each one's val/train bpb and CORE; the progress bars show each model's ETA "
                     "(the default 300 steps took 10-16 min in all on 2 Xeon cores with native bf16)"], out
    (repo / "runs" / "speedrun_cpu" / "mome" / "summary.json").unlink()  # MoME left to train, Base done
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", FAKE_DTYPE="float32", DEMO_STEPS="20",
                          FAKE_LOG=str(tmp_path / "again.log"))
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "[speedrun] CPU demo in float32: tiny MoME (tiny Base is done) on the embedded corpus, 20 steps" in out, out


def test_the_demo_models_checkpoint_every_50_steps_and_older_demos_still_continue(fake_speedrun, tmp_path):
    """A demo model saved only at its last step (or on a single Ctrl-C): a crash, a SIGKILL or a second Ctrl-C lost
    every step it had trained (the 300 default steps: 10-40 min on 2 cores). Both models now save every 50 steps,
    keeping the last checkpoint alone; the cadence is no trajectory flag, so a demo started without it (an older
    version's) continues and a finished one stays done."""
    from nanochat.train_resume import TRAJECTORY_KEYS
    from scripts.results import SAME_RUN_IGNORED_ARGS

    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    trained = ran(env["FAKE_LOG"], "scripts.base_train")
    assert len(trained) == 2 and all(" --save-every 50 --keep-last 1 " in line for line in trained), trained
    assert "save_every" not in TRAJECTORY_KEYS and "save_every" in SAME_RUN_IGNORED_ARGS


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGINT"])
def test_a_step_killed_by_a_signal_speedrun_did_not_get_says_so(fake_speedrun, sig):
    """A step killed by a signal that speedrun.sh itself did not get (the OOM killer's SIGKILL; a second Ctrl-C where
    speedrun.sh was started with SIGINT ignored, as `bash speedrun.sh &` in a script starts it, so its trap is never
    set and base_train aborts on its own) ended the demo with the step's exit status and no word from speedrun.sh.
    It now names the step and the signal."""
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_TRAIN_KILL=sig)
    out, err = proc.communicate(timeout=20)
    code = 128 + getattr(signal, sig)
    assert proc.returncode == code, (proc.returncode, err)
    assert f"[speedrun] CPU demo stopped: scripts.base_train was killed by {sig} (exit {code}): run 'bash " \
           "speedrun.sh' again to continue" in err, err
    assert len(ran(env["FAKE_LOG"], "scripts.base_train")) == 1


@pytest.mark.parametrize("name,value", [("DEMO_STEPS", "abc"), ("DEMO_STEPS", "0"), ("DEMO_CORE_MAX", "1.5"),
                                        ("DEMO_DTYPE", "bf16")])
def test_a_bad_override_stops_before_any_step(fake_speedrun, name, value):
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", **{name: value})
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and f"{name} must be" in err and f"(got '{value}')" in err, err
    assert not os.path.exists(env["FAKE_LOG"])  # not even the mode probe ran
    if name == "DEMO_DTYPE":
        assert "DEMO_DTYPE must be bfloat16 or float32 (got 'bf16')" in err


def test_the_demo_trains_in_the_dtype_the_check_chose_unless_demo_dtype_forces_it(fake_speedrun, tmp_path):
    """The dtype speedrun_preflight chose (FAKE_DTYPE: float32, as on a CPU without native bf16) reaches both
    models; DEMO_DTYPE is passed to it (it then chooses that); a demo trained in one dtype is not continued in
    another (base_train refuses the resume) and speedrun.sh names DEMO_DTYPE among what to change."""
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", FAKE_DTYPE="float32")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "CPU demo done" in out, err
    assert [line.split(" -- ")[0] for line in ran(env["FAKE_LOG"], "scripts.speedrun_preflight")] == [
        "-m scripts.speedrun_preflight mode --demo-dir runs/speedrun_cpu --asked "]
    trained = ran(env["FAKE_LOG"], "scripts.base_train")
    assert len(trained) == 2 and all(" --dtype float32 " in line for line in trained), trained
    # the report says it: a float32 demo's numbers are not the bf16 table's in README
    assert [line.split(" --title ")[1] for line in ran(env["FAKE_LOG"], REPORT)] == [
        "CPU demo: tiny Base vs tiny MoME (embedded corpus, float32, bundle: subset)"]
    forced = str(tmp_path / "forced.log")
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0", FAKE_LOG=forced, DEMO_DTYPE="bfloat16")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "--dtype 'float32' (checkpoint) != 'bfloat16'" in err, (out, err)
    assert "to change DEMO_STEPS or DEMO_DTYPE" in err
    assert [line.split(" -- ")[0] for line in ran(forced, "scripts.speedrun_preflight")] == [
        "-m scripts.speedrun_preflight mode --demo-dir runs/speedrun_cpu --asked bfloat16"]
    assert [" --dtype bfloat16 " in line for line in ran(forced, "scripts.base_train")] == [True]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_during_data_preparation_says_where(fake_speedrun, signum):
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_PREP="slow")
    marker = env["FAKE_LOG"] + ".prep"
    for _ in range(500):
        if os.path.exists(marker):
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 1, (proc.returncode, err)
    assert f"[speedrun] CPU demo stopped ({signum.name}) during scripts.prepare_data: run 'bash speedrun.sh' " \
           "again to continue" in err
    assert "tok_train" not in open(env["FAKE_LOG"]).read()


def test_a_stop_signal_between_steps_is_not_lost(fake_speedrun):
    repo, env = fake_speedrun
    proc = start_speedrun(repo, env, FAKE_PREP="signal-me")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 1, (proc.returncode, err)
    assert "[speedrun] CPU demo stopped (SIGTERM) after scripts.prepare_data" in err
    assert "tok_train" not in open(env["FAKE_LOG"]).read()


def test_the_gpu_path_skips_a_finished_run_and_one_machine_trains_one_at_a_time(fake_speedrun, tmp_path):
    """The same on the GPU path (torchrun a fake too): a finished d12 run is not run again, and a second checkout
    of the same user (the same data root) is refused while the first one trains on the machine's GPUs."""
    repo, env = fake_speedrun
    env = {**env, "FAKE_MODE": "gpu 1", "NANOCHAT_DATA_DIR": str(tmp_path / "data")}
    proc = start_speedrun(repo, env, FAKE_TRAIN_S="0")
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and len(ran(env["FAKE_LOG"], "scripts.base_train")) == 1, err
    again = str(tmp_path / "again.log")
    proc = start_speedrun(repo, env, FAKE_LOG=again)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "[speedrun] d12 MoME already done: report at runs/speedrun_d12_mome/report.md" in out
    assert ran(again, "scripts.prepare_data") == ran(again, "scripts.base_train") == ran(again, "scripts.report") == []
    shutil.rmtree(repo / "runs" / "speedrun_d12_mome")
    other = tmp_path / "other"
    shutil.copytree(repo, other, ignore=shutil.ignore_patterns("runs"))
    first = start_speedrun(repo, env)
    wait_for_training(repo, first, model="", run="runs/speedrun_d12_mome")
    try:
        second = start_speedrun(other, env, FAKE_LOG=str(tmp_path / "second.log"))
        out, err = second.communicate(timeout=20)
        assert second.returncode == 2, err
        assert f"another speedrun.sh is running the d12 MoME run of {repo} (pid {first.pid}) on this machine's " \
               "GPUs" in err
        assert ran(tmp_path / "second.log", "scripts.speedrun_preflight layout") == []
        assert first.poll() is None
    finally:
        os.kill(first.pid, signal.SIGTERM)
        first.communicate(timeout=20)
