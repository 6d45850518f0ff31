"""An interrupted base_eval continues: the finished results it keeps (core.partial.json, bpb.partial.json), when
they are reused and when recomputed, and what it says it kept. Under torchrun: test_base_eval_ranks.py."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import base_eval_fixtures  # noqa: E402
from base_eval_fixtures import _count_calls, _eval_args  # noqa: E402
from conftest import sigterm_after  # noqa: E402

tiny_run = base_eval_fixtures.tiny_run  # the fixture (module scope: one tiny trained run for this file)

REPORTS = ("core.json", "core.csv", "core.md", "bpb.json")


def test_interrupted_eval_continues_to_the_same_reports(tiny_run, tmp_path, monkeypatch, capsys):
    """SIGTERM in CORE, then in bpb: each rerun keeps what finished (never scoring it again) and the final reports
    equal those of an uninterrupted run byte for byte."""
    from nanochat import core_eval, loss_eval
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    assert main(_eval_args(root, bundle, tmp_path / "whole")) == 0
    out = tmp_path / "resumed"
    with monkeypatch.context() as m:
        sigterm_after(m, core_eval, "evaluate_task", 1)  # the first task (mc) finishes, the second is cut
        assert main(_eval_args(root, bundle, out)) == 128 + 15
    err = capsys.readouterr().err
    assert "interrupted (SIGTERM); finished results (1 core, 0 bpb) are kept in" in err and "Traceback" not in err
    assert list(json.loads((out / "core.partial.json").read_text())["items"]) == ["mc"]
    assert not (out / "core.json").exists()
    with monkeypatch.context() as m:
        tasks = _count_calls(m, core_eval, "evaluate_task")
        sigterm_after(m, loss_eval, "evaluate_bpb", 1)  # train bpb finishes, val is cut
        assert main(_eval_args(root, bundle, out)) == 128 + 15
    assert [a[3].label for a in tasks] == ["lm"]  # mc was not scored again
    assert "CORE tasks: 1 of 2 reused from" in capsys.readouterr().out
    assert list(json.loads((out / "bpb.partial.json").read_text())["items"]) == ["split train"]
    with monkeypatch.context() as m:
        tasks, bpbs = _count_calls(m, core_eval, "evaluate_task"), _count_calls(m, loss_eval, "evaluate_bpb")
        assert main(_eval_args(root, bundle, out)) == 0
    assert (len(tasks), len(bpbs)) == (0, 2)  # val and ood
    assert "bpb results: 1 of 3 reused from" in capsys.readouterr().out
    for name in REPORTS:
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(REPORTS)  # the partial files are gone


def test_changed_settings_or_fresh_recompute(tiny_run, tmp_path, monkeypatch, capsys):
    """Finished tasks are reused only under the same settings and inputs: another --dtype (a setting of the whole
    evaluation), another --max-per-task (an input of each task) or --fresh recompute every task."""
    from nanochat import core_eval
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"

    def interrupted_then(*extra) -> list:
        with monkeypatch.context() as m:
            sigterm_after(m, core_eval, "evaluate_task", 1)
            assert main(_eval_args(root, bundle, out, "--eval", "core")) == 143
        with monkeypatch.context() as m:
            tasks = _count_calls(m, core_eval, "evaluate_task")
            assert main(_eval_args(root, bundle, out, "--eval", "core", *extra)) == 0
        return [a[3].label for a in tasks]

    assert interrupted_then("--dtype", "bfloat16") == ["mc", "lm"]
    assert "computed with other settings (dtype 'float32' -> 'bfloat16'); recomputing them" in capsys.readouterr().out
    assert json.loads((out / "core.json").read_text())["dtype"] == "bfloat16"
    assert interrupted_then("--max-per-task", "2") == ["mc", "lm"]
    assert "the inputs of mc changed (max_per_task -1 -> 2); recomputing it" in capsys.readouterr().out
    assert json.loads((out / "core.json").read_text())["tasks"]["mc"]["n"] == 2
    assert interrupted_then("--fresh") == ["mc", "lm"]
    assert "--fresh: 1 finished result(s) in" in capsys.readouterr().out
    assert interrupted_then() == ["lm"]  # the same command: mc is reused
    # the code that computed the numbers is a setting too (a fix between the interrupt and the rerun)
    from nanochat import eval_resume

    real_version = eval_resume.code_version
    with monkeypatch.context() as m:
        sigterm_after(m, core_eval, "evaluate_task", 1)
        assert main(_eval_args(root, bundle, out, "--eval", "core")) == 143
    with monkeypatch.context() as m:
        m.setattr(eval_resume, "code_version", lambda: {**real_version(), "diff_sha256": "an-edit-of-the-code"})
        tasks = _count_calls(m, core_eval, "evaluate_task")
        assert main(_eval_args(root, bundle, out, "--eval", "core")) == 0
    assert [a[3].label for a in tasks] == ["mc", "lm"] and "'an-edit-of-the-code'" in capsys.readouterr().out


def test_core_follows_the_run_and_another_recorded_cap_is_not_reused(tiny_run, tmp_path, monkeypatch, capsys):
    """Without --bundle and --max-per-task a checkpoint that records neither (tiny_run's, like an imported one) is
    evaluated on the search order's bundle with every example, and the line of resolved settings says why; once
    the run records --core-max-per-task 2 (its config.json), the same command scores 2 examples per task and
    reuses no task the interrupted evaluation finished with all of them."""
    import shutil

    from nanochat import core_eval
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    run, out = tmp_path / "run", tmp_path / "o"
    shutil.copytree(root / "run", run)
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE", str(bundle))
    argv = ["--run", str(run), "--eval", "core", "--device-batch-size", "3", "--no-progress", "--device-type", "cpu",
            "--out-dir", str(out)]
    with monkeypatch.context() as m:
        sigterm_after(m, core_eval, "evaluate_task", 1)
        assert main(argv) == 143
    assert ("; CORE bundle the first found (NANOCHAT_EVAL_BUNDLE, the cache, a download) (default: the run records "
            "no bundle); examples per task all (default: the run records no --core-max-per-task); world size 1;"
            in capsys.readouterr().out)
    (run / "config.json").write_text(json.dumps({"args": {"core_max_per_task": 2}}))
    with monkeypatch.context() as m:
        tasks = _count_calls(m, core_eval, "evaluate_task")
        assert main(argv) == 0
    assert [a[3].label for a in tasks] == ["mc", "lm"]
    out_text = capsys.readouterr().out
    assert "examples per task 2 (the run's --core-max-per-task, its config.json)" in out_text
    assert "the inputs of mc changed (max_per_task -1 -> 2); recomputing it" in out_text
    core = json.loads((out / "core.json").read_text())
    assert (core["bundle"], core["max_per_task"]) == (str(bundle), 2)
    assert {t["n"] for t in core["tasks"].values()} == {2}


def test_an_evaluation_that_fails_midway_says_what_it_kept(tiny_run, tmp_path, monkeypatch, capsys):
    """E.g. another rank was stopped and this rank's collective failed: the error propagates, after a line saying
    which finished results are on disk for the rerun."""
    from nanochat import core_eval
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    real, calls = core_eval.evaluate_task, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("Connection closed by peer")
        return real(*args, **kwargs)

    monkeypatch.setattr(core_eval, "evaluate_task", failing)
    with pytest.raises(RuntimeError, match="closed by peer"):
        main(_eval_args(root, bundle, tmp_path / "o", "--eval", "core"))
    assert "base_eval: failed (RuntimeError); finished results (1 core) are kept in" in capsys.readouterr().err


def test_two_evaluations_into_one_out_dir_at_once_are_refused(tiny_run, tmp_path, capsys):
    """They would overwrite each other's partial results and reports: the second is refused naming the first."""
    from nanochat.run_dir import RunDirLock
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    out = tmp_path / "o"
    other = RunDirLock(out).acquire("--out-dir")  # another base_eval holds it
    try:
        assert main(_eval_args(root, bundle, out, "--eval", "core")) == 2
        err = capsys.readouterr().err
        assert f"--out-dir {out} is in use by another" in err and "choose another --out-dir" in err, err
    finally:
        other.release()
    assert main(_eval_args(root, bundle, out, "--eval", "core")) == 0


def test_a_finished_split_of_the_older_partial_format_is_scored_again(tiny_run, tmp_path, monkeypatch, capsys):
    """bpb.partial.json of the code before the slot balance held a split's bpb as a bare number. Outside a git
    checkout (a copy without .git) the code version cannot tell the two codes apart: the rerun must score that
    split again, not crash on the number."""
    from nanochat import eval_resume, loss_eval
    from scripts.base_eval import main

    root, _, _, bundle = tiny_run
    out, args = tmp_path / "o", _eval_args(root, bundle, tmp_path / "o", "--eval", "bpb")
    monkeypatch.setattr(eval_resume, "code_version", lambda: {"trees": None, "diff_sha256": None})
    with monkeypatch.context() as m:
        sigterm_after(m, loss_eval, "evaluate_bpb", 1)  # train bpb finishes, val is cut
        assert main(args) == 143
    partial = json.loads((out / "bpb.partial.json").read_text())
    item = partial["items"]["split train"]
    item["result"] = item["result"]["bpb"]  # as the older code wrote it, with its key
    item["key"] = {k: v for k, v in item["key"].items() if k in ("data_sha256", "eval_tokens")}
    (out / "bpb.partial.json").write_text(json.dumps(partial))
    with monkeypatch.context() as m:
        bpbs = _count_calls(m, loss_eval, "evaluate_bpb")
        assert main(args) == 0
    assert len(bpbs) == 3  # train again, val, ood
    assert json.loads((out / "bpb.json").read_text())["splits"]["train"] == item["result"]


def test_a_stop_voted_at_a_partial_write_counts_the_item_it_wrote(tmp_path, monkeypatch):
    """With several ranks, a signal latched on any rank ends the item's write step with Interrupted once rank 0's
    write has succeeded: the item is on disk, so the "kept" line must count it."""
    import signal

    from nanochat import eval_resume

    calls = []

    def rank0_decides(fn):  # as with 2 ranks: fn runs (on rank 0), then a signal latched elsewhere stops the step
        calls.append(fn)
        value = fn()
        if len(calls) == 2:  # the write, after the reuse decision
            raise eval_resume.Interrupted(signal.SIGTERM)
        return value

    monkeypatch.setattr(eval_resume, "is_dist", lambda: True)
    monkeypatch.setattr(eval_resume, "rank0_decides", rank0_decides)
    store = eval_resume.FinishedResults(tmp_path / "core.partial.json", {"s": 1})
    with pytest.raises(eval_resume.Interrupted):
        store.get_or_run("arc_easy", lambda: {"k": 1}, lambda: {"acc": 0.5})
    on_disk = json.loads((tmp_path / "core.partial.json").read_text())["items"]
    assert list(on_disk) == list(store.items) == ["arc_easy"]
