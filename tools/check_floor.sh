#!/usr/bin/env bash
# The oldest CuPy the extras allow, with NVRTC from its wheel and no CUDA toolkit: a fresh venv
# with cupy-cuda12x at setup.cfg's floor compiles every kernel family (the compile check of the
# CPU suite). .ci/run calls it.
#   bash tools/check_floor.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
FLOOR=$(sed -n 's/^ *cupy-cuda12x>=\([0-9.]*\)$/\1/p' setup.cfg | head -1)
VENV=${1:-$(mktemp -d)/floor}
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "cupy-cuda12x==$FLOOR" nvidia-cuda-nvrtc-cu12 \
  numpy safetensors ml_dtypes pytest hypothesis
"$VENV/bin/python" -c "import cupy; print('floor: cupy', cupy.__version__)"
PYTHONPATH=. "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/device/test_kernels_compile.py
