#!/usr/bin/env bash
# Builds the CPU backend under AddressSanitizer and UndefinedBehaviorSanitizer (the cpu-sanitize
# preset, build/cpu-sanitize) and runs the whole CPU test suite on it: an out-of-bounds access, a use
# after free, a leak or undefined behaviour anywhere a test reaches aborts that test.
# Usage: bash scripts/test-sanitized.sh [extra ctest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh --tests
cmake --preset cpu-sanitize >/dev/null
cmake --build --preset cpu-sanitize
ctest --preset cpu-sanitize --timeout 900 "$@"
