import pytest
import torch

from conftest import tiny_config
from nanochat.gpt import build_model
from nanochat.optim import build_optimizer
from nanochat.train_loop import train_step


def test_train_step_applies_mome_balancing_bias():
    cfg = tiny_config(memory="mome", memory_options={"slots": 4, "topk": 2, "balance": "bias", "balance_lr": 0.01})
    model = build_model(cfg, seed=0)
    opt = build_optimizer(model)
    data = iter([(torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32)))] * 2)
    assert torch.all(model.memory.router_bias == 0)
    train_step(model, opt, data, grad_accum=2, autocast_ctx=torch.autocast("cpu", enabled=False), device="cpu")
    bias = model.memory.router_bias
    # zero-init routers tie, so the selected slots are over-loaded and the rest under-loaded: +-lr everywhere visited
    assert bias.abs().max().item() == torch.tensor(0.01).item()
    assert (bias > 0).any() and (bias < 0).any()
    assert torch.all(model.memory.balance_counts == 0)  # consumed by the update


def test_shared_bigram_table_sparse_grad_trains_like_dense(monkeypatch):
    """The sparse gradient of the table shared by all memory layers equals the dense one, and the optimizer's
    step from it equals the step from its dense equivalent.

    Both gradients are sums of the same terms w * dL/dmix, one per (layer, token, head, slot), in different orders
    (sparse: one entry per term, summed by to_dense; dense: index_add per layer, then layer by layer), so neither
    is the other's bits. Each is compared with the sum of the terms recorded from the forward and backward,
    multiplied and summed in float64 (products of fp32 values are exact there; the float64 sum's own error is
    ~1e-16 relative), within the worst case of any float32 summation order: |error| <= gamma_n * sum|terms| per
    element, gamma_n = n u / (1 - n u), u = 2^-24, n the number of terms plus one for the rounding of each product
    (plus n times the smallest subnormal). Training each model on its own gradient would not be a fair comparison
    on every CPU: Adam turns last-bit differences of near-zero elements into O(lr) steps. So the dense model takes
    the densified sparse gradient, and the two models must stay equal bit for bit, which checks that densify-then-AdamW is the dense path."""
    from nanochat.memory import mome, mome_mix as mix_paths

    mixes = []  # (flat ids (B, T, H, K), weights (B, T, H, K), [dL/dmix (B, T, H, d)]) per call

    def recording_mix(table, flat, w, sparse=False):
        out = mix_paths.mome_mix_fused(table, flat, w, sparse)
        grad = []
        out.register_hook(grad.append)
        mixes.append((flat, w.detach(), grad))
        return out

    monkeypatch.setattr(mome, "mome_mix", recording_mix)
    monkeypatch.setattr(mix_paths, "MIX", "bag")  # the K-row mix per layer (the default for this table is the row mix)
    cfg = tiny_config(memory="mome", n_layer=4, memory_options={"slots": 4, "topk": 2, "index": "bigram",
                                                                 "bigram_factor": 2})
    models = [build_model(cfg, seed=0), build_model(cfg, seed=0)]
    models[1].memory.sparse_shared_grad = False  # the dense reference
    for model in models:  # random routers: zero-init ones tie and every slot would get the same score
        with torch.no_grad():
            for router in model.memory.routers:
                router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(1)))
    sparse_model, dense_model = models
    table = sparse_model.memory.table.weight
    opts = [build_optimizer(m) for m in models]
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (2, 33), generator=g) for _ in range(3)]
    compared = 0
    for batch in batches:
        mixes.clear()
        sparse_model(batch[:, :-1], batch[:, 1:]).backward()
        terms = [(flat.reshape(-1), (w[..., None].double() * grad[0][..., None, :].double()).reshape(-1, table.size(1)))
                 for flat, w, grad in mixes]  # one (row id, term (d,)) per layer, token, head and slot
        rows, vals = torch.cat([r for r, _ in terms]), torch.cat([v for _, v in terms])
        exact = torch.zeros(table.shape, dtype=torch.float64).index_add_(0, rows, vals)
        abs_sum = torch.zeros(table.shape, dtype=torch.float64).index_add_(0, rows, vals.abs())
        n = torch.bincount(rows, minlength=table.size(0)).max().item() + 1
        bound = n * 2.0**-24 / (1 - n * 2.0**-24) * abs_sum + n * 2.0**-149  # + subnormal products' rounding
        dense_model(batch[:, :-1], batch[:, 1:]).backward()
        sparse, dense = table.grad, dense_model.memory.table.weight.grad
        assert sparse.is_sparse and not dense.is_sparse
        for name, grad in (("sparse", sparse.to_dense()), ("dense", dense)):
            err = (grad.double() - exact).abs()
            assert (err <= bound).all(), (name, (err - bound).max())
        compared += int(abs_sum.sum() > 0)
        for (name, a), b in zip(sparse_model.named_parameters(), dense_model.parameters()):
            if a is not table:  # the same backward code everywhere else
                assert torch.equal(a.grad, b.grad), name
        dense_model.memory.table.weight.grad = sparse.to_dense()
        for model, opt in zip(models, opts):
            opt.step()
            assert not model.memory.table.weight.grad.is_sparse  # densified once by the optimizer
            model.zero_grad(set_to_none=True)
        for (name, a), b in zip(sparse_model.named_parameters(), dense_model.parameters()):
            assert torch.equal(a, b), name
    assert compared == 2  # step 1: zero-init output projections, so the table gets gradient from step 2 on


class _ToyHookBlock:
    """A memory block using the two training-time hooks: it scales every FFN increment by ``scale`` (given the
    block input, which it records) and returns ``weight**2`` as its auxiliary loss."""

    @staticmethod
    def make(scale: float):
        from nanochat.memory.base import MemoryBlock

        class Toy(MemoryBlock):
            def __init__(self, config):
                super().__init__(config)
                self.weight = torch.nn.Parameter(torch.empty(()))
                self.seen = []

            def init_weights(self):
                self.weight.data.fill_(3.0)

            def scalar_params(self):
                return [self.weight]

            def prepare(self, idx, state):
                return {"aux": []}

            def mlp_out(self, layer, h, delta, ctx):
                self.seen.append((layer, h.shape))
                ctx["aux"].append(self.weight.square())
                return delta * scale

            def aux_loss(self, ctx):
                return torch.stack(ctx["aux"]).mean()

        return Toy


@pytest.mark.parametrize("family", ["nanochat", "mobilellm"])
def test_mlp_out_and_aux_loss_hooks(monkeypatch, family):
    from nanochat import memory
    from nanochat.families import FAMILIES, param_groups
    from nanochat.optim import MuonAdamW, OptimConfig

    monkeypatch.setitem(memory.MEMORY_BLOCKS, "toy", _ToyHookBlock.make(0.0))
    cfg_cls = FAMILIES[family].config_cls
    extra = {} if family == "nanochat" else {"ffn_hidden": 64}
    toy = build_model(cfg_cls(**tiny_config(memory="toy").to_dict() | extra), seed=0)
    base = build_model(cfg_cls(**tiny_config().to_dict() | extra), seed=0)
    with torch.no_grad():  # the toy block zeroes every FFN increment: the base model with zero FFN outputs
        for block in base.blocks:
            block.mlp.c_proj.weight.zero_()
        for block in toy.blocks:
            block.mlp.c_proj.weight.normal_()
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(toy(idx), base(idx), rtol=0, atol=0)
    assert toy.memory.seen[:2] == [(0, (2, 16, 128)), (1, (2, 16, 128))]
    loss, aux = toy(idx, targets=idx, return_aux=True)
    assert torch.equal(loss, toy(idx, targets=idx)) and aux.item() == 9.0
    _, zero = base(idx, targets=idx, return_aux=True)
    assert zero.item() == 0.0 and zero.shape == ()
    # the trainer adds the auxiliary loss before backward and reports it apart from the LM loss
    opt = MuonAdamW(param_groups(toy, OptimConfig()))
    grads = []
    step = opt.step
    monkeypatch.setattr(opt, "step", lambda: (grads.append(toy.memory.weight.grad.clone()), step()))
    data = iter([(idx, idx)] * 2)
    lm, _, _, aux_mean = train_step(toy, opt, data, grad_accum=2, autocast_ctx=torch.autocast("cpu", enabled=False),
                                    device="cpu")
    assert aux_mean == 9.0 and abs(lm - loss.item()) < 1e-4
    # the aux loss is divided by grad_accum like the LM loss: the weight's gradient is d aux / d weight = 2 * 3 once
    # per optimizer step, not once per micro-step (JTok-M's lambda would otherwise grow with the accumulation)
    assert [g.item() for g in grads] == [6.0]
    assert toy.memory.weight.item() != 3.0


def test_logged_routing_stats_cover_every_rank(gloo_checks):
    """Two gloo ranks, each with its own token rows: the logged memory/* and moe/* records equal what one process
    computes from the two ranks' counters added up (not rank 0's tokens alone), on both ranks. The ranks are
    tests/_stats_worker.py's in the session's shared 2-rank launch (conftest.gloo_checks)."""
    from _stats_worker import model_for
    from nanochat.train_loop import module_stats, stats_buffers

    ranks = [torch.load(gloo_checks / f"routing_stats.rank{i}.pt") for i in range(2)]
    for name in ranks[0]:
        local = [ranks[i][name]["local"] for i in range(2)]
        model = model_for(name)
        for key, buf in stats_buffers(model).items():
            if not key.endswith(".count"):  # forwards per rank: equal by design
                assert not torch.equal(local[0][key], local[1][key]), (name, key)  # the sum over ranks matters
            buf.copy_(local[0][key] + local[1][key])
        want = module_stats(model)
        assert any(k.endswith(("maxvio/layer0", "maxvio/layer1")) for k in want), (name, want)
        for i in range(2):
            assert ranks[i][name]["stats"] == want, (name, i)
        for key, buf in stats_buffers(model).items():  # rank 0's tokens alone give other numbers
            buf.copy_(local[0][key])
        assert module_stats(model) != want, name


def test_a_signal_during_the_step_is_voted_in_that_step():
    """base_train's Ctrl-C handler only latches the signal; a flag read when the step starts made a signal that
    came during step s stop after step s + 1 (walk of 2026-11-27: SIGINT during step 7 saved step 8). Read at
    the vote, as ``time_up`` is, it stops after step s, the 'next step boundary' docs/training.md promises."""
    model = build_model(tiny_config(), seed=0)
    opt = build_optimizer(model)
    received = []

    def batches():  # the signal lands while the step's second micro-batch is read
        for i in range(2):
            if i == 1:
                received.append("SIGINT")
            yield torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32))

    _, _, votes, _ = train_step(model, opt, batches(), grad_accum=2, autocast_ctx=torch.autocast("cpu", enabled=False),
                                device="cpu", stop_requested=lambda: bool(received))
    assert votes.signal and not votes.wall_time
    _, _, votes, _ = train_step(model, opt, iter([(torch.randint(0, 512, (2, 32)),) * 2] * 2), grad_accum=2,
                                autocast_ctx=torch.autocast("cpu", enabled=False), device="cpu", stop_requested=False)
    assert not votes.signal  # a plain bool, as before
