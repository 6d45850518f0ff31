"""One clear error for each bad input a careless or unlucky user can give: corrupt data shards (also when found by
the loader's background thread), broken tokenizer files, non-UTF-8 JSON, a string where a boolean belongs in a
config file, a negative --top-k. Each names the file or flag; none is a traceback."""

import json
import random
import shutil

import pytest

from nanochat import checkpoint as ckpt
from nanochat.dataset import DataError, write_manifest, write_text_shard
from scripts import base_train

WORDS = "the a of river stone green light walks under over quickly seven houses bright morning".split()
COMMON = ["--depth", "1", "--aspect-ratio", "64", "--head-dim", "32", "--max-seq-len", "64", "--device-batch-size", "2",
          "--total-batch-size", "256", "--eval-tokens", "256", "--eval-every", "-1", "--no-final-core",
          "--num-iterations", "2"]


def make_data(root):
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(1400)]
    root.mkdir(parents=True)
    # more than the eval-row packer's 1000-document buffer in the first shard: fixed rows never read the second
    write_text_shard(root / "train_00000.parquet", docs[:1100], row_group_size=128)
    write_text_shard(root / "train_00001.parquet", docs[1100:1200], row_group_size=16)
    write_text_shard(root / "val_00000.parquet", docs[1200:], row_group_size=16)
    write_manifest(root, "test", ["train_00000.parquet", "train_00001.parquet"], ["val_00000.parquet"], source="test")
    return root


def garble_data_pages(path):
    """Overwrite everything between the leading magic and the footer with noise: the footer (schema, row counts)
    still reads, so the file passes the up-front checks and only fails when its pages are decoded."""
    raw = bytearray(path.read_bytes())
    footer_len = int.from_bytes(raw[-8:-4], "little")
    end = len(raw) - 8 - footer_len
    raw[4:end] = random.Random(1).randbytes(end - 4)
    path.write_bytes(bytes(raw))


def train_real(tmp_path, data_dir, tok_dir, *extra):
    return base_train.main([*COMMON, "--data-dir", str(data_dir), "--tokenizer-dir", str(tok_dir),
                            "--run-dir", str(tmp_path / "run"), *extra])


def test_garbage_train_pages_are_a_clear_error_from_the_loader_thread(tmp_path, tiny_tokenizer_dir, capsys):
    from nanochat.dataloader import PackedDataLoader
    from nanochat.tokenizer import get_tokenizer

    data = make_data(tmp_path / "data")
    # the second train shard, with no train-bpb rows (they come from the row groups the loader reads first, which
    # may be this shard's): only the loader's background thread meets the garbage, during the first step
    garble_data_pages(data / "train_00001.parquet")
    loader = PackedDataLoader(data, "train", 2, 64, get_tokenizer(tiny_tokenizer_dir))  # the footer is fine
    with pytest.raises(DataError, match=r"train_00001\.parquet: row group \d+ cannot be read"):
        next(loader)
    assert train_real(tmp_path, data, tiny_tokenizer_dir, "--no-final-train-bpb") == 2
    err = capsys.readouterr().err
    assert "train_00001.parquet: row group" in err and "training stopped during step 1" in err
    assert "Traceback" not in err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["stop_reason"] == "data_error"


def test_errors_in_the_tokenizer_thread_name_the_file(tmp_path):
    from nanochat.dataloader import PackedDataLoader

    class Broken:
        bos_token_id = 0

        def encode_batch(self, texts):
            raise RuntimeError("tokenizer exploded")

    data = make_data(tmp_path / "data")
    loader = PackedDataLoader(data, "train", 2, 64, Broken())
    with pytest.raises(DataError, match=r"reading .*train_0000\d\.parquet \(row group \d+\) failed: "
                                        r"RuntimeError: tokenizer exploded"):
        next(loader)


def test_garbage_val_shard_names_the_file(tmp_path, tiny_tokenizer_dir, capsys):
    data = make_data(tmp_path / "data")
    garble_data_pages(data / "val_00000.parquet")
    assert train_real(tmp_path, data, tiny_tokenizer_dir) == 2
    err = capsys.readouterr().err
    assert f"{data / 'val_00000.parquet'}: row group 0 cannot be read" in err


@pytest.mark.parametrize("damage, needle", [
    (lambda d: (d / "tokenizer.json").write_text(json.dumps(
        {k: v for k, v in json.loads((d / "tokenizer.json").read_text()).items() if k != "special_tokens"})),
     "tokenizer.json: 'special_tokens' is missing or not a dict"),
    (lambda d: (d / "tokenizer.json").write_bytes(b'{"format": "\xff\xfe"}'), "tokenizer.json is not valid JSON"),
], ids=["no-special-tokens", "non-utf8-header"])  # token_bytes.pt: training counts the tokenizer's own bytes
def test_broken_tokenizer_files_are_named(tmp_path, tiny_tokenizer_dir, capsys, damage, needle):
    tok = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, tok)
    damage(tok)
    data = make_data(tmp_path / "data")
    assert train_real(tmp_path, data, tok) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_non_utf8_json_files_are_named(tmp_path, capsys):
    from conftest import tiny_config
    from nanochat.dataset import load_manifest
    from nanochat.gpt import build_model
    from scripts import base_eval

    run = tmp_path / "run"
    ckpt.save_checkpoint(run, 1, build_model(tiny_config(), seed=0), {})
    (ckpt.step_dir(run, 1) / "meta.json").write_bytes(b'{"step": 1, "model_config": "\xff"}')
    assert base_eval.main(["--run", str(run), "--device-type", "cpu", "--eval", "bpb"]) == 2
    assert f"{ckpt.step_dir(run, 1) / 'meta.json'} is not valid JSON" in capsys.readouterr().err
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(DataError, match="manifest.json is not valid JSON"):
        load_manifest(tmp_path / "data")


@pytest.mark.parametrize("value", ['"false"', '"no"', "0"])
def test_config_string_for_a_boolean_is_an_error(tmp_path, capsys, value):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"compile = {value}\n")
    with pytest.raises(SystemExit) as e:
        base_train.main(["--config", str(cfg), "--synthetic-data", "--dry-run"])
    assert e.value.code == 2
    assert "key 'compile' must be true or false (a TOML boolean, unquoted)" in capsys.readouterr().err


def test_config_booleans_still_work(tmp_path):
    from nanochat.train_args import parse_args

    cfg = tmp_path / "c.toml"
    cfg.write_text("compile = false\nsynthetic-data = true\n")
    args = parse_args(["--config", str(cfg)])
    assert args.compile is False and args.synthetic_data is True


@pytest.mark.parametrize("argv, needle", [(["--top-k", "-5"], "--top-k must be >= 0"),
                                          (["--temperature", "-1"], "--temperature must be >= 0")])
def test_sample_rejects_negative_top_k_and_temperature(tmp_path, capsys, argv, needle):
    from scripts import sample

    with pytest.raises(SystemExit) as e:
        sample.main(["--run", str(tmp_path), "--prompt", "hi", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_engine_rejects_negative_top_k():
    import torch

    from nanochat.engine import sample_next

    with pytest.raises(ValueError, match="--top-k must be >= 0"):
        sample_next(torch.zeros(1, 8), 1.0, -5, None)


def _eval_run(tmp_path, tok_dir, vocab_size):
    from conftest import tiny_config
    from nanochat.gpt import build_model

    run = tmp_path / "run"
    model = build_model(tiny_config(vocab_size=vocab_size, sequence_len=64), seed=0)
    ckpt.save_checkpoint(run, 7, model, {"tokenizer_dir": str(tok_dir)})
    return run


def test_base_eval_step_without_a_checkpoint_lists_the_available_steps(tmp_path, capsys):
    """A mistyped --step in one process named ranks and shared filesystems and left an empty eval/step_N/ behind."""
    from scripts import base_eval

    run = _eval_run(tmp_path, tmp_path / "tok", 256)
    assert base_eval.main(["--run", str(run), "--step", "99", "--eval", "bpb", "--device-type", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "step_000099 does not exist (available steps: [7])" in err and "rank" not in err
    assert not (run / "eval" / "step_000099").exists()


def test_base_eval_failed_bundle_download_is_one_error_line(tmp_path, capsys, offline_bundle, tiny_tokenizer_dir,
                                                            tiny_tokenizer):
    """Offline, base_eval without --bundle ended in a DownloadError traceback (exit 1), not the one-line advice."""
    from scripts import base_eval

    run = _eval_run(tmp_path, tiny_tokenizer_dir, tiny_tokenizer.vocab_size)
    assert base_eval.main(["--run", str(run), "--eval", "core", "--no-progress", "--device-type", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--bundle subset" in err and "Traceback" not in err
