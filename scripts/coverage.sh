#!/usr/bin/env bash
# Which lines of lmoe's host code the CPU test suite runs: builds the cpu-coverage preset
# (build/cpu-coverage, gcov), runs the whole CPU suite (the CLI and MPI tests' processes count too),
# and prints gcovr's table per file of src/, apps/ and include/ with the lines no test reached,
# then the totals. CUDA code is not in this build. Usage: bash scripts/coverage.sh [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh --tests --coverage
cmake --preset cpu-coverage >/dev/null
cmake --build --preset cpu-coverage
find build/cpu-coverage -name '*.gcda' -delete  # counts of this run only
ctest --preset cpu-coverage --timeout 900 "$@"
python3 -m gcovr -r . build/cpu-coverage --filter 'src/' --filter 'apps/' --filter 'include/' \
  --gcov-ignore-parse-errors=negative_hits.warn_once_per_file --print-summary \
  --txt build/cpu-coverage/coverage.txt --json-summary build/cpu-coverage/coverage.json
cat build/cpu-coverage/coverage.txt
echo "coverage: table in build/cpu-coverage/coverage.txt, JSON in build/cpu-coverage/coverage.json"
