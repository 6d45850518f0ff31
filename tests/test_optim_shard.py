"""The sharded MuonAdamW under gloo: 2 processes (and 4 ranks as threads of one, tests/_thread_ranks.py) compute the
1-process update, with O(buckets) collectives, ~1/W of the optimizer state per rank, and world-size independent
state dicts."""

import pytest
import torch

from conftest import REPO, run_torchrun

WORKER = REPO / "tests" / "_shard_worker.py"


def run(tmp_path, nproc, load=None, then_load=None, extra=()):
    """The worker on ``nproc`` ranks (optionally loading the state dict file ``load``) -> rank 0's result: 2 gloo
    processes under torchrun, 1 in this process, 4 as threads of this process (tests/_thread_ranks.py; the 2-process
    launch is the one of real processes). With ``then_load``, the same launch next runs from that state dict into
    w<nproc>_loaded.pt (one start-up); ``extra``: the worker's further arguments (--old-names OUT, --grad-order OUT),
    for the 2-process launch."""
    out = tmp_path / f"w{nproc}{'_loaded' if load else ''}.pt"
    runs = [(out, load)] + ([(tmp_path / f"w{nproc}_loaded.pt", then_load)] if then_load else [])
    if nproc == 1:  # in this process: no torchrun start-up
        from _shard_worker import main

        assert not extra
        main(runs)
    elif nproc != 2:  # thread ranks: the same collectives without a start-up per rank
        import torch.distributed as dist

        from nanochat import optim_shard
        from _shard_worker import threads

        assert not extra
        with pytest.MonkeyPatch.context() as mp:  # what threads sets for its ranks, put back after
            mp.setattr(optim_shard, "SHARD_MIN_NUMEL", optim_shard.SHARD_MIN_NUMEL)
            for name in ("all_reduce", optim_shard.REDUCE_SCATTER, optim_shard.ALL_GATHER):
                mp.setattr(dist, name, getattr(dist, name))
            threads(nproc, runs)
    else:
        r = run_torchrun(WORKER, nproc, [*(f"{o},{l}" if l else str(o) for o, l in runs), *map(str, extra)])
        assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out, weights_only=False)


def assert_state_close(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for k, va in a["state"][i].items():
            vb = b["state"][i][k]
            assert va.shape == vb.shape and va.device.type == "cpu", (i, k)
            # the averaged gradients are bit-identical by construction; what may differ is how a batched matmul
            # (Polar Express over c matrices instead of K) rounds, ~1e-7 relative
            assert torch.allclose(va, vb, rtol=1e-5, atol=1e-6), (i, k, (va - vb).abs().max())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{world size: result} of fresh runs; the 4 thread ranks also continue the 1-process state into
    w4_loaded.pt for test_state_dict_moves_between_world_sizes (they were a 4-process launch, whose start-up is ~17 s
    of 2 cores). The 2-process launch also runs the old-names run ("old names": its result) and the grad-order
    scenario (grad_order.json) after its own run (a 2-process start-up is ~5 s of 2 cores)."""
    tmp = tmp_path_factory.mktemp("shard")
    res = {1: run(tmp, 1)}
    res[2] = run(tmp, 2, extra=["--old-names", tmp / "w2_old_names.pt", "--grad-order", tmp / "grad_order.json"])
    res["old names"] = torch.load(tmp / "w2_old_names.pt", weights_only=False)
    res[4] = run(tmp, 4, then_load=tmp / "w1.pt")
    return tmp, res


def test_sharded_update_equals_single_process(results):
    _, res = results
    for w in (2, 4):
        for name, p in res[1]["params"].items():
            assert torch.allclose(p, res[w]["params"][name], rtol=1e-5, atol=1e-6), (w, name)
        assert res[w]["grad_norm"] == pytest.approx(res[1]["grad_norm"], rel=1e-6)
        assert_state_close(res[1]["state_dict"], res[w]["state_dict"])


def test_state_dict_gathered_on_rank0_alone_is_the_state_dict(results):
    """The checkpoint path: rank 0 gets exactly state_dict()'s dict (the same bytes under torch.save, so the same
    state.pt as before), every other rank gets None (no full copy in its host memory)."""
    _, res = results
    for w in (1, 2, 4):
        r = res[w]
        assert r["got_rank0"] == ["dict"] + [None] * (w - 1), w
        a, b = r["state_dict"], r["on_rank0"]
        assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
        for i in a["state"]:
            assert a["state"][i].keys() == b["state"][i].keys()
            for k, va in a["state"][i].items():
                vb = b["state"][i][k]
                assert va.dtype == vb.dtype and va.device == vb.device and torch.equal(va, vb), (w, i, k)
        assert r["saved_bytes"]["state_dict"] == r["saved_bytes"]["state_dict_on_rank0"], w


def test_local_state_covers_every_state_tensor_a_rank_holds(results):
    """local_state() (each rank's non-finite check at a save) holds every tensor of the rank's state, under the
    state dict's keys: together the ranks cover all of it."""
    _, res = results
    for w in (1, 2, 4):
        r = res[w]
        local = [n for _, n in r["local_state"]]
        # all of each rank's state but the padding matrices of a Muon chunk (never saved): rank 0 has none, the
        # last rank some (the tiny model has Muon groups of an odd number of matrices)
        assert local[0] == r["state_numel"][0] and all(n <= s for n, s in zip(local, r["state_numel"])), w
        assert (local[-1] < r["state_numel"][-1]) == (w > 1), (w, local, r["state_numel"])
        full = {str(i): sorted(st) for i, st in r["state_dict"]["state"].items()}
        seen = {}
        for keys, _ in r["local_state"]:
            for i, names in keys.items():
                assert names == full[i.removesuffix(" tail")], (w, i)
                seen[i.removesuffix(" tail")] = names
        assert seen == full, w


def test_collectives_per_step_follow_buckets_not_parameters(results):
    _, res = results
    assert res[1]["per_step"] == [{"collectives": 0, "bytes": 0}] * 3  # one process: no communication
    for w in (2, 4):
        r = res[w]
        kinds = r["bucket_kinds"]
        assert kinds.count("ReplicatedBucket") == 1 and "RowShardBucket" in kinds and "MuonBucket" in kinds
        # reduce + gather per sharded bucket, one all-reduce for the small params, one for the grad norm
        expected = 2 * (len(kinds) - 1) + 1 + 1
        assert all(s["collectives"] == expected for s in r["per_step"]), r["per_step"]
        assert expected < r["n_params"]  # the old optimizer issued one all-reduce per parameter


def test_a_sharded_step_raises_no_future_warning(results):
    """torch 2.13 deprecated reduce_scatter_tensor and all_gather_into_tensor: a FutureWarning on every rank, every
    run. Their new names are called where torch has them (the worker records every FutureWarning of its runs)."""
    _, res = results
    for w in (2, 4):
        assert res[w]["future_warnings"] == [], res[w]["future_warnings"]


def test_a_torch_without_the_new_collective_names_takes_the_old_ones_with_the_same_step(results):
    """A torch before 2.13 may have only the old names: the same collectives, counted alike
    (tests/_shard_worker.py and bench/dist_optim.py count them by name), the same update. (The 2-process launch
    deletes the new names from torch.distributed and reloads nanochat.optim_shard, which chooses again.)"""
    _, res = results
    old = res["old names"]
    assert old["collective_names"] == ("reduce_scatter_tensor", "all_gather_into_tensor")
    assert old["per_step"] == res[2]["per_step"] and old["per_step"][0]["collectives"] > 2, old["per_step"]
    for name, p in res[2]["params"].items():
        assert torch.allclose(p, old["params"][name], rtol=1e-5, atol=1e-6), name
    if hasattr(torch.distributed, "reduce_scatter_single"):  # this torch warns for the old names: seen by the worker
        assert res[2]["collective_names"] == ("reduce_scatter_single", "all_gather_single")
        assert any("reduce_scatter_tensor` is deprecated" in m for m in old["future_warnings"]), old["future_warnings"]


def test_optimizer_state_per_rank_shrinks_with_world_size(results):
    _, res = results
    full = res[1]["state_numel"][0]
    # ideal 1/W, plus the replicated small params and Muon padding: the tiny model has Muon groups of only 2
    # matrices (c_fc, c_proj, routers), which 4 ranks split as chunks of 1 with 2 padding matrices
    for w, bound in ((2, 0.55), (4, 0.35)):
        per_rank = res[w]["state_numel"]
        assert sum(per_rank) >= full
        assert max(per_rank) < bound * full, (w, per_rank, full)


def test_gradient_hooks_launch_every_bucket_during_backward(results):
    _, res = results
    assert all(all(res[w]["launched_in_backward"]) for w in (2, 4))
    assert not any(res[1]["launched_in_backward"])  # one process: no hooks, nothing to launch


def test_state_dict_moves_between_world_sizes(results):
    tmp, res = results
    # a 2-process state continued on 1 process == a 1-process state continued on 4 ranks == 1 on 1
    saved = {w: tmp / f"w{w}.pt" for w in (1, 2)}
    a = run(tmp, 1, saved[2])
    b = torch.load(tmp / "w4_loaded.pt", weights_only=False)  # 4 ranks from saved[1]: the fixture's 4-rank run
    c = run(tmp, 1, saved[1])
    for other in (a, b):
        for name, p in c["params"].items():
            assert torch.allclose(p, other["params"][name], rtol=1e-5, atol=1e-6), name
        assert_state_close(c["state_dict"], other["state_dict"])


def test_a_gradient_missing_on_one_rank_never_pairs_different_buckets(results):
    """Buckets launch in one order on every rank: U's bucket is complete on rank 0 during backward but only at
    step() on rank 1 (no gradient there). Launching in readiness order would reduce rank 0's U with rank 1's V
    (same sizes: silently wrong numbers). A frozen parameter in a group does not break arming the hooks
    (registering a hook on it raises). tests/_grad_order_worker.py, run in the fixture's 2-process launch."""
    import json

    tmp, _ = results
    res = json.loads((tmp / "grad_order.json").read_text())
    first, second = res["steps"]
    # exp_avg = (1 - beta1) * g after one step, then beta1 * m + (1 - beta1) * g (the averaged gradients 0.5, 10.5)
    assert first["U"] == pytest.approx([0.1]) and first["V"] == pytest.approx([2.1])
    assert second["U"] == pytest.approx([0.18]) and second["V"] == pytest.approx([3.78])


def test_rows_that_the_world_size_does_not_divide_are_still_sharded(tmp_path, monkeypatch):
    """A large AdamW table of R rows with R % W != 0 (Engram's: a sum of primes): rank r updates and keeps Adam
    moments for its R // W rows, the R % W tail rows are all-reduced and updated on every rank. 3 ranks (threads of
    this process: tests/_thread_ranks.py) continue a 1-process state (loaded into shards) exactly as 1 process does,
    and save the full table's state."""
    from _row_tail_worker import run as run_here
    from _thread_ranks import run_ranks
    from nanochat import optim_shard

    one = run_here()
    assert one["bucket_kinds"] == ["ReplicatedBucket"]  # one process: no sharding
    torch.save({"state_dict": one["state_dict"]}, tmp_path / "from1.pt")
    stayed = run_here(tmp_path / "from1.pt")
    monkeypatch.setattr(optim_shard, "SHARD_MIN_NUMEL", optim_shard.SHARD_MIN_NUMEL)  # the ranks lower it
    moved = run_ranks(3, lambda rank, world: run_here(tmp_path / "from1.pt"))[0]
    assert moved["bucket_kinds"] == ["RowShardBucket", "RowShardBucket"]  # 37 rows too (37 = 3 x 12 + 1)
    for a, b in zip(stayed["tables"], moved["tables"]):
        assert torch.equal(a, b)  # elementwise AdamW on the same averaged gradients: the same floats
    assert moved["grad_norm"] == pytest.approx(stayed["grad_norm"], rel=1e-6)
    assert_state_close(stayed["state_dict"], moved["state_dict"])
    # per rank: 2 moments of (36 / 3 + 37 // 3 + the one tail row) rows of 64
    assert moved["state_numel"] == [2 * 64 * (12 + 12 + 1)] * 3
    assert moved["local_state_numel"] == moved["state_numel"]  # the tail's moments are checked at a save too


@pytest.mark.parametrize("row", ["d24_token_memory/engram", "d24_token_memory/bigram_12v", "d24/mome_a2_m12",
                                 "d24_sparse_moe/moe_mome"])
def test_every_large_table_of_the_d24_rows_is_sharded(row):
    """docs/training.md's promise for the paper's multi-GPU rows: every AdamW parameter of >= SHARD_MIN_NUMEL elements
    gets a row-sharded bucket (ZeRO-2 moments) at 2, 4 and 8 ranks; Engram's 6,249,886-row table is 2 mod 4."""
    from nanochat import optim_shard
    from nanochat.families import family_of, param_groups
    from nanochat.train_args import parse_args
    from scripts.base_train import model_config, optim_config

    args = parse_args(["--config", str(REPO / "configs" / f"{row}.toml")])
    config = model_config(args, args.vocab_size)
    with torch.device("meta"):
        model = family_of(config).model_cls(config)
    groups = param_groups(model, optim_config(args))
    large = [p for g in groups if g["kind"] == "adamw" for p in g["params"] if p.numel() >= optim_shard.SHARD_MIN_NUMEL]
    assert large
    for world in (2, 4, 8):
        buckets = optim_shard.build_buckets(groups, world, rank=world - 1)
        sharded = {id(b.params[0]) for b in buckets if isinstance(b, optim_shard.RowShardBucket)}
        assert all(id(p) in sharded for p in large), (row, world)
