"""Exit codes and error lines of the entry points, alike across them: a bad flag, file or value exits 2 with one
line naming it (no traceback), a full disk exits 2 naming what could not be written, Ctrl-C exits 130 with one
line. tok_train and prepare_data exited 1 for bad input, and a negative --step read as a missing checkpoint."""

import errno
import importlib
import os
from pathlib import Path

import pytest


def one_error_line(err: str) -> str:
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("error: "), err
    return err


# ---- tok_train ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [("--max-chars", "0"), ("--max-chars", "-1"), ("--doc-cap", "0"),
                                         ("--doc-cap", "-5"), ("--eval-chars", "0"), ("--vocab-size", "264")])
def test_tok_train_count_flags_are_flag_errors(flag, value, tmp_path, capsys):
    """--max-chars -1 trained on one document cropped by a character, --doc-cap -5 cropped every document by five
    (both silently); a zero read every document and then failed late; a vocab below 256 bytes + 9 specials failed
    only once the data was found (exit 1)."""
    from scripts.tok_train import main

    with pytest.raises(SystemExit) as e:
        main(["--data-dir", str(tmp_path), "--output-dir", str(tmp_path / "t"), flag, value])
    assert e.value.code == 2 and f"argument {flag}: must be an integer >= " in capsys.readouterr().err


def test_tok_train_bad_inputs_exit_2(embedded_data_dir, tmp_path, capsys):
    from scripts.tok_train import main

    out = str(tmp_path / "t")
    assert main(["--data-dir", str(tmp_path / "none"), "--output-dir", out]) == 2
    assert "prepare_data" in one_error_line(capsys.readouterr().err)
    assert main(["--vocab-size", "5000", "--max-chars", "3000", "--data-dir", str(embedded_data_dir),
                 "--output-dir", out]) == 2
    assert "the training text is too small for this vocab" in one_error_line(capsys.readouterr().err)
    (tmp_path / "file").write_text("x")
    assert main(["--data-dir", str(embedded_data_dir), "--output-dir", str(tmp_path / "file" / "t")]) == 2
    assert "is not a writable directory" in one_error_line(capsys.readouterr().err)


def test_tok_train_full_disk_and_ctrl_c(embedded_data_dir, tmp_path, capsys, monkeypatch):
    from nanochat.tokenizer import Tokenizer
    from scripts.tok_train import main

    out = tmp_path / "t"
    flags = ["--vocab-size", "300", "--data-dir", str(embedded_data_dir), "--max-chars", "20000",
             "--output-dir", str(out)]

    def full_disk(self, data):  # the real Tokenizer.save, whose first temp file fills the disk
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    assert main(flags) == 2
    monkeypatch.undo()
    err = one_error_line(capsys.readouterr().err)
    assert f"could not write the tokenizer to --output-dir {out}" in err and "No space left on device" in err
    assert f"({out / 'tokenizer.bpe'})" in err, err  # the file, not the temp name it was written under
    assert sorted(p.name for p in out.iterdir()) == []

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Tokenizer, "train_from_iterator", interrupted)
    assert main(flags) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and "interrupted" in err, err


# ---- prepare_data ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value, needle", [("--val-fraction", "0", "in (0, 1)"),
                                                 ("--val-fraction", "1.5", "in (0, 1)"),
                                                 ("--val-fraction", "nan", "in (0, 1)"),
                                                 ("--max-docs", "1", "must be an integer >= 2")])
def test_prepare_data_value_flags_are_flag_errors(flag, value, needle, tmp_path, capsys):
    """Both were a ValueError after the lock and the output check (exit 1); --max-docs 1 only with hf: data."""
    from scripts.prepare_data import main

    with pytest.raises(SystemExit) as e:
        main(["--dataset", "local", "--text-dir", str(tmp_path), "--data-dir", str(tmp_path / "o"), flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: " in err and needle in err, err


def test_prepare_data_corrupt_embedded_corpus_is_one_line(tmp_path, capsys, monkeypatch):
    """A damaged data/embedded/*.txt.xz was an LZMAError traceback."""
    from scripts import prepare_data

    src = tmp_path / "embedded"
    src.mkdir()
    (src / "book.txt.xz").write_bytes(b"not xz at all")
    monkeypatch.setattr(prepare_data, "EMBEDDED_DIR", src)
    assert prepare_data.main(["--dataset", "embedded", "--data-dir", str(tmp_path / "o")]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert f"{src / 'book.txt.xz'}" in err and "restore data/embedded/ from git" in err


def test_prepare_data_unreadable_input_and_full_disk_exit_2(tmp_path, capsys, monkeypatch):
    from scripts import prepare_data

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("one paragraph\n\nanother paragraph\n\nand a third\n")
    flags = ["--dataset", "local", "--text-dir", str(src), "--data-dir", str(tmp_path / "o"), "--doc-chars", "10"]
    real_read_text = type(src).read_text

    def unreadable(path, *a, **k):  # as root chmod cannot make a file unreadable
        if path.name == "a.txt":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_read_text(path, *a, **k)

    monkeypatch.setattr(type(src), "read_text", unreadable)
    assert prepare_data.main(flags) == 2
    err = one_error_line(capsys.readouterr().err)
    assert f"cannot read {src / 'a.txt'}: Permission denied" in err
    monkeypatch.undo()

    import pyarrow.parquet as pq

    def full_disk(table, where, *a, **k):  # the real write_text_shard, whose temp file fills the disk
        Path(where).write_bytes(b"PAR1")
        raise OSError(errno.ENOSPC, "No space left on device", str(where))

    monkeypatch.setattr(pq, "write_table", full_disk)
    assert prepare_data.main(flags) == 2
    err = one_error_line(capsys.readouterr().err)
    # the shard asked for, not the temp name it was written under (its own since session 20); no temp file left
    assert f"could not write {tmp_path / 'o' / 'train_00000.parquet'}: No space left on device" in err, err
    assert not [p.name for p in (tmp_path / "o").iterdir() if p.name.endswith(".tmp")]


# ---- --step and the other numeric flags ----------------------------------------------------------------------
STEP_SCRIPTS = {
    "scripts.wic_probe": ["--run", "r", "--wic", "w.tsv"],
    "scripts.build_slot_map": ["--checkpoint", "r", "--group-size", "4", "--output", "m.json"],
    "scripts.export_reference": ["--run", "r", "--out", "o"],
    "scripts.sample": ["--run", "r", "--prompt", "hi"],
    "scripts.base_eval": ["--run", "r"],
}


@pytest.mark.parametrize("module", sorted(STEP_SCRIPTS))
def test_negative_step_is_a_flag_error(module, capsys):
    """It was a late 'checkpoint step_-00001 does not exist' (after loading torch and reading the run dir)."""
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as e:
        main([*STEP_SCRIPTS[module], "--step", "-1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --step: must be an integer >= 0 (got '-1')" in err, err


@pytest.mark.parametrize("flag, value, needle", [("--device-batch-size", "0", "an integer >= 1"),
                                                 ("--device-batch-size", "-2", "an integer >= 1"),
                                                 ("--eval-tokens", "0", "'run' or an integer >= 1"),
                                                 ("--eval-tokens", "-5", "'run' or an integer >= 1"),
                                                 ("--max-per-task", "-2", "'run', an integer >= 1, or -1 for all")])
def test_base_eval_count_flags_are_flag_errors(flag, value, needle, capsys):
    from scripts import base_eval

    with pytest.raises(SystemExit) as e:
        base_eval.main(["--run", "r", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: must be {needle}" in err, err


@pytest.mark.parametrize("value, needle", [("gpu", "is not a device"), ("cuda:0", "no GPU index"),
                                           ("cuda", "no such device here")])
def test_base_eval_device_type_is_a_flag_error(value, needle, capsys, monkeypatch):
    """compute_init's SystemExit(message) exited 1, after parsing, under torchrun on every rank."""
    import torch

    from scripts import base_eval

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        base_eval.main(["--run", "r", "--device-type", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --device-type: " in err and needle in err, err


# ---- sample: each sample printed when it is done -------------------------------------------------------------
def test_iter_samples_yields_each_sample_when_it_stops():
    """A sample that meets a stop token is yielded before the decoding of the others goes on; the tokens are
    generate()'s, which collects them."""
    import torch

    from conftest import tiny_config
    from nanochat.engine import generate, iter_samples
    from nanochat.gpt import build_model

    model = build_model(tiny_config(), seed=0)
    with torch.no_grad():  # zero-initialised output layers would make every sample the same
        for p in model.parameters():
            if p.ndim >= 1 and torch.all(p == 0):
                p.normal_(std=0.5)
    kw = dict(max_tokens=12, num_samples=4, temperature=1.0, seed=3)
    free = generate(model, [1, 2, 3], **kw)
    stop = free[2][1]  # sample 2 stops at its second token; the same seed draws the same tokens until then
    assert any(stop not in s for s in free), "precondition: another sample runs on past it"
    forwards = []
    model.register_forward_pre_hook(lambda *a: forwards.append(1))
    seen = [(i, list(ids), len(forwards)) for i, ids in iter_samples(model, [1, 2, 3], stop_ids={stop}, **kw)]
    expected = generate(model, [1, 2, 3], stop_ids={stop}, **kw)
    assert sorted(i for i, _, _ in seen) == [0, 1, 2, 3] and all(ids == expected[i] for i, ids, _ in seen)
    first_i, first_ids, forwards_then = seen[0]
    assert first_ids[-1] == stop and len(first_ids) <= 2
    assert forwards_then == len(first_ids) < seen[-1][2]  # the prefill + one decode step per token after the first


def test_sample_prints_finished_samples_before_ctrl_c(tmp_path, capsys, monkeypatch):
    """The samples of a prompt were printed only once all were generated: Ctrl-C midway showed none of them."""
    from scripts import sample
    from test_analysis import make_run

    run, _, _ = make_run(tmp_path, "base")
    real = sample.iter_samples

    def first_then_ctrl_c(*a, **k):
        yield next(real(*a, **k))
        raise KeyboardInterrupt

    monkeypatch.setattr(sample, "iter_samples", first_then_ctrl_c)
    argv = ["--run", str(run), "--prompt", "hi", "--num-samples", "3", "--max-tokens", "4", "--device-type", "cpu"]
    assert sample.main(argv) == 130
    out, err = capsys.readouterr()
    assert err == "interrupted\n" and out.startswith("--- sample 0 (step ") and out.count("--- sample") == 1, out
    monkeypatch.undo()
    assert sample.main(argv) == 0
    whole = capsys.readouterr().out
    assert whole.startswith(out) and [f"--- sample {i} " in whole for i in range(3)] == [True] * 3


def left_by_a_killed_writer(folder, name: str) -> Path:
    """The temp file a SIGKILLed write_atomic of ``folder/name`` leaves (its own name, old, unlocked)."""
    from nanochat.jsonfile import STALE_TEMP_S

    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{name}.0123abcd.tmp"
    tmp.write_bytes(b"half")
    then = tmp.stat().st_mtime - 2 * STALE_TEMP_S
    os.utime(tmp, (then, then))
    return tmp


def test_builds_remove_the_temp_files_of_killed_ones(embedded_data_dir, tmp_path, capsys):
    """prepare_data, tok_train and export_reference each remove, once done, the temp files that a SIGKILLed run of
    theirs left (a shard's, a tokenizer file's, a model's: no later write reuses the name); before, they stayed."""
    from reference_fixtures import our_base_run
    from scripts import export_reference, prepare_data, tok_train

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("one paragraph\n\nanother paragraph\n\nand a third\n")
    data = tmp_path / "o"
    left = left_by_a_killed_writer(data, "train_00000.parquet")
    assert prepare_data.main(["--dataset", "local", "--text-dir", str(src), "--data-dir", str(data),
                              "--doc-chars", "10"]) == 0
    tok = tmp_path / "tok"
    left_tok = left_by_a_killed_writer(tok, "tokenizer.bpe")
    assert tok_train.main(["--vocab-size", "300", "--data-dir", str(embedded_data_dir), "--max-chars", "20000",
                           "--output-dir", str(tok)]) == 0
    run = our_base_run(tmp_path)
    ckpt = tmp_path / "base" / "base_checkpoints" / "d4"
    left_model = left_by_a_killed_writer(ckpt, "model_000012.pt")
    assert export_reference.main(["--run", str(run), "--out", str(tmp_path / "base")]) == 0
    err = capsys.readouterr().err
    for tmp in (left, left_tok, left_model):
        assert not tmp.exists() and f"by writers killed midway: {tmp.name}" in err, err


def test_tok_train_dataset_default_matches_base_train(tmp_path, monkeypatch, capsys):
    """tok_train's --dataset defaulted to `embedded` (base_train's to fineweb-edu) and --help did not show it: the
    README's prepare_data fineweb-edu + tok_train --vocab-size 32768 trained the d12 tokenizer on the 2.7 MB
    Shakespeare/Gutenberg corpus. Same default, same check, defaults shown."""
    from nanochat.train_args import parse_args as train_parse_args
    from scripts.tok_train import main, parse_args

    assert parse_args([]).dataset == train_parse_args([]).dataset == "fineweb-edu"
    with pytest.raises(SystemExit) as e:
        parse_args(["--dataset", "fineweb"])
    assert e.value.code == 2 and "argument --dataset: 'fineweb' is not one of fineweb-edu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "(default: fineweb-edu)" in " ".join(capsys.readouterr().out.split())
    # the missing-data error names the directory the default resolves to ($NANOCHAT_DATA_DIR/fineweb-edu)
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "data"))
    assert main(["--output-dir", str(tmp_path / "t")]) == 2
    assert str(tmp_path / "data" / "fineweb-edu") in one_error_line(capsys.readouterr().err)


def test_base_trains_tokenizer_hints_name_the_runs_data(tmp_path, capsys, embedded_data_dir, tiny_tokenizer_dir):
    """base_train's hint for a missing tokenizer, or (--dry-run) one of another vocab size, said `tok_train
    --output-dir DIR`:
    with tok_train's default now fineweb-edu, a mini row (embedded data) following it trained on the wrong corpus,
    or failed for lack of fineweb-edu. The hint now carries the run's data dir and vocab size."""
    from nanochat.tokenizer import Tokenizer
    from scripts import base_train

    common = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "32", "--num-iterations",
              "1", "--eval-every", "-1", "--no-final-core", "--data-dir", str(embedded_data_dir)]
    missing = tmp_path / "no_tokenizer"
    assert base_train.main([*common, "--vocab-size", "512", "--tokenizer-dir", str(missing),
                            "--run-dir", str(tmp_path / "a")]) == 2
    want = f"python -m scripts.tok_train --vocab-size 512 --data-dir {embedded_data_dir} --output-dir {missing}"
    assert want in one_error_line(capsys.readouterr().err)
    other = Tokenizer.load(tiny_tokenizer_dir).vocab_size + 1  # the dry run's check, and the start's (which said
    for dry_run in (["--dry-run"], []):                         # "retrain the tokenizer with --vocab-size": no command)
        assert base_train.main([*common, "--vocab-size", str(other), "--tokenizer-dir", str(tiny_tokenizer_dir),
                                "--run-dir", str(tmp_path / f"b{len(dry_run)}"), *dry_run]) == 2
        err = one_error_line(capsys.readouterr().err)
        want = f"python -m scripts.tok_train --vocab-size {other} --data-dir {embedded_data_dir} --output-dir DIR"
        assert want in err and f"holds a tokenizer of vocab size {other - 1}, but this run needs --vocab-size " \
            f"{other}" in err, (dry_run, err)
