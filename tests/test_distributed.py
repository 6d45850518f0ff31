import pytest
import torch

from conftest import REPO, run_torchrun


@pytest.mark.parametrize("memory", ["base", "mome_bigram_shared"])
def test_two_process_gloo_equals_single_process_grad_accum(tmp_path, memory):
    """optimizer.step() after per-rank backward on 2 gloo processes = 1 process accumulating the same global batch.

    Compared bit for bit over 3 steps, which holds by construction, not by luck of the CPU:
    - each micro-batch's gradient is computed by the same code on the same shapes, weights and thread count
      (run_torchrun: 1 thread per process) on both runs, so it is the same bits;
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
    worker = REPO / "tests" / "_dist_optim_worker.py"
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    r1 = run_torchrun(worker, 1, [str(one), "3", memory])
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = run_torchrun(worker, 2, [str(two), "3", memory])
    assert r2.returncode == 0, r2.stderr[-3000:]
    a, b = torch.load(one), torch.load(two)
    assert a["final"].keys() == b["final"].keys() == a["initial"].keys()
    for k in a["final"]:
        assert torch.equal(a["initial"][k], b["initial"][k]), k
        assert torch.equal(a["final"][k], b["final"][k]), (k, (a["final"][k] - b["final"][k]).abs().max())
    unmoved = [k for k in a["final"] if torch.equal(a["final"][k], a["initial"][k])]
    assert not unmoved, unmoved  # every parameter took steps: the comparison is not between two idle models
