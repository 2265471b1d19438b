#!/usr/bin/env bash
# Builds the CPU backend under the sanitizers and runs the whole CPU test suite on each build:
#   cpu-sanitize (build/cpu-sanitize): AddressSanitizer + UndefinedBehaviorSanitizer; an
#     out-of-bounds access, a use after free, a leak or undefined behaviour aborts the test.
#   cpu-tsan (build/cpu-tsan): ThreadSanitizer; a data race or a lock-order inversion between rank
#     threads aborts the test. OpenBLAS runs one thread there: its own threads synchronize in code
#     ThreadSanitizer cannot see, which it would report as races in every GEMM.
# Usage: bash scripts/test-sanitized.sh [extra ctest arguments]   (docs/testing.md)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh --tests
for preset in cpu-sanitize cpu-tsan; do
  echo "test-sanitized: $preset"
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset"
  ctest --preset "$preset" --timeout 900 "$@"
done
