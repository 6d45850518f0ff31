"""Shared builders for the MoME block tests: a tiny config for every indexer and a block with random weights."""

import torch

from conftest import tiny_config
from nanochat.gpt import build_model
from nanochat.memory.mome import MoMEMemory
from nanochat.memory.slot_map import write_slot_map

VOCAB, C, HEADS, GROUP = 96, 64, 2, 3  # vocab 96 pads to 128; divisible by the group size 3
ROWS, DEDICATED = 40, 10  # mod/headmod: 40 does not divide 96, so the rows hold 3 or 2 tokens


def mome_config(tmp_path, M, K, index, memory_layers=(), **extra):
    opts = dict(slots=M, topk=K, index=index, **extra)
    if index == "grouped":
        perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5)).tolist()
        path = tmp_path / "map.json"
        write_slot_map(path, [perm[i : i + GROUP] for i in range(0, VOCAB, GROUP)], VOCAB, GROUP)
        opts.update(group_size=GROUP, slot_map=str(path))
    if index == "bigram":
        opts.update(bigram_factor=2)
    if index in ("mod", "headmod"):
        opts.update(rows=ROWS, **({"dedicated_size": DEDICATED} if index == "headmod" else {}))
    return tiny_config(vocab_size=VOCAB, n_embd=C, n_head=HEADS, n_kv_head=HEADS, n_layer=2, memory="mome",
                       memory_layers=memory_layers, memory_options=opts)


def random_block(cfg, seed=0):
    """A MoME block whose routers and gates are random (no top-K ties, non-trivial gamma)."""
    block = MoMEMemory(cfg)
    block.init_weights()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.ndim > 1 else 0.3))
    return block


def naive_row(cfg, block, tokens, b, t):
    """The row n_t of position (b, t) by the paper's indexers, in Python ints (independent of the block's code)."""
    o = block.opts
    x = int(tokens[b, t])
    if o.index == "token":
        return x
    if o.index == "grouped":
        return int(block.slot_map[x])
    if o.index == "mod":  # reference notes §3.4: slot = token mod S
        return x % o.rows
    if o.index == "headmod":  # tokens below D keep their own slot, others D + ((tok - D) mod (S - D))
        D = o.dedicated_size
        return x if x < D else D + (x - D) % (o.rows - D)
    n = o.bigram_factor * cfg.vocab_size  # paper/reference hash, written out in Python ints
    if t == 0:
        return n - 1
    return ((36313 * x) ^ (27191 * int(tokens[b, t - 1]))) % (n - 1)


def counts_with_random_routers(**opts):
    """(load_counts, balance_counts, eval slot-balance counts) of one training and one eval forward of a tiny
    4-layer MoME with balance counting on and random routers (seeded: the same for options that keep the routers'
    shapes), to compare options that must not change the selections."""
    model = build_model(tiny_config(memory="mome", n_layer=4, memory_options=dict(balance="bias", **opts)), seed=0)
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for r in model.memory.routers:
            r.weight.copy_(torch.randn(r.weight.shape, generator=g))
    model(idx)
    model.eval()
    model.memory.start_eval_loads()
    model(idx)
    return model.memory.load_counts.clone(), model.memory.balance_counts.clone(), model.memory.pop_eval_loads()
