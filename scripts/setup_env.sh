#!/usr/bin/env bash
# Create .venv and install mome-nanochat with its dev extra. Safe to re-run.
# Picks the torch build: CUDA wheel from PyPI when an NVIDIA GPU is visible, else the CPU build
# (a local wheel if pip's find-links has one, otherwise the PyTorch CPU index). Never lets an unpinned
# torch pull a multi-GB CUDA build onto a CPU-only machine.
#
# A re-run (speedrun.sh and test.sh call this every time) skips the install when .venv is the one its last
# successful install left: .venv/.setup_env.stamp holds what decided that install (this script, pyproject.toml,
# the checkout's path, the torch version and build, the venv's Python) and the packages it ended with, and a run
# that finds the same reuses .venv. Anything different installs as usual. `--reinstall` (or SETUP_REINSTALL=1,
# for speedrun.sh and test.sh) installs even when nothing differs; `rm -rf .venv` starts from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/one_at_a_time.sh
. scripts/one_at_a_time.sh  # the locks, and $VENV_STAMP (scripts/test.sh and speedrun.sh read the stamp too)
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
INPUTS=(scripts/setup_env.sh pyproject.toml)  # the files pip's install reads or that decide it (no lock file)
case "${SETUP_REINSTALL:-0}" in  # SETUP_REINSTALL=0 must not mean "reinstall"
    0) reinstall="" ;;
    1) reinstall=1 ;;
    *) echo "[setup] SETUP_REINSTALL must be 0 or 1 (got '$SETUP_REINSTALL')" >&2; exit 2 ;;
esac
case "${1:-}" in
    --reinstall) reinstall=1 ;;
    "") ;;
    *) echo "[setup] unknown argument '$1': the only one is --reinstall (install even when .venv matches)" >&2
       exit 2 ;;
esac
build=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then build=cuda; fi

fingerprint() {  # one "what value" line each for what decides the install and what it left in .venv
    echo "checkout $PWD"  # the editable install points here
    echo "torch $TORCH_VERSION $build build"
    # -I: the checkout's mome_nanochat.egg-info (found through the current directory or PYTHONPATH) is no package
    # of the venv, and would make a run from elsewhere differ
    .venv/bin/python -I - "${INPUTS[@]}" <<'EOF'
import hashlib, importlib.metadata, sys
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        print(path, hashlib.sha256(f.read()).hexdigest())
print("python", sys.version.replace("\n", " "))
dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
print("packages", len(dists), hashlib.sha256("\n".join(dists).encode()).hexdigest())
EOF
}

unchanged() {  # .venv is what its last install left; sets $now, the fingerprint of .venv as it is
    now=""
    [ -f "$VENV_STAMP" ] || return 1
    now="$(fingerprint 2>/dev/null)" || now=""  # a venv whose python no longer runs: install
    [ "$now" = "$(cat "$VENV_STAMP")" ]
}
reuse() {
    echo "[setup] reusing .venv: unchanged since its last install ($VENV_STAMP); 'bash scripts/setup_env.sh" \
         "--reinstall' (SETUP_REINSTALL=1 for speedrun.sh and test.sh) installs again"
    exit 0
}

# The lock of .venv in this checkout is $VENV_LOCK (fd 8): held shared to check the stamp (by any number of
# runs, and by scripts/test.sh while its pytest runs), exclusively to install. Two pip installs into one .venv
# corrupt it, and one under running tests breaks them. A run that finds .venv unchanged goes on at once; one that
# must install waits for the tests and the other runs, then checks again (another run may have installed it
# meanwhile: then it reuses that install).
if [ -z "$reinstall" ]; then
    one_at_a_time 8 "$VENV_LOCK" setup \
        "another scripts/setup_env.sh is installing .venv in $PWD: waiting for it to finish" -s
    ! unchanged || reuse
fi
one_at_a_time 8 "$VENV_LOCK" setup \
    ".venv is in use in $PWD (scripts/test.sh's tests, speedrun.sh, another setup_env.sh): waiting for them to finish"
if [ -n "$reinstall" ]; then
    echo "[setup] installing (asked to)"
elif unchanged; then  # installed by another run while this one waited
    reuse
elif [ -f "$VENV_STAMP" ]; then
    changed="$(grep -vxF -f "$VENV_STAMP" <<<"$now" | cut -d' ' -f1 | paste -sd' ')" || true
    echo "[setup] .venv differs from its last install (${changed:-its python does not run}): installing"
elif [ -e .venv ]; then  # made by uv, by this script before the stamp, or by an install that failed or was stopped
    echo "[setup] .venv has no stamp of a finished install ($VENV_STAMP): installing"
fi
# no stamp while .venv changes: an install that fails or is stopped part-way leaves none, and the next run installs
rm -f "$VENV_STAMP"

install_venv() {
    if [ ! -x .venv/bin/python ]; then
        "$PYTHON" -m venv .venv
    fi
    # shellcheck disable=SC1091
    . .venv/bin/activate
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    # Always the venv's own pip (`python -m pip`): a .venv made by `uv sync` has none, and a bare `pip` would then
    # be the system one and install into the system Python. Bootstrap it instead.
    python -m pip --version >/dev/null 2>&1 || python -m ensurepip --upgrade >/dev/null
    if ! python -c "import torch" >/dev/null 2>&1; then
        if [ "$build" = cuda ]; then
            echo "[setup] NVIDIA GPU found: installing torch==${TORCH_VERSION} (CUDA build)"
            python -m pip install -q "torch==${TORCH_VERSION}"
        elif python -m pip download -q --no-deps --no-index -d "$(mktemp -d)" "torch==${TORCH_VERSION}" \
                >/dev/null 2>&1; then
            echo "[setup] no GPU: installing the local CPU wheel of torch==${TORCH_VERSION}"
            python -m pip install -q "torch==${TORCH_VERSION}"
        else
            echo "[setup] no GPU: installing torch==${TORCH_VERSION} from the PyTorch CPU index"
            python -m pip install -q "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu \
                --extra-index-url https://pypi.org/simple
        fi
    fi
    python -m pip install -q -e ".[dev]"
    python - "$TORCH_VERSION" <<'EOF'
import sys, torch
print(f"[setup] torch {torch.__version__}, cuda available: {torch.cuda.is_available()}")
if torch.__version__.split("+")[0] != sys.argv[1]:  # the torch step above keeps any torch .venv already has
    print(f"[setup] kept the torch .venv already had, not torch=={sys.argv[1]}: rm -rf .venv to install that one")
EOF
    # written last, whole (a rename): only an install that got this far leaves a stamp for the next run to match
    fingerprint >"$VENV_STAMP.tmp"
    mv "$VENV_STAMP.tmp" "$VENV_STAMP"
}
# Nothing the install starts gets a copy of the lock (8<&-: bash keeps the lock on a close-on-exec copy of the
# descriptor while the function runs): a process it leaves running (a daemon of a build step: Python's subprocess
# closes what it does not pass on, a shell or a fork does not) must not hold .venv after this run.
install_venv 8<&-
