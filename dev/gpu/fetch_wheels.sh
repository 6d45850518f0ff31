#!/usr/bin/env bash
# Wheels the GPU machine's image lacks (rustbpe: the tokenizer trainer some CUDA tests build their tiny tokenizer
# with), downloaded HERE for the GPU machine's python 3.12 on x86-64 into .whl/ (git-ignored). Name `.whl` in the
# device call's `carry`; dev/gpu/run_all.sh installs them into /tmp/site and puts that on PYTHONPATH.
#   bash dev/gpu/fetch_wheels.sh        (from the repo root, on a machine that reaches the package index)
set -euo pipefail
version=$(python3 -c "import importlib.metadata as m; print(m.version('rustbpe'))" 2>/dev/null \
          || .venv/bin/python -c "import importlib.metadata as m; print(m.version('rustbpe'))")
# downloaded aside, then swapped in: a failed download (no index reachable) keeps the wheels .whl/ already holds
new=$(mktemp -d) && trap 'rm -rf "$new"' EXIT
# rustbpe has no runtime requirements (its METADATA lists only the 'dev' extra), so --no-deps fetches all it needs
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$new" "rustbpe==$version"
rm -rf .whl && mkdir .whl && mv "$new"/*.whl .whl/
ls -l .whl
