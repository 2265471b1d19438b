#!/usr/bin/env bash
# On a GPU machine: configures the `cuda` preset, builds, runs the whole test suite with CTest (CPU,
# MPI, CLI and CUDA tests) and prints a summary. Logs go to $OUT when it is set (the device tool's
# output folder), else to build/cuda/gpu_check/. Usage: bash scripts/gpu_check.sh [extra ctest args]
set -uo pipefail
cd "$(dirname "$0")/.."

# NVLink multicast stays off on shared machines (it can take a host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

logs="${OUT:-build/cuda/gpu_check}"
mkdir -p "$logs"
started=$(date +%s)
stage() { echo "== $1 ($(($(date +%s) - started)) s)"; }

stage "machine"
{ nvidia-smi -L; nvcc --version | tail -1; cmake --version | head -1; g++ --version | head -1; } 2>&1 | tee "$logs/machine.log"

stage "configure"
if ! cmake --preset cuda >"$logs/configure.log" 2>&1; then
  tail -40 "$logs/configure.log"; echo "gpu_check: configure FAILED"; exit 1
fi

stage "build"
# -k 0: a target that fails to build must not keep the others (and their tests) from running.
cmake --build --preset cuda -j16 -- -k 0 >"$logs/build.log" 2>&1
build_rc=$?
if [ "$build_rc" -ne 0 ]; then
  grep -E "error|FAILED" -A5 "$logs/build.log" | head -60; echo "gpu_check: build FAILED (continuing with what was built)"
fi
grep -E "warning" "$logs/build.log" | sort -u | head -20

stage "ctest"
# GPU test processes share the GPU; a per-test limit keeps a hang from eating the whole lease.
timeout 480 ctest --preset cuda -j8 --timeout 300 "$@" >"$logs/ctest.log" 2>&1
ctest_rc=$?
cp build/cuda/Testing/Temporary/LastTest.log "$logs/LastTest.log" 2>/dev/null

stage "lmoe run on the GPU (Kimi-K3 dims, 8 ranks sharing the GPU)"
# Every tier at every T, checked against the contract and fp64 on the CPU. The times include the
# host barriers of the cuda-threads communicator: they show correctness, not the tiers' speed.
timeout 240 build/cuda/lmoe run --backend cuda -n 8 -t 1,8,64,128,256,512,2048 --repeats 3 \
  --json "$logs/run_cuda_k3_tp8.json" >"$logs/run_cuda.log" 2>"$logs/run_cuda.err"
run_rc=$?
cat "$logs/run_cuda.log"

stage "summary"
grep -hE "^\[ (parity|k3) " "$logs/LastTest.log" | sort -u
grep -E "tests passed|tests failed|Total Test time" "$logs/ctest.log"
sed -n '/The following tests FAILED/,$p' "$logs/ctest.log" | head -40
[ "$ctest_rc" -eq 124 ] && echo "gpu_check: ctest was stopped at 480 s"
echo "gpu_check: build exit code $build_rc, ctest exit code $ctest_rc, lmoe run exit code $run_rc, logs in $logs"
[ "$build_rc" -eq 0 ] && [ "$run_rc" -eq 0 ] && exit "$ctest_rc"
exit 1
