"""Rows say how many training shards the paper read ([row] train_shards); --dry-run and a run's start print the
passes over the prepared split and warn, naming prepare_data --num-shards N, when another number is prepared."""

import json

import pytest

from conftest import REPO
from data_fixtures import write_numbered_docs
from nanochat.dataloader import _tokenize_docs, estimate_split_tokens
from nanochat.dataset import iter_documents
from nanochat.row_config import check_row_config, find_configs, load_row_config
from nanochat.train_setup import data_passes_lines
from scripts import base_train

TRAIN = {"total-batch-size": 256, "max-seq-len": 32, "device-batch-size": 8}


@pytest.fixture(scope="module")
def two_shard_dir(tmp_path_factory):
    """A 'fineweb-edu' directory of 2 train shards (60 documents) and a val shard."""
    return write_numbered_docs(tmp_path_factory.mktemp("fw"), 60, row_group_size=8, val_docs=8,
                               dataset="fineweb-edu", max_words=40)


def _row_config(tmp_path, shards, dataset="fineweb-edu"):
    path = tmp_path / "row.toml"
    lines = ['[row]', 'table = "t"', 'name = "r"'] + ([f"train_shards = {shards}"] if shards else [])
    lines += ["", "[train]", f'dataset = "{dataset}"', "depth = 2", "num-iterations = 10"]
    lines += [f"{k} = {v}" for k, v in TRAIN.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_fineweb_row_of_the_paper_pins_its_shards_and_bad_values_are_refused(tmp_path):
    expected = {"d12": 100, "d12_scaling": 100, "d12_compound": 100}
    family = {"m125": 160, "m350": 520, "qwen3": 369}  # families spec §8 (training shards)
    for path in find_configs():
        cfg = load_row_config(path)
        table = cfg["row"]["table"]
        want = expected.get(table) or (family[path.stem.split("_")[0]] if table == "families" else None)
        assert cfg["row"].get("train_shards") == want, path
        if want:
            assert cfg["train"]["dataset"] == "fineweb-edu", path
    for bad in (0, -3, "100", True, 1.5):
        cfg = {"row": {"table": "t", "name": "r", "train_shards": bad}, "train": dict(TRAIN)}
        with pytest.raises(ValueError, match="'train_shards' must be a positive integer"):
            check_row_config(cfg, tmp_path / "x.toml")


def test_split_token_estimate_is_exact_when_the_sample_covers_the_split(two_shard_dir, tiny_tokenizer):
    exact = sum(len(d) for d in _tokenize_docs(tiny_tokenizer, list(iter_documents(two_shard_dir, "train"))))
    assert estimate_split_tokens(two_shard_dir, "train", tiny_tokenizer, sample_docs=1000) == (exact, 60)
    estimate, sampled = estimate_split_tokens(two_shard_dir, "train", tiny_tokenizer, sample_docs=10)
    first = sum(len(d) for d in _tokenize_docs(tiny_tokenizer, list(iter_documents(two_shard_dir, "train"))[:10]))
    assert sampled == 10 and estimate == round(first / 10 * 60)


def _args(config, data_dir, tokenizer_dir, *extra):
    from nanochat.train_args import parse_args

    return parse_args(["--config", str(config), "--data-dir", str(data_dir), "--tokenizer-dir", str(tokenizer_dir),
                       "--dry-run", *extra])


def test_fewer_or_more_shards_than_the_paper_read_warn_with_the_prepare_command(tmp_path, two_shard_dir,
                                                                                 tiny_tokenizer, tiny_tokenizer_dir):
    exact = sum(len(d) for d in _tokenize_docs(tiny_tokenizer, list(iter_documents(two_shard_dir, "train"))))
    total = 10 * TRAIN["total-batch-size"]
    for shards, warned in ((2, False), (5, True), (1, True), (None, False)):
        args = _args(_row_config(tmp_path, shards), two_shard_dir, tiny_tokenizer_dir)
        lines = data_passes_lines(args, total, tiny_tokenizer)
        passes = total / exact  # the whole split is within the 1,024-document sample: the estimate is exact
        assert lines[0].split(":", 1)[1] == (f" ~{passes:.2f} over the prepared train split: 2 shards in "
                                             f"{two_shard_dir}, ~{exact:,} tokens (estimated from its first 60 "
                                             "documents)"), lines  # one parenthesis, not two in a row
        assert (len(lines) == 2) == warned, (shards, lines)
        if warned:
            assert f"python -m scripts.prepare_data --dataset fineweb-edu --num-shards {shards}" in lines[1]
            assert f"~{passes:.2f} passes where the paper's {shards} give ~{passes * 2 / shards:.2f}" in lines[1]
    # a row of another dataset than the prepared one says nothing of shards; no tokenizer: no estimate
    args = _args(_row_config(tmp_path, 5, dataset="climbmix"), two_shard_dir, tiny_tokenizer_dir)
    assert len(data_passes_lines(args, total, tiny_tokenizer)) == 1
    args = _args(_row_config(tmp_path, 5), two_shard_dir, tiny_tokenizer_dir)
    lines = data_passes_lines(args, total, None)
    assert "unknown until the tokenizer exists" in lines[0] and "2.50 x the paper's passes" in lines[1]
    lines = data_passes_lines(_args(_row_config(tmp_path, 5), tmp_path / "none", tiny_tokenizer_dir), total, None)
    assert lines == [f"{'data passes':>26}: unknown: no prepared data in {tmp_path / 'none'} yet (the paper's: "
                     f"python -m scripts.prepare_data --dataset fineweb-edu --num-shards 5 --data-dir "
                     f"{tmp_path / 'none'})"]
    lines = data_passes_lines(_args(_row_config(tmp_path, None), tmp_path / "none", tiny_tokenizer_dir), total, None)
    assert lines == [f"{'data passes':>26}: unknown: no prepared data in {tmp_path / 'none'} yet"]


def test_the_paper_shards_come_from_the_parse_that_gave_the_flags(tmp_path, two_shard_dir, tiny_tokenizer_dir):
    """data_passes_lines parsed the --config file a second time: a file edited after the flags were read was
    described by its new [row] train_shards. The parse's own value rides on the args, outside vars(args), which
    config.json records (and a --resume and speedrun compare) as the flags alone."""
    config = _row_config(tmp_path, 5)
    args = _args(config, two_shard_dir, tiny_tokenizer_dir)
    config.write_text(config.read_text().replace("train_shards = 5", "train_shards = 7"))
    lines = data_passes_lines(args, 10 * TRAIN["total-batch-size"], None)
    assert "the paper trained this row on 5 fineweb-edu train shards" in lines[1], lines
    assert args.paper_shards == (5, "fineweb-edu") and "paper_shards" not in vars(args)
    flat = tmp_path / "flat.toml"
    flat.write_text("depth = 2\n")
    assert _args(flat, two_shard_dir, tiny_tokenizer_dir).paper_shards is None


def test_the_prepare_command_names_the_runs_data_dir(tmp_path, two_shard_dir, tiny_tokenizer, tiny_tokenizer_dir,
                                                    monkeypatch):
    """The prepare_data command of the hint and of the warning omitted --data-dir: followed, it prepared the
    default directory, not the one the run reads. It names a --data-dir the run was given (quoted for the shell),
    and none where the run reads the default one."""
    total = 10 * TRAIN["total-batch-size"]
    spaced = tmp_path / "my data"
    lines = data_passes_lines(_args(_row_config(tmp_path, 5), spaced, tiny_tokenizer_dir), total, None)
    assert lines[0].endswith(f"--num-shards 5 --data-dir '{spaced}')"), lines
    lines = data_passes_lines(_args(_row_config(tmp_path, 5), two_shard_dir, tiny_tokenizer_dir), total,
                              tiny_tokenizer)
    assert lines[1].endswith(f"--num-shards 5 --data-dir {two_shard_dir}"), lines
    from nanochat.train_args import parse_args

    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "root"))
    args = parse_args(["--config", str(_row_config(tmp_path, 5)), "--tokenizer-dir", str(tiny_tokenizer_dir),
                       "--dry-run"])
    lines = data_passes_lines(args, total, None)
    assert lines[0].endswith("--num-shards 5)") and str(tmp_path / "root" / "fineweb-edu") in lines[0], lines


def test_dry_run_prints_the_passes_and_the_warning(tmp_path, capsys, two_shard_dir, tiny_tokenizer_dir):
    config = _row_config(tmp_path, 4)
    rc = base_train.main(["--config", str(config), "--data-dir", str(two_shard_dir), "--tokenizer-dir",
                          str(tiny_tokenizer_dir), "--run-dir", str(tmp_path / "run"), "--dry-run"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and json.loads(out[-1])["total_tokens"] == 2560
    assert any(line.strip().startswith("data passes: ~") for line in out), out
    assert any(line.startswith("warning: the paper trained this row on 4 fineweb-edu train shards") and
               line.endswith(f"--num-shards 4 --data-dir {two_shard_dir}") for line in out), out


def test_a_generated_row_warns_on_a_smaller_preparation(tmp_path, two_shard_dir, tiny_tokenizer):
    from nanochat.train_args import parse_args

    args = parse_args(["--config", str(REPO / "configs/families/qwen3_base.toml"), "--data-dir", str(two_shard_dir),
                       "--dry-run"])
    lines = data_passes_lines(args, 20_000_000_000, tiny_tokenizer)
    assert lines[-1].endswith("python -m scripts.prepare_data --dataset fineweb-edu --num-shards 369 --data-dir "
                              f"{two_shard_dir}"), lines


def test_a_run_prints_them_when_it_starts(tmp_path, capsys, two_shard_dir, tiny_tokenizer_dir):
    config = _row_config(tmp_path, 3)
    rc = base_train.main(["--config", str(config), "--data-dir", str(two_shard_dir), "--tokenizer-dir",
                          str(tiny_tokenizer_dir), "--run-dir", str(tmp_path / "run"), "--num-iterations", "2",
                          "--aspect-ratio", "32", "--head-dim", "32", "--eval-tokens", "64", "--eval-every", "-1",
                          "--no-final-core", "--device-type", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    start = out.index("data passes: ~")
    warning = out.index("warning: the paper trained this row on 3 fineweb-edu train shards")
    assert start < warning < out.index("step 00001"), out
