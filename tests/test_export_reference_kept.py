"""What a failed or interrupted export_reference says it left under --out: "nothing of this export was left" also
when it kept the tokenizer it had created, because another checkpoint beside it (an export running at the same
time) may use it (session 20)."""

import errno
from pathlib import Path

import pytest
import torch

from reference_fixtures import our_base_run
from scripts import export_reference


def failing_export(tmp_path, monkeypatch, error: BaseException, concurrent: bool):
    """Export our run into a new base dir; at its weights' torch.save (the tokenizer written, by this export), an
    export under another --model-tag runs whole first if ``concurrent``, then ``error`` is raised. main's code."""
    run, out = our_base_run(tmp_path), tmp_path / "base"
    real_save, nested = torch.save, []

    def save(obj, path, *a, **k):
        if nested or not Path(path).name.startswith("model_"):
            return real_save(obj, path, *a, **k)
        nested.append("running")  # the nested export's own torch.save goes straight through
        nested[:] = [export_reference.main(["--run", str(run), "--out", str(out), "--model-tag", "other"])
                     if concurrent else None]
        raise error

    monkeypatch.setattr(torch, "save", save)
    code = export_reference.main(["--run", str(run), "--out", str(out)])
    assert nested == ([0] if concurrent else [None])
    return code, out


FULL_DISK = OSError(errno.ENOSPC, "No space left on device", "x")


@pytest.mark.parametrize("error, code", [(FULL_DISK, 2), (KeyboardInterrupt(), 130)])
def test_a_kept_tokenizer_is_named_with_why(tmp_path, monkeypatch, capsys, error, code):
    assert failing_export(tmp_path, monkeypatch, error, concurrent=True)[0] == code
    err = capsys.readouterr().err
    out = tmp_path / "base"
    assert "nothing of this export was left" not in err, err
    assert (f"removed what this export added except {out / 'tokenizer' / 'token_bytes.pt'}, "
            f"{out / 'tokenizer' / 'tokenizer.pkl'} (another checkpoint in {out / 'base_checkpoints'} may use them)"
            in err), err
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == ["token_bytes.pt", "tokenizer.pkl"]


@pytest.mark.parametrize("error, code", [(FULL_DISK, 2), (KeyboardInterrupt(), 130)])
def test_an_export_alone_leaves_nothing_and_says_so(tmp_path, monkeypatch, capsys, error, code):
    returned, out = failing_export(tmp_path, monkeypatch, error, concurrent=False)
    err = capsys.readouterr().err
    assert returned == code and "nothing of this export was left" in err and "except" not in err, err
    assert not out.exists()
