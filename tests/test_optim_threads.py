"""The sharded MuonAdamW with W ranks as threads of this process (tests/_thread_ranks.py): edge cases of the
sharding that a torchrun launch would make slow to check."""

import torch

from _thread_ranks import BUILD_LOCK, run_ranks
from nanochat import optim_shard
from nanochat.optim import MuonAdamW


def _frozen_in_groups(rank: int, world: int) -> dict:
    """Two steps of a hand-built optimizer whose groups hold frozen parameters (finalize_groups leaves them out of
    the model's groups; a caller building groups by hand may not): a frozen matrix first in its Muon group (whose
    state is keyed by its first parameter), a frozen table of the row-sharded size, a frozen small vector. The
    trainable ones get the same gradient on every rank, so their averaged gradient is the same for every W."""
    with BUILD_LOCK:
        gen = torch.Generator().manual_seed(0)
        frozen = {"matrix": torch.nn.Parameter(torch.randn(8, 8, generator=gen), requires_grad=False),
                  "table": torch.nn.Parameter(torch.randn(64, 8, generator=gen), requires_grad=False),
                  "vector": torch.nn.Parameter(torch.randn(3, generator=gen), requires_grad=False)}
        trained = {"m1": torch.nn.Parameter(torch.randn(8, 8, generator=gen)),
                   "m2": torch.nn.Parameter(torch.randn(8, 8, generator=gen)),
                   "table": torch.nn.Parameter(torch.randn(64, 8, generator=gen)),
                   "vector": torch.nn.Parameter(torch.randn(3, generator=gen))}
        weights = {k: torch.randn(p.shape, generator=gen) for k, p in trained.items()}
    initial = {k: p.detach().clone() for k, p in frozen.items()}
    opt = MuonAdamW([
        dict(kind="adamw", name="a", params=[trained["table"], frozen["table"], frozen["vector"], trained["vector"]],
             lr=0.1, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.5),
        dict(kind="muon", name="m", params=[frozen["matrix"], trained["m1"], trained["m2"]], lr=0.1, momentum=0.9,
             beta2=0.95, weight_decay=0.5, ns_steps=5)])
    for _ in range(2):
        opt.arm_grad_hooks()
        sum((p * weights[k]).sum() for k, p in trained.items()).backward()
        opt.step()
        for p in trained.values():
            p.grad = None
    return {"frozen_moved": [k for k, p in frozen.items() if not torch.equal(p, initial[k])],
            "frozen_grads": [k for k, p in frozen.items() if p.grad is not None],
            "trained": {k: p.detach().clone() for k, p in trained.items()}, "state": opt.state_dict()["state"],
            "sharded": sorted(type(b).__name__ for b in opt.buckets)}


def test_frozen_parameters_in_a_group_stay_as_they_are_on_any_number_of_ranks(monkeypatch):
    """A frozen parameter is never updated, on one rank or several. With several, the buckets used to count it as a
    zero gradient (every rank joins every collective): AdamW's and Muon's decay moved it on 2 ranks, not on 1."""
    monkeypatch.setattr(optim_shard, "SHARD_MIN_NUMEL", 256)  # the 64 x 8 tables take the row-sharded path
    one = run_ranks(1, _frozen_in_groups)[0]
    two = run_ranks(2, _frozen_in_groups)
    assert "RowShardBucket" in two[0]["sharded"] and "MuonBucket" in two[0]["sharded"]
    for res in (one, *two):
        assert res["frozen_moved"] == [] and res["frozen_grads"] == []
    # the trained parameters take the same steps (frozen ones hold no state: indices 1, 2 and 4 are absent)
    assert sorted(one["state"]) == sorted(two[0]["state"]) == [0, 3, 5]
    for k, p in one["trained"].items():
        for res in two:
            assert torch.allclose(p, res["trained"][k], rtol=1e-5, atol=1e-6), k
    for i, st in one["state"].items():
        for name, v in st.items():
            assert torch.allclose(v, two[0]["state"][i][name], rtol=1e-5, atol=1e-6), (i, name)


def _tiny_mome_steps(load=None, steps=2):
    """``fn(rank, world)`` for run_ranks: a tiny MoME model (vocab 256, 1024-row tables: 3 ranks leave a tail row
    of every table, the Muon groups of 2 matrices an all-padding rank) trained ``steps`` steps through the gradient
    hooks on this rank's own batch, from the state dict ``load`` if given."""
    from nanochat.gpt import GPTConfig, build_model
    from nanochat.optim import build_optimizer

    def fn(rank: int, world: int) -> dict:
        with BUILD_LOCK:
            cfg = GPTConfig(sequence_len=16, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=32,
                            memory="mome", memory_options={"slots": 4, "topk": 2})
            model = build_model(cfg, seed=0)
        opt = build_optimizer(model)
        if load is not None:
            opt.load_state_dict(load)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        idx = torch.randint(0, 256, (steps, 2, 17), generator=torch.Generator().manual_seed(7 + rank))
        for batch in idx:
            opt.arm_grad_hooks()
            model(batch[:, :-1], batch[:, 1:]).backward()
            opt.step()
            model.zero_grad(set_to_none=True)
        return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "initial": initial,
                "kinds": {type(b).__name__ for b in opt.buckets}, "state": opt.state_dict(),
                "on_rank0": opt.state_dict_on_rank0()}
    return fn


def test_three_ranks_with_tail_rows_and_padding_matrices_stay_in_step(monkeypatch):
    """W = 3 does not divide the tables' rows (a tail row each, all-reduced and updated by every rank) nor the Muon
    groups (padding matrices, a rank that owns none), with every collective launched from the gradient hooks: after
    each rank's own backward every rank holds the same parameters (bit for bit: whatever a rank updates alone is
    all-gathered, the rest is updated alike from the same reduced gradient), the state gathered onto rank 0 is the
    state dict, and 2 ranks and 1 load it into their shards and gather it back unchanged."""
    monkeypatch.setattr(optim_shard, "SHARD_MIN_NUMEL", 1024)  # tables and embeddings take the row-sharded path
    three = run_ranks(3, _tiny_mome_steps())
    assert three[0]["kinds"] == {"MuonBucket", "RowShardBucket", "ReplicatedBucket"}
    for name, p in three[0]["params"].items():
        assert not torch.equal(p, three[0]["initial"][name]), name  # every parameter took steps
        for other in three[1:]:
            assert torch.equal(p, other["params"][name]), name
    assert three[1]["on_rank0"] is None and three[2]["on_rank0"] is None
    a, b = three[0]["state"], three[0]["on_rank0"]
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    assert all(torch.equal(v, b["state"][i][k]) for i, st in a["state"].items() for k, v in st.items())
    for world in (2, 1):  # loaded into this many ranks' shards and gathered again: the same state, exactly
        moved = run_ranks(world, _tiny_mome_steps(load=a, steps=0))[0]["state"]
        assert moved["param_groups"] == a["param_groups"] and moved["state"].keys() == a["state"].keys(), world
        assert all(torch.equal(v, moved["state"][i][k]) for i, st in a["state"].items() for k, v in st.items()), world
