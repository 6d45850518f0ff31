import torch

from conftest import REPO, run_torchrun


def test_two_process_gloo_equals_single_process_grad_accum(tmp_path):
    worker = REPO / "tests" / "_dist_optim_worker.py"
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    r1 = run_torchrun(worker, 1, [str(one), "3"])
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = run_torchrun(worker, 2, [str(two), "3"])
    assert r2.returncode == 0, r2.stderr[-3000:]
    a, b = torch.load(one), torch.load(two)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=0), (k, (a[k] - b[k]).abs().max())
