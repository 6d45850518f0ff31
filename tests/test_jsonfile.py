"""nanochat.jsonfile's atomic write: a writer that fails leaves the old file and no temp file."""

import pytest

from nanochat.jsonfile import write_atomic, write_text_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    """A writer stopped midway (a full disk, Ctrl-C) after writing part of the temp file: ``path`` keeps its old
    content and the half-written temp file beside it is removed (it would be taken for an artifact otherwise)."""
    path = tmp_path / "f.bin"
    write_text_atomic(path, "old\n")

    def half_then(error):
        def write(tmp):
            tmp.write_bytes(b"ne")
            raise error
        return write

    # Ctrl-C is no Exception: an ``except Exception`` would leave the temp file
    for error in (OSError(28, "No space left on device"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            write_atomic(path, half_then(error))
        assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]
    write_atomic(path, lambda tmp: tmp.write_bytes(b"new"))
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]
