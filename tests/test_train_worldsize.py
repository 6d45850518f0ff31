"""base_train and --resume-new-world-size in one process (the torchrun moves: test_train_dist.py)."""

import pytest

from scripts import base_train
from test_train_e2e import TINY

BATCH = ["--device-batch-size", "2", "--total-batch-size", "256", "--num-iterations", "2"]


def test_the_world_size_flag_without_resume_is_an_error(tmp_path, capsys):
    """A flag that would change nothing is refused, not ignored: a fresh run has no checkpoint to re-partition."""
    with pytest.raises(SystemExit) as e:  # at parsing, as every flag check: --dry-run catches it too
        base_train.main([*TINY, *BATCH, "--run-dir", str(tmp_path / "r"), "--resume-new-world-size"])
    assert e.value.code == 2
    assert "--resume-new-world-size only applies with --resume" in capsys.readouterr().err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_batch_the_world_size_does_not_divide_under_resume_names_what_may_change(tmp_path, capsys):
    """Under --resume the total batch is the checkpoint's (another one is refused as a trajectory change), so the
    advice names what a resume may change instead of only "pick a total batch"."""
    run = tmp_path / "r"
    assert base_train.main([*TINY, *BATCH, "--run-dir", str(run)]) == 0
    capsys.readouterr()
    # 256 tokens is not a whole number of 3 x 32-token rows: as 3 processes of 2 rows each would find
    assert base_train.main([*TINY, *BATCH, "--device-batch-size", "3", "--run-dir", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--total-batch-size 256 is not divisible" in err
    assert "a --resume keeps the checkpoint's --total-batch-size" in err and "--device-batch-size" in err
