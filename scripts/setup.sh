#!/usr/bin/env bash
# Installs the dependencies and builds the `lmoe` tool (CPU backend) into build/cpu/lmoe.
# (The CUDA backend: cmake --preset cuda && cmake --build --preset cuda, or scripts/gpu_check.sh.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset cpu >/dev/null
cmake --build --preset cpu --target lmoe
