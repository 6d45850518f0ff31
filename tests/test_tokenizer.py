import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanochat.tokenizer import (SPECIAL_TOKENS, Tokenizer, TokenizerError, check_vocab_matches, get_token_bytes,
                                get_tokenizer)
from scripts.tok_train import capped_texts

SAMPLE = "Hello world! It's 2024: 12345 apples, naïve café, 日本語, emoji 🙂\n\n  indented\ttab <|bos|> end"


@pytest.fixture(scope="module")
def trained(embedded_data_dir):  # noqa: F811
    """A freshly trained tokenizer that still holds the rustbpe trainer."""
    return Tokenizer.train_from_iterator(capped_texts(embedded_data_dir, "train", 2_000_000, 10_000), vocab_size=2048)


def test_train_small_vocab_with_specials_at_end(trained):
    tok = trained
    assert tok.vocab_size == 2048 and len(tok.mergeable_ranks) == 2048 - 9
    assert [tok.special_tokens[s] for s in SPECIAL_TOKENS] == list(range(2039, 2048))
    assert tok.bos_token_id == 2039


def test_tiktoken_ids_equal_rustbpe_trainer_ids(trained, embedded_data_dir):  # noqa: F811
    tok = trained
    texts = [SAMPLE] + list(capped_texts(embedded_data_dir, "val", 50_000, 2_000))
    for text in texts:
        assert tok.encode(text) == tok._trainer.encode(text)


def test_specials_are_single_tokens_with_zero_bytes(tiny_tokenizer):  # noqa: F811
    tb = tiny_tokenizer.token_bytes()
    for name in SPECIAL_TOKENS:
        ids = tiny_tokenizer.enc.encode(name, allowed_special="all")
        assert ids == [tiny_tokenizer.special_tokens[name]]
        assert tb[ids[0]] == 0
    # special-token text inside a document is ordinary text, never the special id
    ids = tiny_tokenizer.encode("<|bos|>")
    assert tiny_tokenizer.bos_token_id not in ids and tiny_tokenizer.decode(ids) == "<|bos|>"


def test_token_bytes_are_raw_byte_lengths(tiny_tokenizer):  # noqa: F811
    tb = tiny_tokenizer.token_bytes()
    assert tb.dtype == torch.int32 and tb.shape == (tiny_tokenizer.vocab_size,)
    for tok_bytes, rank in list(tiny_tokenizer.mergeable_ranks.items())[::37]:
        assert tb[rank] == len(tok_bytes)
    assert (tb[:256] == 1).all()


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_unicode_round_trip_and_byte_count(tiny_tokenizer, text):  # noqa: F811
    ids = tiny_tokenizer.encode(text)
    assert tiny_tokenizer.decode(ids) == text
    assert tiny_tokenizer.decode_bytes(ids) == text.encode("utf-8")
    assert int(tiny_tokenizer.token_bytes()[ids].sum()) == len(text.encode("utf-8"))


@settings(max_examples=100, deadline=None)
@given(st.binary())
def test_arbitrary_bytes_are_representable(tiny_tokenizer, data):  # noqa: F811
    ids = [tiny_tokenizer.enc.encode_single_token(bytes([b])) for b in data]
    assert tiny_tokenizer.decode_bytes(ids) == data


def test_save_load_round_trip(tiny_tokenizer, tmp_path):  # noqa: F811
    tiny_tokenizer.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    assert loaded.vocab_size == tiny_tokenizer.vocab_size
    assert loaded.special_tokens == tiny_tokenizer.special_tokens
    assert loaded.encode(SAMPLE) == tiny_tokenizer.encode(SAMPLE)
    assert torch.equal(get_token_bytes(tmp_path), tiny_tokenizer.token_bytes())
    # plain-text formats, nothing pickled
    assert (tmp_path / "tokenizer.bpe").read_text().splitlines()[0] == "AA== 0"
    assert not list(tmp_path.glob("*.tmp"))


def test_save_fsyncs_each_file_once(tiny_tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """Each of the three files reaches the disk before its rename, once: write_atomic fsyncs the temp file, so a
    second fsync of the same data in the writer (as _atomic_write had) only costs time. The folder is fsynced after
    each rename."""
    from nanochat import jsonfile

    synced, real = [], os.fsync
    monkeypatch.setattr(jsonfile.os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real(fd))
    tiny_tokenizer.save(tmp_path)
    files = [tmp_path / name for name in ("tokenizer.bpe", "token_bytes.pt", "tokenizer.json")]
    assert synced == [i for f in files for i in (f.stat().st_ino, tmp_path.stat().st_ino)]


def test_missing_and_corrupt_tokenizer_errors(tmp_path, tiny_tokenizer):  # noqa: F811
    with pytest.raises(TokenizerError, match="scripts.tok_train"):
        get_tokenizer(tmp_path / "nowhere")
    tiny_tokenizer.save(tmp_path)
    with open(tmp_path / "tokenizer.bpe", "a") as f:
        f.write("not-base64-and-no-rank\n")
    with pytest.raises(TokenizerError, match="tokenizer.bpe:.*malformed"):
        Tokenizer.load(tmp_path)


def test_retrain_hints_name_the_data_and_vocab_flags(tmp_path, tiny_tokenizer):  # noqa: F811
    """The library's hints said `tok_train --output-dir DIR`: followed as written, tok_train trains on its default
    fineweb-edu at 32768 tokens, not the run's corpus. Not knowing the run, they name the flags to fill in (the
    vocab size where the files give it), and --overwrite exactly where tok_train would refuse without it (a
    tokenizer.json in the directory)."""
    def error(call) -> str:
        with pytest.raises(TokenizerError) as e:
            call()
        return str(e.value)

    defaults = "tok_train's defaults are fineweb-edu and 32768"
    nowhere = tmp_path / "nowhere"
    said = error(lambda: get_tokenizer(nowhere))
    assert f"`python -m scripts.tok_train --data-dir DATA_DIR --vocab-size N --output-dir {nowhere}`" in said \
        and defaults in said, said
    tiny_tokenizer.save(tmp_path / "t")
    (tmp_path / "t" / "token_bytes.pt").unlink()
    for call, vocab in ((lambda: get_token_bytes(tmp_path / "t"), "N"),
                        (lambda: get_token_bytes(tmp_path / "t", vocab_size=1024), "1024")):
        said = error(call)
        assert f"`python -m scripts.tok_train --data-dir DATA_DIR --vocab-size {vocab} --output-dir {tmp_path / 't'} " \
               "--overwrite`" in said and defaults in said, said
    torch.save(torch.ones(3, dtype=torch.long), tmp_path / "t" / "token_bytes.pt")
    said = error(lambda: get_token_bytes(tmp_path / "t", vocab_size=1024))
    assert said.startswith(f"{tmp_path / 't' / 'token_bytes.pt'} has 3 entries but the tokenizer has 1024 tokens") \
        and "--vocab-size 1024 --output-dir" in said and "--overwrite`" in said, said
    (tmp_path / "t" / "tokenizer.bpe").unlink()  # a header without its ranks: tok_train wants --overwrite
    said = error(lambda: Tokenizer.load(tmp_path / "t"))
    assert f"--vocab-size N --output-dir {tmp_path / 't'} --overwrite`" in said and defaults in said, said
    tiny_tokenizer.save(tmp_path / "t")
    (tmp_path / "t" / "tokenizer.json").write_text("{}")
    said = error(lambda: Tokenizer.load(tmp_path / "t"))
    assert "unknown format" in said and f"--output-dir {tmp_path / 't'} --overwrite`" in said, said


def test_vocab_mismatch_and_bad_vocab_flag(tiny_tokenizer):  # noqa: F811
    check_vocab_matches(tiny_tokenizer, tiny_tokenizer.vocab_size, "cfg")
    with pytest.raises(ValueError, match=r"1024 does not match vocab_size 32768 of ckpt/meta.json"):
        check_vocab_matches(tiny_tokenizer, 32768, "ckpt/meta.json")
    with pytest.raises(TokenizerError, match="--vocab-size must be >= 265"):
        Tokenizer.train_from_iterator(iter(["abc"]), vocab_size=100)


def test_fingerprint_names_the_token_ids_not_the_files(tiny_tokenizer, tmp_path):  # noqa: F811
    """A saved-and-reloaded copy has the same fingerprint; two merges swapped (same vocab size) do not, and a
    checkpoint's meta with the other fingerprint is refused naming its tokenizer dir."""
    tiny_tokenizer.save(tmp_path / "copy")
    assert Tokenizer.load(tmp_path / "copy").fingerprint() == tiny_tokenizer.fingerprint()
    ranks = dict(tiny_tokenizer.mergeable_ranks)
    (a, ra), (b, rb) = sorted(ranks.items(), key=lambda kv: kv[1])[300:302]
    ranks[a], ranks[b] = rb, ra
    other = Tokenizer(ranks, pattern=tiny_tokenizer.pattern, special_tokens=list(tiny_tokenizer.special_tokens))
    assert other.vocab_size == tiny_tokenizer.vocab_size and other.fingerprint() != tiny_tokenizer.fingerprint()
    meta = {"tokenizer_sha256": tiny_tokenizer.fingerprint(), "tokenizer_dir": "/runs/x/tok"}
    check_vocab_matches(tiny_tokenizer, tiny_tokenizer.vocab_size, "run x", meta)
    check_vocab_matches(other, other.vocab_size, "run x", {})  # older checkpoints: no fingerprint, vocab only
    with pytest.raises(ValueError, match=r"not the one run x was trained with .* \(/runs/x/tok\) via --tokenizer-dir"):
        check_vocab_matches(other, other.vocab_size, "run x", meta)


def test_tok_train_cli_reports_compression(embedded_data_dir, tmp_path, capsys):  # noqa: F811
    from scripts.tok_train import main

    out = tmp_path / "tok"
    assert main(["--vocab-size", "512", "--data-dir", str(embedded_data_dir), "--max-chars", "300000",
                 "--eval-chars", "50000", "--output-dir", str(out)]) == 0
    text = capsys.readouterr().out
    ratio = float(text.split("held-out val: ")[1].split(" bytes/token")[0])
    assert f"on the train split of {embedded_data_dir} -> {out}" in text.splitlines()[-1]  # which data it read
    assert 1.5 < ratio < 5
    assert get_tokenizer(out).vocab_size == 512
    # bad input exits 2, as in every entry point (tok_train exited 1 before session 20)
    assert main(["--vocab-size", "512", "--data-dir", str(tmp_path / "none"), "--output-dir", str(tmp_path / "t2")]) == 2
    assert "prepare_data" in capsys.readouterr().err
    # the tokenizer of existing runs is not replaced silently (a 4096-token one over the 32768 of the GPU rows)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert main(["--vocab-size", "300", "--data-dir", str(embedded_data_dir), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --output-dir {out} already holds a tokenizer (vocab 512)") and "--overwrite" in err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert main(["--vocab-size", "300", "--data-dir", str(embedded_data_dir), "--max-chars", "300000",
                 "--eval-chars", "50000", "--output-dir", str(out), "--overwrite"]) == 0
    assert get_tokenizer(out).vocab_size == 300


def test_an_interrupted_save_leaves_no_tokenizer_rather_than_a_mixed_one(tiny_tokenizer, tmp_path,  # noqa: F811
                                                                          monkeypatch):
    """tok_train stopped (Ctrl-C, a kill, a full disk) while it saves: the directory holds the complete tokenizer
    or none (no tokenizer.json, the file loaders look for: a clear 'no tokenizer' error, and tok_train runs again
    without --overwrite), never new merges under an old header and old token_bytes.pt. Before: the header was
    written second, token_bytes.pt last: a fresh save stopped there left a tokenizer whose token_bytes.pt was
    missing (and tok_train refused to retrain without --overwrite, which the error did not say), and a re-save
    over an old one loaded as a mix."""
    from nanochat import tokenizer as tokmod

    tiny_tokenizer.save(tmp_path / "fresh")
    (tmp_path / "fresh" / "token_bytes.pt").unlink()  # as left by a kill before its rename
    with pytest.raises(TokenizerError, match=r"token_bytes.pt is missing; retrain with .*--overwrite"):
        get_token_bytes(tmp_path / "fresh")

    tiny_tokenizer.save(tmp_path)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    real_write = tokmod.write_bytes_atomic
    failures = {"token_bytes.pt": lambda: monkeypatch.setattr(tokmod.torch, "save", full_disk),
                "tokenizer.json": lambda: monkeypatch.setattr(tokmod, "write_bytes_atomic", lambda path, data: (
                    full_disk() if path.name == "tokenizer.json" else real_write(path, data)))}
    for fail in failures.values():
        fail()
        with pytest.raises(OSError):
            tiny_tokenizer.save(tmp_path)
        monkeypatch.undo()
        assert not (tmp_path / "tokenizer.json").exists()
        with pytest.raises(TokenizerError, match="no tokenizer in"):
            get_tokenizer(tmp_path)
        tiny_tokenizer.save(tmp_path)  # the retry (tok_train without --overwrite) completes it
        assert get_tokenizer(tmp_path).encode(SAMPLE) == tiny_tokenizer.encode(SAMPLE)


def test_tok_train_skips_null_documents_as_the_loader_does(tmp_path):
    """A shard whose text column holds a null (a mirror's shard, a hand-made manifest): the loader reads it as an
    empty document; tok_train's reader crashed on it with a TypeError traceback."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nanochat.dataset import write_manifest

    pq.write_table(pa.table({"text": pa.array(["hello world", None, "", "bye"], type=pa.string())}),
                   tmp_path / "t.parquet")
    pq.write_table(pa.table({"text": ["val doc"]}), tmp_path / "v.parquet")
    write_manifest(tmp_path, "x", ["t.parquet"], ["v.parquet"], source="test")
    assert list(capped_texts(tmp_path, "train", 1000, 100)) == ["hello world", "bye"]
    assert list(capped_texts(tmp_path, "train", 13, 100)) == ["hello world", "by"]


def test_ranks_missing_a_single_byte_token_are_refused():
    """256 ranks that are not the 256 bytes (a foreign or hand-edited file) were accepted: encoding a text with the
    missing byte then panicked inside tiktoken (a BaseException, "no entry found for key")."""
    ranks = {bytes([b]): b for b in range(256) if b != 0x61}
    ranks[b"zz"] = 0x61
    with pytest.raises(TokenizerError, match=r"no token for the single byte\(s\) \[0x61\]"):
        Tokenizer(ranks)


def test_training_bpb_counts_the_tokenizers_raw_bytes_whatever_its_token_bytes_file_says(
        tmp_path, monkeypatch, embedded_data_dir, tiny_tokenizer_dir):
    """The train/val bpb during training divided by the directory's token_bytes.pt (checked for length only), while
    base_eval counts the tokenizer's raw bytes: a hand-copied file (e.g. the authors' partial-UTF-8-as-3 convention)
    made the two bpb numbers of one run differ silently."""
    import shutil

    from nanochat.train_args import parse_args
    from nanochat.train_setup import load_run_data

    tok = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, tok)
    real = Tokenizer.load(tok).token_bytes()
    torch.save(real + 1, tok / "token_bytes.pt")  # another convention, same length
    args = parse_args(["--data-dir", str(embedded_data_dir), "--tokenizer-dir", str(tok), "--dataset", "embedded"])
    data = load_run_data(args, 0, 1, "cpu")
    assert torch.equal(data.token_bytes.to(real.dtype), real)
