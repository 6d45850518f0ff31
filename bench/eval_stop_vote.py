"""The cost of the evaluation's stop vote (``nanochat.eval_resume.stop_voted``): the bare vote all-reduce, and
evaluate_bpb per batch over the same batches with the vote and without it, alternated 7 times (medians printed).

    torchrun --standalone --nproc_per_node=2 bench/eval_stop_vote.py --every 4            # CPU, gloo
    torchrun --standalone --nproc_per_node=2 bench/eval_stop_vote.py --n-embd 256 --n-layer 4 --seq-len 256 \\
        --batch 8 --vocab 4096 --batches 40

Without the vote every rank runs its batches on its own and the ranks meet once, in the final all-reduce; with it
they meet at every vote, so besides the all-reduce a vote costs the wait for the slowest rank.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from nanochat import loss_eval
from nanochat.eval_resume import stop_voted
from nanochat.gpt import GPT, GPTConfig

ap = argparse.ArgumentParser()
for name, default in (("n-embd", 128), ("n-layer", 2), ("seq-len", 64), ("batch", 4), ("vocab", 1024),
                      ("batches", 200), ("every", 4)):
    ap.add_argument(f"--{name}", type=int, default=default)
a = ap.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

votes = torch.zeros(2, dtype=torch.int64)
for _ in range(200):
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
t0 = time.perf_counter()
for _ in range(2000):
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    votes.tolist()
vote_us = (time.perf_counter() - t0) / 2000 * 1e6

heads = max(1, a.n_embd // 64)
model = GPT(GPTConfig(sequence_len=a.seq_len, vocab_size=a.vocab, n_layer=a.n_layer, n_head=heads, n_kv_head=heads,
                      n_embd=a.n_embd))
model.init_weights()
model.eval()
rows = torch.randint(0, a.vocab, (a.batches * a.batch * world, a.seq_len + 1), generator=torch.Generator().manual_seed(0))
token_bytes = torch.ones(a.vocab, dtype=torch.int64)


def batches():
    mine = rows[rank::world]
    for s in range(0, len(mine), a.batch):
        yield mine[s:s + a.batch, :-1], mine[s:s + a.batch, 1:]


def ms_per_batch(voted: bool) -> float:
    loss_eval.stop_voted = (lambda b, d: stop_voted(b, d, a.every)) if voted else (lambda b, d: b)
    dist.barrier()
    t0 = time.perf_counter()
    loss_eval.evaluate_bpb(model, batches(), token_bytes)
    return (time.perf_counter() - t0) / a.batches * 1e3


ms_per_batch(True)
with_vote, without = [], []
for _ in range(7):
    with_vote.append(ms_per_batch(True))
    without.append(ms_per_batch(False))
if rank == 0:
    w, wo = statistics.median(with_vote), statistics.median(without)
    print(f"vote every {a.every}: n_embd {a.n_embd} n_layer {a.n_layer} B {a.batch} T {a.seq_len} V {a.vocab}: "
          f"vote all-reduce {vote_us:.0f} us; evaluate_bpb per batch {wo:.2f} ms without the vote, {w:.2f} ms with it "
          f"({(w - wo) / wo * 100:+.1f}%); runs with {[round(x, 2) for x in with_vote]} "
          f"without {[round(x, 2) for x in without]}")
dist.destroy_process_group()
