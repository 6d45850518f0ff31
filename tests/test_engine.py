import os
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from nanochat.engine import generate, generate_uncached, sample_next
from nanochat.gpt import build_model

MEMORIES = ["base", "ve", "bigram", "mome"]


def _model(memory="base"):
    model = build_model(tiny_config(memory=memory), seed=0)
    with torch.no_grad():  # make every zero-initialised part non-trivial so the test can fail
        for p in model.parameters():
            if p.ndim >= 1 and torch.all(p == 0):
                p.normal_(std=0.05)
    return model


@pytest.mark.parametrize("memory", MEMORIES)
def test_cached_greedy_equals_uncached(memory):
    model = _model(memory)
    prompt = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    cached = generate(model, prompt, max_tokens=10, temperature=0.0)[0]
    assert cached == generate_uncached(model, prompt, max_tokens=10)


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    model = _model()
    a = generate(model, [1, 2, 3], max_tokens=12, num_samples=3, temperature=1.0, seed=7)
    b = generate(model, [1, 2, 3], max_tokens=12, num_samples=3, temperature=1.0, seed=7)
    c = generate(model, [1, 2, 3], max_tokens=12, num_samples=3, temperature=1.0, seed=8)
    assert a == b and a != c
    assert len({tuple(s) for s in a}) > 1  # samples differ from each other


def test_sample_next_top_k_and_greedy():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    assert sample_next(logits, 0.0, None, None).item() == 1
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, 2, g).item() for _ in range(50)}
    assert draws <= {1, 3} and len(draws) == 2
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0, None, None)


def test_stop_ids_end_generation():
    model = _model()
    first = generate(model, [1, 2], max_tokens=1, temperature=0.0)[0][0]
    out = generate(model, [1, 2], max_tokens=8, temperature=0.0, stop_ids={first})[0]
    assert out == [first]


def test_generate_runs_no_forward_past_the_last_token():
    model = _model()
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    generate(model, [1, 2, 3], max_tokens=4, temperature=0.0)
    hook.remove()
    assert len(calls) == 4  # the prefill and 3 decode steps: the 4th token's logits are never needed


def test_sample_script_does_not_print_the_stop_token(tmp_path, capsys, monkeypatch):
    from scripts import sample

    class Tok:
        bos_token_id = 9

        def encode(self, text):
            return [1]

        def decode(self, ids):
            return "".join("<|bos|>" if i == 9 else f"<{i}>" for i in ids)

    meta = {"step": 3}
    monkeypatch.setattr(sample, "load_model", lambda *a, **k: (_model(), meta))
    monkeypatch.setattr(sample, "iter_samples", lambda *a, **k: iter([(0, [4, 5, 9])]))
    monkeypatch.setattr("nanochat.tokenizer.get_tokenizer", lambda *a: Tok())
    monkeypatch.setattr("nanochat.tokenizer.check_vocab_matches", lambda *a: None)
    sample.main(["--run", str(tmp_path), "--prompt", "hi", "--device-type", "cpu"])
    assert capsys.readouterr().out.splitlines()[-1] == "hi<4><5>"
    with pytest.raises(SystemExit) as e:
        sample.main(["--run", str(tmp_path), "--prompt", "hi", "--device-type", "gpu"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv, needle", [(["--temperature", "nan"], "--temperature must be >= 0 and finite"),
                                          (["--temperature", "inf"], "--temperature must be >= 0 and finite"),
                                          (["--device-type", "cuda:999"], "argument --device-type: cuda:999: no such device")])
def test_sample_refuses_flags_torch_would_fail_on_with_a_traceback(tmp_path, capsys, argv, needle):
    from scripts import sample

    with pytest.raises(SystemExit) as e:
        sample.main(["--run", str(tmp_path), "--prompt", "hi", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_sample_errors_and_ctrl_c_are_one_line(tmp_path, capsys, monkeypatch):
    from scripts import sample

    assert sample.main(["--run", str(tmp_path), "--prompt", "hi", "--device-type", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no checkpoint found") and len(err.splitlines()) == 1

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sample, "load_model", interrupt)
    assert sample.main(["--run", str(tmp_path), "--prompt", "hi", "--device-type", "cpu"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_sample_to_a_full_stdout_is_one_error_line(tmp_path):
    import subprocess
    import sys

    from test_analysis import make_run

    run, _, _ = make_run(tmp_path, "base")
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "scripts.sample", "--run", str(run), "--prompt", "hi",
                            "--max-tokens", "3", "--device-type", "cpu"], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 1 and r.stderr == "error: could not write the samples to stdout: No space left on device\n"


def test_sample_read_error_is_not_reported_as_a_stdout_failure(tmp_path, capsys, monkeypatch):
    """An OSError while loading (an unreadable checkpoint or tokenizer file, not root) was caught as a failed write
    of the samples: "could not write the samples to stdout", exit 1, and stdout sent to /dev/null."""
    from scripts import sample

    meta = tmp_path / "checkpoints" / "step_000001" / "meta.json"

    def unreadable(*a, **k):
        raise PermissionError(13, "Permission denied", str(meta))

    monkeypatch.setattr(sample, "load_model", unreadable)
    assert sample.main(["--run", str(tmp_path), "--prompt", "hi", "--device-type", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: [Errno 13] Permission denied: '{meta}'\n", err
