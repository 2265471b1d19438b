# shellcheck shell=bash
# The frame that scripts/gpu_check.sh and the GPU scripts of benchmarks/ share; sourced from the
# source tree's root after the caller sets check_name (its messages' prefix and its log folder's
# name). It keeps NVLink multicast off, picks the log folder ($OUT when it is set, else
# build/cuda/$check_name/) and counts the GPUs ($gpus); the caller then sets $stages
# (LMOE_CHECK_STAGES, else its default). Then the stages, the build and the summary:
#
#   stage TITLE              prints "== TITLE (seconds since the start)"
#   wants NAME               whether NAME is among the stages asked for
#   rc[NAME]=CODE            an exit code the summary reports (any nonzero one fails the script)
#   machine_info             the GPUs, driver, nvcc, cmake and g++ versions ($logs/machine.log)
#   configure_cuda LINEINFO  configures the `cuda` preset (LMOE_CUDA_ARCHITECTURES=90a: this
#                            Hopper only) with -DLMOE_CUDA_LINEINFO=LINEINFO; exits 1 if that fails
#   build_cuda JOBS          builds every target with JOBS jobs (rc[build])
#   summary                  every exit code, then exits 1 if any is nonzero, else 0 (with
#                            LMOE_CHECK_PACK=1, first packs the logs into one .tar.gz)
set -uo pipefail

# NVLink multicast stays off on shared machines (it can take a host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

logs="${OUT:-build/cuda/$check_name}"
mkdir -p "$logs"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
started=$(date +%s)
stage() { echo "== $1 ($(($(date +%s) - started)) s)"; }
# shellcheck disable=SC2154  # $stages: set by the caller after sourcing this
wants() { [[ " $stages " == *" $1 "* ]]; }
declare -A rc

machine_info() {
  stage "machine: $gpus GPU(s)"
  { nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1; nvcc --version | tail -1
    cmake --version | head -1; g++ --version | head -1; } 2>&1 | tee "$logs/machine.log"
}

configure_cuda() {
  local lineinfo=$1
  stage "configure + build"
  # LMOE_CUDA_ARCHITECTURES=90a builds for the machine's Hopper only (about half the build time).
  if ! cmake --preset cuda ${LMOE_CUDA_ARCHITECTURES:+-DCMAKE_CUDA_ARCHITECTURES=$LMOE_CUDA_ARCHITECTURES} \
    -DLMOE_CUDA_LINEINFO="$lineinfo" >"$logs/configure.log" 2>&1; then
    tail -40 "$logs/configure.log"; echo "$check_name: configure FAILED"; exit 1
  fi
  grep -E "lmoe:" "$logs/configure.log"
}

build_cuda() {
  # -k 0: a target that fails to build must not keep the others (and their tests) from running.
  cmake --build --preset cuda -j"$1" -- -k 0 >"$logs/build.log" 2>&1
  rc[build]=$?
  [ "${rc[build]}" -ne 0 ] && { grep -E "error|FAILED" -A5 "$logs/build.log" | head -60; echo "$check_name: build FAILED"; }
  grep -E "warning" "$logs/build.log" | sort -u | head -20
}

summary() {
  stage "summary"
  local failed=0 name
  for name in "${!rc[@]}"; do
    echo "$check_name: $name exit code ${rc[$name]}"
    [ "${rc[$name]}" -ne 0 ] && failed=1
  done
  # A caller that collects $OUT may take back only a few files (a GPU machine's run tool returns at
  # most 8): with LMOE_CHECK_PACK=1 every log and JSON goes into one archive instead.
  if [ "${LMOE_CHECK_PACK:-0}" = 1 ]; then
    tar -czf "/tmp/$check_name.tar.gz" -C "$logs" . && rm -rf "${logs:?}"/* &&
      mv "/tmp/$check_name.tar.gz" "$logs/" && echo "$check_name: logs packed in $logs/$check_name.tar.gz"
  else
    echo "$check_name: logs in $logs"
  fi
  exit $failed
}
