"""Ranks whose view of the files differs must still take the same branch (or all stop with one clear error):
torchrun (gloo, 2 processes; 3 for base_eval's two bundle views) runs of base_train and base_eval where rank 1
(and rank 2) sees a different run dir or bundle.

Each run is bounded by a timeout: a rank that takes another branch than the others hangs in a collective.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import REPO, run_torchrun  # noqa: E402
import base_eval_fixtures  # noqa: E402
from test_train_e2e import TINY, losses  # noqa: E402

from nanochat import checkpoint as ckpt  # noqa: E402
from nanochat.common import every_rank_ok, rank0_decides  # noqa: E402

tiny_run = base_eval_fixtures.tiny_run  # the module fixture (a checkpoint, tokenizer, data, bundle) of base_eval's tests

WORKER = REPO / "tests" / "_rank_view_worker.py"
TIMEOUT = 300  # a hang guard: 2 ranks on 2 loaded cores can run 5x slower than on an idle machine
TRAIN = [*TINY, "--device-batch-size", "2", "--total-batch-size", "256", "--num-iterations", "4", "--save-every", "2"]


def view_spec(tmp_path, module: str, argv: list[str], rank_argv=None, rank_env=None, name="spec") -> Path:
    """The worker's spec file for ``module.main`` with some ranks' own argv/env (its ranks' exit codes: codes_of)."""
    out = tmp_path / f"{name}_out"
    out.mkdir()
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"module": module, "argv": argv, "out": str(out),
                                "rank_argv": rank_argv or {}, "rank_env": rank_env or {}}))
    return spec


def codes_of(spec: Path) -> dict:
    """{rank: exit code} of the spec's run."""
    out = Path(json.loads(spec.read_text())["out"])
    return {int(p.stem[4:]): json.loads(p.read_text())["code"] for p in out.glob("rank*.json")}


def run_views(tmp_path, module: str, argv: list[str], rank_argv=None, rank_env=None, name="spec", nproc=2):
    """torchrun ``nproc`` processes of ``module.main`` with some ranks' own argv/env; returns
    (result, {rank: exit code})."""
    spec = view_spec(tmp_path, module, argv, rank_argv, rank_env, name)
    res = run_torchrun(WORKER, nproc, [str(spec)], timeout=TIMEOUT)
    return res, codes_of(spec)


def test_helpers_are_the_identity_without_distributed():
    def missing():
        raise FileNotFoundError("nope")

    assert rank0_decides(lambda: 7) == 7 and every_rank_ok(lambda: "x") == "x"
    for helper in (rank0_decides, every_rank_ok):
        with pytest.raises(FileNotFoundError, match="^nope$"):
            helper(missing)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 1-process run of 4 steps (checkpoints at 2 and 4); returns (dir, its losses). A 2-process run has the
    same losses within 1e-5 (test_train_dist), and the views below stop or start fresh before loading state."""
    from scripts import base_train

    run = tmp_path_factory.mktemp("ranks") / "full"
    assert base_train.main([*TRAIN, "--run-dir", str(run)]) == 0
    return run, losses(run)


def interrupted_copy(src: Path, dst: Path, keep_checkpoint: bool) -> Path:
    """``src`` as if killed after the step-2 checkpoint (or before any, keep_checkpoint=False)."""
    shutil.copytree(src, dst)
    (dst / "summary.json").unlink()
    shutil.rmtree(ckpt.step_dir(dst, 4))
    if not keep_checkpoint:
        shutil.rmtree(dst / ckpt.CKPT_DIR)
    return dst


def resume_auto_spec(tmp_path, full: Path, rank0_has_checkpoint: bool):
    """The spec of a 2-process ``--resume auto`` where exactly one rank's run dir holds the step-2 checkpoint.
    Returns (spec, rank 0's run dir)."""
    mine = interrupted_copy(full, tmp_path / "rank0_view", keep_checkpoint=rank0_has_checkpoint)
    theirs = interrupted_copy(full, tmp_path / "rank1_view", keep_checkpoint=not rank0_has_checkpoint)
    spec = view_spec(tmp_path, "scripts.base_train", [*TRAIN, "--run-dir", str(mine), "--resume", "auto"],
                     rank_argv={"1": [*TRAIN, "--run-dir", str(theirs), "--resume", "auto"]})
    return spec, mine


def eval_tokens_spec(tmp_path, tiny_run) -> Path:
    """The spec of a 2-process `base_eval --eval-tokens run` whose rank 1 reads a config.json copy that records
    another --eval-tokens (512) than rank 0's (256); its bpb.json goes to tmp_path/out."""
    root = tiny_run[0]
    views = {}
    for rank, tokens in ((0, 256), (1, 512)):
        views[rank] = Path(shutil.copytree(root / "run", tmp_path / f"view{rank}"))
        (views[rank] / "config.json").write_text(json.dumps({"args": {"eval_tokens": tokens}}))
    argv = ["--eval", "bpb", "--splits", "val", "--device-batch-size", "3", "--no-progress", "--device-type", "cpu",
            "--dtype", "float32", "--out-dir", str(tmp_path / "out")]
    return view_spec(tmp_path, "scripts.base_eval", ["--run-dir", str(views[0]), *argv],
                     rank_argv={"1": ["--run-dir", str(views[1]), *argv]})


@pytest.fixture(scope="module")
def views_that_agree(tmp_path_factory, finished_run, tiny_run):
    """One 2-process torchrun (a start-up is ~5 s of the CI's 2 cores) for the two views below whose ranks agree and
    finish: the --resume auto where only rank 1 has a checkpoint, then the --eval-tokens run whose rank 1 reads
    another record (each run with its own process group). Returns {name: (torchrun result, exit codes, its dir)}."""
    tmp = tmp_path_factory.mktemp("views_that_agree")
    (tmp / "resume").mkdir()
    (tmp / "eval_tokens").mkdir()
    resume, mine = resume_auto_spec(tmp / "resume", finished_run[0], rank0_has_checkpoint=False)
    tokens = eval_tokens_spec(tmp / "eval_tokens", tiny_run)
    res = run_torchrun(WORKER, 2, [str(resume), "--next-run", str(tokens)], timeout=TIMEOUT)
    return {"resume": (res, codes_of(resume), mine), "eval_tokens": (res, codes_of(tokens), tmp / "eval_tokens")}


@pytest.fixture(scope="module")
def views_that_stop(tmp_path_factory, finished_run, embedded_data_dir, tiny_tokenizer_dir):
    """One 2-process torchrun for the two views below whose ranks all stop with one error (exit 2), each run whatever
    the other's code (_rank_view_worker --every-run), where each had a launch of its own (~6 s of the CI's 2 cores):
    the --resume auto where only rank 0 has a checkpoint, then the training whose rank 1 has no prepared data.
    Returns {name: (torchrun result, exit codes, its dir)}; the launch's stderr holds both runs' errors."""
    tmp = tmp_path_factory.mktemp("views_that_stop")
    (tmp / "resume").mkdir()
    (tmp / "data").mkdir()
    resume, mine = resume_auto_spec(tmp / "resume", finished_run[0], rank0_has_checkpoint=True)
    data = data_missing_spec(tmp / "data", embedded_data_dir, tiny_tokenizer_dir)
    res = run_torchrun(WORKER, 2, ["--every-run", str(resume), "--next-run", str(data)], timeout=TIMEOUT)
    return {"resume": (res, codes_of(resume), mine), "data": (res, codes_of(data), tmp / "data")}


def test_resume_checkpoint_missing_on_rank1_stops_every_rank(views_that_stop):
    res, codes, mine = views_that_stop["resume"]
    assert codes == {0: 2, 1: 2}, (codes, res.stderr[-3000:])
    # rank 0 chose step 2; rank 1 cannot follow; every rank raises its error, which rank 0 alone prints
    assert res.stderr.count("rank 1 of 2: checkpoint") == 1, res.stderr[-3000:]
    assert "step_000002 (chosen on rank 0) lacks meta.json, model.pt, state.pt" in res.stderr
    assert not (mine / "summary.json").exists() and ckpt.list_steps(mine) == [2]  # nothing trained


def test_resume_auto_follows_rank0_when_only_rank1_has_a_checkpoint(finished_run, views_that_agree):
    full, full_losses = finished_run
    res, codes, mine = views_that_agree["resume"]
    assert codes == {0: 0, 1: 0}, (codes, res.stderr[-3000:])
    assert "no checkpoint in" in res.stdout  # rank 0 decided: fresh start, for both ranks
    got = losses(mine)
    assert got.keys() == full_losses.keys() == {1, 2, 3, 4}
    for s in got:  # both ranks trained the same 4 steps from scratch, as in the uninterrupted run
        assert abs(got[s] - full_losses[s]) < 1e-5, (s, got[s], full_losses[s])


def data_missing_spec(tmp_path, embedded_data_dir, tiny_tokenizer_dir) -> Path:
    """The spec of a 2-process training whose rank 1's node has no prepared data (its --data-dir is missing)."""
    assert TRAIN[:3] == ["--synthetic-data", "--vocab-size", "256"]
    argv = [*TRAIN[3:], "--tokenizer-dir", str(tiny_tokenizer_dir), "--run-dir", str(tmp_path / "run")]
    return view_spec(tmp_path, "scripts.base_train", [*argv, "--data-dir", str(embedded_data_dir)],
                     rank_argv={"1": [*argv, "--data-dir", str(tmp_path / "no_data_here")]})


def test_data_missing_on_rank1_stops_every_rank(views_that_stop):
    """Rank 1's node has no prepared data: every rank stops with rank 1's error before the (collective)
    tokenization of the eval rows, instead of rank 0 waiting there for a rank that already exited."""
    res, codes, tmp_path = views_that_stop["data"]
    assert codes == {0: 2, 1: 2}, (codes, res.stderr[-3000:])
    # every rank raises rank 1's error (every_rank_ok); rank 0 alone prints it
    assert res.stderr.count(f"rank 1 of 2: --data-dir {tmp_path / 'no_data_here'}") == 1, res.stderr[-3000:]


def _core_argv(run: Path, out: Path) -> list[str]:
    return ["--run-dir", str(run), "--eval", "core", "--device-batch-size", "3", "--no-progress",
            "--device-type", "cpu", "--out-dir", str(out)]


def _one_process_core(run: Path, bundle: Path, out: Path) -> dict:
    from scripts.base_eval import main

    assert main([*_core_argv(run, out), "--bundle", str(bundle)]) == 0
    return json.loads((out / "core.json").read_text())


# the broken bundle view each non-zero rank of the one 3-process base_eval launch has (rank 0 has the bundle)
CORE_VIEW_RANK = {"no_bundle": 1, "task_file_missing": 2}


@pytest.fixture(scope="module")
def core_with_broken_bundle_views(tmp_path_factory, tiny_run):
    """One 3-process CORE where rank 1's bundle download failed (no bundle) and rank 2's copy lacks one task file
    (a torchrun start-up per view would cost ~8 s of the CI's 2 cores), and the 1-process CORE on rank 0's bundle.
    Returns (torchrun result, {rank: exit code}, 3-process core.json, 1-process core.json)."""
    tmp = tmp_path_factory.mktemp("core_views")
    root, _, _, bundle = tiny_run
    partial = Path(shutil.copytree(bundle, tmp / "partial_bundle"))
    (partial / "eval_data" / "cat" / "lm.jsonl").unlink()
    theirs = {"no_bundle": tmp / "missing_bundle", "task_file_missing": partial}
    ref = _one_process_core(root / "run", bundle, tmp / "ref")
    out = tmp / "three"
    env = {"NANOCHAT_EVAL_CACHE": str(tmp / "cache")}  # nothing to find there, no download possible
    rank_env = {"0": {**env, "NANOCHAT_EVAL_BUNDLE": str(bundle)}}
    for view, rank in CORE_VIEW_RANK.items():
        rank_env[str(rank)] = {**env, "NANOCHAT_EVAL_BUNDLE": str(theirs[view]),
                               "NANOCHAT_EVAL_BUNDLE_URL": "http://127.0.0.1:9/none.zip"}
    res, codes = run_views(tmp, "scripts.base_eval", _core_argv(root / "run", out), rank_env=rank_env, nproc=3)
    got = json.loads((out / "core.json").read_text()) if (out / "core.json").is_file() else None
    return res, codes, got, ref


@pytest.mark.parametrize("view", list(CORE_VIEW_RANK))
def test_core_bundle_differs_on_a_rank_evaluates_rank0s_bundle(core_with_broken_bundle_views, view):
    """A rank's bundle download failed (no bundle), or its copy lacks one task file: rank 0 decides and reads
    the bundle for everyone, so the multi-process CORE equals the 1-process one on rank 0's bundle. Both views
    are ranks of one launch: a rank that follows its own view stops, and every rank stops with its error, which
    names the rank (CORE_VIEW_RANK says which view that rank had)."""
    res, codes, got, ref = core_with_broken_bundle_views
    rank = CORE_VIEW_RANK[view]
    # every rank reports the error of the rank it came from as "rank R of 3: ...": this view's own failure
    assert f"rank {rank} of 3:" not in res.stderr, (f"rank {rank} ({view}) failed", codes, res.stderr[-3000:])
    views = {0: "rank 0's bundle", **{r: v for v, r in CORE_VIEW_RANK.items()}}
    exits = {f"rank {r} ({v})": codes.get(r, "no exit code: crashed or killed") for r, v in views.items()}
    assert set(exits.values()) == {0}, (exits, res.stderr[-3000:])
    assert got["label"] == ref["label"] == "CORE-2/3"
    assert got["tasks"] == ref["tasks"] and got["core"] == pytest.approx(ref["core"], abs=1e-12)


def test_eval_tokens_run_follows_rank0s_record_when_a_ranks_copy_differs(views_that_agree):
    """`--eval-tokens run` read each rank's own config.json: a node whose copy records another budget (a final
    evaluation resumed there with other flags) built another number of bpb rows, and the ranks' collectives no
    longer matched. Rank 0 decides, as for CORE's bundle and cap. (eval_tokens_spec's run, in views_that_agree's
    launch.)"""
    res, codes, tmp_path = views_that_agree["eval_tokens"]
    assert codes == {0: 0, 1: 0}, (codes, res.stderr[-3000:])
    assert "256 tokens per split (the run's --eval-tokens (its config.json))" in res.stdout, res.stdout[-2000:]
    assert json.loads((tmp_path / "out" / "bpb.json").read_text())["eval_tokens"] == 256
