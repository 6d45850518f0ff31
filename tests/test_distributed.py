import pytest
import torch

from _dist_optim_worker import STEPS


@pytest.fixture(scope="module")
def one_and_two_process_runs(gloo_checks):
    """{design: (1-process result, 2-process result)} for every design of _dist_optim_worker: one 2-process
    torchrun trains them all in turn (the session's shared launch, conftest.gloo_checks); the 1-process reference
    runs in this process at 1 thread, the thread count of a torchrun worker (run_torchrun), so each micro-batch's
    gradient is computed by the same kernels."""
    from _dist_optim_worker import DESIGNS, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = {memory: train(memory, STEPS, rank=0, world_size=1) for memory in DESIGNS}
    finally:
        torch.set_num_threads(threads)
    return {memory: (one[memory], torch.load(gloo_checks / f"dist_optim.{memory}.pt")) for memory in DESIGNS}


@pytest.mark.parametrize("memory", ["base", "mome_bigram_shared"])
def test_two_process_gloo_equals_single_process_grad_accum(one_and_two_process_runs, memory):
    """optimizer.step() after per-rank backward on 2 gloo processes = 1 process accumulating the same global batch.

    Compared bit for bit over 3 steps, which holds by construction, not by luck of the CPU:
    - each micro-batch's gradient is computed by the same code on the same shapes, weights and thread count
      (1 thread: run_torchrun's workers, and the reference in this process) on both runs, so it is the same bits;
    - the 1-process reference sums the micro-batch gradients in the association the 2-process step uses
      (per-rank pairs, then pair0 + pair1, halved; see _dist_optim_worker): a sum of two floats does not depend on
      the order of its operands and halving is exact, so the averaged gradient is the same bits however the
      collective orders the sum and whether it halves before or after;
    - from identical gradients the same update arithmetic gives identical parameters, step after step.
    A natural 1-process accumulation (((g0 + g1) + g2) + g3) / 4 differs in the last bits, and Adam and NorMuon
    turn last-bit differences of near-zero gradient elements into O(lr) steps (a ~0 gradient element's Adam step
    is lr * sign(g)), so no small tolerance against it would hold on every CPU: that is why the reference pairs.
    The sharded optimizer (each rank runs Polar Express on its chunk of a Muon group, AdamW on its rows) keeps
    this exact here: a batched matmul over c matrices rounds each matrix as one over K does (measured, not
    guaranteed by torch); should a change break that, compare the first step within float32 rounding and later
    ones within what Adam/NorMuon amplification allows, as test_optim_shard does."""
    a, b = one_and_two_process_runs[memory]
    assert a["final"].keys() == b["final"].keys() == a["initial"].keys()
    for k in a["final"]:
        assert torch.equal(a["initial"][k], b["initial"][k]), k
        assert torch.equal(a["final"][k], b["final"][k]), (k, (a["final"][k] - b["final"][k]).abs().max())
    unmoved = [k for k in a["final"] if torch.equal(a["final"][k], a["initial"][k])]
    assert not unmoved, unmoved  # every parameter took steps: the comparison is not between two idle models
