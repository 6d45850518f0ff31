"""Run one paper table row (all its seeds) from a config file.

    python -m scripts.run configs/d12/mome_c1_m6.toml --plan
    python -m scripts.run configs/d12/mome_c1_m6.toml --seeds 42,43 --nproc-per-node 8 --device-batch-size 16
    python -m scripts.run configs/mini/base.toml -- --num-iterations 50      # extra base_train flags after --

Outputs go to runs/<table>/<row>/seed<N>/, <row> the config's [row] name (override the root with --runs-root): a
copy of a shipped row config that keeps its [row] table and name but changes its [train] is refused, naming both
files (its seeds would mix with the row's); give the copy a [row] name of its own. A finished run (summary.json with
stop_reason "completed") is never overwritten; an unfinished one (interrupted, stopped at its wall-time limit,
crashed, killed) is continued with base_train --resume auto (from its latest checkpoint, or from step 0 when it
has none). Seeds run one after another and the runner stops at the first failure or unfinished seed (a
wall-time stop, ``-- --max-wall-time-seconds S``, or a signal that reached base_train alone), printing how to
continue it (the same command, with --resume auto in place of a ``-- --overwrite`` or ``-- --resume STEP``,
which replace ``--resume auto``) and the log path. Relative paths (the config, --runs-root, and --data-dir,
--tokenizer-dir, --bundle, --init-from after ``--``) are the caller's: base_train gets them absolute. A seed whose
checkpoint was trained with other flags is not continued: base_train names the runner command that starts it
afresh (``--seeds N ... -- ... --overwrite``, its paths absolute). Before the first seed starts, and with ``--plan``,
each seed's base_train flags are checked with base_train's own parser (and its model config, where the row pins
--vocab-size): a bad [train] key or value, or a bad flag after ``--``, stops the runner naming the file and the
key. ``--plan`` prints the exact commands and exits without touching data or devices (on a Python without torch,
which the parser needs, it plans unchecked and says so). Hardware overrides keep the total batch size fixed (the
gradient-accumulation count changes instead); batch flags given to base_train after ``--`` are checked the same way.
"""

import argparse
import contextlib
import ctypes
import io
import os
import shlex
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

from nanochat.cli_types import SEED_MAX, dest_name, is_seed
from nanochat.hand_command import resume_value_at
from nanochat.lost_output import point_at_devnull
from nanochat.row_config import REPO, load_row_config, shipped_row, train_differences
from nanochat.terminal import replace_unencodable_output

# base_train's refused --resume reads this: its own advice (drop --resume, add --overwrite) cannot be followed under
# this runner, which adds --resume auto itself; the runner's command that starts the seed afresh is named instead
AFRESH_ENV = "NANOCHAT_RUN_AFRESH_COMMAND"


def parse_seeds(text: str) -> list[int]:
    wrong = f"--seeds must be a comma-separated list of integers in [0, {SEED_MAX}] (got {text!r})"
    try:
        seeds = [int(s) for s in text.split(",") if s.strip() != ""]
    except ValueError:
        raise ValueError(wrong) from None
    if not seeds or not all(map(is_seed, seeds)):  # each is a base_train --seed (cli_types.seed_int)
        raise ValueError(wrong)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds has duplicates: {text!r}")
    return seeds


def row_seeds(cfg: dict) -> list[int]:
    """The row's default seeds ([row] seeds), held to ``parse_seeds``' rule here: base_train would refuse a bad one
    only when its turn came, after the seeds before it had trained, and a string ran as its digits."""
    seeds = cfg["row"]["seeds"]
    if (not isinstance(seeds, list) or not seeds or any(type(s) is not int or not is_seed(s) for s in seeds)
            or len(set(seeds)) != len(seeds)):
        raise ValueError(f"config {cfg['path']}: [row] seeds must be a list of distinct integers in [0, {SEED_MAX}] "
                         f"(got {seeds!r}); fix the file or pass --seeds")
    return seeds


def check_hardware(train: dict, nproc: int, device_batch: int) -> int:
    """Return grad-accum steps, or raise if the fixed total batch cannot be split this way."""
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be >= 1 (got {nproc})")
    if device_batch < 1:
        raise ValueError(f"--device-batch-size must be >= 1 (got {device_batch})")
    total, seq = train["total-batch-size"], train["max-seq-len"]  # integers: row_config._check_count
    per_step = nproc * device_batch * seq
    if total % per_step:
        raise ValueError(
            f"total batch {total} tokens is not divisible by nproc {nproc} x device batch {device_batch} x seq {seq} "
            f"= {per_step}; pick --device-batch-size / --nproc-per-node so that it divides"
        )
    return total // per_step


BATCH_FLAGS = ("--total-batch-size", "--max-seq-len", "--device-batch-size")


def split_batch_flags(extra: list[str]) -> tuple[dict, list[str]]:
    """The batch flags among the base_train flags after ``--`` ({config key: value}) and the other flags; the
    runner checks the batch split with them, as base_train will see it."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in BATCH_FLAGS:
        parser.add_argument(flag, type=int)
    known, rest = parser.parse_known_args(extra)
    values = {flag[2:]: getattr(known, dest_name(flag)) for flag in BATCH_FLAGS}
    return {key: value for key, value in values.items() if value is not None}, rest


# base_train flags that take a path (--init-from: RUN_DIR[:STEP], whose ":STEP" suffix an absolute prefix keeps)
PATH_FLAGS = ("--data-dir", "--tokenizer-dir", "--bundle", "--init-from")
NOT_PATHS = {"--bundle": "subset"}  # a name the flag takes besides paths (the shipped CORE subset)
# the flags the runner gives base_train itself, with what sets them instead: base_train takes the last of a
# repeated flag, so one after ``--`` would replace the runner's (a seed 7 trained into seed42/, say)
RUNNER_SET = {"--config": "use the config instead", "--seed": "use --seeds instead",
              "--run-dir": "use --runs-root instead", "--run-name": "it is <table>_<row>_seed<N>"}


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))  # no shell expands the ~ of --flag=~/x


def _flag_path(flag: str, value: str) -> str:
    """A PATH_FLAGS value made absolute, but an empty one or a name the flag takes (NOT_PATHS)."""
    return value if not value or NOT_PATHS.get(flag) == value else _absolute(value)


def absolute_paths(extra: list[str]) -> list[str]:
    """The base_train flags after ``--`` with each relative path of PATH_FLAGS made absolute against this process's
    directory (the user's): base_train runs from the repo root. A flag the runner sets itself is refused."""
    out, flag_of_next = [], None
    for token in extra:
        name, eq, value = token.partition("=")
        if token.startswith("--") and name in RUNNER_SET:
            raise ValueError(f"{name} after --: the runner sets it for each seed; {RUNNER_SET[name]}")
        if flag_of_next is not None:
            token, flag_of_next = _flag_path(flag_of_next, token), None
        elif name in PATH_FLAGS and eq:
            token = f"{name}={_flag_path(name, value)}"
        elif token in PATH_FLAGS:
            flag_of_next = token
        out.append(token)
    return out


def start_flags(extra: list[str]) -> list[str]:
    """The user's --resume (with its value, if given) and --overwrite among the base_train flags after ``--``, as
    typed: they say how a seed starts, and the runner then adds no --resume auto of its own."""
    return [f for i, f in enumerate(extra) if f.split("=")[0] in ("--resume", "--overwrite")
            or resume_value_at(extra, i)]


def how_to_continue(extra: list[str]) -> str:
    """How an unfinished seed continues, for the user's flags after ``--``: the same command, unless their own
    --overwrite (which would delete the seed), --resume STEP (which would set its later checkpoints aside) or --resume
    [latest] (which refuses the row's later seeds, without a checkpoint yet) is in it; then --resume auto in their
    place: it continues this seed and starts the later ones."""
    typed, same = start_flags(extra), "by re-running the same command"
    if typed in ([], ["--resume", "auto"], ["--resume=auto"]):
        return same
    return f"{same} with --resume auto in place of {' '.join(typed)} after --"


def build_commands(cfg: dict, seeds: list[int], nproc: int, device_batch: int, runs_root: Path,
                   extra: list[str]) -> list[tuple[int, Path, list[str]]]:
    """One command per seed; ``--resume auto`` (continue an unfinished run) unless ``extra`` says how to start."""
    row = cfg["row"]
    out = []
    start = [] if start_flags(extra) else ["--resume", "auto"]
    for seed in seeds:
        run_dir = runs_root / row["table"] / row["name"] / f"seed{seed}"
        train_cmd = ["-m", "scripts.base_train", "--config", cfg["path"], "--seed", str(seed),
                     "--device-batch-size", str(device_batch), "--run-dir", str(run_dir),
                     "--run-name", f"{row['table']}_{row['name']}_seed{seed}", *extra, *start]
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *train_cmd]
        else:
            cmd = [sys.executable, *train_cmd]
        out.append((seed, run_dir, cmd))
    return out


def check_own_row(cfg: dict, runs_root: Path) -> None:
    """Refuse a copy of a shipped row config that keeps the row's [row] table and name but trains otherwise (its
    [train] differs): its seeds would go to the row's runs/<table>/<name>/ folder among the row's own, where a
    finished one would stand for the row's seed (and the row's own config would then skip it as finished). A copy
    that trains what the row trains (only its [row] seeds or notes changed) runs the row's seeds, in its folder."""
    shipped = shipped_row(cfg)
    if shipped is None or not (diffs := train_differences(cfg, shipped)):
        return
    table, name = cfg["row"]["table"], cfg["row"]["name"]
    raise ValueError(f"config {cfg['path']} is row {table}/{name}, the row of {shipped['path']}, with another [train] "
                     f"({', '.join(diffs)}): its seeds would train into {runs_root / table / name}/ among that row's. "
                     f"Give the copy a [row] name of its own (its seeds then go to {runs_root / table}/<name>/), or "
                     "run the row's own config with the changed flags after --")


def check_train_flags(commands: list[tuple[int, Path, list[str]]]) -> None:
    """Check each seed's base_train argv as base_train will, here and before any seed starts: a bad [train] key or
    value (and a bad flag after ``--``) is then refused by --plan, and not only when base_train starts, after the
    earlier seeds have trained. Its parse (the checks of the parsed flags included) and, for a row that pins
    --vocab-size (the shipped rows do), its model config (memory and geometry flags: no model is built, no data or
    tokenizer read); ``--dry-run`` is added to the checked argv, which then skips the device probe (a CUDA row is
    planned anywhere; base_train probes its device itself) and only warns of a missing slot map. Raises ValueError
    with base_train's message (which names the --config file and its key). A Python without torch (base_train's
    parser needs it) plans unchecked, and says so. Nothing is written and the commands are not changed."""
    try:
        from nanochat.train_args import model_config, parse_args
    except ModuleNotFoundError as e:
        if (e.name or "nanochat").split(".")[0] in ("nanochat", "scripts"):  # a broken checkout, not a bare Python
            raise
        print(f"[run] note: base_train's flags are not checked: this Python has no {e.name} (base_train's parser "
              "needs it)", file=sys.stderr)
        return
    for seed, _, cmd in commands:
        argv = cmd[cmd.index("scripts.base_train") + 1:]
        said = io.StringIO()
        try:
            # argparse's usage and error are read from stderr; a warning is base_train's to give when it runs
            with contextlib.redirect_stderr(said), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                args = parse_args([*argv, "--dry-run"])
                if args.vocab_size is not None:  # otherwise the tokenizer's: base_train's preflight checks it
                    model_config(args, args.vocab_size)
        except SystemExit as e:
            if not e.code:  # a --help after --, printed once here
                return
            message = said.getvalue().strip().split(": error: ", 1)[-1]
        except ValueError as e:  # base_train's preflight prints these as they are
            message = str(e)
        else:
            continue
        raise ValueError(f"{message} (base_train's flags of seed {seed}; no seed was started)")


def afresh_command(config: str, extra: list[str], seed: int, runner_flags: list[str]) -> str | None:
    """The runner command that starts ``seed`` afresh (--overwrite after ``--``), for base_train to name when it
    refuses the --resume auto the runner added; None when the user's flags after ``--`` say how to start: base_train's
    own advice then applies to them as written. ``config`` is as the user typed it, ``runner_flags`` as
    ``typed_runner_flags`` gives them, ``extra`` the flags after ``--`` before the runner reformatted any. Its paths
    are absolute (the user's relative ones resolved as the runner resolved them): the command is printed into the
    seed's train.log too, and must delete the seed it names from whatever directory it is run."""
    if start_flags(extra):
        return None
    return shlex.join(["python", "-m", "scripts.run", _absolute(config), "--seeds", str(seed), *runner_flags, "--",
                       *absolute_paths(extra), "--overwrite"])


def say(text: str) -> None:
    """Write ``text`` (the runner's line, or its child's echoed) to stdout now. A stdout that is gone (EIO: the
    terminal closed; EPIPE: a killed `| tee`) is pointed at /dev/null: the child, its log and the next seeds go
    on, and neither a later line nor the interpreter's last flush raises. A stdout closed from the start (None:
    `>&-`) is skipped."""
    if sys.stdout is None:
        return
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError:
        point_at_devnull(sys.stdout)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent():
    """A ``preexec_fn`` that makes the child get SIGTERM when this runner dies, even by SIGKILL (no handler of
    ours runs then): otherwise base_train trains on unseen until its next line hits the dead pipe, and is killed
    by it mid-step instead of saving. None (nothing to do) off Linux, which has no PR_SET_PDEATHSIG, and off the
    main thread: the signal fires when the *thread* that forked exits, which must not be before the runner."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it
    parent = os.getpid()

    def preexec():
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the runner died before prctl: no signal will come, so stop as it would
            os._exit(128 + signal.SIGTERM)
    return preexec


def fresh_summary(run_dir: Path, before: dict | None) -> dict | None:
    """run_dir's summary.json unless it is ``before`` (read before the launch: not rewritten since), unreadable or
    absent."""
    from nanochat.report import read_json

    try:
        summary = read_json(run_dir / "summary.json")
    except ValueError:  # a damaged file says nothing reliable
        return None
    return None if summary == before else summary


def failure_message(seed: int, code: int, summary: dict | None, how: str, log_path: Path) -> str:
    """The runner's last line when base_train exited ``code`` != 0: what this launch's summary.json (None: it wrote
    none, e.g. bad flags before the first step) says of the stop, and the way on where the runner has one."""
    head = f"[run] seed {seed} failed with exit code {code}"
    if not summary or not summary.get("stop_reason"):
        return f"{head}; see {log_path}"
    reason, error = summary["stop_reason"], summary.get("error")
    # a stop by an error names its last checkpoint; the others (a signal: torchrun's exit code) saved their step's
    last = summary["last_checkpoint"] if "last_checkpoint" in summary else summary.get("step")
    said = f"{head}: {reason} at step {summary.get('step')}" + (f" ({error})" if error else "")
    if reason.startswith("nonfinite"):  # the same command would meet the same NaN: base_train names lower LRs
        return (f"{said}; base_train's message in the log names the last good checkpoint and the lower learning "
                f"rates to continue with (--resume-override-lr and the LR flags, after --). Log: {log_path}")
    where = f"its checkpoint of step {last}" if last is not None else "the start (no checkpoint was saved)"
    fixed = "once the cause is fixed, " if error else ""  # e.g. torchrun's own exit code after a signal stop
    step = summary.get("step")
    if reason == "error" and last is not None and step is not None and step < last:
        # a failed rewind (--resume K below the latest): --resume auto would take the latest, dropping the rewind
        return (f"{said}; {fixed}it continues from its checkpoint of step {step} by re-running the same command (its "
                f"--resume {step} kept; the later checkpoints, up to step {last}, are untouched). Log: {log_path}")
    return f"{said}; {fixed}it continues from {where} {how}. Log: {log_path}"


def run_one(seed: int, run_dir: Path, cmd: list[str], afresh: str | None = None,
            how: str = "by re-running the same command") -> None:
    """Train one seed with ``cmd``; ``afresh`` (``afresh_command``) is named by base_train if it refuses the resume,
    ``how`` (``how_to_continue``) the way on when the seed stops unfinished."""
    from nanochat.report import read_json, unfinished

    if (run_dir / "summary.json").is_file() and unfinished(run_dir) is None:
        say(f"[run] seed {seed}: finished run in {run_dir} (summary.json: completed), not overwriting\n")
        return
    if run_dir.is_dir() and any(run_dir.iterdir()) and cmd[-2:] == ["--resume", "auto"]:
        # an interrupted (SIGTERM) run has a summary.json too: it is continued
        say(f"[run] seed {seed}: continuing the unfinished run in {run_dir} (--resume auto)\n")
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "train.log"
    (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n", encoding="utf-8")
    say(f"[run] seed {seed}: {shlex.join(cmd)}\n[run] log: {log_path}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if "torch.distributed.run" in cmd:
        env.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank unless the user says otherwise
    if afresh is None:
        env.pop(AFRESH_ENV, None)  # the user's own --resume/--overwrite: base_train's advice names their flags
    else:
        env[AFRESH_ENV] = afresh
    before = fresh_summary(run_dir, None)  # a summary.json of an earlier launch is no account of this one
    with open(log_path, "a", encoding="utf-8") as log:
        # The child runs in a session of its own, so a terminal's Ctrl-C reaches only this runner, which forwards
        # each SIGINT/SIGTERM it gets exactly once: base_train saves a checkpoint on the first and aborts only on
        # a later Ctrl-C. (In one process group the child would get the terminal's SIGINT plus a forwarded one.)
        # A runner that is SIGKILLed forwards nothing: die_with_parent tells the child then, on Linux.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent())
        # Its output as written: a progress bar's "\r" stays one (universal newlines made each refresh a line of its
        # own, on the terminal and in the log), and a byte that does not decode (a C library's or a compiler's
        # message) is replaced (raised, it killed the runner, whose death stops the child).
        output = io.TextIOWrapper(proc.stdout, errors="replace", newline="")
        received = []

        def forward(signum, frame):
            received.append(signum)
            # a hang-up (the terminal or ssh session closed) never reaches the child in its own session: it is
            # stopped as by SIGTERM, so it saves its checkpoint instead of dying at its next line to a dead pipe.
            # Slurm's pre-emption notice (SIGUSR1) too: torchrun forwards SIGTERM to its workers, a SIGUSR1 kills it
            proc.send_signal(signal.SIGTERM if signum in (signal.SIGHUP, signal.SIGUSR1) else signum)

        # SIGHUP only where it is not ignored: under nohup the run is meant to outlive the terminal
        hangup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
        previous = {sig: signal.signal(sig, forward)
                    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, *hangup)}
        try:
            for line in output:  # until the child exits: its "saved checkpoint" lines reach the log too
                say(line)
                log.write(line)
                log.flush()  # `tail -f train.log` follows the run live
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if received:
        raise SystemExit(f"[run] interrupted (child exit code {code}); seed {seed} is resumed {how}. Log: {log_path}")
    if code != 0:
        raise SystemExit(failure_message(seed, code, fresh_summary(run_dir, before), how, log_path))
    summary = read_json(run_dir / "summary.json", {})
    if summary.get("stop_reason") == "wall_time_limit":  # base_train exits 0, but the seed is not finished
        raise SystemExit(f"[run] seed {seed} stopped at its wall-time limit (--max-wall-time-seconds) at step "
                         f"{summary.get('step')} of {summary.get('num_iterations')}; it continues from its checkpoint "
                         f"{how}. Log: {log_path}")
    if summary and summary.get("stop_reason") != "completed":  # e.g. a signal that reached base_train alone (not
        # this runner): it saved and exited 0 (no summary.json after exit 0: a --dry-run)
        raise SystemExit(f"[run] seed {seed} is not finished ({unfinished(run_dir)}); it continues from its "
                         f"checkpoint {how}. Log: {log_path}")


def typed_runner_flags(args, parser) -> list[str]:
    """The runner's flags besides the config and --seeds, as given, --runs-root absolute (for ``afresh_command``)."""
    given = [("--nproc-per-node", args.nproc_per_node), ("--device-batch-size", args.device_batch_size),
             ("--runs-root", None if args.runs_root == parser.get_default("runs_root") else _absolute(args.runs_root))]
    return [token for flag, value in given if value is not None for token in (flag, str(value))]


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a configs/<table>/<row>.toml file")
    p.add_argument("--plan", action="store_true",
                   help="check the flags, print the commands and exit (no data, no devices)")
    p.add_argument("--seeds", default=None, help="comma list (default: the row's seeds)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="GPUs/processes (default: the row's)")
    p.add_argument("--device-batch-size", type=int, default=None, help="rows per micro-batch (total batch stays fixed)")
    p.add_argument("--runs-root", default=str(REPO / "runs"), help="root of the runs/<table>/<row>/seed<N> tree")
    args = p.parse_args(argv)
    try:
        cfg = load_row_config(args.config)
        seeds = parse_seeds(args.seeds) if args.seeds is not None else row_seeds(cfg)
        nproc = args.nproc_per_node if args.nproc_per_node is not None else cfg["row"]["nproc_per_node"]
        typed_extra = extra
        batch, extra = split_batch_flags(absolute_paths(extra))
        if "device-batch-size" in batch and args.device_batch_size is not None:
            raise ValueError("--device-batch-size is given both to the runner and after --; give it once")
        device_batch = batch.pop("device-batch-size", args.device_batch_size)
        if device_batch is None:
            device_batch = cfg["train"]["device-batch-size"]
        accum = check_hardware({**cfg["train"], **batch}, nproc, device_batch)
        extra = [*(f"--{key}={value}" for key, value in batch.items()), *extra]
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    # resolved here, once, as the afresh command resolves it: base_train runs from the repo root, the user may not
    runs_root = Path(_absolute(args.runs_root))
    commands = build_commands(cfg, seeds, nproc, device_batch, runs_root, extra)
    try:
        check_train_flags(commands)
        check_own_row(cfg, runs_root)  # after the flags: a copy's bad key is named as the row's would be
    except ValueError as e:
        p.error(str(e))
    if args.plan:
        say(f"# {cfg['row']['table']}/{cfg['row']['name']}: {len(seeds)} seed(s), nproc {nproc}, "
            f"device batch {device_batch}, grad accum {accum}\n")
        for _, _, cmd in commands:
            say(shlex.join(cmd) + "\n")
        return
    runner_flags = typed_runner_flags(args, p)
    for seed, run_dir, cmd in commands:
        run_one(seed, run_dir, cmd, afresh_command(args.config, typed_extra, seed, runner_flags),
                how_to_continue(typed_extra))
    say(f"[run] done: {len(commands)} seed(s) of {cfg['row']['table']}/{cfg['row']['name']}\n")


if __name__ == "__main__":
    replace_unencodable_output()
    main()
