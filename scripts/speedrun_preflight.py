"""What speedrun.sh does on this machine, decided before any download or tokenizer training.

    python -m scripts.speedrun_preflight mode [--demo-dir DIR [--asked D] -- BASE_FLAGS... -- MOME_FLAGS...]
        stdout "gpu N" or "cpu 0". Exits 2 with advice when nvidia-smi sees GPUs that torch cannot use (a CPU
        torch in .venv, a driver too old for the wheel, CUDA_VISIBLE_DEVICES hiding them) or when a GPU machine
        cannot reach huggingface.co: a GPU machine never falls back to the CPU demo on its own.
        SPEEDRUN_MODE=gpu|cpu skips the detection (cpu: run the demo deliberately, without importing torch here).
        With --demo-dir and the demo models' flags but --dtype, the CPU path's line is "cpu 0 DTYPE BASE MOME": the
        demo's dtype as `dtype` chooses it, then for each model `done`'s state word with --dtype DTYPE added.
        One Python start for what speedrun.sh needs before the demo (each costs 2-3 s here).
    python -m scripts.speedrun_preflight layout --gpus N [--max-device-batch 32] -- BASE_TRAIN_FLAGS...
        stdout "NPROC DEVICE_BATCH": the most GPUs (then the largest device batch) that split the flags' total
        batch exactly, after a base_train --dry-run of the flags with that layout (so the flags are checked;
        --attention and --mome-kernels are resolved only when training starts).
    python -m scripts.speedrun_preflight done RUN_DIR -- BASE_TRAIN_FLAGS...
        exit 0 when RUN_DIR holds this run finished: summary.json says "completed" (all steps and the final
        evaluation) and config.json records the same flags, but the layout, paths and --resume (not the seeds; the
        ones left at their defaults too: a run started by hand with --init-from is another); learning rates changed
        from these flags' by --resume-override-lr on a resume (config.json lr_overrides) count as the same, said on
        stderr; else exit 1 (base_train --resume has work to do). stdout the state word, as `mode` gives it: "done",
        "train", or "train,FLAG=VALUE,..." where the run was continued by hand with other LRs from these flags' (a
        non-finite stop's advice) and stopped again: the LRs its checkpoint records, which base_train --resume auto
        accepts (``resume_lrs``; said on stderr); one started with other LRs is refused by base_train as before.
    python -m scripts.speedrun_preflight dtype DEMO_DIR [--asked bfloat16|float32]
        stdout the CPU demo's dtype: --asked (DEMO_DTYPE) if given; else the one a model under DEMO_DIR with a
        checkpoint started with (it continues with its flags); else bfloat16 where this CPU has native bf16
        matmuls, float32 where it has not or cannot tell. stderr one line: the choice and why.

Messages go to stderr; the shell reads the one stdout line.
"""

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from nanochat.terminal import replace_unencodable_output


class Stop(Exception):
    """speedrun.sh must not go on; the message says what to do."""


@dataclass
class Probe:
    smi_gpus: int  # GPUs listed by `nvidia-smi -L` (0 when it is missing or fails)
    smi_status: str  # "ok", "not installed", or why it failed
    driver: str | None  # NVIDIA driver version from nvidia-smi
    torch_version: str
    torch_cuda: str | None  # CUDA version torch was built for; None = CPU-only build
    torch_gpus: int  # GPUs torch can use
    cuda_warning: str | None  # what torch said when CUDA failed to initialise
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES


def say(msg: str) -> None:
    print(f"[speedrun] {msg}", file=sys.stderr, flush=True)


def _nvidia_smi(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("nvidia-smi") or "nvidia-smi", *args], capture_output=True, text=True,
                          timeout=60)


def probe() -> Probe:
    import torch

    smi_gpus, status, driver = 0, "not installed", None
    if shutil.which("nvidia-smi"):
        try:
            listing = _nvidia_smi("-L")
            if listing.returncode == 0:
                smi_gpus, status = sum(line.startswith("GPU ") for line in listing.stdout.splitlines()), "ok"
                query = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
                driver = (query.stdout.split() or [None])[0] if query.returncode == 0 else None
            else:
                status = f"failed: {(listing.stdout + listing.stderr).strip()[:300]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            status = f"failed: {e}"
    with warnings.catch_warnings(record=True) as caught:  # torch warns (not raises) when CUDA cannot start
        warnings.simplefilter("always")
        torch_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Probe(smi_gpus, status, driver, torch.__version__, torch.version.cuda, torch_gpus,
                 str(caught[0].message) if caught else None, os.environ.get("CUDA_VISIBLE_DEVICES"))


def have_internet(timeout: float = 8.0) -> bool:
    try:
        urllib.request.urlopen(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout=timeout)
        return True
    except Exception:  # noqa: BLE001 - any failure means "cannot download"
        return False


def unusable_gpus(p: Probe) -> str:
    """Why torch cannot use the GPUs nvidia-smi lists, and what to do about it."""
    if p.torch_cuda is None:
        why = f"the torch in .venv ({p.torch_version}) is a CPU-only build"
        fix = ("rm -rf .venv && bash speedrun.sh  (scripts/setup_env.sh installs the CUDA build when nvidia-smi "
               "works)")
    elif p.visible_devices is not None and p.visible_devices.strip() in ("", "-1"):
        why = f"CUDA_VISIBLE_DEVICES={p.visible_devices!r} hides them"
        fix = "unset CUDA_VISIBLE_DEVICES (or list the GPUs to use) and re-run"
    else:
        why = (f"torch {p.torch_version} is built for CUDA {p.torch_cuda} but cannot initialise it with NVIDIA "
               f"driver {p.driver or '?'}" + (f" (torch says: {p.cuda_warning.strip()})" if p.cuda_warning else ""))
        fix = ("the driver is probably too old for this wheel (nvidia-smi's header shows the newest CUDA it "
               "supports): update the NVIDIA driver, or install a torch built for an older CUDA into .venv, "
               f"e.g. pip install torch=={p.torch_version.split('+')[0]} --index-url "
               "https://download.pytorch.org/whl/cu126")
    return (f"nvidia-smi sees {p.smi_gpus} GPU(s) but torch cannot use CUDA: {why}.\n"
            f"  fix: {fix}\n  to run the CPU demo on this machine on purpose: SPEEDRUN_MODE=cpu bash speedrun.sh")


def decide_mode(requested: str, p: Probe | None, internet) -> tuple[str, int]:
    """("gpu", GPUs torch can use) or ("cpu", 0); raises Stop rather than running the CPU demo on a GPU machine.

    ``p`` may be None for SPEEDRUN_MODE=cpu; ``internet`` is called only when the GPU run is otherwise possible (it may
    take seconds)."""
    if requested not in ("", "gpu", "cpu"):
        raise Stop(f"SPEEDRUN_MODE must be gpu or cpu (got {requested!r})")
    if requested == "cpu":
        say("SPEEDRUN_MODE=cpu: running the CPU demo")
        return "cpu", 0
    if p.torch_gpus == 0 and p.smi_gpus > 0:
        raise Stop(unusable_gpus(p))
    if p.torch_gpus == 0 and requested == "gpu":
        raise Stop(f"SPEEDRUN_MODE=gpu but no CUDA GPU is visible (nvidia-smi: {p.smi_status}; torch "
                   f"{p.torch_version} sees none). Unset SPEEDRUN_MODE to run the CPU demo.")
    if p.torch_gpus == 0:
        say(f"no CUDA GPU found (nvidia-smi: {p.smi_status}): the d12 run needs GPUs, so this runs the CPU demo.")
        return "cpu", 0
    if p.smi_gpus > p.torch_gpus:
        say(f"using the {p.torch_gpus} GPU(s) torch sees (nvidia-smi lists {p.smi_gpus}; "
            f"CUDA_VISIBLE_DEVICES={p.visible_devices!r})")
    if requested == "" and not internet():
        raise Stop(f"{p.torch_gpus} CUDA GPU(s) but huggingface.co is unreachable, and the d12 run downloads "
                   "FineWeb-Edu.\n  fix: check the network/proxy (or HF_ENDPOINT); if the data and tokenizer are "
                   "already in place: SPEEDRUN_MODE=gpu bash speedrun.sh\n  to run the CPU demo on purpose: "
                   "SPEEDRUN_MODE=cpu bash speedrun.sh")
    return "gpu", p.torch_gpus


def layout(gpus: int, max_device_batch: int, train_flags: list[str]) -> tuple[int, int]:
    """Choose processes x device batch for the flags' total batch, then dry-run base_train with exactly that."""
    from nanochat.plan import choose_layout
    from nanochat.train_args import parse_args
    from scripts import base_train

    args = parse_args(train_flags)
    try:
        nproc, device_batch, accum = choose_layout(args.total_batch_size, args.max_seq_len, gpus, max_device_batch)
    except ValueError as e:
        raise Stop(str(e)) from e
    unused = (f" ({gpus - nproc} GPU(s) left idle: no device batch lets {gpus} processes split it)"
              if nproc < gpus else "")
    say(f"{args.total_batch_size:,} tokens/step = {nproc} process(es) x device batch {device_batch} x "
        f"{args.max_seq_len} tokens x grad accum {accum}{unused}")
    world = {"WORLD_SIZE": str(nproc), "RANK": "0", "LOCAL_RANK": "0"}  # the world size --dry-run plans for
    with mock.patch.dict(os.environ, world), contextlib.redirect_stdout(sys.stderr):
        code = base_train.main([*train_flags, "--device-batch-size", str(device_batch), "--dry-run"])
    if code != 0:
        raise Stop(f"base_train --dry-run failed (exit {code}) for the flags above; nothing was downloaded")
    return nproc, device_batch


def unfinished_run(run_dir: Path, train_flags: list[str]) -> str | None:
    """None when ``run_dir`` holds the run of ``train_flags`` finished, final evaluation included; else why not.
    A run finished with other flags is not this run (base_train --resume refuses it or evaluates it again), except
    for the layout and bookkeeping flags (results.SAME_RUN_IGNORED_ARGS: the layout, paths, --resume; not the seeds),
    so that a run finished by hand with --resume, or on another GPU count, is not evaluated again; nor LRs changed
    by --resume-override-lr from these flags' ones (``overridden_from``), said on stderr for a finished run.
    Flag values an older version recorded are read as base_train --resume reads them (a ValueError where it
    refuses them): --core-max-per-task 0, "all" then, is -1."""
    from nanochat.report import unfinished

    problem = unfinished(run_dir)
    if problem:
        return problem
    # torch comes with these (2-3 s here): only for a completed run
    from nanochat import init_from
    from nanochat.cli_types import recorded_args, recorded_args_now
    from nanochat.report import fmt_lr_overrides, read_json
    from nanochat.train_args import parse_args
    from nanochat.train_resume import read_old_records
    from scripts.results import SAME_RUN_IGNORED_ARGS

    config = read_json(run_dir / "config.json") or {}
    saved = recorded_args(config)
    args = parse_args(train_flags)
    with contextlib.redirect_stdout(sys.stderr):  # its note goes where this script's messages go
        read_old_records(args, saved)  # here: an asked 0 (or -1) becomes -1 if the run recorded 0
    saved = recorded_args_now(saved)
    # as base_train resolves it; its other resolved defaults (run name, compile) are ignored
    args.data_seed = init_from.data_seed(vars(args))
    # the args as config.json holds them. A flag speedrun.sh leaves at its default counts too (a model finished by
    # hand with --init-from is another model); a default one an older config.json lacks (added since) is not compared
    wanted = json.loads(json.dumps(vars(args), default=str))
    missing = object()
    differ = sorted(k for k, v in wanted.items() if k not in SAME_RUN_IGNORED_ARGS and (v is not None or k in saved)
                    and saved.get(k, missing) != v and not overridden_from(config, k, v, saved.get(k)))
    if differ:
        return f"{run_dir} completed with other flags ({', '.join(differ)})"
    overrides = fmt_lr_overrides(config)
    if overrides:
        say(f"{run_dir}: learning rates {overrides}; its report says so")
    return None


def overridden_from(config: dict, key: str, wanted, recorded) -> bool:
    """The run's ``recorded`` value of flag ``key`` (``config``'s "args": config.json's, or a checkpoint's meta.json
    "config") differs from the ``wanted`` one only by the --resume-override-lr changes ``config`` records
    (lr_overrides), the first made from ``wanted``: the run started with speedrun.sh's LR and was continued by hand
    with another (a non-finite stop's advice). Its done check takes it, an unfinished one is continued with the
    recorded LR (base_train --resume auto, with speedrun's LRs, would refuse both), and its report names the change;
    a run started with another LR is not speedrun's. --resume-override-lr itself is the resume's bookkeeping."""
    from nanochat.train_resume import LR_KEYS

    if key == "resume_override_lr":
        return True
    if key not in LR_KEYS:
        return False
    changes = [entry["changes"][key] for entry in config.get("lr_overrides") or []
               if key in (entry.get("changes") or {})]
    return bool(changes) and changes[0].get("checkpoint") == wanted and changes[-1].get("now") == recorded


def resume_lrs(run_dir: Path, train_flags: list[str]) -> tuple[list[str], str | None]:
    """The LR flags that base_train --resume auto needs to continue the checkpoint it takes in ``run_dir`` (the
    latest), and the overrides on one line: where that checkpoint's LRs differ from ``train_flags``' only by its
    --resume-override-lr changes, the first made from these flags' values (``overridden_from``): a speedrun run
    continued by hand with other LRs (a non-finite stop's advice) and stopped again before completing. Else ([],
    None): no checkpoint, the same LRs, or one started with other LRs, which base_train refuses as before.
    ValueError for a corrupt meta.json."""
    from nanochat import checkpoint as ckpt
    from nanochat.cli_types import flag_name
    from nanochat.report import fmt_lr_overrides
    from nanochat.train_args import parse_args
    from nanochat.train_resume import LR_KEYS

    steps = ckpt.list_steps(run_dir)
    if not steps:
        return [], None
    meta = ckpt.load_meta(run_dir, steps[-1])
    saved, config = ckpt.recorded_run_args(meta), ckpt.recorded_config(meta)
    wanted = vars(parse_args(train_flags))
    differ = [k for k in LR_KEYS if k in saved and saved[k] != wanted[k]]
    if not differ or not all(overridden_from(config, k, wanted[k], saved[k]) for k in differ):
        return [], None
    return [f"{flag_name(k)}={saved[k]}" for k in differ], fmt_lr_overrides(config)


def demo_state(train_flags: list[str], run_dir: Path | None = None) -> str:
    """"done" when the run of ``train_flags`` (in ``run_dir``, else its --run-dir) is finished (``unfinished_run``);
    else "train", or "train,FLAG=VALUE,..." with the LR flags its --resume auto continues it with (``resume_lrs``)."""
    if run_dir is None:
        only = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        only.add_argument("--run-dir", type=Path, required=True)
        run_dir = only.parse_known_args(train_flags)[0].run_dir
    try:
        if unfinished_run(run_dir, train_flags):
            lrs, overrides = resume_lrs(run_dir, train_flags)
            if lrs:
                say(f"{run_dir}: learning rates {overrides}; continuing with them")
            return ",".join(["train", *lrs])
    except ValueError as e:  # a run file that is not JSON, a recorded flag base_train --resume refuses: not done;
        say(f"{run_dir}: {e}")  # base_train --resume says what it finds
        return "train"
    return "done"


def demo_dtype(demo_dir: Path, asked: str = "") -> tuple[str, str]:
    """(dtype, why) for the CPU demo in ``demo_dir``, as ``dtype``'s usage above says."""
    from nanochat.checkpoint import list_steps, load_meta, recorded_run_args
    from nanochat.common import SLOW_BF16_RATIO, cpu_has_native_bf16

    native = cpu_has_native_bf16()
    slow = f"no AVX512-BF16 or AMX on this CPU: a bf16 matmul costs about {SLOW_BF16_RATIO}x a float32 one"
    if asked:
        return asked, "DEMO_DTYPE" + (f"; {slow}" if asked == "bfloat16" and native is False else "")
    runs = sorted(d for d in demo_dir.iterdir() if list_steps(d)) if demo_dir.is_dir() else []
    for run in runs:
        try:
            started = recorded_run_args(load_meta(run)).get("dtype")
        except ValueError:  # a corrupt meta.json: base_train --resume says what it finds
            continue
        if started in ("bfloat16", "float32"):
            return started, f"the dtype {run} started with: a demo with a checkpoint continues with its flags"
    if native:
        return "bfloat16", "this CPU has native bf16 matmuls; DEMO_DTYPE=float32 forces float32"
    why = slow if native is False else "cannot tell whether this CPU has native bf16 matmuls"
    return "float32", f"{why}; DEMO_DTYPE=bfloat16 forces bf16"


def main(argv: list[str] | None = None) -> int:
    """The command (see the module doc); a Ctrl-C is one line and exit 130, as speedrun.sh runs these in command
    substitutions where a traceback would be all the user sees of the stop."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        say(f"interrupted (Ctrl-C) during the {argv[0] if argv else 'preflight'} check")
        return 130


def _main(argv: list[str]) -> int:
    train_flags, demo_flags = [], []
    if "--" in argv:
        i = argv.index("--")
        argv, train_flags = argv[:i], argv[i + 1:]
        while "--" in train_flags:  # mode: the demo models' flags, one list after each --
            i = train_flags.index("--")
            demo_flags.append(train_flags[:i])
            train_flags = train_flags[i + 1:]
        demo_flags.append(train_flags)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("mode", "layout", "done", "dtype"))
    ap.add_argument("run_dir", nargs="?", type=Path, help="done: the run directory; dtype: the demo's")
    ap.add_argument("--gpus", type=int, default=None, help="layout: GPUs available")
    ap.add_argument("--max-device-batch", type=int, default=32, help="layout: largest rows per micro-batch")
    ap.add_argument("--asked", default="", choices=("", "bfloat16", "float32"), help="dtype, mode: DEMO_DTYPE")
    ap.add_argument("--demo-dir", type=Path, default=None, help="mode: the CPU demo's directory")
    args = ap.parse_args(argv)
    try:
        if args.what == "mode":
            requested = os.environ.get("SPEEDRUN_MODE", "")
            # SPEEDRUN_MODE=cpu needs no probe (nor torch, 2-3 s to import here)
            mode, ngpu = decide_mode(requested, None if requested == "cpu" else probe(), have_internet)
            if mode == "cpu" and args.run_dir is not None:
                ap.error("mode takes --demo-dir DIR, not a positional directory")
            if mode == "cpu" and args.demo_dir is not None:
                if len(demo_flags) != 2 or not all(demo_flags):
                    ap.error("mode --demo-dir needs the two demo models' flags: -- BASE_FLAGS... -- MOME_FLAGS...")
                dtype, why = demo_dtype(args.demo_dir, args.asked)
                say(f"CPU demo dtype: {dtype} ({why})")
                print(mode, ngpu, dtype, *(demo_state([*flags, "--dtype", dtype]) for flags in demo_flags))
            else:
                print(mode, ngpu)
        elif args.what == "dtype":
            if args.run_dir is None:
                ap.error("dtype needs the demo's directory")
            dtype, why = demo_dtype(args.run_dir, args.asked)
            say(f"CPU demo dtype: {dtype} ({why})")
            print(dtype)
        elif args.what == "done":
            if args.run_dir is None or not train_flags:
                ap.error("done needs RUN_DIR and the base_train flags after --")
            state = demo_state(train_flags, args.run_dir)
            print(state)
            return 0 if state == "done" else 1
        else:
            if args.gpus is None or not train_flags:
                ap.error("layout needs --gpus N and the base_train flags after --")
            print(*layout(args.gpus, args.max_device_batch, train_flags))
    except Stop as e:
        say(f"stop: {e}")
        return 2
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
