import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
os.environ.setdefault("WANDB_MODE", "disabled")
# the default tokenizer directory is an empty one, as in a fresh clone: a developer's trained tokenizer/ must not change
# what a test sees (--dry-run plans with the vocab of the tokenizer a run would load)
os.environ["NANOCHAT_TOKENIZER_DIR"] = tempfile.mkdtemp(prefix="no_tokenizer_")
atexit.register(shutil.rmtree, os.environ["NANOCHAT_TOKENIZER_DIR"], ignore_errors=True)
# torchrun's log directory (--log-dir; PET_LOG_DIR is its default): without one each launch makes a torchelastic_*
# directory under TMPDIR and leaves it there (3,042 in this machine's /tmp on 2026-11-27). One directory
# per test session, removed at its end, for every launch a test makes (torchrun_forked's, scripts.run's torchrun)
if "PET_LOG_DIR" not in os.environ:
    os.environ["PET_LOG_DIR"] = tempfile.mkdtemp(prefix="torchrun_logs_")
    atexit.register(shutil.rmtree, os.environ["PET_LOG_DIR"], ignore_errors=True)
torch.set_num_threads(min(2, os.cpu_count() or 1))
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # inductor writes C++ for the capability ATEN_CPU_CAPABILITY picks, but torch 2.13 reuses a compiled graph cached
    # under another capability: an AVX-512 run's graphs, rebuilt under avx2, left half of each output unwritten
    # (every compile test failed). One cache per emulated capability; a real CPU has one capability, CI a fresh /tmp.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{os.environ['ATEN_CPU_CAPABILITY']}"
# the session fixtures (prepared data, tiny tokenizer) for every test module: built once per session, where an
# import into each module made one copy per module
pytest_plugins = ["data_fixtures"]


# The files that take longest on CI's 2 cores (torchrun launches, inductor compiles, runner processes), longest
# first: scripts/test.sh's workers take whole files in collection order (--dist loadfile --no-loadscope-reorder), so
# these start first and the run ends on short files. pytest-xdist's own order (most tests first) left a one-test
# file of ~20-50 s (test_repro_e2e) to start last, with the other worker idle meanwhile (dev/LOG.md, 2026-11-28).
# A file missing here runs after them, in the usual (alphabetical) order: a stale list costs time, never a test.
LONGEST_FILES = ("test_train_dist.py", "test_mome_triton.py", "test_bench_step.py", "test_repro_e2e.py",
                 "test_run_control.py", "test_setup_error_ranks.py", "test_train_error_ranks.py",
                 "test_signal_boundary.py", "test_final_eval_ranks.py", "test_speedrun.py", "test_mome_shared_kernel.py",
                 "test_perf_equivalence.py", "test_train_e2e.py", "test_moe.py", "test_init_from.py",
                 "test_optim_shard.py", "test_mome_triton_inject.py", "test_jtok.py", "test_rank_consistency.py",
                 "test_periodic_eval_cut.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    # stable: each file's tests keep their order and stay together (its module fixtures run once)
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
    if os.environ.get("RUN_SLOW") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow end-to-end test: run with RUN_SLOW=1 or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kernel_globals(monkeypatch):
    """Whatever a test (or base_train, base_eval in it) sets, MoME's kernel globals ROW_SUM, FUSE_INJECT and
    SHARED_TABLE_KERNEL are restored afterwards."""
    from nanochat.memory import mome_mix

    for name in ("ROW_SUM", "FUSE_INJECT", "SHARED_TABLE_KERNEL"):
        monkeypatch.setattr(mome_mix, name, getattr(mome_mix, name))


@pytest.fixture
def offline_bundle(tmp_path, monkeypatch):
    """No CORE bundle given or cached, and its download fails at once: an offline machine without --bundle."""
    monkeypatch.delenv("NANOCHAT_EVAL_BUNDLE", raising=False)
    monkeypatch.setenv("NANOCHAT_EVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", "http://127.0.0.1:9/none.zip")  # port 9: nothing listens
    monkeypatch.setenv("NANOCHAT_EVAL_RETRY_SCALE", "0")


@pytest.fixture
def shared_dir():
    if not SHARED.is_dir():
        pytest.skip(f"../shared not found at {SHARED} (only present on developer/CI machines)")
    return SHARED


# One option set per memory design and per MoME path that changes the computation: the bf16 step tests (on the
# GPU, tests/test_gpu.py; under the CUDA autocast emulation, tests/test_cuda_autocast_policy.py) run each.
MEMORY_OPTION_SETS = {
    "base": dict(memory="base"),
    "ve": dict(memory="ve"),
    "bigram": dict(memory="bigram", memory_options={"factor": 2}),
    "mome": dict(memory="mome", memory_options={"slots": 6, "topk": 2}),
    "mome_full_routing": dict(memory="mome", memory_options={"slots": 4, "topk": 4}),
    "mome_bigram_index": dict(memory="mome", memory_options={"slots": 4, "topk": 2, "index": "bigram",
                                                             "bigram_factor": 2}),
    "mome_headmod_index": dict(memory="mome", memory_options={"slots": 6, "topk": 2, "index": "headmod",
                                                              "rows": 100, "dedicated_size": 30}),
    "mome_balance": dict(memory="mome", memory_options={"slots": 6, "topk": 2, "balance": "bias"}),
    "mome_trust_region": dict(memory="mome", memory_options={"slots": 6, "topk": 2, "balance": "trust-region"}),
    "mome_token_only": dict(memory="mome", memory_options={"slots": 6, "topk": 2, "routing": "token-only"}),
    "mome_conv1d": dict(memory="mome", memory_options={"slots": 6, "topk": 2, "router_type": "conv1d"}),
    "mome_conv1d_value": dict(memory="mome", memory_options={"slots": 6, "topk": 2, "router_type": "conv1d",
                                                             "router_input": "value"}),
    "mome_shared_per_head": dict(memory="mome", memory_options={"slots": 6, "topk": 2, "shared_expert": True,
                                                                "per_head_table": True}),
    "mome_k1_softmax": dict(memory="mome", memory_options={"slots": 4, "topk": 1}),
    "mome_maxvio_window": dict(memory="mome", memory_options={"slots": 6, "topk": 2, "maxvio_window": 1}),
    "engram": dict(memory="engram", memory_options={"compression": "identity", "dim": 64, "heads": 2,
                                                      "first_prime": 101}),
    "jtok": dict(memory="jtok"),
    "jtokm": dict(memory="jtokm"),
    "move_input": dict(memory="move_input", memory_options={"experts": 5, "rank": 8}),
    # STEM replaces FFN up-projections: a SwiGLU family (untied, as the nanochat GPT, for the tests that move lm_head)
    "stem": dict(memory="stem", family="mobilellm", tie_embeddings=False),
}


def tiny_config(**kw):
    """A small config of ``family`` (default nanochat); a SwiGLU family gets d = C/H and its rule's FFN width."""
    from nanochat.families import FAMILIES

    base = dict(sequence_len=32, vocab_size=512, n_layer=2, n_head=2, n_kv_head=2, n_embd=128)
    base.update(kw)
    family = FAMILIES[base.pop("family", "nanochat")]
    if family.ffn_rule is not None:
        base.setdefault("head_dim", base["n_embd"] // base["n_head"])
        base.setdefault("ffn_hidden", family.ffn_rule(base["n_embd"]))
    return family.config_cls(**base)


def load_bench(name: str):
    """Import bench/<name>.py (a script directory, not a package) as a fresh module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sigterm_after(monkeypatch, module, name: str, calls_before: int) -> list:
    """Wrap module.name: the call after ``calls_before`` calls sends this process a real SIGTERM, as a Slurm time
    limit would (the code under test must have turned SIGTERM into something it handles: the default action would
    end pytest). Returns the list of calls made (their positional arguments)."""
    import signal
    import time

    real, calls = getattr(module, name), []

    def wrapped(*args, **kwargs):
        calls.append(args)
        if len(calls) > calls_before:
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN), "SIGTERM is not handled"
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in here
            raise AssertionError(f"SIGTERM did not interrupt {module.__name__}.{name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def torchrun_env(**extra: str) -> dict:
    """The environment of a test's torchrun launch (run_torchrun's, and each torchrun_forked launch a test makes
    itself): this process's, read now (a test's monkeypatch.setenv included), with one thread per worker (2 ranks
    on CI's 2 cores) and this checkout importable, then ``extra``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def run_torchrun(script: Path, nproc: int, args: list[str], timeout: int = 300):
    """Run ``torchrun --standalone --nproc_per_node=nproc script args`` on CPU (gloo) and return the result (its
    launcher forked from one that imported torch once: torchrun_forked)."""
    import torchrun_forked

    argv = ["--standalone", f"--nproc_per_node={nproc}", str(script), *args]
    return torchrun_forked.run(argv, env=torchrun_env(), cwd=REPO, timeout=timeout)


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory):
    """``run(*flags)``: the run dir of test_train_e2e.train(dir, *flags) with nothing stopping it, the reference a
    stopped and resumed run must read like. Trained once per pytest process for each flag list (the tests of
    test_signal_boundary and test_pending_resume trained the same reference six times, two flag lists) where a
    test first asks for it, before it patches anything; the tests only read it."""
    from test_train_e2e import train

    made = {}

    def run(*flags: str) -> Path:
        if flags not in made:
            out = tmp_path_factory.mktemp("uninterrupted")
            assert train(out, *flags) == 0, f"the uninterrupted reference run with {list(flags)} failed"
            made[flags] = out
        return made[flags]

    return run


# the checks of tests/_gloo_checks_worker.py, all in the one 2-rank launch of the session fixture gloo_checks
GLOO_CHECKS = ("dist_optim", "moe_balance", "mome_trust_region", "slot_balance", "routing_stats", "core_eval",
               "eval_stop_votes", "eval_setup_stops")


@pytest.fixture(scope="session")
def gloo_checks(tmp_path_factory) -> Path:
    """The directory of each GLOO_CHECKS check's files (<name>.rank<r>.pt, <name>.<design>.pt or <name>.json, as
    each check's worker writes them under its own launch), from one 2-rank torchrun for all of them:
    test_distributed, test_moe, test_mome_trust_region, test_slot_balance, test_train_hooks, test_core_eval and
    test_base_eval_ranks (2) each had a launch of their own, ~5 s of the CI's 2 cores apiece. Once per test run
    (once_per_test_run): each pytest-xdist worker with one of these files ran it, ~10 s, in most full runs."""
    def launch(out: Path) -> None:
        r = run_torchrun(REPO / "tests" / "_gloo_checks_worker.py", 2, [str(out), *GLOO_CHECKS])
        assert r.returncode == 0, r.stderr[-3000:]

    return once_per_test_run(tmp_path_factory, "gloo_checks", launch)


# the runs of two_rank_signal_runs' launch, in order, each as a failure names it
TWO_RANK_SIGNAL_RUNS = ("rank 1 alone gets SIGTERM mid step 2 (test_signal_step)",
                        "rank 1 alone gets SIGTERM as step 2's eval starts (test_signal_boundary)",
                        "the --resume of that run (test_signal_boundary)")


@pytest.fixture(scope="session")
def two_rank_signal_runs(tmp_path_factory):
    """``run(n)``: (the run dir as run n left it, rank 0's stdout of it) of the TWO_RANK_SIGNAL_RUNS of
    tests/_mid_step_signal_worker.py on 2 gloo ranks, all in one torchrun launch (--runs-out) once per test run
    (once_per_test_run): test_signal_step's and test_signal_boundary's 2-rank runs had a launch of their own, ~4 s
    of the CI's 2 cores apiece. A run that fails ends the launch (the runs after it are not started): ``run(n)``
    of it or a later one fails naming it, with its output; the runs before it are read as they ended."""
    from test_train_e2e import TINY

    def launch(out: Path) -> None:
        def kill(ranks: str) -> list[str]:  # the worker's first flags: these ranks get SIGTERM in call 2
            return ["--kill-step", "2", "--kill-ranks", ranks, "--kill-with", "SIGTERM"]

        batch = ["--device-batch-size", "2", "--total-batch-size", "256", "--num-iterations", "6"]
        step_run, eval_run = [*TINY, *batch, "--run-dir", str(out / "step")], \
            [*TINY, "--eval-every", "2", *batch, "--run-dir", str(out / "eval")]
        r = run_torchrun(REPO / "tests" / "_mid_step_signal_worker.py", 2, [
            "--runs-out", str(out), *kill("1"), *step_run,
            "--next-run", *kill("1"), "--kill-in", "eval", *eval_run,
            "--next-run", *kill(""), *eval_run, "--resume"])
        # the run that failed: the last one a rank started (its stdout file is opened as it starts), the earlier
        # of the two ranks' (a rank stops at its first failed run; the other may have started the next)
        last = [max((n for n in range(len(TWO_RANK_SIGNAL_RUNS)) if (out / f"run{n}.rank{rank}.out").exists()),
                    default=0) for rank in (0, 1)]
        failed = None if r.returncode == 0 else min(last)
        (out / "launch.json").write_text(json.dumps({"returncode": r.returncode, "failed": failed,
                                                     "stderr": r.stderr[-3000:]}))

    out = once_per_test_run(tmp_path_factory, "two_rank_signal_runs", launch)

    def run(n: int) -> tuple[Path, str]:
        ended = json.loads((out / "launch.json").read_text())
        if ended["failed"] is not None and n >= ended["failed"]:
            said = out / f"run{ended['failed']}.rank0.out"
            raise AssertionError(f"run {ended['failed']} of the launch ({TWO_RANK_SIGNAL_RUNS[ended['failed']]}) "
                                 f"failed, the launch's code {ended['returncode']}:\n"
                                 + (said.read_text()[-3000:] if said.exists() else "") + ended["stderr"])
        return out / f"run{n}", (out / f"run{n}.rank0.out").read_text()

    return run


def once_per_test_run(tmp_path_factory, name: str, make) -> Path:
    """The directory ``make(directory)`` fills (raising where it fails), made once for all the pytest processes of
    this test run: a session fixture alone runs once per pytest-xdist worker that uses it. The first worker to ask
    makes it in the directory the workers' temp dirs share (its own temp dir in a run without xdist), under a file
    lock that any other worker asking meanwhile waits on; the others read it. The files are read-only to their
    users. A make that raised leaves it unmade: the next worker to ask makes it again, and fails with its own
    message."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out, made = shared / name, shared / f"{name}.made"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes (or the process ends)
        if not made.exists():
            shutil.rmtree(out, ignore_errors=True)  # what a make that failed left
            out.mkdir()
            make(out)
            made.touch()
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process descended from it (Linux /proc), children first."""
    import signal

    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    order, todo = [], [pid]
    while todo:
        p = todo.pop()
        order.append(p)
        todo.extend(children.get(p, []))
    for p in reversed(order):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
