"""scripts/setup_env.sh reuses .venv when it is what its last successful install left (the stamp), and installs
otherwise. It runs here for real on a copy of the checkout, with a fake pip: `python3 -m venv` makes a real venv
(without pip) and puts a `pip` module in it that logs each call, "installs" torch and mome-nanochat as a module and
dist-info the venv's importlib.metadata lists, and on request fails or hangs mid-install (no network, seconds)."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from test_shell_locks import venv_lock

STAMP = Path(".venv/.setup_env.stamp")
FAKE_PIP = r'''
import os, sys, sysconfig, time
from pathlib import Path
args = sys.argv[1:]
with open(os.environ["FAKE_PIP_LOG"], "a") as f:
    f.write(" ".join(args) + "\n")
site = Path(sysconfig.get_paths()["purelib"])
def dist(name, version):
    (site / f"{name}-{version}.dist-info").mkdir(exist_ok=True)
    (site / f"{name}-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                                                 f"Version: {version}\n")
if args[0] == "--version":
    print("pip 0 (fake)")
elif args[0] == "download":
    sys.exit(1)  # no local torch wheel: the script takes the PyTorch CPU index
elif "-e" in args:
    if os.environ.get("FAKE_PIP") == "slow":
        Path(os.environ["FAKE_PIP_LOG"] + ".slow").write_text(str(os.getpid()))
        time.sleep(60)
    if os.environ.get("FAKE_PIP") == "hold":  # until the test releases it
        Path(os.environ["FAKE_PIP_LOG"] + ".held").touch()
        for _ in range(1200):
            if Path(os.environ["FAKE_PIP_LOG"] + ".release").exists():
                break
            time.sleep(0.05)
    if os.environ.get("FAKE_PIP") == "leave":  # a child that keeps its descriptors and outlives pip (a daemon)
        import subprocess
        left = subprocess.Popen(["sleep", "600"], close_fds=False, start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        Path(os.environ["FAKE_PIP_LOG"] + ".left").write_text(str(left.pid))
    if os.environ.get("FAKE_PIP") == "fail":
        sys.exit("ERROR: No matching distribution found for numpy>=1.26 (fake)")
    dist("mome_nanochat", "0.1.0")
else:
    version = next(a for a in args if a.startswith("torch==")).split("==")[1] + "+cpu"
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n"
                                               "class cuda:\n    is_available = staticmethod(lambda: False)\n")
    dist("torch", version)
'''


def write_exe(path: Path, text: str):
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def checkout(tmp_path):
    """A checkout (setup_env.sh, pyproject.toml) with no .venv, as a fresh clone has, and its environment."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / "scripts").mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(REPO / "scripts" / "setup_env.sh", repo / "scripts")
    shutil.copy(REPO / "scripts" / "one_at_a_time.sh", repo / "scripts")
    shutil.copy(REPO / "pyproject.toml", repo)
    (tmp_path / "fake_pip.py").write_text(FAKE_PIP)
    write_exe(bin_dir / "python3", f'''#!/bin/sh
[ "$1 $2" = "-m venv" ] || {{ echo "fake python3: only -m venv (got $*)" >&2; exit 99; }}
"{sys.executable}" -m venv --without-pip "$3" || exit
site="$("$3/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir "$site/pip" && : >"$site/pip/__init__.py" && cp "{tmp_path / 'fake_pip.py'}" "$site/pip/__main__.py"
''')
    write_exe(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'NVIDIA-SMI has failed (fake: no driver)'; exit 9\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(bin_dir / "python3"),
           "FAKE_PIP_LOG": str(tmp_path / "pip.log")}
    for name in ("SETUP_REINSTALL", "TORCH_VERSION", "FAKE_PIP", "VIRTUAL_ENV"):
        env.pop(name, None)
    return repo, env


def setup(repo: Path, env: dict, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "scripts" / "setup_env.sh"), *args], env={**env, **extra},
                          capture_output=True, text=True, timeout=120)


def pip_calls(env: dict) -> list[str]:
    log = Path(env["FAKE_PIP_LOG"])
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)  # each check sees the calls since the last one
    return [c for c in calls if c != "--version"]


def installed(repo: Path, env: dict) -> subprocess.CompletedProcess:
    """A first, full install, checked: torch and the package installed, then the stamp."""
    r = setup(repo, env)
    assert r.returncode == 0, r.stderr
    assert "[setup] no GPU: installing torch==2.13.0 from the PyTorch CPU index" in r.stdout
    assert "[setup] torch 2.13.0+cpu, cuda available: False" in r.stdout and "reusing" not in r.stdout
    calls = pip_calls(env)
    assert calls[-1] == "install -q -e .[dev]" and calls[-2].startswith("install -q torch==2.13.0 --index-url")
    assert [line.split(" ")[0] for line in (repo / STAMP).read_text().splitlines()] == \
        ["checkout", "torch", "scripts/setup_env.sh", "pyproject.toml", "python", "packages"]
    return r


def reused(repo: Path, env: dict, **extra: str):
    r = setup(repo, env, **extra)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("[setup] reusing .venv: unchanged since its last install (.venv/.setup_env.stamp)")
    assert "--reinstall' (SETUP_REINSTALL=1 for speedrun.sh and test.sh) installs again" in r.stdout
    assert pip_calls(env) == []


def test_a_second_run_reuses_the_venv(checkout):
    repo, env = checkout
    installed(repo, env)
    stamp = (repo / STAMP).read_text()
    assert f"checkout {repo}\n" in stamp and "torch 2.13.0 cpu build\n" in stamp
    reused(repo, env)
    reused(repo, env, PYTHONPATH=str(repo))  # a checkout on PYTHONPATH is not a change of the venv
    assert (repo / STAMP).read_text() == stamp


def edit_pyproject(repo, env):
    path = repo / "pyproject.toml"
    path.write_text(path.read_text().replace('"pyyaml>=6",', '"pyyaml>=6",\n    "rich>=13",'))
    return {}


def remove_package(repo, env):
    shutil.rmtree(next(repo.glob(".venv/lib/python*/site-packages/mome_nanochat-0.1.0.dist-info")))
    return {}


def edit_script(repo, env):
    with open(repo / "scripts" / "setup_env.sh", "a") as f:
        f.write("# edited\n")
    return {}


def gpu_appears(repo, env):
    write_exe(Path(env["PYTHON"]).parent / "nvidia-smi", "#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n")
    return {}


@pytest.mark.parametrize("change,what", [
    (edit_pyproject, "pyproject.toml"), (edit_script, "scripts/setup_env.sh"), (remove_package, "packages"),
    (gpu_appears, "torch"), (lambda repo, env: {"TORCH_VERSION": "2.14.1"}, "torch"),
    (lambda repo, env: {"PYTHON": "unused: .venv exists"}, None)])
def test_a_change_installs_again_and_the_next_run_reuses(checkout, change, what):
    repo, env = checkout
    installed(repo, env)
    env = {**env, **change(repo, env)}
    if what is None:  # the interpreter that would make a new .venv: the existing one is kept, as before the stamp
        reused(repo, env)
        return
    r = setup(repo, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"[setup] .venv differs from its last install ({what}): installing\n"), r.stdout
    assert pip_calls(env) == ["install -q -e .[dev]"]  # torch is kept (an importable torch always was)
    assert ("kept the torch .venv already had, not torch==2.14.1: rm -rf .venv" in r.stdout) == \
        (env.get("TORCH_VERSION") == "2.14.1")
    reused(repo, env)


def test_a_moved_checkout_installs_again(checkout, tmp_path):
    """The editable install points at the checkout: a copy elsewhere (with its .venv) must not reuse it."""
    repo, env = checkout
    installed(repo, env)
    moved = tmp_path / "moved"
    shutil.copytree(repo, moved, symlinks=True)
    r = setup(moved, env)
    assert r.returncode == 0 and "differs from its last install (checkout)" in r.stdout, r.stderr
    assert pip_calls(env) == ["install -q -e .[dev]"]
    reused(moved, env)


@pytest.mark.parametrize("how", [["--reinstall"], {"SETUP_REINSTALL": "1"}])
def test_a_forced_reinstall(checkout, how):
    repo, env = checkout
    installed(repo, env)
    args, extra = (how, {}) if isinstance(how, list) else ([], how)
    r = setup(repo, env, *args, **extra)
    assert r.returncode == 0 and "reusing" not in r.stdout and "differs" not in r.stdout, r.stderr
    assert r.stdout.startswith("[setup] installing (asked to)\n") and pip_calls(env) == ["install -q -e .[dev]"]
    reused(repo, env)


def test_a_failed_install_leaves_no_stamp(checkout):
    """A failed install after a successful one: the next run must not take the old stamp for a valid one (the
    inputs are back as the stamp has them) and installs."""
    repo, env = checkout
    r = setup(repo, env, FAKE_PIP="fail")
    assert r.returncode != 0 and "No matching distribution" in r.stderr
    assert not (repo / STAMP).exists() and (repo / ".venv").is_dir()
    pip_calls(env)
    r = setup(repo, env)
    assert r.returncode == 0 and "reusing" not in r.stdout and pip_calls(env) == ["install -q -e .[dev]"], r.stderr
    assert (repo / STAMP).is_file()
    pyproject = (repo / "pyproject.toml").read_text()
    edit_pyproject(repo, env)
    assert setup(repo, env, FAKE_PIP="fail").returncode != 0
    assert not (repo / STAMP).exists()
    (repo / "pyproject.toml").write_text(pyproject)
    pip_calls(env)
    r = setup(repo, env)
    assert r.returncode == 0 and "reusing" not in r.stdout and pip_calls(env) == ["install -q -e .[dev]"]
    reused(repo, env)


@pytest.mark.parametrize("first", ["fresh", "reinstall"])
def test_an_install_killed_mid_way_leaves_no_stamp(checkout, first):
    """SIGKILL (a scheduler's, a lost node) in pip's install: nothing can clean up, so the stamp must already be
    gone. `--reinstall` of an unchanged venv is the hard case: what it left matches the old stamp in every line."""
    repo, env = checkout
    args = []
    if first == "reinstall":
        installed(repo, env)
        args = ["--reinstall"]
    proc = subprocess.Popen(["bash", str(repo / "scripts" / "setup_env.sh"), *args], env={**env, "FAKE_PIP": "slow"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        marker = Path(env["FAKE_PIP_LOG"] + ".slow")
        for _ in range(1500):
            if marker.exists():
                break
            assert proc.poll() is None, "setup_env.sh ended before its pip install"
            time.sleep(0.02)
        else:
            pytest.fail("the fake pip install never started")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
    assert not (repo / STAMP).exists()
    pip_calls(env)
    r = setup(repo, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("[setup] .venv has no stamp of a finished install (.venv/.setup_env.stamp): installing")
    assert pip_calls(env)[-1] == "install -q -e .[dev]"
    reused(repo, env)


@pytest.mark.parametrize("args,extra,message", [
    (["--reinstal"], {}, "[setup] unknown argument '--reinstal': the only one is --reinstall"),
    ([], {"SETUP_REINSTALL": "yes"}, "[setup] SETUP_REINSTALL must be 0 or 1 (got 'yes')")])
def test_a_bad_argument_stops_before_anything(checkout, args, extra, message):
    repo, env = checkout
    r = setup(repo, env, *args, **extra)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (repo / ".venv").exists() and pip_calls(env) == []


def test_setup_reinstall_0_reuses(checkout):
    repo, env = checkout
    installed(repo, env)
    reused(repo, env, SETUP_REINSTALL="0")


@pytest.mark.skipif(shutil.which("flock") is None, reason="no flock command (util-linux)")
def test_a_second_run_waits_for_an_install_and_then_reuses_it(checkout):
    """speedrun.sh and test.sh (or two of either) in one checkout: two pip installs into one .venv at once would
    corrupt it. The second waits, then finds the first's install and reuses it."""
    repo, env = checkout
    log = Path(env["FAKE_PIP_LOG"])
    first = subprocess.Popen(["bash", str(repo / "scripts" / "setup_env.sh")], env={**env, "FAKE_PIP": "hold"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    second = None
    try:
        for _ in range(1500):
            if Path(f"{log}.held").exists():
                break
            assert first.poll() is None, "setup_env.sh ended before its pip install"
            time.sleep(0.02)
        else:
            pytest.fail("the fake pip install never started")
        second = subprocess.Popen(["bash", str(repo / "scripts" / "setup_env.sh")], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        line = second.stdout.readline()
        assert line == f"[setup] another scripts/setup_env.sh is installing .venv in {repo}: waiting for it to " \
                       "finish\n", line
        calls = pip_calls(env)
        Path(f"{log}.release").touch()
        assert first.wait(timeout=60) == 0
        rest = second.communicate(timeout=60)[0]
        assert second.returncode == 0, rest
        assert rest.startswith("[setup] reusing .venv: unchanged since its last install"), rest
        assert calls[-1] == "install -q -e .[dev]" and pip_calls(env) == []  # the second installed nothing
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.skipif(shutil.which("flock") is None, reason="no flock command (util-linux)")
def test_a_process_pip_left_running_does_not_hold_the_lock(checkout):
    """A child of pip that keeps its descriptors and outlives it must not hold .venv's lock: the next install would
    wait for it."""
    repo, env = checkout
    assert setup(repo, env, FAKE_PIP="leave").returncode == 0
    left = int(Path(env["FAKE_PIP_LOG"] + ".left").read_text())
    try:
        assert venv_lock(repo, "-x") == 0
    finally:
        os.kill(left, signal.SIGKILL)


@pytest.mark.skipif(shutil.which("flock") is None, reason="no flock command (util-linux)")
@pytest.mark.parametrize("pull", [False, True])
def test_tests_running_on_the_venv_hold_off_an_install_but_not_a_check(checkout, pull):
    """scripts/test.sh holds .venv's lock shared while pytest runs (speedrun.sh while it runs): a run that finds
    .venv unchanged goes on at once; an install waits for them to end, and says why. pull: `git pull` writes a
    changed setup_env.sh anew (a new inode; flock locks an inode), and the change calls for an install (the script is
    one of the stamp's inputs): a run that held .venv's lock before the pull must still hold that install off."""
    repo, env = checkout
    installed(repo, env)
    holder = subprocess.Popen(["bash", "-c", ". scripts/one_at_a_time.sh; hold_venv run; echo held; "
                               "while [ ! -e release ]; do sleep 0.05; done"], cwd=repo, stdout=subprocess.PIPE,
                              text=True)
    script, install = repo / "scripts" / "setup_env.sh", None
    try:
        assert holder.stdout.readline() == "held\n"
        reused(repo, env)
        if pull:
            ino = script.stat().st_ino
            (repo / "pulled").write_text(script.read_text() + "# pulled\n")
            (repo / "pulled").replace(script)  # as git writes a changed file: a new one renamed over the old
            assert script.stat().st_ino != ino
        install = subprocess.Popen(["bash", str(script), *([] if pull else ["--reinstall"])], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert install.stdout.readline() == f"[setup] .venv is in use in {repo} (scripts/test.sh's tests, " \
                                            "speedrun.sh, another setup_env.sh): waiting for them to finish\n"
        assert pip_calls(env) == []
        (repo / "release").touch()
        assert install.wait(timeout=60) == 0 and pip_calls(env) == ["install -q -e .[dev]"]
    finally:
        (repo / "release").touch()
        holder.wait(timeout=60)
        if install is not None and install.poll() is None:
            install.kill()
            install.wait()
