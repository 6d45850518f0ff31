#!/usr/bin/env bash
# One command for the test suite on a fresh machine: set up .venv, then run pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
# One run at a time per checkout: setup_env.sh reinstalls .venv when it differs from its stamp (or when asked to),
# and two installs at once, or one under the other's pytest, break each other. What else two runs share is made for
# sharing (dev/LOG.md, 2026-11-27): pytest's numbered temp dirs, inductor's cache (atomic writes and file locks, as
# torchrun's ranks use it), free ports. The lock is this script's file: no lock file to ignore or clean up. The
# children get no copy of it (9<&-): a process a test left behind must not hold it after this run.
if command -v flock >/dev/null 2>&1; then
    exec 9<scripts/test.sh
    lock_rc=0
    flock -n -E 75 9 || lock_rc=$?  # 75: held by another run; anything else: no lock to be had here
    if [ "$lock_rc" = 75 ]; then
        echo "[test] another scripts/test.sh is running in $PWD: waiting for it to finish"
        lock_rc=0
        flock 9 || lock_rc=$?
    fi
    if [ "$lock_rc" != 0 ]; then  # e.g. NFS, where flock(2) needs a file open for writing: not another run
        echo "[test] cannot lock scripts/test.sh (flock exit $lock_rc): not waiting for another one in this checkout"
    fi
else
    echo "[test] no flock command: not waiting for another scripts/test.sh in this checkout"
fi
bash scripts/setup_env.sh 9<&-
# shellcheck disable=SC1091
. .venv/bin/activate
export WANDB_MODE=disabled OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
python -m pytest -q "$@" 9<&-
