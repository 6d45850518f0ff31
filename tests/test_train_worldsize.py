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
