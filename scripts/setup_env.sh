#!/usr/bin/env bash
# Create .venv and install mome-nanochat with its dev extra. Safe to re-run.
# Picks the torch build: CUDA wheel from PyPI when an NVIDIA GPU is visible, else the CPU build
# (a local wheel if pip's find-links has one, otherwise the PyTorch CPU index). Never lets an unpinned
# torch pull a multi-GB CUDA build onto a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
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
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "[setup] NVIDIA GPU found: installing torch==${TORCH_VERSION} (CUDA build)"
        python -m pip install -q "torch==${TORCH_VERSION}"
    elif python -m pip download -q --no-deps --no-index -d "$(mktemp -d)" "torch==${TORCH_VERSION}" >/dev/null 2>&1; then
        echo "[setup] no GPU: installing the local CPU wheel of torch==${TORCH_VERSION}"
        python -m pip install -q "torch==${TORCH_VERSION}"
    else
        echo "[setup] no GPU: installing torch==${TORCH_VERSION} from the PyTorch CPU index"
        python -m pip install -q "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu \
            --extra-index-url https://pypi.org/simple
    fi
fi
python -m pip install -q -e ".[dev]"
python -c "import torch; print(f'[setup] torch {torch.__version__}, cuda available: {torch.cuda.is_available()}')"
