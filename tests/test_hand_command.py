"""base_train's --resume takes its value optionally; the two readers of typed base_train flags (the runner's
start_flags, hand_command's without_flags) tell its value from the next flag by one rule, resume_value_at."""

import argparse

import pytest

from nanochat.hand_command import resume_value_at, without_flags
from scripts.run import start_flags

ARGVS = [["--resume"], ["--resume", "auto"], ["--resume", "3", "--depth", "2"], ["--resume", "--depth", "2"],
         ["--depth", "2", "--resume"], ["--resume", "--overwrite"], ["--resume", "latest", "--overwrite"],
         ["--depth", "2"], ["--resume=4", "--depth", "2"]]


@pytest.mark.parametrize("argv", ARGVS)
def test_resume_value_at_reads_as_argparse_reads_base_trains_resume(argv):
    # base_train's --resume as train_args declares it, with the other flags of these argvs
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", nargs="?", const="latest", default=None)
    parser.add_argument("--depth")
    parser.add_argument("--overwrite", action="store_true")
    values = [token for i, token in enumerate(argv) if resume_value_at(argv, i)]
    assert len(values) <= 1
    if "--resume" in argv:
        expected = values[0] if values else "latest"
    else:
        expected = next((t.split("=", 1)[1] for t in argv if t.startswith("--resume=")), None)
        assert values == []
    assert parser.parse_args(argv).resume == expected


def test_resume_value_at_edges():
    assert not resume_value_at(["auto"], 0)  # no flag before it
    assert not resume_value_at(["--resume"], 1)  # past the end
    assert not resume_value_at(["--resume=3", "4"], 1)  # a --resume=V has its value already
    assert resume_value_at(["--resume", "7"], 1)


def test_without_flags_drops_the_start_flags_and_the_valued_ones():
    argv = ["--depth", "2", "--resume", "--overwrite", "--matrix-lr", "0.02", "--resume-override-lr", "--x=1",
            "--embedding-lr=0.3"]
    assert without_flags(argv, {"--matrix-lr", "--embedding-lr"}) == ["--depth", "2", "--x=1"]
    assert without_flags(["--resume", "5", "--depth", "2"], set()) == ["--depth", "2"]
    assert without_flags(["--resume", "--depth", "2"], set()) == ["--depth", "2"]  # --depth is no value of --resume
    assert without_flags(["--depth", "2", "--resume=latest"], set()) == ["--depth", "2"]
    assert without_flags(["--depth", "2", "--matrix-lr"], {"--matrix-lr"}) == ["--depth", "2"]  # no value to drop


def test_start_flags_keeps_resume_with_its_value_alone():
    assert start_flags(["--resume", "5", "--depth", "2"]) == ["--resume", "5"]
    assert start_flags(["--resume", "--depth", "2"]) == ["--resume"]
    assert start_flags(["--depth", "2", "--overwrite", "--resume=auto"]) == ["--overwrite", "--resume=auto"]
    assert start_flags(["--depth", "2"]) == []
