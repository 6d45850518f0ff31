#!/usr/bin/env bash
# One command for the test suite on a fresh machine: set up .venv, then run pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export WANDB_MODE=disabled OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
python -m pytest -q "$@"
