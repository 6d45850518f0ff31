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
