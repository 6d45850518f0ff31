"""A run reading the DEFAULT data directory of its --dataset (no --data-dir) refuses data the manifest there records
as another dataset's: an hf: dataset prepared under the default name it had before session 33 (hf:a--b's old name
is hf:a/b's name now), or data copied there by hand. base_train and tok_train trained on it without a word. With
an explicit --data-dir the directory is the user's choice and is read whatever --dataset says (docs/extending.md
prepares the embedded corpus into a --data-dir and trains with the default --dataset)."""

import pytest
from data_fixtures import train_tiny_tokenizer, write_numbered_docs

from nanochat.dataset import DataError, check_default_dir_dataset, default_data_dir, load_manifest


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "root"))
    return tmp_path / "root"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    data = write_numbered_docs(tmp_path_factory.mktemp("tokdata"), 40, row_group_size=8, val_docs=8)
    out = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer(data, out, vocab_size=280)
    return out


def _prepared(data_dir, dataset):
    data_dir.mkdir(parents=True)
    return write_numbered_docs(data_dir, 40, row_group_size=8, val_docs=8, dataset=dataset)


def _load(*argv):
    from nanochat.train_args import parse_args
    from nanochat.train_setup import load_run_data

    return load_run_data(parse_args(list(argv)), 0, 1, "cpu")


def test_base_train_refuses_an_older_named_hf_dataset_in_its_default_dir(root, tok_dir):
    """hf:a--b (a local path) was prepared before session 33 under hf-a--b, now hf:a/b's default directory."""
    shared = _prepared(root / "hf-a--b", "hf:a--b")
    assert default_data_dir("hf:a/b") == shared == default_data_dir("hf:a--b")  # the latter: found by its manifest
    with pytest.raises(ValueError) as e:
        _load("--dataset", "hf:a/b", "--tokenizer-dir", str(tok_dir))
    msg = str(e.value)
    assert msg.startswith(f"--dataset hf:a/b reads its default directory {shared} (no --data-dir), which holds the "
                          "data of --dataset hf:a--b (prepared there under the default name it had before session "
                          "33)"), msg
    assert f"move that data to {root / 'hf_a--b'} (where --dataset hf:a--b finds it)" in msg, msg
    assert "`python -m scripts.prepare_data --dataset hf:a/b`" in msg, msg
    assert msg.endswith("to train on that data, pass --dataset hf:a--b"), msg
    # the dataset the directory holds is read as before, and so is the same directory given as --data-dir
    for argv in (["--dataset", "hf:a--b"], ["--dataset", "hf:a/b", "--data-dir", str(shared)]):
        data = _load(*argv, "--tokenizer-dir", str(tok_dir))
        assert data.data_dir == str(shared.resolve())


def test_base_train_refuses_another_datasets_data_copied_into_its_default_dir(root, tok_dir):
    """The embedded corpus copied by hand into the default fineweb-edu directory: the default --dataset refuses it;
    given as --data-dir (docs/extending.md's flow, with the default --dataset) it is read."""
    fineweb = _prepared(root / "fineweb-edu", "embedded")
    with pytest.raises(ValueError) as e:
        _load("--tokenizer-dir", str(tok_dir))
    msg = str(e.value)
    assert msg.startswith(f"--dataset fineweb-edu reads its default directory {fineweb} (no --data-dir), which "
                          f"holds the data of --dataset embedded (its manifest.json)"), msg
    assert f"move that data to {root / 'embedded'} (where --dataset embedded finds it)" in msg, msg
    assert "`python -m scripts.prepare_data --dataset fineweb-edu`" in msg, msg
    assert msg.endswith(f"to train on that data, pass --data-dir {fineweb} --dataset embedded"), msg
    data = _load("--data-dir", str(fineweb), "--tokenizer-dir", str(tok_dir))
    assert data.data_dir == str(fineweb.resolve()) and load_manifest(fineweb)["dataset"] == "embedded"


def test_a_default_dir_holding_its_own_dataset_is_read(root, tok_dir):
    embedded = _prepared(root / "embedded", "embedded")
    assert _load("--dataset", "embedded", "--tokenizer-dir", str(tok_dir)).data_dir == str(embedded.resolve())
    _prepared(root / "hf-a--b", "hf:a/b:")  # an empty config is no config (parse_hf_spec): the same dataset
    check_default_dir_dataset(default_data_dir("hf:a/b"), "hf:a/b")
    check_default_dir_dataset(root / "hf-a--b", "hf:a/b:")


def test_the_check_leaves_missing_unreadable_and_unrecorded_manifests_to_the_loader(tmp_path):
    """No manifest, a corrupt one, or one recording no dataset (load_manifest has required the key since the first
    format, 2026-11-21; a null or empty value records none): not this check's refusal."""
    check_default_dir_dataset(tmp_path / "none", "embedded")
    (tmp_path / "manifest.json").write_text("{not json")
    check_default_dir_dataset(tmp_path, "embedded")
    for held in (None, ""):
        check_default_dir_dataset(tmp_path, "embedded", {"dataset": held, "train": [], "val": [], "shards": {}})
    with pytest.raises(DataError, match="holds the data of --dataset climbmix"):
        check_default_dir_dataset(tmp_path, "embedded", {"dataset": "climbmix"})
    with pytest.raises(DataError) as e:  # a name no --dataset takes (a test's, a hand-written manifest's)
        check_default_dir_dataset(tmp_path, "embedded", {"dataset": "synthetic"})
    assert "to train on embedded, move that data out of it and prepare" in str(e.value)
    assert str(e.value).endswith(f"to train on that data, pass --data-dir {tmp_path}"), e.value


def test_tok_train_refuses_another_datasets_data_in_its_default_dir(root, tmp_path, capsys):
    from scripts import tok_train

    fineweb = _prepared(root / "fineweb-edu", "embedded")
    out = tmp_path / "tok"
    assert tok_train.main(["--vocab-size", "280", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --dataset fineweb-edu reads its default directory {fineweb} (no --data-dir), "
                          "which holds the data of --dataset embedded"), err
    assert not out.exists()
    assert tok_train.main(["--vocab-size", "280", "--output-dir", str(out), "--data-dir", str(fineweb)]) == 0
    assert (out / "tokenizer.json").is_file()


def test_the_dry_run_plan_says_the_run_will_refuse_the_data(root, tok_dir):
    from nanochat.train_args import parse_args
    from nanochat.train_setup import data_passes_lines

    fineweb = _prepared(root / "fineweb-edu", "embedded")
    args = parse_args(["--tokenizer-dir", str(tok_dir), "--dry-run"])
    lines = data_passes_lines(args, 10_000, None)
    assert len(lines) == 1 and lines[0].startswith(
        f"{'data passes':>26}: unknown: the run will refuse it: --dataset fineweb-edu reads its default directory "
        f"{fineweb} (no --data-dir), which holds the data of --dataset embedded"), lines


def test_every_rank_stops_when_one_ranks_default_dir_holds_another_dataset(tmp_path, tok_dir, monkeypatch):
    """The check runs where the other per-rank data checks run (load_run_data's open_local, every_rank_ok): a node
    whose default directory holds another dataset's data stops every rank with its error, none goes on alone."""
    import torch.distributed as dist
    from _thread_ranks import run_ranks

    import nanochat.dataset as dataset

    own = _prepared(tmp_path / "node0" / "embedded", "embedded")
    other = _prepared(tmp_path / "node1" / "embedded", "climbmix")
    monkeypatch.setattr(dataset, "default_data_dir", lambda name: (own, other)[dist.get_rank()])

    def rank_main(rank, world):
        try:
            _load("--dataset", "embedded", "--tokenizer-dir", str(tok_dir))
        except ValueError as e:
            return str(e)
        return None

    errors = run_ranks(2, rank_main)
    assert errors[0] == errors[1] and errors[0].startswith("rank 1 of 2: "), errors
    assert f"--dataset embedded reads its default directory {other} (no --data-dir), which holds the data of " \
           "--dataset climbmix" in errors[0], errors
