"""One base_train run reads its tokenizer files once: the flag checks, the data set-up and an --init-from source
kept in the same tokenizer directory share the loaded object (a 32768-token tokenizer takes ~30 ms to read)."""

import json
import shutil

import pytest

from nanochat import checkpoint as ckpt
from nanochat.tokenizer import Tokenizer
from scripts import base_train

SMALL = ["--depth", "1", "--aspect-ratio", "64", "--head-dim", "32", "--max-seq-len", "64", "--device-batch-size", "2",
         "--total-batch-size", "256", "--eval-tokens", "512", "--eval-every", "-1", "--no-final-core",
         "--no-final-train-bpb", "--num-iterations", "2", "--save-every", "1"]


@pytest.fixture
def loads(monkeypatch) -> list:
    """The directories Tokenizer.load reads during the test (every loader, get_tokenizer included, ends there)."""
    seen, real = [], Tokenizer.load.__func__

    def counting(cls, directory):
        seen.append(directory)
        return real(cls, directory)

    monkeypatch.setattr(Tokenizer, "load", classmethod(counting))
    return seen


@pytest.fixture(scope="module")
def trained(tmp_path_factory, embedded_data_dir, tiny_tokenizer_dir):
    """A finished tiny run on real data (checkpoints at steps 1 and 2): a --resume and an --init-from source."""
    run = tmp_path_factory.mktemp("tokonce") / "trained"
    assert base_train.main([*SMALL, "--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir),
                            "--run-dir", str(run)]) == 0
    return run


@pytest.mark.parametrize("extra", [[], ["--vocab-size", "1024"], ["--dry-run"], ["--dry-run", "--vocab-size", "1024"]],
                         ids=["plain", "pinned-vocab", "dry-run", "dry-run-pinned-vocab"])
def test_a_run_loads_its_tokenizer_once(tmp_path, loads, embedded_data_dir, tiny_tokenizer_dir, extra):
    assert base_train.main([*SMALL, "--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir),
                            "--run-dir", str(tmp_path / "run"), *extra]) == 0
    assert loads == [tiny_tokenizer_dir]


def test_resume_and_init_from_load_the_tokenizer_once(tmp_path, loads, trained, embedded_data_dir,
                                                     tiny_tokenizer_dir):
    common = [*SMALL, "--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir)]
    run = tmp_path / "resumed"
    shutil.copytree(trained, run)
    shutil.rmtree(ckpt.step_dir(run, 2))
    assert base_train.main([*common, "--run-dir", str(run), "--resume"]) == 0
    assert loads == [tiny_tokenizer_dir]
    for i, extra in enumerate([[], ["--dry-run"]]):
        loads.clear()
        assert base_train.main([*common, "--run-dir", str(tmp_path / f"from{i}"), "--init-from", str(trained),
                                *extra]) == 0
        assert loads == [tiny_tokenizer_dir], extra


def test_an_imported_source_sharing_the_runs_tokenizer_directory_is_not_read_again(tmp_path, loads,
                                                                                   embedded_data_dir):
    """A run imported before session 33 records no tokenizer fingerprint: its run dir's tokenizer is fingerprinted.
    When that is the directory this run trains with, the run's loaded tokenizer serves (same files); another
    directory is read. An import of today records one: nothing of the source is read."""
    from reference_fixtures import make_their_files
    from scripts import import_reference
    from test_init_from import on_imported

    their, _, _ = make_their_files(tmp_path, "mome_token")
    imported = tmp_path / "imported"
    assert import_reference.main([str(their), "--run-dir", str(imported)]) == 0
    common = on_imported(embedded_data_dir, imported)
    copy = tmp_path / "tok_copy"
    shutil.copytree(imported / "tokenizer", copy)
    loads.clear()
    assert base_train.main([*common, "--tokenizer-dir", str(copy), "--run-dir", str(tmp_path / "c"), "--dry-run"]) == 0
    assert [str(d) for d in loads] == [str(copy)]  # the recorded fingerprint serves
    meta_path = next(imported.glob("checkpoints/step_*/meta.json"))
    meta = json.loads(meta_path.read_text())
    del meta["tokenizer_sha256"]  # as imported before session 33
    meta_path.write_text(json.dumps(meta))
    own = imported / "tokenizer"
    for i, extra in enumerate([[], ["--dry-run"]]):
        loads.clear()
        assert base_train.main([*common, "--tokenizer-dir", str(own), "--run-dir", str(tmp_path / f"a{i}"),
                                *extra]) == 0
        assert loads == [own], extra
    loads.clear()
    assert base_train.main([*common, "--tokenizer-dir", str(copy), "--run-dir", str(tmp_path / "b"), "--dry-run"]) == 0
    assert [str(d) for d in loads] == [str(copy), str(own)]  # the source's copy is its own files: read


def test_an_init_from_run_hashes_its_tokenizer_once(tmp_path, monkeypatch, trained, embedded_data_dir,
                                                     tiny_tokenizer_dir):
    """The fingerprint (a hash of every merge, ~6 ms at 32768 tokens) of this run's tokenizer serves the data
    set-up's record and the source check alike: one hash per run, a --dry-run's too."""
    hashed, real = [], Tokenizer._token_ids_sha256

    def counting(self):
        hashed.append(self.directory)
        return real(self)

    monkeypatch.setattr(Tokenizer, "_token_ids_sha256", counting)
    common = [*SMALL, "--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir)]
    for i, extra in enumerate([[], ["--dry-run"]]):
        hashed.clear()
        assert base_train.main([*common, "--run-dir", str(tmp_path / f"from{i}"), "--init-from", str(trained),
                                *extra]) == 0
        assert hashed == [tiny_tokenizer_dir.resolve()], extra
