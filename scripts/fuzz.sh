#!/usr/bin/env bash
# Coverage-guided fuzzing of lmoe's parsers of outside input (tests/fuzz/parser_targets.hpp) with
# clang's libFuzzer under ASan + UBSan: builds build/fuzz, writes each target's seeds, then fuzzes
# each target for SECONDS (default 60). A crash (an exception other than lmoe::Error, or a sanitizer
# report) stops with its reproducer in build/fuzz/findings/<target>/; the corpus grows in
# build/fuzz/corpus/<target>/ and is reused by the next run.
# Usage: bash scripts/fuzz.sh [SECONDS] [TARGET ...]   (targets: safetensors tier_table tier_policy
#        bench_json machine_rates; default all)
set -euo pipefail
cd "$(dirname "$0")/.."
all_targets=(safetensors tier_table tier_policy bench_json machine_rates)
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
bash scripts/install-deps.sh
# clang 15 or newer: lmoe::Error takes a std::source_location, which libstdc++ builds on a builtin
# that clang 14 lacks. Debian 12 and Ubuntu 24.04 both package clang-19 and its libFuzzer runtime.
cxx=""
for version in 20 19 18 17 16 15; do
  if command -v "clang++-$version" >/dev/null; then cxx="clang++-$version"; break; fi
done
if [ -z "$cxx" ]; then
  echo "fuzz: installing clang-19 and its libFuzzer runtime (Debian packages)" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends clang-19 libclang-rt-19-dev >/dev/null
  cxx="clang++-19"
fi
CC="${cxx/clang++/clang}" CXX="$cxx" cmake -S . -B build/fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
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
