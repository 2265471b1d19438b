#!/usr/bin/env bash
# Installs the dependencies and builds lmoe (CPU backend; the CUDA backend too when nvcc is found).
# The tool lands in build/cpu/lmoe (and build/cuda/lmoe).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset cpu >/dev/null
cmake --build --preset cpu
