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
# Two pytest processes (pytest-xdist), each running whole files (--dist loadfile: a file's module fixtures and its
# shared launches run once). On a 2-core machine like CI's, inductor's cache warm, the suite took 9 min 45 s this
# way and 12 min 22 s in one process; three workers were no faster (dev/LOG.md, 2026-11-27). TEST_WORKERS=0 runs it
# in one process (--pdb needs that); an -n or --dist among the arguments comes later and wins.
workers="${TEST_WORKERS:-2}"  # an empty TEST_WORKERS is unset
case "$workers" in
    *[!0-9]*) echo "[test] TEST_WORKERS must be a whole number of pytest processes, 0 for one process" \
                      "(got '$workers')" >&2; exit 2 ;;
esac
# --no-loadscope-reorder: the workers take the files in collection order, the longest first (tests/conftest.py's
# LONGEST_FILES), not pytest-xdist's most-tests-first, which started a long one-test file last.
# The children get no copy of the locks: a process a test left behind must not hold them after this run
python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder "$@" 8<&- 9<&-
