#!/usr/bin/env bash
# One command for the test suite on a fresh machine: set up .venv, then run pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
# One run at a time per checkout (the lock is $TEST_LOCK, fd 9): a second run waits for the first, as it did
# before .venv had a lock of its own (hold_venv below). What else two runs share is made for sharing (dev/LOG.md,
# 2026-11-27): pytest's numbered temp dirs, inductor's cache (atomic writes and file locks, as torchrun's ranks use
# it), free ports.
# shellcheck source=scripts/one_at_a_time.sh
. scripts/one_at_a_time.sh
one_at_a_time 9 "$TEST_LOCK" test "another scripts/test.sh is running in $PWD: waiting for it to finish"
bash scripts/setup_env.sh 9<&-
# .venv's lock held shared while pytest runs: an install by speedrun.sh or a user in this checkout waits for the
# tests to end
hold_venv test
# shellcheck disable=SC1091
. .venv/bin/activate
export WANDB_MODE=disabled OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# the children get no copy of the locks: a process a test left behind must not hold them after this run
python -m pytest -q "$@" 8<&- 9<&-
