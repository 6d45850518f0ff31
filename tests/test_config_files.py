"""Broken config files (base_train --config, scripts.run's row configs): each fault is one line naming the file, the
key and what the key takes, exit code 2, no traceback; and TOML's true/false work for the on/off keys."""

import pytest

from nanochat.row_config import load_row_config
from nanochat.train_args import parse_args
from scripts import run

TINY = ["--synthetic-data", "--vocab-size", "256", "--depth", "2", "--max-seq-len", "64", "--dry-run"]
BIGRAM = 'memory = "mome"\nmome-index = "bigram"\n'
LISTED = "configs/README.md lists the row configs"


def write(tmp_path, text: str, name: str = "c.toml"):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return path


def refused(capsys, argv) -> str:
    """The error line of a base_train parse that must stop with exit code 2."""
    with pytest.raises(SystemExit) as stopped:
        parse_args(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("value, want", [("true", "on"), ("false", "off"), ('"on"', "on"), ('"off"', "off")])
def test_toml_booleans_work_for_on_off_keys(tmp_path, value, want):
    cfg = write(tmp_path, f"{BIGRAM}mome-shared-table-kernel = {value}\n")
    assert parse_args(["--config", str(cfg), *TINY]).mome_shared_table_kernel == want


@pytest.mark.parametrize("value, shown", [('"yes"', "'yes'"), ('"true"', "'true'"), ("1", "1")])
def test_an_on_off_key_names_its_values_booleans_included(tmp_path, capsys, value, shown):
    cfg = write(tmp_path, f"{BIGRAM}mome-shared-table-kernel = {value}\n")
    assert refused(capsys, ["--config", str(cfg), *TINY]).endswith(
        f"--config {cfg}: key 'mome-shared-table-kernel' must be one of 'off', 'on' (or true, false) (got {shown})")


@pytest.mark.parametrize("line, wanted", [
    ('eval-every = "ten"', "key 'eval-every' must be an integer (got 'ten')"),
    ("eval-every = 10.0", "key 'eval-every' must be an integer (got 10.0)"),
    ("eval-every = true", "key 'eval-every' must be an integer (got True)"),
    ("eval-every = [10]", "key 'eval-every' takes one value, not a list (got [10])"),
    ('matrix-lr = "fast"', "key 'matrix-lr' must be a number (got 'fast')"),
    ('attention = "flash"', "key 'attention' must be one of 'sdpa', 'fa2', 'fa3', 'auto' (got 'flash')"),
    ("attention = true", "key 'attention' must be one of 'sdpa', 'fa2', 'fa3', 'auto' (got True)"),
    # was "must be a string": --resume takes one of three things, none of them true
    ("resume = true", "key 'resume' must be 'latest', 'auto' or a step number (got True)"),
])
def test_a_value_of_the_wrong_type_names_the_file_the_key_and_the_type(tmp_path, capsys, line, wanted):
    cfg = write(tmp_path, line + "\n")
    assert f"--config {cfg}: {wanted}" in refused(capsys, ["--config", str(cfg), "--synthetic-data", "--dry-run"])


@pytest.mark.parametrize("line, wanted", [
    ('dataset = "nope"', "argument --dataset: 'nope' is not one of"),
    ("seed = -1", "argument --seed: must be an integer in [0, 4294967295] (got '-1')"),
    ("core-max-per-task = 0", "argument --core-max-per-task: must be an integer >= 1, or -1 for all (got '0')"),
])
def test_a_value_its_flags_type_refuses_names_the_file(tmp_path, capsys, line, wanted):
    cfg = write(tmp_path, line + "\n")
    flag = wanted.split(":")[0].split()[-1]
    error = refused(capsys, ["--config", str(cfg), *TINY])
    assert wanted in error and error.endswith(f"({flag} from --config {cfg})"), error
    assert not refused(capsys, ["--config", str(cfg), *TINY, flag, "x"]).endswith(f"from --config {cfg})")


def test_a_value_out_of_range_names_the_file_that_set_it(tmp_path, capsys):
    cfg = write(tmp_path, "eval-every = 0\n")
    assert refused(capsys, ["--config", str(cfg), *TINY]).endswith(
        f"--eval-every must be a positive step count or -1 (got 0) (--eval-every from --config {cfg})")
    good = write(tmp_path, "eval-every = 5\n", "good.toml")  # the command line's value: no file to name
    assert refused(capsys, ["--config", str(good), *TINY, "--eval-every", "0"]).endswith("(got 0)")


def test_the_command_line_wins_over_the_file(tmp_path):
    cfg = write(tmp_path, "eval-every = 7\n")
    assert parse_args(["--config", str(cfg), *TINY]).eval_every == 7
    assert parse_args(["--config", str(cfg), *TINY, "--eval-every", "9"]).eval_every == 9


@pytest.mark.parametrize("form", ["--config", "--config="])
def test_two_config_files_are_refused(tmp_path, capsys, form):
    """Only the last file would be read: the keys of the first would be dropped without a word."""
    a, b = write(tmp_path, "eval-every = 7\n", "a.toml"), write(tmp_path, "core-every = 5\n", "b.toml")
    first = [form + str(a)] if form.endswith("=") else [form, str(a)]
    line = refused(capsys, [*first, "--config", str(b), *TINY])
    assert line.endswith(f"--config given 2 times ({a}, {b}): one config file per run; put the keys of the others "
                         "on the command line"), line


def test_one_flag_under_two_spellings_is_refused(tmp_path, capsys):
    """TOML sees two keys; base_train would take the later one silently."""
    cfg = write(tmp_path, "matrix_lr = 0.01\nmatrix-lr = 0.05\n")
    assert refused(capsys, ["--config", str(cfg), *TINY]).endswith(
        f"--config {cfg}: keys 'matrix_lr' and 'matrix-lr' both set --matrix-lr; keep one")


@pytest.mark.parametrize("text", ["", "# nothing set yet\n"])
def test_an_empty_file_is_refused(tmp_path, capsys, text):
    cfg = write(tmp_path, text)
    assert refused(capsys, ["--config", str(cfg), *TINY]).endswith(
        f"--config {cfg}: the file sets no key (drop --config, or fill it in)")


def test_a_directory_a_missing_file_and_non_utf8_bytes_are_named(tmp_path, capsys):
    assert refused(capsys, ["--config", str(tmp_path), *TINY]).endswith(
        f"--config {tmp_path}: a directory, not a file ({LISTED})")
    missing = tmp_path / "missing.toml"
    assert refused(capsys, ["--config", str(missing), *TINY]).endswith(f"--config {missing}: file not found ({LISTED})")
    cfg = write(tmp_path, b"depth = 2\n# caf\xe9\n")
    assert refused(capsys, ["--config", str(cfg), *TINY]).endswith(
        f"--config {cfg}: not UTF-8 text (byte 0xe9 at offset 15); TOML files are UTF-8")


def test_a_table_in_a_flat_file_reads_as_a_row_config(tmp_path, capsys):
    cfg = write(tmp_path, "depth = { n = 2 }\n")
    assert refused(capsys, ["--config", str(cfg), *TINY]).endswith(
        f"config {cfg}: unknown top-level table(s) ['depth']; allowed: row, train, paper")


def test_keys_outside_the_tables_of_a_row_config_are_named(tmp_path, capsys):
    cfg = write(tmp_path, "depth = 2\n[train]\nmax-seq-len = 64\n")
    assert refused(capsys, ["--config", str(cfg), *TINY]).endswith(
        f"config {cfg}: key(s) ['depth'] outside a table: a file with tables is a row config ([row], [train], "
        "[paper]); put them under [train]")


def test_comma_list_flags_take_toml_lists(tmp_path):
    cfg = write(tmp_path, 'save-at-flops = ["1e18", "2e18"]\n')
    assert parse_args(["--config", str(cfg), *TINY]).save_at_flops == "1e18,2e18"


ROW = ('[row]\ntable = "t"\nname = "r"\n{row}[train]\ntotal-batch-size = {total}\nmax-seq-len = 64\n'
       "device-batch-size = 2\n")


@pytest.mark.parametrize("total, row", [('"lots"', ""), ("4096.5", ""), ("[4096]", ""), ("0", ""), ("true", ""),
                                        ("4096", 'nproc_per_node = "x"\n'), ("4096", "nproc_per_node = 0\n"),
                                        ("4096", "nproc_per_node = 1.5\n")])
def test_the_runner_names_a_bad_batch_key_or_process_count_of_a_row(tmp_path, capsys, total, row):
    cfg = write(tmp_path, ROW.format(total=total, row=row))
    key = "[row] 'nproc_per_node'" if row else "[train] 'total-batch-size'"
    with pytest.raises(ValueError, match=rf"^config {cfg}: {key.replace('[', '.').replace(']', '.')} must be an "
                                         r"integer >= 1 \(got "):
        load_row_config(cfg)
    with pytest.raises(SystemExit) as stopped:
        run.main([str(cfg), "--plan", "--runs-root", str(tmp_path / "runs")])
    assert stopped.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_the_runner_names_a_non_utf8_directory_or_missing_config(tmp_path):
    """In base_train's words (one helper): the runner said "is a directory" and "does not exist"."""
    cfg = write(tmp_path, b'[row]\ntable = "t"\nname = "caf\xe9"\n')
    with pytest.raises(ValueError, match=rf"^config {cfg}: not UTF-8 text \(byte 0xe9 at offset 29\)"):
        load_row_config(cfg)
    with pytest.raises(ValueError) as e:
        load_row_config(tmp_path)
    assert str(e.value) == f"config {tmp_path}: a directory, not a file ({LISTED})"
    with pytest.raises(FileNotFoundError) as e:
        load_row_config(tmp_path / "missing.toml")
    assert str(e.value) == f"config {tmp_path / 'missing.toml'}: file not found ({LISTED})"


def test_a_misspelled_key_names_the_flag_it_is_close_to(tmp_path, capsys):
    cfg = write(tmp_path, "matrx_lr = 0.01\n")
    assert refused(capsys, ["--config", str(cfg), *TINY]).endswith(
        f"--config {cfg}: unknown key 'matrx_lr' (not a base_train flag; did you mean 'matrix_lr'?)")
    cfg = write(tmp_path, "matrx-lr = 0.01\n")
    assert refused(capsys, ["--config", str(cfg), *TINY]).endswith("(not a base_train flag; did you mean 'matrix-lr'?)")
    cfg = write(tmp_path, 'config = "other.toml"\n')
    assert refused(capsys, ["--config", str(cfg), *TINY]).endswith(
        f"--config {cfg}: key 'config' cannot be set in a config file (one --config per run)")


def test_an_unreadable_file_is_named(tmp_path, capsys, monkeypatch):
    cfg = write(tmp_path, "depth = 2\n")

    def unreadable(self):  # root reads a chmod 000 file: the refusal is simulated
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(type(cfg), "read_bytes", unreadable)
    assert refused(capsys, ["--config", str(cfg), *TINY]).endswith(
        f"--config {cfg}: cannot be read (Permission denied)")


def test_a_value_only_a_resume_takes_is_checked_as_the_resume_parses_it(tmp_path, capsys):
    """--core-max-per-task 0 ("all" in older versions) continues a run recorded with it, from its config file too."""
    cfg = write(tmp_path, "core-max-per-task = 0\n")
    assert parse_args(["--config", str(cfg), *TINY, "--resume"]).core_max_per_task == 0
    assert "--core-max-per-task" in refused(capsys, ["--config", str(cfg), *TINY])


def test_a_row_config_without_a_train_table_sets_no_key(tmp_path, capsys):
    """A row config of [row] alone was a KeyError traceback in base_train; it sets no flag, as an empty file."""
    cfg = write(tmp_path, '[row]\ntable = "t"\nname = "r"\ntrain_shards = 3\n')
    assert refused(capsys, ["--config", str(cfg), *TINY]).endswith(
        f"--config {cfg}: the file sets no key (drop --config, or fill it in)")
