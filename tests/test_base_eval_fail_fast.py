"""base_eval checks what its bpb evaluation needs before CORE runs (minutes to hours on a GPU): a --eval-tokens the
split cannot fill, a --splits name that is no split, a corpus with nothing to score. The bpb rows are built before
CORE and scored after it; an earlier run's finished split is not tokenized again."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import base_eval_fixtures  # noqa: E402
from base_eval_fixtures import _count_calls, _eval_args  # noqa: E402
from conftest import sigterm_after  # noqa: E402

tiny_run = base_eval_fixtures.tiny_run  # the fixture (module scope: one tiny trained run for this file)
BASE_EVAL = Path(__file__).parent.parent / "scripts" / "base_eval.py"


def _without(args: list[str], flag: str) -> list[str]:
    i = args.index(flag)
    return args[:i] + args[i + 2:]


def test_an_eval_tokens_the_split_cannot_fill_stops_before_core(tiny_run, tmp_path, monkeypatch, capsys):
    """The train split holds 150 short documents (~9k tokens): 10,000,000 asked is refused with exit 2 before any CORE
    task is scored, naming --eval-tokens, the split, what it holds and what was asked; nothing is written."""
    from nanochat import core_eval
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"
    args = _without(_eval_args(root, bundle, out), "--eval-tokens")
    tasks = _count_calls(monkeypatch, core_eval, "evaluate_task")
    assert main([*args, "--eval-tokens", "10000000"]) == 2
    err = capsys.readouterr().err
    assert tasks == [] and not (out / "core.partial.json").exists() and not (out / "core.json").exists()
    assert err.count("error: ") == 1 and "Traceback" not in err, err
    assert "error: --eval-tokens 10,000,000: the train split of" in err, err
    assert "yields only" in err and "10,000,000 eval tokens were asked for" in err, err
    # the run records no --eval-tokens (as an imported run): the paper's budget, and the message says where it came
    # from; the val split alone (50 documents) is checked as well
    assert main([*args, "--splits", "val"]) == 2
    err = capsys.readouterr().err
    assert tasks == [] and not (out / "core.partial.json").exists()
    assert "--eval-tokens run = 20,971,520, default (the checkpoint does not record --eval-tokens): " in err, err
    assert "the val split of" in err, err


def test_a_split_that_is_no_split_is_a_flag_error(tiny_run, capsys):
    import pytest

    from scripts.base_eval import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--run", "x", "--splits", "train,test"])
    assert e.value.code == 2
    assert "--splits: unknown split(s) ['test']; choose from train, val" in capsys.readouterr().err


def test_a_corpus_with_nothing_to_score_stops_before_core(tiny_run, tmp_path, monkeypatch, capsys):
    from nanochat import core_eval
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "o"
    tasks = _count_calls(monkeypatch, core_eval, "evaluate_task")
    assert main([*_eval_args(root, bundle, out), "--bpb-corpus", f"empty={empty}"]) == 2
    assert "the corpus produced no tokens to score" in capsys.readouterr().err
    assert tasks == [] and not (out / "core.partial.json").exists()


def test_rows_built_before_core_give_the_same_reports_and_a_finished_split_is_not_rebuilt(tiny_run, tmp_path,
                                                                                          monkeypatch, capsys):
    """The rows are built before CORE (build_eval_rows has run for both splits when the first CORE task starts), the
    reports equal an uninterrupted run's byte for byte, and a rerun after a stop in val's bpb tokenizes val alone."""
    from nanochat import core_eval, dataloader, loss_eval
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    assert main(_eval_args(root, bundle, tmp_path / "whole")) == 0
    out = tmp_path / "resumed"
    with monkeypatch.context() as m:
        built = _count_calls(m, dataloader, "build_eval_rows")
        seen_at_core = []
        real_task = core_eval.evaluate_task
        m.setattr(core_eval, "evaluate_task", lambda *a, **k: seen_at_core.append(len(built)) or real_task(*a, **k))
        sigterm_after(m, loss_eval, "evaluate_bpb", 1)  # train bpb finishes, val is cut
        assert main(_eval_args(root, bundle, out)) == 128 + 15
    assert seen_at_core == [2, 2] and [a[1] for a in built] == ["train", "val"]
    assert list(json.loads((out / "bpb.partial.json").read_text())["items"]) == ["split train"]
    with monkeypatch.context() as m:
        built = _count_calls(m, dataloader, "build_eval_rows")
        assert main(_eval_args(root, bundle, out)) == 0
    assert [a[1] for a in built] == ["val"]
    capsys.readouterr()
    for name in ("core.json", "core.csv", "core.md", "bpb.json"):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_two_ranks_refuse_an_eval_tokens_the_split_cannot_fill_once_before_core(tiny_run, tmp_path):
    """Under torchrun (2 gloo ranks) every rank packs the same rows, so every rank refuses together: one error line
    (rank 0's), exit 2 on both, no CORE task scored (no core.partial.json). One torchrun, ~5 s."""
    from conftest import run_torchrun

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"
    res = run_torchrun(BASE_EVAL, 2, ["--run-dir", str(root / "run"), "--bundle", str(bundle), "--eval-tokens",
                                      "10000000", "--no-progress", "--device-type", "cpu", "--out-dir", str(out)])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--eval-tokens 10,000,000" in errors[0], res.stderr[-4000:]
    assert "exitcode  : 2 " in res.stderr and res.returncode != 0, res.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == []


def test_a_split_named_twice_is_built_and_scored_once(capsys):
    """--splits train,train would build (and hold) the train rows twice and score them twice; it is --splits train."""
    from scripts.base_eval import parse_args

    assert parse_args(["--run", "x", "--splits", "val,train,val,,train"]).split_names == ["val", "train"]
    assert parse_args(["--run", "x", "--splits", ""]).split_names == []


def test_a_corpus_name_given_twice_is_a_flag_error(tmp_path, capsys):
    """--bpb-corpus a=x --bpb-corpus a=y would score y alone under a (one name, one line of bpb.json)."""
    import pytest

    from scripts.base_eval import parse_args

    for name in ("x.txt", "y.txt"):
        (tmp_path / name).write_text("some text")
    with pytest.raises(SystemExit) as e:
        parse_args(["--run", "x", "--bpb-corpus", f"a={tmp_path / 'x.txt'}", "--bpb-corpus", f"a={tmp_path / 'y.txt'}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--bpb-corpus a={tmp_path / 'y.txt'}: the name a is given twice (also a={tmp_path / 'x.txt'})" in err, err
    corpora = parse_args(["--run", "x", "--bpb-corpus", f"a={tmp_path / 'x.txt'}", "--bpb-corpus",
                          f"b={tmp_path / 'x.txt'}"]).corpora
    assert list(corpora) == ["a", "b"]
