"""speedrun.sh and a run continued by hand with other learning rates (--resume-override-lr, a non-finite stop's
advice) that stopped again before completing: speedrun_preflight gives the LR flags its --resume auto continues it
with, from the checkpoint that resume takes; a run started with other LRs stays refused."""

import json

from test_train_e2e import TINY as TINY_MODEL

from nanochat import checkpoint as ckpt
from nanochat.train_args import parse_args
from scripts import base_train
from scripts import speedrun_preflight as pre

TINY = [*TINY_MODEL, "--device-batch-size", "4", "--total-batch-size", "256", "--num-iterations", "4",
        "--save-every", "2"]
ONE_STEP = ["--max-wall-time-seconds", "1e-6"]  # at least one step per process: a stop after exactly one (saved)


def test_a_run_continued_by_hand_with_other_lrs_and_stopped_again_is_continued_with_them(tmp_path, capsys):
    """Measured before the fix (dev/LOG.md, session 30): the run resumed by hand with --resume N --resume-override-lr
    --matrix-lr (half) and stopped again (a wall-time limit here; Ctrl-C, SIGTERM, a requeue alike) was sent by
    speedrun.sh to base_train --resume auto with speedrun's LRs, which refuses it (exit 2) on every start. The check
    now gives the recorded LRs, base_train --resume auto accepts them and the run completes; it is then done."""
    run = tmp_path / "run"
    flags = [*TINY, "--run-dir", str(run), "--resume", "auto"]  # speedrun's
    matrix = parse_args(flags).matrix_lr
    assert base_train.main([*flags, *ONE_STEP]) == 0  # stopped at step 1
    hand = [*TINY, "--run-dir", str(run), "--resume", "1", "--resume-override-lr", "--matrix-lr", str(matrix / 2)]
    assert base_train.main([*hand, *ONE_STEP]) == 0  # stopped again at step 2, its checkpoint with the new LR
    capsys.readouterr()
    state = pre.demo_state(flags)
    assert state == f"train,--matrix-lr={matrix / 2}", state
    assert (f"[speedrun] {run}: learning rates overridden by hand (--resume-override-lr): --matrix-lr {matrix} -> "
            f"{matrix / 2} from step 1; continuing with them\n") in capsys.readouterr().err
    # the GPU path's check: the same word on stdout, exit 1 (not done)
    assert pre.main(["done", str(run), "--", *flags]) == 1
    assert capsys.readouterr().out == f"{state}\n"
    # base_train's own rule holds: a plain --resume auto with other LRs is refused
    assert base_train.main(flags) == 2
    assert f"--matrix-lr {matrix / 2} (checkpoint) != {matrix}" in capsys.readouterr().err
    assert base_train.main([*flags, *state.split(",")[1:]]) == 0  # speedrun.sh's command: accepted, completed
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop_reason"], summary["step"]) == ("completed", 4)
    config = json.loads((run / "config.json").read_text())
    assert config["lr_overrides"] == [{"step": 1, "changes": {"matrix_lr": {"checkpoint": matrix, "now": matrix / 2}}}]
    capsys.readouterr()
    assert pre.main(["done", str(run), "--", *flags]) == 0 and capsys.readouterr().out == "done\n"


def write_checkpoint(run, step, args, overrides):
    """A checkpoint's meta.json as base_train writes its recorded config (only what the checks read; also
    test_speedrun's)."""
    d = ckpt.step_dir(run, step)
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"model_config": {}, "config": {"args": args, "lr_overrides": overrides}},
                                            default=str))


def test_the_lrs_come_from_the_checkpoint_the_resume_takes_and_only_when_every_difference_is_an_override(tmp_path,
                                                                                                        capsys):
    run = tmp_path / "run"
    flags = ["--depth", "4", "--num-iterations", "20", "--run-dir", str(run), "--resume", "auto"]
    recipe = vars(parse_args(flags))
    matrix, embedding = recipe["matrix_lr"], recipe["embedding_lr"]
    halved = {"step": 8, "changes": {"matrix_lr": {"checkpoint": matrix, "now": matrix / 2},
                                     "embedding_lr": {"checkpoint": embedding, "now": embedding / 2}}}
    again = {"step": 12, "changes": {"matrix_lr": {"checkpoint": matrix / 2, "now": matrix / 4}}}
    # stopped after the override, before its first save: the checkpoint (step 8) holds speedrun's LRs, which
    # --resume auto takes as they are, whatever config.json says
    write_checkpoint(run, 8, recipe, [])
    (run / "config.json").write_text(json.dumps({"args": {**recipe, "matrix_lr": matrix / 2},
                                                 "lr_overrides": [halved]}))
    assert pre.demo_state(flags) == "train"
    # halved at step 8, the matrix LR again at 12 (the advice followed twice): the last values, both LRs
    write_checkpoint(run, 14, {**recipe, "matrix_lr": matrix / 4, "embedding_lr": embedding / 2}, [halved, again])
    assert pre.demo_state(flags) == f"train,--embedding-lr={embedding / 2},--matrix-lr={matrix / 4}"
    assert (f"--matrix-lr {matrix} -> {matrix / 2} from step 8, --embedding-lr {embedding} -> {embedding / 2} from "
            f"step 8, --matrix-lr {matrix / 2} -> {matrix / 4} from step 12; continuing with them") in \
        capsys.readouterr().err
    # one LR no recorded override explains: base_train refuses it whatever; no half-explained command
    write_checkpoint(run, 16, {**recipe, "matrix_lr": matrix / 4, "embedding_lr": embedding / 3}, [halved, again])
    assert pre.demo_state(flags) == "train"
    # started with other LRs: without an override, or the first one made from another value
    write_checkpoint(run, 17, {**recipe, "matrix_lr": matrix / 2}, [])
    assert pre.demo_state(flags) == "train"
    other = {"step": 18, "changes": {"matrix_lr": {"checkpoint": matrix * 2, "now": matrix / 2}}}
    write_checkpoint(run, 18, {**recipe, "matrix_lr": matrix / 2}, [other])
    assert pre.demo_state(flags) == "train"
    assert "continuing" not in capsys.readouterr().err
    # a corrupt meta.json: not done, no flags; base_train --resume says what it finds
    (ckpt.step_dir(run, 18) / "meta.json").write_text("{")
    assert pre.demo_state(flags) == "train"
