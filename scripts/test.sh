#!/usr/bin/env bash
# Builds lmoe and runs the whole test suite (unit, parity, MPI and CLI tests) with CTest.
# GPU tests skip without a GPU. Usage: bash scripts/test.sh [extra ctest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh --tests
cmake --preset cpu >/dev/null
cmake --build --preset cpu
ctest --preset cpu --timeout 900 "$@"
