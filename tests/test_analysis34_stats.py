"""analyze_memory's statistics against a naive reference of the paper's M_l and gamma~_l (session 34 review).

The reference is the paper's definition in plain Python loops over positions, on what a real tiny model's forward
injects (hooked at the block's value/residual output, not read from the capture), one row per forward: so the
batching, padding, BOS exclusion, layer/head order and accumulation of the analysis are all checked, on a model
with three memory layers that are not the default alternating set.
"""

import pytest
import torch

from conftest import tiny_config
from nanochat.analysis import Domain
from nanochat.families import build_model

BOS = 0


def tiny_model(memory, opts=None, memory_layers=(0, 2, 3), seed=0):
    """4 layers, 3 memory layers (not the default alternating set), 2 KV heads; the zero-inits un-zeroed."""
    cfg = tiny_config(vocab_size=64, n_layer=4, n_embd=64, n_head=2, n_kv_head=2, memory=memory,
                      memory_options=opts or {}, memory_layers=memory_layers, sequence_len=32)
    model = build_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "memory" in name or "c_proj" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model.eval()


def uneven_rows(n=4, seed=3):
    """Rows of different lengths, BOS first, some with a BOS inside (a packed second document)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        r = torch.randint(1, 64, (3 + 4 * i % 23,), generator=g)
        r[0] = BOS
        if i % 3 == 2:
            r[len(r) // 2] = BOS
        rows.append(r)
    return rows


def hooked_injections(model, row):
    """One forward of one row; per memory layer (in block.layers order) the gate output (T, H) and the per-head
    norm of what the block actually adds, (T, H): the block's value/residual output minus its input."""
    from nanochat.memory.base import MemoryBlock

    block = model.memory
    seen = {}
    residual = type(block).residual is not MemoryBlock.residual
    hook_name = "residual" if residual else "value"
    real = getattr(block, hook_name)

    def wrapped(layer, *args):
        out = real(layer, *args)
        before = args[0] if residual else args[1]  # residual(layer, x, ctx); value(layer, xn, v, ctx)
        if layer in block.layers:
            seen[layer] = out.double() - before.double()
        return out

    gates = {}
    hooks = [g.register_forward_hook(lambda m, i, o, li=li: gates.__setitem__(li, o.detach().double()))
             for li, g in enumerate(block.gates)]
    setattr(block, hook_name, wrapped)
    try:
        with torch.no_grad():
            model(row[None])
    finally:
        del block.__dict__[hook_name]
        for h in hooks:
            h.remove()
    H = block.gates[0].proj.out_features
    gam, nrm = [], []
    for li, layer in enumerate(block.layers):
        d = seen[layer][0]  # (T, H, d) for value, (T, C) for residual
        d = d.view(d.size(0), H, -1)
        gam.append(gates[li][0])
        nrm.append(d.norm(dim=-1))
    return torch.stack(gam, 1), torch.stack(nrm, 1)  # (T, L, H)


@pytest.mark.parametrize("memory,opts", [("ve", {}), ("bigram", dict(factor=2)),
                                         ("mome", dict(slots=6, topk=2, shared_expert=True, per_head_table=True))])
def test_gate_and_injected_norm_equal_the_real_injection_one_row_at_a_time(memory, opts):
    from scripts.analyze_memory import memory_use

    model = tiny_model(memory, opts)
    block = model.memory
    rows = uneven_rows()
    L, H = len(block.layers), block.gates[0].proj.out_features
    got = memory_use(model, [Domain("d", rows)], 3, BOS, progress=False)["d"]  # two batches, padded
    # naive: per (layer, head), the plain mean over every non-BOS position of every row, rows run alone
    sums_g = [[0.0] * H for _ in range(L)]
    sums_n = [[0.0] * H for _ in range(L)]
    count = 0
    for row in rows:
        gam, nrm = hooked_injections(model, row)
        for t in range(len(row)):
            if int(row[t]) == BOS:
                continue
            count += 1
            for li in range(L):
                for h in range(H):
                    sums_g[li][h] += float(gam[t, li, h])
                    sums_n[li][h] += float(nrm[t, li, h])
    assert got["tokens"] == count
    want_g = torch.tensor(sums_g, dtype=torch.float64) / count
    want_n = torch.tensor(sums_n, dtype=torch.float64) / count
    # fp32 forwards of other shapes (batched, padded) agree to fp32 rounding, not bit for bit
    torch.testing.assert_close(torch.tensor(got["gamma"], dtype=torch.float64), want_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got["inject_norm"], dtype=torch.float64), want_n, rtol=1e-4, atol=1e-6)



def test_top_ranks_breaks_ties_by_cell_order():
    """Equal cells rank in row-major order (a stable sort), the same on every device and run; before, a non-stable
    argsort could give the figure's rank numbers to either of two tied sites."""
    from nanochat.analysis import top_ranks

    grid = torch.tensor([[0.5] * 16 + [0.25] * 16] * 2)  # 64 cells: argsort's unstable path on the CPU
    ranks = top_ranks(grid, k=20).flatten().tolist()
    assert ranks[:16] == list(range(1, 17)) and ranks[32:36] == [17, 18, 19, 20], ranks
