#!/usr/bin/env bash
# One command for the test suite on a fresh machine: set up .venv, then run pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
# One run at a time per checkout: setup_env.sh reinstalls .venv when it differs from its stamp (or when asked to),
# and two installs at once, or one under the other's pytest, break each other. What else two runs share is made for
# sharing (dev/LOG.md, 2026-11-27): pytest's numbered temp dirs, inductor's cache (atomic writes and file locks, as
# torchrun's ranks use it), free ports. The children get no copy of the lock (9<&-): a process a test left behind
# must not hold it after this run.
# shellcheck source=scripts/one_at_a_time.sh
. scripts/one_at_a_time.sh
one_at_a_time 9 scripts/test.sh test "another scripts/test.sh is running in $PWD: waiting for it to finish"
bash scripts/setup_env.sh 9<&-
# shellcheck disable=SC1091
. .venv/bin/activate
export WANDB_MODE=disabled OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
python -m pytest -q "$@" 9<&-
