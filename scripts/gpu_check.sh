#!/usr/bin/env bash
# On a GPU machine, in one run: configure the `cuda` preset, build, run the GPU test binaries
# (CUDA kernels and tiers over every communicator, NCCL, MPI), the kernel benchmark and `lmoe bench`,
# and print a summary. Logs and JSON go to $OUT when it is set (a folder the caller collects), else
# to build/cuda/gpu_check/. Every stage has its own time limit, so a hang costs one stage.
# Probes, Nsight profiles and the fused tier's traces and A/B runs are benchmarks/probes.sh,
# benchmarks/profile.sh and benchmarks/fused_timeline.sh, on the same frame (scripts/gpu_check_lib.sh).
#
#   bash scripts/gpu_check.sh            # everything that this machine's GPU count allows
#   LMOE_CHECK_STAGES="build tests" bash scripts/gpu_check.sh   # a subset of: build tests python opbench sidebyside p2p graphs p2pshared hardening fused fusedturns sanitize sanitizempi fusedbench layer grouped baseline scaling nccl kernels bench bench1 tune policy run
#   LMOE_CUDA_ARCHITECTURES=90a ...                                # build for this Hopper machine only
cd "$(dirname "$0")/.."
check_name=gpu_check
# shellcheck source=scripts/gpu_check_lib.sh
source scripts/gpu_check_lib.sh
# The default: the build, the main test suites and benchmarks; with several GPUs also the PyTorch baseline.
default_stages="build tests p2p graphs nccl kernels bench bench1"
[ "$gpus" -ge 2 ] && default_stages="$default_stages baseline"
stages="${LMOE_CHECK_STAGES:-$default_stages}"

machine_info

if wants build; then
  configure_cuda OFF
  build_cuda 16
fi

gtest() {  # name, limit in seconds, binary, gtest filter, then any further gtest arguments
  local name=$1 limit=$2 binary=$3 filter=$4
  shift 4
  stage "$name"
  timeout "$limit" "$binary" --gtest_filter="$filter" "$@" >"$logs/$name.log" 2>&1
  rc[$name]=$?
  grep -E "^\[ (parity|k3|nccl|p2p|norm) " "$logs/$name.log" | head -80
  grep -E "^\[  FAILED  \]|exception with|PASSED|SKIPPED \]" "$logs/$name.log" | sort -u | head -30
  [ "${rc[$name]}" -eq 124 ] && echo "gpu_check: $name stopped at $limit s"
}

if wants tests; then
  # Everything except the p2p communicator (its own stages below) and, when that stage runs too,
  # the fused tier (so that its soak does not run twice).
  excluded='P2p*:*p2p*'
  wants fused && excluded="$excluded:Fused*:*FusedParity*"
  wants graphs && excluded="$excluded:*DeviceToken*"
  gtest cuda_tests 300 build/cuda/tests/lmoe_cuda_tests "-$excluded"
fi

if wants python; then
  # The PyTorch package built against this machine's torch with its CUDA ops (python/torch.cmake),
  # then every test of tests/python, the GPU ones included. Needs scikit-build-core and pytest
  # importable by python3; the package goes to $logs/site, not into python3's environment.
  stage "python: pip install . (CUDA ops) and pytest tests/python"
  rm -rf "$logs/site"
  LMOE_PYTHON_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 420 python3 -m pip install -q \
    --no-build-isolation --no-deps --target "$logs/site" \
    ${LMOE_CUDA_ARCHITECTURES:+-Ccmake.define.CMAKE_CUDA_ARCHITECTURES=$LMOE_CUDA_ARCHITECTURES} . \
    >"$logs/python_build.log" 2>&1
  rc[python_build]=$?
  tail -5 "$logs/python_build.log"
  if [ "${rc[python_build]}" -eq 0 ]; then
    PYTHONPATH="$logs/site${PYTHONPATH:+:$PYTHONPATH}" timeout 400 python3 -m pytest tests/python -q \
      -p no:cacheprovider -rs >"$logs/python_tests.log" 2>&1
    rc[python_tests]=$?
    tail -25 "$logs/python_tests.log"
  fi
fi

if wants opbench; then
  # The tail as a torch op against `lmoe bench` and plain PyTorch, per tail in graphs of 8 (tp 1,
  # K3 dims): the package from the python stage, the lmoe binary from the build stage.
  stage "torch op vs lmoe bench vs PyTorch: K3, tp 1, graphs of 8 tails"
  PYTHONPATH="$logs/site${PYTHONPATH:+:$PYTHONPATH}" timeout 300 python3 benchmarks/torch_op_bench.py \
    --lmoe build/cuda/lmoe -t 1,16,128,1024,8192 --json "$logs/torch_op_k3_tp1.json" \
    >"$logs/opbench.log" 2>&1
  rc[opbench]=$?
  tail -12 "$logs/opbench.log"
fi

if wants sidebyside; then
  # lmoe at tp 1 (every tier, the policy's pick and the fastest) against PyTorch, warm and cold L2,
  # with the floor from this run's GEMM and copy rates (docs/gemm.md, docs/perf.md).
  stage "lmoe vs PyTorch at tp 1: K3, graphs of 8 tails, warm and cold"
  timeout 600 python3 benchmarks/tail_vs_torch.py --lmoe build/cuda/lmoe --json "$logs/tail_vs_torch.json" \
    --markdown "$logs/tail_vs_torch.md" >"$logs/tail_vs_torch.log" 2>&1
  rc[sidebyside]=$?
  grep -E "^rates|^\|" "$logs/tail_vs_torch.log"
fi

if wants p2p; then
  p2p_filter='P2p*:*p2p*'
  wants graphs && p2p_filter="$p2p_filter:-*DeviceToken*"
  gtest p2p_tests 240 build/cuda/tests/lmoe_cuda_tests "$p2p_filter"
fi

if wants graphs; then
  # One CUDA graph for every T (docs/graphs.md), in a process of its own: NCCL reads
  # NCCL_GRAPH_MIXING_SUPPORT (which the tests set to 0) once, when it first initializes.
  gtest graphs_tests 400 build/cuda/tests/lmoe_cuda_tests '*DeviceToken*'
  for mode in graph device-tokens; do
    stage "lmoe bench --mode $mode (tp 1, p2p)"
    timeout 150 build/cuda/lmoe bench --backend cuda -n 1 --comm p2p --mode "$mode" -t 1,2,4,8,16,32,64,128,256,512 --check-max-tokens 16 \
      --json "$logs/graphs_$mode.json" >"$logs/graphs_$mode.log" 2>"$logs/graphs_$mode.err"
    rc[graphs_$mode]=$?
    cat "$logs/graphs_$mode.log"; tail -3 "$logs/graphs_$mode.err"
  done
fi

if wants p2pshared; then
  # Opt-in: p2p ranks sharing one GPU, which can stall (docs/p2p.md), with per-block progress in
  # every failure message.
  stage "p2p ranks sharing a GPU (diagnostics)"
  LMOE_P2P_SHARED_GPU=1 LMOE_P2P_DIAGNOSE=1 LMOE_P2P_TIMEOUT_MS=3000 timeout 250 build/cuda/tests/lmoe_cuda_tests \
    --gtest_filter='P2p*:*p2p*:-*Fused*' >"$logs/p2pshared.log" 2>&1
  rc[p2pshared]=$?
  grep -E "exception with|waited" "$logs/p2pshared.log" | cut -c1-400 | head -8
  grep -E "^\[  FAILED  \].*\(|PASSED" "$logs/p2pshared.log" | sed 's/, where GetParam.*//' | sort -u | head -20
  grep -E "^\[ parity" "$logs/p2pshared.log" | head -60
fi

if wants hardening; then
  # The communicators' and fused kernels' failure and soak tests with ranks sharing this GPU, each
  # group in a process of its own: an illegal address is sticky, and would fail every later test of
  # the process (docs/testing.md's failure-class table names each test).
  hardening_groups=(
    'P2p.*:P2pLayoutAgreement.*'
    'P2pCollectivesAtTheProductionLayout.*'
    'P2pKilledRank.*'
    'FusedFailureText.*:Fused.FailedConstructions*:Fused.OneRanksWaits*:Fused.RanksThatLayOut*:Fused.DifferentMaxTokens*'
    'Fused.DeviceTPast*:Fused.RanksReplayingDifferentT*:Fused.DecodeExchangeKeepsNegativeZero*'
    'Fused.SoakOfTheKernelsInTurn*:Fused.LlLines*'
  )
  for i in "${!hardening_groups[@]}"; do
    LMOE_P2P_SHARED_GPU=1 gtest "hardening_$i" 150 build/cuda/tests/lmoe_cuda_tests "${hardening_groups[$i]}"
  done
  if [ -x build/cuda/tests/lmoe_p2p_mpi_tests ] && command -v mpirun >/dev/null; then
    stage "p2p, one process per rank (2, sharing the GPU)"
    LMOE_P2P_SHARED_GPU=1 timeout 120 mpirun -n 2 --oversubscribe --allow-run-as-root \
      build/cuda/tests/lmoe_p2p_mpi_tests >"$logs/hardening_mpi.log" 2>&1
    rc[hardening_mpi]=$?
    grep -E "^\[  FAILED  \]|PASSED|exception with" "$logs/hardening_mpi.log" | sort -u | head -12
  fi
fi

if wants fused; then
  # The fused tier with its ranks sharing this GPU (tests/cuda/test_fused_{tail,decode,chained}.cpp).
  gtest fused_tests 400 build/cuda/tests/lmoe_cuda_tests 'Fused*:*FusedParity*:CudaTailTp1*'
  grep -E "^\[ fused" "$logs/fused_tests.log"
fi

if wants fusedturns; then
  # The decode and general kernels taking turns on one workspace with several ranks, no host
  # synchronization between calls (docs/fused.md). Repeated: a queue-order race shows up only
  # sometimes. If it stops, once more with more hardware queues per GPU, which
  # tells a false dependency between ranks' streams from a protocol fault.
  gtest fused_turns 200 build/cuda/tests/lmoe_cuda_tests 'Fused.TheKernelsTakeTurns*:*DecodeKernelWithSeveralRanks*' \
    --gtest_repeat=3
  grep -E "^\[ fused" "$logs/fused_turns.log" | sort | uniq -c
  if [ "${rc[fused_turns]}" -ne 0 ]; then
    stage "fused turns again, CUDA_DEVICE_MAX_CONNECTIONS=32"
    CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 120 build/cuda/tests/lmoe_cuda_tests \
      --gtest_filter='Fused.TheKernelsTakeTurns*' >"$logs/fused_turns32.log" 2>&1
    rc[fused_turns32]=$?
    grep -E "^\[ fused|FAILED|exception" "$logs/fused_turns32.log" | sort -u | head -20
  fi
fi

if wants sanitize; then
  if command -v compute-sanitizer >/dev/null; then
    # One small fused run under memcheck and racecheck (one rank: the sanitizer serializes kernels,
    # and ranks spinning on each other would then wait for each other until the timeout). Its sizes
    # run all three kernels of one rank: the decode kernel, the chained path (on compute 9.0) and
    # the general kernel; then the chained path with every split of K (1 … 16 blocks a cluster).
    for tool in memcheck racecheck; do
      stage "compute-sanitizer $tool"
      timeout 300 compute-sanitizer --tool $tool --error-exitcode 3 build/cuda/tests/lmoe_cuda_tests \
        --gtest_filter='TpDtype/FusedParity.*/tp1_bf16:Fused.ChainedPathSplitsK*' >"$logs/sanitize_$tool.log" 2>&1
      rc[sanitize_$tool]=$?
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$logs/sanitize_$tool.log" | head -5
    done
  fi
fi

if wants sanitizempi; then
  # The paths with several ranks under the sanitizer too (the decode kernel's LL exchange, the
  # general kernel's staged one, the p2p rounds): one process per GPU, each under its own
  # compute-sanitizer, so that a process whose kernels the tool serializes does not stop its peers
  # (ranks as threads of one process cannot run under it: their kernels spin on each other). The
  # waits get two minutes, as the tool slows every kernel down. Needs 2 GPUs and MPI.
  if [ "$gpus" -ge 2 ] && command -v compute-sanitizer >/dev/null && [ -x build/cuda/tests/lmoe_p2p_mpi_tests ]; then
    for tool in memcheck racecheck; do
      stage "compute-sanitizer $tool, two p2p processes (mpirun -n 2)"
      LMOE_P2P_TIMEOUT_MS=120000 timeout 220 mpirun -n 2 --oversubscribe --allow-run-as-root -x LMOE_P2P_TIMEOUT_MS \
        compute-sanitizer --tool $tool --error-exitcode 3 build/cuda/tests/lmoe_p2p_mpi_tests --gtest_color=no \
        --gtest_filter='P2pProcesses.EveryTierMeetsItsContractEagerAndCaptured' >"$logs/sanitize_mpi_$tool.log" 2>&1
      rc[sanitize_mpi_$tool]=$?
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$logs/sanitize_mpi_$tool.log" | sort | uniq -c | head -6
    done
  else
    echo "gpu_check: sanitizempi skipped (needs 2 GPUs, MPI and compute-sanitizer)"
  fi
fi

if wants fusedbench; then
  # The fused tier against overlap at decode sizes (graph replays). One GPU: K3 at tp 1 (the whole
  # tail on one GPU); one rank's compute at K3 tp 8 (norm + the 896-column stripe's product + add,
  # i.e. a tp-1 tail with d = 896); tp 2 and 8 with the ranks sharing this GPU (the protocol's cost
  # on one GPU, not a multi-GPU figure). Several GPUs: one rank per GPU, fused over p2p side by side
  # with overlap over p2p and over NCCL.
  # One rank: warm and with the weights evicted from L2 before each replay (--cold-l2, as in a
  # model; docs/bench.md); ranks sharing a GPU share its L2, so those stay warm.
  specs=("k3_tp1:-n 1 --comm p2p" "stripe896_tp1:-n 1 --comm p2p --d-model 896 --d-latent 3584"
         "k3_tp1_cold:-n 1 --comm p2p --cold-l2"
         "stripe896_tp1_cold:-n 1 --comm p2p --d-model 896 --d-latent 3584 --cold-l2")
  if [ "$gpus" -ge 2 ]; then
    specs+=("k3_tp$gpus:-n $gpus --comm p2p,nccl" "k3_tp${gpus}_cold:-n $gpus --comm p2p,nccl --cold-l2")
  else
    specs+=("k3_tp2_shared:-n 2 --comm p2p" "k3_tp8_shared:-n 8 --comm p2p")
  fi
  for spec in "${specs[@]}"; do
    name=${spec%%:*}; args=${spec#*:}
    stage "lmoe bench fused vs overlap: $name"
    LMOE_P2P_SHARED_GPU=1 timeout 150 build/cuda/lmoe bench --backend cuda $args --tiers fused,overlap \
      -t 1,2,4,8,16,32,64,128,256 --check-max-tokens 256 --json "$logs/fused_$name.json" >"$logs/fused_$name.log" 2>"$logs/fused_$name.err"
    rc[fused_$name]=$?
    cat "$logs/fused_$name.log"; tail -3 "$logs/fused_$name.err"
  done
  # The general kernel at the decode kernel's sizes with several ranks (LMOE_FUSED_DECODE=0), for
  # the two kernels side by side (the rows above ran the decode kernel at T ≤ 16): one rank per GPU
  # where there are several, else two ranks sharing this GPU.
  # (Cold weights only with a GPU per rank: ranks sharing a GPU share its L2.)
  colds=("")
  if [ "$gpus" -ge 2 ]; then decode_args="-n $gpus --comm p2p"; colds+=("--cold-l2"); else decode_args="-n 2 --comm p2p"; fi
  for cold in "${colds[@]}"; do
    name="k3_general_several${cold:+_cold}"
    stage "lmoe bench fused (general kernel, LMOE_FUSED_DECODE=0) vs overlap: $name"
    LMOE_FUSED_DECODE=0 LMOE_P2P_SHARED_GPU=1 timeout 150 build/cuda/lmoe bench --backend cuda $decode_args $cold \
      --tiers fused,overlap -t 1,2,4,8,16 --check-max-tokens 16 --json "$logs/fused_$name.json" \
      >"$logs/fused_$name.log" 2>"$logs/fused_$name.err"
    rc[fused_$name]=$?
    cat "$logs/fused_$name.log"; tail -3 "$logs/fused_$name.err"
  done
fi

if wants layer; then
  # The whole layer on the GPU (docs/layer.md): K3 dims with the experts scaled down (lmoe layer's
  # default), 4 ranks sharing the GPU, checked against fp64 and the CPU backend, stage times per T.
  stage "lmoe layer --backend cuda (K3, scaled experts, tp 4)"
  timeout 240 build/cuda/lmoe layer --backend cuda -n 4 -t 1,16,128,1024 --json "$logs/layer_cuda_k3_tp4.json" \
    >"$logs/layer.log" 2>"$logs/layer.err"
  rc[layer]=$?
  cat "$logs/layer.log"; tail -3 "$logs/layer.err"
  # Kimi-K3's own dims with 1/8 of its experts (fits one GPU), the device path, stage times and
  # the forward's wall time per T (not checked: the fp64 and CPU references take minutes there).
  stage "lmoe layer --backend cuda (K3 dims, 112 experts, tp 1, device experts)"
  LMOE_LAYER_DEVICE_EXPERTS=1 timeout 150 build/cuda/lmoe layer --backend cuda -n 1 --scale 1 --experts 112 \
    -t 1,16,128,1024,8192 --no-check --json "$logs/layer_cuda_k3_e112.json" 2>&1 | tail -8
  if [ -x build/cuda/benchmarks/lmoe_grouped_gemm_bench ]; then
    # The routed experts' grouped GEMM (device path) at K3's expert dims, tp 8, against the
    # per-expert cuBLASLt loop, the copy bandwidth and the GEMM rate of the same run.
    stage "grouped GEMM benchmark (K3 experts, tp 8)"
    timeout 120 build/cuda/benchmarks/lmoe_grouped_gemm_bench --preset kimi-k3 --tp 8 -t 1,16,128,1024,8192 \
      --tiles automatic,m16,m64,m128,m128_wide,wgmma,wgmma_m256 --json "$logs/grouped_gemm.json" >"$logs/grouped_gemm.log" 2>&1
    rc[grouped_gemm]=$?
    cat "$logs/grouped_gemm.log"
    # The same at the layer's shape on one GPU (112 experts, the whole intermediate): the experts'
    # GEMM rate at T = 8192 against the GPU's.
    stage "grouped GEMM benchmark (K3 experts, tp 1, 112 experts)"
    timeout 120 build/cuda/benchmarks/lmoe_grouped_gemm_bench --preset kimi-k3 --tp 1 --experts 112 -t 1024,8192 \
      --tiles automatic,wgmma_m256 --json "$logs/grouped_gemm_e112.json" >"$logs/grouped_gemm_e112.log" 2>&1
    rc[grouped_gemm_e112]=$?
    cat "$logs/grouped_gemm_e112.log"
  fi
fi

if wants grouped; then
  # The experts' grouped GEMM alone, for work on its kernels: its tests (and the layer's, which run
  # it), then the benchmark at the layer's one-GPU shape and at tp 8, for the tiles in
  # LMOE_GROUPED_TILES (default: automatic and wgmma_m256).
  gtest grouped_tests 300 build/cuda/tests/lmoe_cuda_tests \
    '*GroupedGemm*:DeviceSlotSort.*:CudaLayer*:*CudaLayerParity*:*CudaLayerCapture*:CudaTokenChunks.*'
  tiles="${LMOE_GROUPED_TILES:-automatic,wgmma_m256}"
  for shape in "e112:--tp 1 --experts 112 -t 1024,8192" "tp8:--tp 8 -t 1024,4096,8192"; do
    name=${shape%%:*}; args=${shape#*:}
    stage "grouped GEMM benchmark ($name: $args; tiles $tiles)"
    # shellcheck disable=SC2086
    timeout 150 build/cuda/benchmarks/lmoe_grouped_gemm_bench --preset kimi-k3 $args --tiles "$tiles" \
      --no-loop --json "$logs/grouped_$name.json" >"$logs/grouped_$name.log" 2>&1
    rc[grouped_$name]=$?
    cat "$logs/grouped_$name.log"
  done
fi

if wants baseline; then
  # lmoe beside the reference system: its overlap and column tails in plain PyTorch
  # (torch.distributed + torch.mm) on every GPU of this machine, then lmoe's tail on the very input
  # the baseline dumped (T = 128), compared element by element. Needs ≥ 2 GPUs and torch.
  if [ "$gpus" -ge 2 ] && python3 -c "import torch, safetensors" 2>/dev/null; then
    stage "PyTorch baseline: torchrun, $gpus GPUs"
    timeout 300 torchrun --standalone --nproc_per_node="$gpus" scripts/torch_baseline.py --graph \
      -t "${LMOE_BENCH_TOKENS:-1,16,128,256,1024,4096,8192}" --json "$logs/torch_baseline.json" >"$logs/baseline.log" 2>&1
    rc[baseline]=$?
    grep -vE "^\[|Warning" "$logs/baseline.log" | head -40
    timeout 120 torchrun --standalone --nproc_per_node="$gpus" scripts/torch_baseline.py -t 128 --iters 1 --warmup 1 \
      --dump-dir "$logs/baseline_t128" >"$logs/baseline_dump.log" 2>&1
    for tier in overlap column; do
      stage "lmoe tail vs the baseline, $tier, T = 128, nccl"
      timeout 120 build/cuda/lmoe tail --backend cuda --comm nccl --tier "$tier" --check \
        --input "$logs/baseline_t128/t128_input.safetensors" --output "$logs/baseline_t128/t128_lmoe_$tier.safetensors" 2>&1 | tail -3
      python3 scripts/compare_safetensors.py "$logs/baseline_t128/t128_$tier.safetensors" \
        "$logs/baseline_t128/t128_lmoe_$tier.safetensors" --max-rel 0.02
      rc[baseline_$tier]=$?
    done
    rm -f "$logs"/baseline_t128/t128_input.safetensors  # 100+ MB: not worth bringing back
  else
    echo "gpu_check: baseline skipped (needs >= 2 GPUs and python3 with torch and safetensors)"
  fi
fi

if wants scaling; then
  # lmoe's scaling with tp: every tier at K3 dims over nccl and p2p at each tp of LMOE_SCALING_TPS (default
  # 2 4 8; those above this machine's GPU count are skipped), one rank per GPU on the first tp GPUs,
  # weights evicted from L2 before each timed iteration, with the floors (docs/bench.md), then the
  # decode sizes per tail in graphs of 8 layers (what a model's graph pays), and the PyTorch baseline
  # on the same GPUs. A tp's sweep can take minutes: one tp per run (LMOE_SCALING_TPS=8) on a large
  # machine; LMOE_BENCH_TOKENS shortens it.
  for tp in ${LMOE_SCALING_TPS:-2 4 8}; do
    if [ "$tp" -gt "$gpus" ]; then echo "gpu_check: scaling tp $tp skipped ($gpus GPUs)"; continue; fi
    visible=$(seq -s, 0 $((tp - 1)))
    stage "scaling: lmoe bench, K3, tp $tp on GPUs $visible, nccl and p2p"
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$visible timeout 500 build/cuda/lmoe bench --backend cuda -n "$tp" --comm nccl,p2p \
      ${LMOE_BENCH_TOKENS:+-t $LMOE_BENCH_TOKENS} --check-max-tokens 256 --cold-l2 --json "$logs/scaling_k3_tp$tp.json" \
      >"$logs/scaling_tp$tp.log" 2>"$logs/scaling_tp$tp.err"
    rc[scaling_tp$tp]=$?
    cat "$logs/scaling_tp$tp.log"; tail -3 "$logs/scaling_tp$tp.err"
    stage "scaling: per tail in graphs of 8 layers, tp $tp, decode sizes"
    CUDA_VISIBLE_DEVICES=$visible timeout 300 build/cuda/lmoe bench --backend cuda -n "$tp" --comm nccl,p2p \
      -t 1,4,16,32,64,128,256 --check-max-tokens 256 --cold-l2 --layers 8 --json "$logs/scaling_layers8_k3_tp$tp.json" \
      >"$logs/scaling_layers8_tp$tp.log" 2>"$logs/scaling_layers8_tp$tp.err"
    rc[scaling_layers8_tp$tp]=$?
    cat "$logs/scaling_layers8_tp$tp.log"; tail -3 "$logs/scaling_layers8_tp$tp.err"
    stage "scaling: fused per tail, the decode kernel launched programmatically, tp $tp"
    # Against the fused rows of the run above (launched after the previous kernel's end, the default
    # with several ranks; LMOE_FUSED_DECODE_PROGRAMMATIC=1 lets it start before that end).
    CUDA_VISIBLE_DEVICES=$visible LMOE_FUSED_DECODE_PROGRAMMATIC=1 timeout 200 build/cuda/lmoe bench --backend cuda \
      -n "$tp" --comm p2p --tiers fused -t 1,2,4,8,16 --check-max-tokens 16 --cold-l2 --layers 8 \
      --json "$logs/scaling_decode_programmatic_tp$tp.json" \
      >"$logs/scaling_decode_programmatic_tp$tp.log" 2>"$logs/scaling_decode_programmatic_tp$tp.err"
    rc[scaling_decode_programmatic_tp$tp]=$?
    cat "$logs/scaling_decode_programmatic_tp$tp.log"; tail -3 "$logs/scaling_decode_programmatic_tp$tp.err"
    if python3 -c "import torch, safetensors" 2>/dev/null; then
      stage "scaling: PyTorch baseline, tp $tp on GPUs $visible"
      # L2 evicted before each timed iteration, as in the lmoe sweep above, then the two side by side
      # (scripts/baseline_table.py: the T both measured, lmoe's fastest against the baseline's and
      # against the floor the sweep recorded).
      CUDA_VISIBLE_DEVICES=$visible timeout 300 torchrun --standalone --nproc_per_node="$tp" scripts/torch_baseline.py --graph \
        --cold-l2 -t "${LMOE_BENCH_TOKENS:-1,16,128,256,1024,4096,8192}" --json "$logs/scaling_torch_tp$tp.json" \
        >"$logs/scaling_torch_tp$tp.log" 2>&1
      rc[scaling_torch_tp$tp]=$?
      grep -vE "^\[|Warning" "$logs/scaling_torch_tp$tp.log" | head -30
      stage "scaling: lmoe against the PyTorch baseline, tp $tp"
      python3 scripts/baseline_table.py "$logs/scaling_k3_tp$tp.json" "$logs/scaling_torch_tp$tp.json" \
        --json "$logs/scaling_vs_torch_tp$tp.json" | tee "$logs/scaling_vs_torch_tp$tp.md"
      rc[scaling_vs_torch_tp$tp]=${PIPESTATUS[0]}
    fi
  done
fi

mpi_tests() {  # name, limit in seconds, processes, binary, environment (VAR=value ...)
  local name=$1 limit=$2 ranks=$3 binary=$4; shift 4
  local exports=() assignment
  for assignment in "$@"; do exports+=(-x "${assignment%%=*}"); done
  env "$@" timeout "$limit" mpirun -n "$ranks" --oversubscribe --allow-run-as-root "${exports[@]}" "$binary" --gtest_color=no \
    >"$logs/$name.log" 2>&1
  rc[$name]=$?
  grep -E "^\[ p2p|skipped:" "$logs/$name.log" | cut -c1-300 | head -8
  grep -E "^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \] [0-9]|exception with" "$logs/$name.log" | sort -u | head -20
  [ "${rc[$name]}" -eq 124 ] && echo "gpu_check: $name stopped at $limit s"
}

if wants nccl && [ -x build/cuda/tests/lmoe_nccl_tests ]; then
  gtest nccl_tests 240 build/cuda/tests/lmoe_nccl_tests '*'
  if [ "$gpus" -ge 2 ] && [ -x build/cuda/tests/lmoe_nccl_mpi_tests ]; then
    stage "nccl, one process per GPU (mpirun -n $gpus)"
    mpi_tests nccl_mpi 180 "$gpus" build/cuda/tests/lmoe_nccl_mpi_tests
  fi
fi
if wants nccl && [ -x build/cuda/tests/lmoe_p2p_mpi_tests ]; then
  # The p2p communicator between processes (CUDA IPC handles, shared-memory control path).
  if [ "$gpus" -ge 2 ]; then
    stage "p2p, one process per GPU (mpirun -n $gpus)"
    mpi_tests p2p_mpi 300 "$gpus" build/cuda/tests/lmoe_p2p_mpi_tests
  else
    # Two processes on the one GPU (opt-in): IPC within a device; without MPS the GPU time-slices
    # between the two contexts, so every round waits for a switch (slow, not a hang).
    stage "p2p, two processes sharing one GPU (mpirun -n 2, LMOE_P2P_SHARED_GPU=1)"
    mpi_tests p2p_mpi_shared 400 2 build/cuda/tests/lmoe_p2p_mpi_tests LMOE_P2P_SHARED_GPU=1 LMOE_P2P_DIAGNOSE=1
  fi
fi

if wants kernels && [ -x build/cuda/benchmarks/lmoe_kernel_bench ]; then
  stage "kernel benchmark (copy bandwidth, RMSNorm, GEMMs)"
  timeout 180 build/cuda/benchmarks/lmoe_kernel_bench --json "$logs/kernels.json" >"$logs/kernels.log" 2>&1
  rc[kernels]=$?
  cat "$logs/kernels.log"
fi

if wants kernels && [ "$gpus" -ge 2 ] && [ -x build/cuda/benchmarks/lmoe_comm_bench ]; then
  # The communicators' collectives alone, one rank per GPU (docs/p2p.md, "Bandwidth at large T").
  stage "comm benchmark (p2p and NCCL, $gpus ranks)"
  timeout 180 build/cuda/benchmarks/lmoe_comm_bench --comm p2p,nccl --bytes 1048576,8388608,67108864,268435456 \
    --json "$logs/comm.json" 2>&1 | tee "$logs/comm.log"
fi

if wants bench; then
  # Kimi-K3 dims, bf16; one GPU: 8 ranks share it; several: one rank per GPU plus nccl.
  ranks=8; comms="cuda-threads"  # p2p ranks sharing a GPU: opt-in (docs/p2p.md)
  if [ "$gpus" -ge 2 ]; then ranks=$gpus; comms="nccl,p2p,cuda-threads"; fi
  stage "lmoe bench: K3, tp $ranks, comms $comms"
  timeout 300 build/cuda/lmoe bench --backend cuda -n "$ranks" --comm "$comms" \
    -t "${LMOE_BENCH_TOKENS:-1,16,128,256,1024,4096,8192}" --check-max-tokens "${LMOE_BENCH_CHECK:-256}" \
    --json "$logs/bench_k3_tp$ranks.json" >"$logs/bench.log" 2>"$logs/bench.err"
  rc[bench]=$?
  cat "$logs/bench.log"; tail -5 "$logs/bench.err"
fi

if wants bench1; then
  # tp = 1 (the whole tail on one GPU), captured in CUDA graphs through p2p (no peers: its rounds
  # only stage and publish to themselves): the latency of norm + GEMM + add per T.
  stage "lmoe bench: K3, tp 1, p2p (graph replays)"
  timeout 120 build/cuda/lmoe bench --backend cuda -n 1 --comm p2p -t 1,16,128,1024,8192 --check-max-tokens 128 \
    --json "$logs/bench_k3_tp1.json" >"$logs/bench1.log" 2>"$logs/bench1.err"
  rc[bench1]=$?
  cat "$logs/bench1.log"; tail -3 "$logs/bench1.err"
fi

if wants tune; then
  # Tier tables for this machine at K3 dims, each checked by a fresh sweep against the fastest tier
  # measured. Several GPUs: one rank per GPU, for every comm of LMOE_TUNE_COMMS (default: p2p and
  # nccl), named as the tables lmoe carries (docs/tuning.md): a checked one can be copied as it is to
  # src/models/kimi_k3/tier_tables/. One GPU: 8 ranks sharing it through cuda-threads (a table for
  # this machine only: ranks sharing a GPU are not what a built-in table describes). With one rank
  # per GPU the weights are evicted from L2 before each timed forward, as the built-in tables were
  # measured (cold numbers are meant for one rank per GPU).
  cold_args=()
  if [ "$gpus" -ge 2 ]; then
    ranks=$gpus; comms="${LMOE_TUNE_COMMS:-p2p nccl}"; cold_args=(--cold-l2)
    gpu_tag=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/^NVIDIA //' | tr 'A-Z ' 'a-z_')
  else
    ranks=8; comms=cuda-threads; gpu_tag=""
  fi
  grid_args=(); [ -n "${LMOE_TUNE_TOKENS:-}" ] && grid_args=(-t "$LMOE_TUNE_TOKENS")  # default: lmoe tune's grid
  for comm in $comms; do
    name="tiers_k3_tp${ranks}_$comm"; [ -n "$gpu_tag" ] && name="${gpu_tag}x${gpus}_tp${ranks}_$comm"
    stage "lmoe tune: K3, tp $ranks, $comm -> $name.json"
    timeout 300 build/cuda/lmoe tune --backend cuda -n "$ranks" --comm "$comm" "${grid_args[@]}" --iters 20 \
      "${cold_args[@]}" --output "$logs/$name.json" >"$logs/tune_$comm.log" 2>"$logs/tune_$comm.err"
    rc[tune_$comm]=$?
    cat "$logs/tune_$comm.log"; tail -3 "$logs/tune_$comm.err"
    stage "lmoe bench --check-table $name.json (a fresh sweep of its grid)"
    timeout 300 build/cuda/lmoe bench --backend cuda -n "$ranks" --comm "$comm" --iters 20 "${cold_args[@]}" \
      --tier-table "$logs/$name.json" --check-table --check-max-tokens 64 \
      --json "$logs/check_$name.json" >"$logs/check_$comm.log" 2>"$logs/check_$comm.err"
    rc[check_table_$comm]=$?
    tail -25 "$logs/check_$comm.log"; tail -3 "$logs/check_$comm.err"
  done
fi

if wants policy; then
  # What the tails choose here with nothing set (docs/tuning.md): for each comm, the decision at a
  # few T and where it comes from (a tier table built into lmoe for this machine, or the defaults).
  ranks=$gpus; [ "$gpus" -lt 2 ] && ranks=2
  for comm in p2p nccl; do
    for tokens in 1 32 256 4096; do
      stage "lmoe explain: K3, tp $ranks, $comm, T = $tokens"
      build/cuda/lmoe explain --backend cuda --tp "$ranks" --comm "$comm" -t "$tokens" 2>&1 | grep -E "decision|rule" | head -2
    done
  done
fi

if wants run; then
  stage "lmoe run (K3, 8 ranks, every tier against the contract)"
  timeout 240 build/cuda/lmoe run --backend cuda -n 8 -t 1,8,64,128,256,512,2048 --repeats 3 \
    --json "$logs/run_cuda_k3_tp8.json" >"$logs/run_cuda.log" 2>"$logs/run_cuda.err"
  rc[run]=$?
  cat "$logs/run_cuda.log"
fi

summary
