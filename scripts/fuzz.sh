#!/usr/bin/env bash
# Coverage-guided fuzzing of lmoe's parsers of outside input (tests/fuzz/parser_targets.hpp) with
# clang's libFuzzer under ASan + UBSan: builds build/fuzz, writes each target's seeds, then fuzzes
# each target for SECONDS (default 60). A crash (an exception other than lmoe::Error, or a sanitizer
# report) stops with its reproducer in build/fuzz/findings/<target>/; the corpus grows in
# build/fuzz/corpus/<target>/ and is reused by the next run.
# Usage: bash scripts/fuzz.sh [SECONDS] [TARGET ...]   (targets: safetensors safetensors_header
#        checkpoint_index tier_table tier_policy bench_json machine_rates; default all)
set -euo pipefail
cd "$(dirname "$0")/.."
# The targets as tests/CMakeLists.txt lists them (one list).
read -ra all_targets <<<"$(sed -n 's/^set(LMOE_FUZZ_TARGETS \(.*\))$/\1/p' tests/CMakeLists.txt)"
((${#all_targets[@]})) || { echo "fuzz: no set(LMOE_FUZZ_TARGETS ...) line in tests/CMakeLists.txt" >&2; exit 2; }
seconds="${1:-60}"
shift || true
targets=("$@")
((${#targets[@]})) || targets=("${all_targets[@]}")
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz: SECONDS must be a whole number > 0, got '$seconds' (usage: bash scripts/fuzz.sh [SECONDS] [TARGET ...])" >&2
  exit 2
fi
for target in "${targets[@]}"; do
  if [[ " ${all_targets[*]} " != *" $target "* ]]; then
    echo "fuzz: no target '$target' (targets: ${all_targets[*]})" >&2
    exit 2
  fi
done
bash scripts/install-deps.sh --fuzz  # clang 19 and libFuzzer (clang >= 15 needed: see there)
CC=clang-19 CXX=clang++-19 cmake -S . -B build/fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DLMOE_WITH_CUDA=OFF -DLMOE_WITH_MPI=OFF -DLMOE_SANITIZE=address,undefined -DLMOE_FUZZ=ON >/dev/null
cmake --build build/fuzz --target lmoe_fuzz_seeds "${targets[@]/#/lmoe_fuzz_}"
./build/fuzz/tests/lmoe_fuzz_seeds tests/data build/fuzz/seeds >/dev/null
status=0
for target in "${targets[@]}"; do
  mkdir -p "build/fuzz/corpus/$target" "build/fuzz/findings/$target"
  echo "fuzz: $target for ${seconds}s"
  if ! ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
      "./build/fuzz/tests/lmoe_fuzz_$target" -max_total_time="$seconds" -max_len=65536 -print_final_stats=1 \
      -artifact_prefix="build/fuzz/findings/$target/" "build/fuzz/corpus/$target" "build/fuzz/seeds/$target" \
      > "build/fuzz/$target.log" 2>&1; then
    echo "fuzz: $target FAILED: see build/fuzz/$target.log and build/fuzz/findings/$target/" >&2
    grep -m 5 -E "ERROR|runtime error|terminate|what\(\)" "build/fuzz/$target.log" >&2 || true
    status=1
  else
    grep -E "stat::number_of_executed_units|cov:" "build/fuzz/$target.log" | tail -2 | sed "s/^/  /"
  fi
done
exit $status
