#!/usr/bin/env bash
# On a GPU machine: the probes of benchmarks/, each a question about the GPU that lmoe's kernels
# rest on, answered apart from the tail, on the frame it shares with scripts/gpu_check.sh
# (scripts/gpu_check_lib.sh). Logs and JSON go to $OUT when it is set, else to build/cuda/probes/.
#
#   bash benchmarks/probes.sh                            # everything
#   LMOE_CHECK_STAGES="build probe" bash benchmarks/probes.sh   # a subset of: build probe stream
#
#   probe   lmoe_spin_probe (spinning kernels of several streams resident together, under the queue
#           counts and module loading modes that matter for ranks sharing a GPU) and
#           lmoe_launch_floor (a graph replay's cost with no work in it)
#   stream  lmoe_stream_probe (cp.async weight streams by tile geometry and work split) and
#           lmoe_tma_stream_probe (the copy engine's streams by box shape), at K3's w_up and one
#           tp-8 stripe of it
cd "$(dirname "$0")/.."
check_name=probes
# shellcheck source=scripts/gpu_check_lib.sh
source scripts/gpu_check_lib.sh
stages="${LMOE_CHECK_STAGES:-build probe stream}"

machine_info

if wants build; then
  configure_cuda OFF
  build_cuda 16
fi

if wants probe && [ -x build/cuda/benchmarks/lmoe_spin_probe ]; then
  # Whether spinning kernels of several streams run together on this GPU, under the queue counts
  # and module loading modes that matter for ranks sharing a GPU (docs/p2p.md).
  for env in "CUDA_DEVICE_MAX_CONNECTIONS=8" "CUDA_DEVICE_MAX_CONNECTIONS=32" \
             "CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=LAZY"; do
    stage "spin probe: $env"
    name="probe_$(echo "$env" | tr ' =' '__')"
    env $env timeout 120 build/cuda/benchmarks/lmoe_spin_probe --json "$logs/$name.json" 2>&1 | tee "$logs/$name.log"
  done
fi

if wants probe && [ -x build/cuda/benchmarks/lmoe_launch_floor ]; then
  # What a graph replay costs in lmoe bench with no work in it (docs/fused.md, the replay's floor).
  stage "launch floor"
  timeout 60 build/cuda/benchmarks/lmoe_launch_floor --json "$logs/launch_floor.json" 2>&1 | tee "$logs/launch_floor.log"
fi

if wants stream && [ -x build/cuda/benchmarks/lmoe_stream_probe ]; then
  # The fused product's weight stream alone, by tile geometry and work split (docs/fused.md).
  stage "weight stream probe (K3 w_up, and one tp-8 stripe)"
  timeout 60 build/cuda/benchmarks/lmoe_stream_probe --json "$logs/stream_probe.json" 2>&1 | tee "$logs/stream_probe.log"
  timeout 60 build/cuda/benchmarks/lmoe_stream_probe --rows 896 --json "$logs/stream_probe_896.json" 2>&1 | tee -a "$logs/stream_probe.log"
fi
if wants stream && [ -x build/cuda/benchmarks/lmoe_tma_stream_probe ]; then
  # The copy engine's stream of the same weights by box shape (the chained path's copies).
  stage "TMA stream probe (K3 w_up, and one tp-8 stripe)"
  timeout 60 build/cuda/benchmarks/lmoe_tma_stream_probe --json "$logs/tma_stream_probe.json" 2>&1 | tee "$logs/tma_stream_probe.log"
  timeout 60 build/cuda/benchmarks/lmoe_tma_stream_probe --rows 896 --json "$logs/tma_stream_probe_896.json" 2>&1 | tee -a "$logs/tma_stream_probe.log"
fi

summary
