import pytest
import torch

from conftest import tiny_config
from nanochat.gpt import GPTConfig, GPT, build_model
from nanochat.optim import MuonAdamW, OptimConfig, build_optimizer, build_param_groups, polar_express


def test_every_param_in_exactly_one_group_and_routing():
    model = build_model(tiny_config(), seed=0)
    groups = build_param_groups(model, OptimConfig())
    seen = [id(p) for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    kind = {id(p): g["kind"] for g in groups for p in g["params"]}
    for n, p in model.named_parameters():
        if n.startswith("blocks."):
            assert kind[id(p)] == "muon", n
        else:
            assert kind[id(p)] == "adamw", n


def test_group_hyperparameters_d12_and_d24():
    for depth, width_scale, wd in [(12, 1.0, 0.2), (24, 0.5**0.5, 0.05)]:
        with torch.device("meta"):
            model = GPT(GPTConfig.from_depth(depth))
        g = {x["name"]: x for x in build_param_groups(model, OptimConfig())}
        assert abs(g["lm_head"]["lr"] - 0.004 * width_scale) < 1e-12
        assert abs(g["wte"]["lr"] - 0.3 * width_scale) < 1e-12
        assert g["resid_lambdas"]["lr"] == 0.005 and g["x0_lambdas"]["lr"] == 0.5
        assert g["x0_lambdas"]["betas"] == (0.96, 0.95) and g["wte"]["betas"] == (0.8, 0.95)
        assert all(x["eps"] == 1e-10 for x in g.values() if x["kind"] == "adamw")
        muon = [x for x in g.values() if x["kind"] == "muon"]
        assert all(x["lr"] == 0.02 and abs(x["weight_decay"] - wd) < 1e-12 for x in muon)


def test_polar_express_is_nearly_orthogonal():
    torch.manual_seed(0)
    for shape in [(64, 64), (128, 32), (32, 128)]:
        G = torch.randn(*shape)
        X = polar_express(G)
        sv = torch.linalg.svdvals(X)
        # 5 Polar-Express steps push every singular value above ~1e-2 of the top one into [0.7, 1.2]
        assert sv.max() < 1.2 and (sv > 0.7).float().mean() > 0.9, (shape, sv.min(), sv.max())
        # and it points along the polar factor U V^T
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)
        align = (X * (U @ Vh)).sum() / min(shape)
        assert 0.95 < align < 1.05


def test_muon_first_update_is_orthogonal_direction():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(32, 32))
    opt = MuonAdamW([dict(kind="muon", params=[w], lr=1.0, momentum=0.0, beta2=0.95, weight_decay=0.0, ns_steps=5)])
    w.grad = torch.randn(32, 32)
    opt.step()
    sv = torch.linalg.svdvals(-w.detach())
    assert sv.max() / sv.min() < 2.0


def test_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(10, 3))
    p2 = torch.nn.Parameter(p1.detach().clone())
    ours = MuonAdamW([dict(kind="adamw", params=[p1], lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)])
    ref = torch.optim.AdamW([p2], lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(10, 3)
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.allclose(p1, p2, atol=1e-6)


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    idx = torch.randint(0, 512, (2, 33))

    def train(model, opt, n):
        for _ in range(n):
            model(idx[:, :-1], idx[:, 1:]).backward()
            opt.step()
            model.zero_grad(set_to_none=True)

    a = build_model(tiny_config(), seed=0)
    oa = build_optimizer(a)
    train(a, oa, 3)
    b = build_model(tiny_config(), seed=1)
    b.load_state_dict(a.state_dict())
    ob = build_optimizer(b)
    ob.load_state_dict(oa.state_dict())
    train(a, oa, 2)
    train(b, ob, 2)
    # bit for bit by construction: one process, one thread count, the same inputs and restored state run the
    # same kernels in the same order (CPU kernels are deterministic for a fixed thread count)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n


def test_load_state_dict_puts_every_state_tensor_on_the_parameter_device():
    """A checkpoint's optimizer state is loaded from the CPU; on CUDA each tensor must follow its parameter
    (the fused AdamW kernel takes its step counts on the parameter's device too). A model on the meta device
    stands in for the GPU here; torch's own load_state_dict would leave the step counts on the CPU."""
    model = build_model(tiny_config(), seed=0)
    opt = build_optimizer(model)
    idx = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    model(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()
    state = opt.state_dict()
    assert all(v.device.type == "cpu" for st in state["state"].values() for v in st.values())
    with torch.device("meta"):
        meta_model = GPT(tiny_config())
    meta_opt = build_optimizer(meta_model)
    meta_opt.load_state_dict(state)
    placed = [(v.device.type, k) for st in meta_opt.state.values() for k, v in st.items()]
    assert placed and all(dev == "meta" for dev, _ in placed), placed
    assert {k for _, k in placed} >= {"step", "exp_avg", "exp_avg_sq", "momentum_buffer", "second_moment"}


def test_training_state_is_loaded_on_the_cpu(tmp_path):
    """--resume reads state.pt onto the CPU whatever the training device: torch.set_rng_state needs a CPU
    ByteTensor and the dataloader state is numpy-backed (a cuda map_location broke both)."""
    import inspect

    from nanochat import checkpoint as ckpt

    assert "map_location" not in inspect.signature(ckpt.load_training_state).parameters
    model = build_model(tiny_config(), seed=0)
    state = {"optimizer": build_optimizer(model).state_dict(), "loop": {}, "dataloader": [{}],
             "rng": [ckpt.rng_state()], "world_size": 1}
    ckpt.save_checkpoint(tmp_path, 1, model, {}, state)
    loaded = ckpt.load_training_state(tmp_path, 1)
    assert loaded["rng"][0]["torch"].device.type == "cpu"
    ckpt.set_rng_state(loaded["rng"][0])


def test_training_state_is_memory_mapped(tmp_path, monkeypatch):
    """Every rank of a resume reads state.pt; mapped, each pages in only the optimizer rows it keeps (a full read
    per rank is W copies of the state in a node's host memory)."""
    from nanochat import checkpoint as ckpt

    model = build_model(tiny_config(), seed=0)
    ckpt.save_checkpoint(tmp_path, 1, model, {}, {"optimizer": build_optimizer(model).state_dict(), "loop": {},
                                                  "dataloader": [{}], "rng": [ckpt.rng_state()], "world_size": 1})
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    ckpt.load_training_state(tmp_path, 1)
    assert [kw.get("mmap") for kw in calls] == [True]


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1), (3, 2)])
def test_loaded_optimizer_state_holds_no_view_of_the_mapped_file(tmp_path, world, rank):
    """load_state_dict copies its shard out of the loaded (memory-mapped) state: writing to the loaded tensors
    afterwards leaves the optimizer alone. Several world sizes: row shards, a row-shard tail, Muon chunks with
    padding (rank 2 of 3) each take their own slicing path. The buckets of a rank of a larger world are built
    here without a process group (loading issues no collective)."""
    from nanochat import optim_shard

    model = build_model(tiny_config(memory="mome", memory_options={"slots": 4, "topk": 2}), seed=0)
    opt = build_optimizer(model)
    idx = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    model(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()
    torch.save({"optimizer": opt.state_dict()}, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=False, mmap=True)["optimizer"]

    fresh = build_optimizer(model)
    old_min = optim_shard.SHARD_MIN_NUMEL
    optim_shard.SHARD_MIN_NUMEL = 1024  # the tiny tables and embeddings take the row-sharded path
    try:
        fresh.buckets = optim_shard.build_buckets(fresh.param_groups, world, rank)
    finally:
        optim_shard.SHARD_MIN_NUMEL = old_min
    if world > 1:
        kinds = {type(b).__name__ for b in fresh.buckets}
        assert {"RowShardBucket", "MuonBucket"} <= kinds, kinds
    fresh.load_state_dict(loaded)
    before = [v.clone() for st in fresh.state.values() for v in st.values()]
    assert before
    for st in loaded["state"].values():
        for v in st.values():
            v.fill_(float("nan"))  # a private mapping: the file itself is not touched
    after = [v for st in fresh.state.values() for v in st.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_bf16_parameters_keep_bf16_adam_moments_across_a_checkpoint():
    """Adam's moments are created in the parameter's dtype; loading a state must keep them so (the fused kernel
    refuses a bf16 parameter with fp32 moments), while step counts and Muon buffers stay fp32."""
    from nanochat.optim import MuonAdamW

    def make():
        torch.manual_seed(0)
        a = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
        t = torch.nn.Parameter(torch.randn(10, 4, dtype=torch.bfloat16))
        opt = MuonAdamW([dict(kind="adamw", name="t", params=[t], lr=0.1, betas=(0.8, 0.95), eps=1e-10,
                              weight_decay=0.1),
                         dict(kind="muon", name="m", params=[a], lr=0.02, momentum=0.95, beta2=0.95, weight_decay=0.5,
                              ns_steps=5)])
        return a, t, opt

    a, t, opt = make()
    for _ in range(2):
        a.grad, t.grad = torch.randn_like(a), torch.randn_like(t)
        opt.step()
    a2, t2, opt2 = make()
    with torch.no_grad():  # a checkpoint restores the weights too
        a2.copy_(a)
        t2.copy_(t)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[t2]["exp_avg"].dtype == opt2.state[t2]["exp_avg_sq"].dtype == torch.bfloat16
    assert opt2.state[t2]["step"].dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in opt2.state[a2].values())
    g = torch.randn_like(t)
    a.grad, t.grad, a2.grad, t2.grad = torch.zeros_like(a), g, torch.zeros_like(a), g.clone()
    opt.step()
    opt2.step()  # raised "expected scalar type BFloat16 but found Float" before
    assert torch.equal(t2, t)


def test_frozen_parameters_are_left_out_of_the_groups():
    """Nothing may update a frozen parameter, with any number of ranks: it is in no group (and a group left
    empty is dropped), while every trainable parameter is still in exactly one."""
    from conftest import tiny_config
    from nanochat.gpt import build_model
    from nanochat.optim import OptimConfig, build_param_groups

    model = build_model(tiny_config(memory="ve"), seed=0)
    model.wte.weight.requires_grad_(False)
    groups = build_param_groups(model, OptimConfig())
    grouped = [p for g in groups for p in g["params"]]
    assert all(p is not model.wte.weight for p in grouped) and "wte" not in [g["name"] for g in groups]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(grouped) == len(trainable) and {id(p) for p in grouped} == {id(p) for p in trainable}


def _muon_reference_step(p, g, buf, v, lr, mom, wd, beta2, ns_steps):
    """One Muon step on one (m, n) float64 matrix, written from the equations of the reference Muon
    (spec/mome_reference_model.md §1 "Muon"; spec/nanochat_and_modded_nanogpt.md §1.4). Returns the new
    (p, momentum buffer, second moment, update u)."""
    import math

    from nanochat.optim import POLAR_EXPRESS_COEFFS

    m, n = p.shape
    buf = mom * buf + (1 - mom) * g  # momentum buffer
    x = (1 - mom) * g + mom * buf  # Nesterov: look ahead along the new buffer
    # Polar Express after X <- X / (1.02 ||X||_F + 1e-6): X <- aX + (bA + cA^2)X with A = XX^T for a wide (or
    # square) X, and the same map written X <- aX + X(bA + cA^2) with A = X^T X for a tall one
    X = x / (1.02 * torch.linalg.matrix_norm(x) + 1e-6)
    for a, b, c in POLAR_EXPRESS_COEFFS[:ns_steps]:
        if m > n:
            A = X.T @ X
            X = a * X + X @ (b * A + c * A @ A)
        else:
            A = X @ X.T
            X = a * X + (b * A + c * A @ A) @ X
    # NorMuon: a running mean square per row (rows >= cols) or per column (wide), v <- beta2 v + (1 - beta2) mean(X^2);
    # each row (column) divided by sqrt(v), then the whole matrix rescaled to the Frobenius norm X had
    v = beta2 * v + (1 - beta2) * (X * X).mean(dim=1 if m >= n else 0, keepdim=True)
    scaled = X / v.clamp_min(1e-10).sqrt()
    u = scaled * (torch.linalg.matrix_norm(X) / torch.linalg.matrix_norm(scaled))
    # p <- p - lr_eff u - lr_eff wd p [u p >= 0] (cautious decoupled decay), lr_eff = lr sqrt(max(1, m/n))
    lr_eff = lr * math.sqrt(max(1.0, m / n))
    return p - lr_eff * u - lr_eff * wd * p * (u * p >= 0), buf, v, u


def test_muon_update_matches_a_float64_reference_from_the_equations():
    """Three MuonAdamW steps on a wide (24x40) and a tall (40x24) Muon group (one group per shape, as they are
    stacked; two matrices each), with momentum, weight decay and the lr/momentum/wd that a schedule changes
    between steps (apply_schedules sets them on the groups; the optimizer must read them every step), against
    the float64 reference above. On the CPU the code runs Muon in fp32 (polar_express picks bf16 on CUDA only)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one fixed reduction order; and a 2-thread pool stalls ~1 s on a busy 2-core host
    try:
        _check_muon_against_reference()
    finally:
        torch.set_num_threads(threads)


def _check_muon_against_reference():
    gen = torch.Generator().manual_seed(31)
    shapes = [(24, 40), (40, 24)]
    params = {s: [torch.nn.Parameter(torch.randn(*s, generator=gen)) for _ in range(2)] for s in shapes}
    grads = {s: [[torch.randn(*s, generator=gen) for _ in range(2)] for _ in range(3)] for s in shapes}
    beta2, ns_steps = 0.95, 5
    opt = MuonAdamW([dict(kind="muon", name=f"muon_{m}x{n}", params=params[(m, n)], lr=0.0, momentum=0.0,
                          beta2=beta2, weight_decay=0.0, ns_steps=ns_steps) for m, n in shapes])
    schedule = [(0.05, 0.85, 0.5), (0.04, 0.9, 0.4), (0.03, 0.95, 0.3)]  # (lr, momentum, wd) of each step
    ref = {s: [(p.detach().double(), torch.zeros(s, dtype=torch.float64),
                torch.zeros((s[0], 1) if s[0] >= s[1] else (1, s[1]), dtype=torch.float64)) for p in params[s]]
           for s in shapes}
    for step, (lr, mom, wd) in enumerate(schedule):
        for group in opt.param_groups:
            group.update(lr=lr, momentum=mom, weight_decay=wd)
        for s in shapes:
            for p, g in zip(params[s], grads[s][step]):
                p.grad = g.clone()
        opt.step()
        for s in shapes:
            for i, p in enumerate(params[s]):
                pr, buf, v = ref[s][i]
                pr, buf, v, u = _muon_reference_step(pr, grads[s][step][i].double(), buf, v, lr, mom, wd, beta2,
                                                     ns_steps)
                ref[s][i] = (pr, buf, v)
                # the cautious mask is decided by sign(u p): this seed keeps every |u| far above fp32's error on u
                # (at most ~2.3e-6, measured against float64 on these shapes), so no entry can flip its mask
                assert u.abs().min() > 1e-5, (step, s, i, u.abs().min().item())
                # Tolerance 1e-5 on |p| <= ~5: each fp32 step adds at most one rounding of p (<= 2.4e-7 at |p| 4)
                # plus lr_eff (<= 0.065) x the fp32 error of u (<= 2.3e-6), so 3 steps stay under ~1.2e-6 (measured
                # ~5e-7), while each mutation probed (no LR scale, inverted cautious mask, plain momentum, no NorMuon
                # norm ratio, doubled wd, swapped second-moment axis) moves some p by >= 5e-3 within 2 steps
                err = (p.detach().double() - pr).abs().max().item()
                assert err < 1e-5, (step, s, i, err)


def test_grad_norm_is_the_global_l2_norm_of_the_gradients():
    """The logged grad norm (training spec §7.7: the reference logged none) is the L2 norm over every parameter's
    gradient, Muon and AdamW groups alike, read before the update changes anything."""
    model = build_model(tiny_config(memory="mome"), seed=0)
    opt = build_optimizer(model)
    idx = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    model(idx[:, :-1], idx[:, 1:]).backward()
    expect = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()
                                                   if p.grad is not None]))
    opt.step()
    assert float(opt.grad_norm) == pytest.approx(float(expect), rel=1e-5)
