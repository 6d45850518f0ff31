"""dev/gpu/run_all.sh's plumbing on the CPU, as the device machine runs it (python3 and nvidia-smi stand-ins on
PATH, $OUT a fresh folder, the repo's bench/ beside it): the wheel install's outcome is said, the ``diff`` step
runs bench/profile_diff.py on two profiles, an unknown step is exit 2; dev/gpu/fetch_wheels.sh keeps the wheels
it has when the download fails. The benches and the CUDA tests themselves are the device's (docs/performance.md)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

PROFILE = {"steps": 1, "time": "device", "total_us": 1.0,
           "kernels": [{"name": "k", "category": "gemm", "calls": 1, "total_us": 1.0}]}


@pytest.fixture
def device_dir(tmp_path):
    """A folder laid out as the device's checkout (bench/ linked, a .whl/ folder) and a bin/ of stand-ins:
    python3 is this interpreter except ``-m pip``, which fails (a wheel the image cannot take)."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    for d in (work / ".whl", bin_dir):
        d.mkdir(parents=True)
    (work / "bench").symlink_to(REPO / "bench")
    (work / ".whl" / "rustbpe-0.1.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"not a wheel")
    (bin_dir / "python3").write_text(f'#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 1\nexec {sys.executable} "$@"\n')
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'stand-in GPU'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return work, bin_dir


def _run_all(work, bin_dir, out, *steps):
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(out)}
    return subprocess.run(["bash", str(REPO / "dev" / "gpu" / "run_all.sh"), *steps], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)


def test_run_all_says_a_failed_wheel_install_and_runs_the_diff(device_dir, tmp_path):
    work, bin_dir = device_dir
    out = tmp_path / "out"
    (out / "prof").mkdir(parents=True)
    for name in ("ve_auto_auto.json", "mome_auto_auto.json"):
        (out / "prof" / name).write_text(json.dumps({**PROFILE, "label": name.split("_")[0]}))
    res = _run_all(work, bin_dir, out, "diff", str(out / "prof" / "ve_auto_auto.json"),
                   str(out / "prof" / "mome_auto_auto.json"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "wheels: install FAILED (.whl: rustbpe-0.1.0-cp312-cp312-manylinux_2_17_x86_64.whl): the tests that " \
           "import them fail" in lines
    assert not any(line.startswith("wheels: rustbpe") for line in lines)  # the success line
    assert "### Kernel profile: B = mome (" in res.stdout and lines[-1] == "diff rc=0"
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["mome_auto_auto.json", "ve_auto_auto.json"]


def test_run_all_refuses_an_unknown_step(device_dir, tmp_path):
    work, bin_dir = device_dir
    res = _run_all(work, bin_dir, tmp_path / "out", "bnech", "ve", "auto", "auto")
    assert res.returncode == 2 and res.stdout.splitlines()[-1] == "unknown step bnech"


def test_fetch_wheels_keeps_the_wheels_it_has_when_the_download_fails(device_dir):
    """Run where the package index cannot be reached (pip fails): the wheel already in .whl/ stays (the script
    emptied .whl/ before downloading, so the next device call carried no rustbpe), and the exit status says so."""
    work, bin_dir = device_dir
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(REPO / "dev" / "gpu" / "fetch_wheels.sh")], cwd=work, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert [p.name for p in (work / ".whl").iterdir()] == ["rustbpe-0.1.0-cp312-cp312-manylinux_2_17_x86_64.whl"]
    assert sorted(p.name for p in work.iterdir()) == [".whl", "bench"]  # no download folder left behind


def test_fetch_wheels_replaces_the_wheels_after_a_download(device_dir, tmp_path):
    """pip's download (a stand-in that writes the wheel it was asked for into its -d folder) replaces .whl/."""
    work, bin_dir = device_dir
    (work / ".whl" / "stale-0.0.1-py3-none-any.whl").write_bytes(b"old")
    pip_ok = tmp_path / "pip_ok"
    pip_ok.mkdir()
    (pip_ok / "python3").write_text(
        '#!/bin/sh\nif [ "$1 $2 $3" = "-m pip download" ]; then\n'
        '  while [ "$1" != "-d" ]; do shift; done; touch "$2/rustbpe-9.9.9-cp312-cp312-manylinux_2_17_x86_64.whl"\n'
        f'  exit 0\nfi\nexec {sys.executable} "$@"\n')
    (pip_ok / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{pip_ok}{os.pathsep}{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(REPO / "dev" / "gpu" / "fetch_wheels.sh")], cwd=work, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert [p.name for p in (work / ".whl").iterdir()] == ["rustbpe-9.9.9-cp312-cp312-manylinux_2_17_x86_64.whl"]
