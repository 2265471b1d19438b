#!/usr/bin/env bash
# Builds lmoe and runs the whole test suite (unit, parity, MPI and CLI tests) with CTest, then
# builds the Python package into build/python-venv and runs its tests (tests/python) with pytest.
# GPU tests skip without a GPU. LMOE_TEST_PYTHON=0 leaves the Python package out.
# Usage: bash scripts/test.sh [extra ctest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
python_too="${LMOE_TEST_PYTHON:-1}"
if [ "$python_too" = 1 ]; then
  bash scripts/install-deps.sh --tests --python
else
  bash scripts/install-deps.sh --tests
fi
cmake --preset cpu >/dev/null
cmake --build --preset cpu
ctest --preset cpu --timeout 900 "$@"

if [ "$python_too" = 1 ]; then
  # The CPU build of the ops (CUDA ones compile in the cuda preset); incremental in build/python/.
  echo "test: the Python package (pip install ., then pytest tests/python)"
  LMOE_PYTHON_CUDA=OFF CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    build/python-venv/bin/python -m pip install -q --no-build-isolation .
  build/python-venv/bin/python -m pytest tests/python -q -p no:cacheprovider
fi
