"""dataset.write_text_shard goes through jsonfile.write_atomic: a shard write that fails midway (a full disk,
Ctrl-C) leaves neither a torn shard nor a temp file beside it, and two writers never share a temp file."""

import errno

import pyarrow.parquet as pq
import pytest

from nanochat import dataset


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_shard_write_that_fails_midway_leaves_no_file(tmp_path, monkeypatch, error):
    real = pq.write_table

    def torn(table, where, **kwargs):  # part of the file reaches the disk, then the write fails
        real(table, where, **kwargs)
        with open(where, "r+b") as f:
            f.truncate(10)
        raise error

    monkeypatch.setattr(pq, "write_table", torn)
    with pytest.raises(type(error)):
        dataset.write_text_shard(tmp_path / "shard_00000.parquet", ["a document"])
    assert list(tmp_path.iterdir()) == []


def test_a_shard_is_written_whole(tmp_path):
    path = tmp_path / "shard_00000.parquet"
    dataset.write_text_shard(path, ["one", "two"], row_group_size=1)
    assert pq.read_table(path)["text"].to_pylist() == ["one", "two"] and pq.ParquetFile(path).num_row_groups == 2
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
