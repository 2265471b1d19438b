#!/usr/bin/env bash
# On a GPU machine: Nsight Compute on lmoe's kernels, where their time goes (on the frame it shares
# with scripts/gpu_check.sh: scripts/gpu_check_lib.sh). The build stage builds with -lineinfo, so
# that the profiles name source lines (the machine code is the same). Logs go to $OUT when it is
# set, else to build/cuda/profile/. Needs ncu; without it the profile stages do nothing.
#
#   bash benchmarks/profile.sh                            # everything
#   LMOE_CHECK_STAGES="build profile" bash benchmarks/profile.sh   # a subset of: build profile decodeprofile layerprofile
#
#   profile        the fused kernel per shape (tp 1, graph replays): throughput against the peaks,
#                  warp stalls, the hottest source lines
#   decodeprofile  the routed experts' decode tile (m16), up+gate and down, K3 dims, T = 1 and 16
#   layerprofile   every kernel of a K3 layer forward at T = 8192, summed per kernel name
cd "$(dirname "$0")/.."
check_name=profile
# shellcheck source=scripts/gpu_check_lib.sh
source scripts/gpu_check_lib.sh
stages="${LMOE_CHECK_STAGES:-build profile decodeprofile layerprofile}"

machine_info

if wants build; then
  configure_cuda ON
  build_cuda 16
fi

if wants profile && command -v ncu >/dev/null; then
  # Nsight Compute on one fused kernel per shape (tp 1, graph replays): where its time goes
  # (throughput against the peaks, warp stalls, the hottest source lines). Clocks left alone.
  for spec in "stripe896_t1:--d-model 896 --d-latent 3584 -t 1" "k3_t1:-t 1" "k3_t128:-t 128"; do
    name=${spec%%:*}; args=${spec#*:}
    stage "ncu: fused $name"
    timeout 150 ncu --clock-control none --kernel-name regex:fused_ --launch-skip 6 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section Occupancy --section LaunchStats --section SourceCounters --import-source yes \
      build/cuda/lmoe bench --backend cuda -n 1 --comm p2p --tiers fused $args --warmup 2 --iters 5 --no-check \
      >"$logs/ncu_$name.log" 2>&1
    rc[ncu_$name]=$?
    grep -vE "^==PROF==|^#|^ +[0-9]+ +[0-9]+ +fused" "$logs/ncu_$name.log" | grep -E "Duration|Throughput|Warp Cycles|Stall|Eligible|Issued|Registers|Achieved|Theoretical Occ|Block Limit|Dynamic Shared|L2 Hit|Mem Busy|Max Bandwidth|Executed Ipc|No Eligible|Uncoalesced|Excessive|smsp__pcsamp|Waves|est\. speedup|OPT|WRN" | cut -c1-220 | head -60
  done
fi

if wants decodeprofile && command -v ncu >/dev/null; then
  # Nsight Compute on the routed experts' decode tile (m16: the layer's experts at T <= 16 stream
  # their weights at ~3.0-3.3 TB/s): up+gate and down at K3 dims, 112 experts, T = 1 and 16. ncu
  # prints template arguments as "GroupedShape<(int)16, ..., (bool)1>" (then ", (int)R>" where a
  # shape has runs), hence the escaped regex.
  for spec in 'up:GroupedShape<\(int\)16,.*\(bool\)1[,>]' 'down:GroupedShape<\(int\)16,.*\(bool\)0[,>]'; do
    for tokens in 1 16; do
      name=m16_${spec%%:*}_t$tokens; kernel=${spec#*:}
      stage "ncu: $name"
      timeout 120 ncu --clock-control none --kernel-name-base demangled --kernel-name "regex:$kernel" \
        --launch-skip 5 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
        --section Occupancy --section LaunchStats \
        build/cuda/benchmarks/lmoe_grouped_gemm_bench --preset kimi-k3 --tp 1 --experts 112 -t "$tokens" \
        --tiles m16 --no-loop >"$logs/ncu_$name.log" 2>&1
      rc[ncu_$name]=$?
      grep -E "Duration|Throughput|Warp Cycles|Stall|Eligible|Registers|Achieved|Theoretical Occ|Block Limit|Dynamic Shared|L2 Hit|Mem Busy|Max Bandwidth|No Eligible|Waves|Grid Size|est\. speedup|No kernels" "$logs/ncu_$name.log" | cut -c1-200 | head -40
    done
  done
fi

if wants layerprofile && command -v ncu >/dev/null; then
  # Every kernel of the K3 layer's forward at T = 8192 (112 experts, one GPU, device path, stages
  # one after another), timed by Nsight Compute: where the experts stage's time goes beyond its
  # GEMMs. Sums per kernel name over the run's forwards (one warm-up and three timed), divided by 4.
  stage "ncu: every kernel of a K3 layer forward (T = 8192, 112 experts)"
  LMOE_LAYER_SERIAL_STAGES=1 LMOE_LAYER_DEVICE_EXPERTS=1 timeout 400 ncu --clock-control none \
    --metrics gpu__time_duration.sum --csv --print-units base \
    build/cuda/lmoe layer --backend cuda -n 1 --scale 1 --experts 112 -t 8192 --no-check \
    >"$logs/ncu_layer.csv" 2>"$logs/ncu_layer.err"
  rc[layerprofile]=$?
  python3 - "$logs/ncu_layer.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, body = rows[0], rows[1:]
name = head.index("Kernel Name") if "Kernel Name" in head else head.index("Function Name")
metric, value = head.index("Metric Name"), head.index("Metric Value")
total, count = collections.defaultdict(float), collections.Counter()
for r in body:
    if r[metric] == "gpu__time_duration.sum":
        key = r[name].split("(")[0][:90]
        total[key] += float(r[value].replace(",", "")) / 1e3
        count[key] += 1
print(f"{'kernel':92} {'launches':>8} {'us per forward':>15}")
for key, us in sorted(total.items(), key=lambda kv: -kv[1]):
    print(f"{key:92} {count[key]:8d} {us / 4:15.1f}")
print(f"{'all':92} {sum(count.values()):8d} {sum(total.values()) / 4:15.1f}")
PY
fi

summary
