#!/usr/bin/env bash
# On a GPU machine: where the fused tier's time goes, in one call and between the tails of one graph,
# and the same per-tail benchmarks under other settings or with another build (on the frame it
# shares with scripts/gpu_check.sh: scripts/gpu_check_lib.sh). Logs and JSON go to $OUT when it is
# set, else to build/cuda/fused_timeline/.
#
#   bash benchmarks/fused_timeline.sh                 # everything
#   LMOE_CHECK_STAGES="build tailgap" bash benchmarks/fused_timeline.sh   # a subset of: build fusedtrace tailgap stripe
#   LMOE_CUDA_ARCHITECTURES=90a ...                                # build for this Hopper machine only
#   LMOE_CHECK_SETTINGS="- LMOE_FUSED_CHAINED_PACE_NS=200"        # tailgap: the settings to compare
#   LMOE_CHECK_BASE=base_src ...   # also build the source tree base_src (made where git is, e.g.
#                                  # `mkdir base_src && git archive HEAD~1 | tar -x -C base_src`),
#                                  # run every per-tail bench of tailgap and stripe with its lmoe too,
#                                  # and print the two side by side (benchmarks/bench_ab.py, $OUT/ab.md)
#
#   fusedtrace  LMOE_FUSED_TRACE: per block, when each phase of a fused call ended
#   tailgap     the chained path's timeline between tails (benchmarks/tail_timeline.py), then per
#               tail in graphs of 8 layers, for each setting of LMOE_CHECK_SETTINGS
#   stripe      one tp-8 rank's stripe through the decode kernel: its timeline, then per tail
cd "$(dirname "$0")/.."
check_name=fused_timeline
# shellcheck source=scripts/gpu_check_lib.sh
source scripts/gpu_check_lib.sh
stages="${LMOE_CHECK_STAGES:-build fusedtrace tailgap stripe}"
# The lmoe binaries the per-tail benches run: this tree's, then the base tree's where there is one.
binaries=(build/cuda/lmoe ${LMOE_CHECK_BASE:+"$LMOE_CHECK_BASE/build/cuda/lmoe"})
if [ -n "${LMOE_CHECK_BASE:-}" ]; then  # checked before anything is built or run
  if [ ! -f "$LMOE_CHECK_BASE/CMakeLists.txt" ]; then
    echo "$check_name: LMOE_CHECK_BASE=$LMOE_CHECK_BASE is not a source tree (no CMakeLists.txt there)" >&2
    exit 2
  fi
  if ! wants build && [ ! -x "$LMOE_CHECK_BASE/build/cuda/lmoe" ]; then
    echo "$check_name: LMOE_CHECK_BASE=$LMOE_CHECK_BASE has no build/cuda/lmoe and the build stage is not asked for" >&2
    exit 2
  fi
fi

machine_info

if wants build; then
  configure_cuda OFF
  if [ -n "${LMOE_CHECK_BASE:-}" ]; then
    # The base tree's lmoe, beside this tree's build (half the cores each).
    ( cd "$LMOE_CHECK_BASE" && cmake --preset cuda \
        ${LMOE_CUDA_ARCHITECTURES:+-DCMAKE_CUDA_ARCHITECTURES=$LMOE_CUDA_ARCHITECTURES} &&
      cmake --build --preset cuda -j8 --target lmoe ) >"$logs/base_build.log" 2>&1 &
    base_build=$!
    build_cuda 8
    wait "$base_build"
    rc[base_build]=$?
    [ "${rc[base_build]}" -ne 0 ] && { tail -30 "$logs/base_build.log"; echo "$check_name: base build FAILED"; }
  else
    build_cuda 16
  fi
fi

if wants fusedtrace; then
  # Where a fused call's time goes (LMOE_FUSED_TRACE: per block, when each phase ended; µs after the
  # rank's first block entered), K3 at T = 1 and 16: one rank per GPU where there are several (the
  # several-rank exchange), and one rank.
  trace_ranks=1; [ "$gpus" -ge 2 ] && trace_ranks="1 $gpus"
  for ranks in $trace_ranks; do
    for tokens in 1 16; do
      stage "fused trace: K3 tp $ranks T=$tokens"
      LMOE_FUSED_TRACE=1 timeout 60 build/cuda/lmoe bench --backend cuda -n "$ranks" --comm p2p --tiers fused \
        -t "$tokens" --warmup 5 --iters 20 --no-check >"$logs/trace_tp${ranks}_t$tokens.log" 2>&1
      rc[trace_tp${ranks}_t$tokens]=$?
      grep -E "fused trace" "$logs/trace_tp${ranks}_t$tokens.log" | head -24
    done
  done
fi

# One cold `lmoe bench` of the fused tier with one rank, per tail in graphs of `layers` layers (1:
# graph replays), the settings of the array env_args in its environment: log and JSON as
# $logs/TAG.*, each row's T, median and #wrong printed on one line. Arguments: tag, stage title,
# the T list, layers, then further bench arguments (e.g. --d-model 896). With LMOE_CHECK_BASE the
# same again right after with the base tree's lmoe, as $logs/TAG_base.*, its line marked "base:".
fused_per_tail() {
  local tag=$1 title=$2 tokens=$3 layers=$4
  shift 4
  stage "$title"
  local binary name
  for binary in "${binaries[@]}"; do
    name=$tag; [ "$binary" != build/cuda/lmoe ] && { name=${tag}_base; printf 'base: '; }
    env "${env_args[@]}" timeout 90 "$binary" bench --backend cuda -n 1 --comm p2p \
      --tiers fused -t "$tokens" "$@" --cold-l2 --iters 30 --layers "$layers" \
      --check-max-tokens 128 --json "$logs/$name.json" >"$logs/$name.log" 2>&1
    rc[$name]=$?
    grep -E "^ *[0-9]+ " "$logs/$name.log" | awk '{print $1, $6, $NF}' | tr '\n' ';'
    echo
  done
}

if wants tailgap; then
  # What passes between consecutive tp-1 tails in one graph: K3 T = 2 in a graph of 8 layers,
  # traced, its timeline (benchmarks/tail_timeline.py: per tail the median
  # entry, N ready, the last wgmma and the end on one time axis), then per tail in 8 layers, cold,
  # two rounds (K3 and one rank's stripe at tp 8) — for each of LMOE_CHECK_SETTINGS, a list of
  # settings separated by spaces, each "VAR=value[,VAR=value…]" or "-" for none (the default).
  for round in 1 2; do
    for setting in ${LMOE_CHECK_SETTINGS:--}; do
      env_args=(); [ "$setting" != "-" ] && IFS=, read -ra env_args <<<"$setting"
      tag=${setting//[^A-Za-z0-9]/_}
      if [ "$round" = 1 ]; then
        stage "tail timeline: K3 T=2, 8 layers, traced, $setting"
        env "${env_args[@]}" LMOE_FUSED_TRACE=1 timeout 60 build/cuda/lmoe bench --backend cuda -n 1 \
          --comm p2p --tiers fused -t 2 --layers 8 --warmup 5 --iters 20 --no-check \
          >"$logs/timeline_$tag.log" 2>&1
        rc[timeline_$tag]=$?
        python3 benchmarks/tail_timeline.py "$logs/timeline_$tag.log" --json "$logs/timeline_$tag.json"
      fi
      for spec in "k3:" "stripe896:--d-model 896"; do
        name=${spec%%:*}; args=${spec#*:}
        # shellcheck disable=SC2086  # $args: further bench arguments, split on purpose
        fused_per_tail "tailgap_${name}_${tag}_r$round" \
          "per tail, 8 layers, $name, $setting (round $round)" 1,4,16,32,64,128 8 $args
      done
    done
  done
fi

if wants stripe; then
  # One rank's 896-row stripe at K3 tp 8 as one GPU's d (a tp-8 rank's share of the tail at decode
  # sizes): the decode kernel's timeline at T = 1 and 4 in a graph of 8 layers (the pair
  # instance as routed, and the single instance with the chained path off and no pair), through
  # benchmarks/tail_timeline.py --kernel decode; then per tail, cold, two rounds, and as replays, at
  # T = 1 … 5 as routed against LMOE_FUSED_DECODE_PAIR=0 (the chained path takes those calls).
  for spec in "pair:" "single:LMOE_FUSED_CHAINED=0,LMOE_FUSED_DECODE_PAIR=0"; do
    name=${spec%%:*}; env_args=(); [ -n "${spec#*:}" ] && IFS=, read -ra env_args <<<"${spec#*:}"
    for tokens in 1 4; do
      # With LMOE_CHECK_BASE, the base tree's kernel traced too (its timeline has the points its
      # trace had then).
      for binary in "${binaries[@]}"; do
        tag=stripe_timeline_${name}_t$tokens; tree=""
        [ "$binary" != build/cuda/lmoe ] && { tag=${tag}_base; tree=" (base)"; }
        stage "stripe timeline: $name, T=$tokens, 8 layers, traced$tree"
        env "${env_args[@]}" LMOE_FUSED_TRACE=1 timeout 60 "$binary" bench --backend cuda -n 1 \
          --comm p2p --tiers fused -t "$tokens" --d-model 896 --layers 8 --warmup 5 --iters 20 \
          --no-check >"$logs/$tag.log" 2>&1
        rc[$tag]=$?
        python3 benchmarks/tail_timeline.py --kernel decode "$logs/$tag.log" --json "$logs/$tag.json"
      done
    done
  done
  for round in 1 2; do
    for spec in "routed:" "nopair:LMOE_FUSED_DECODE_PAIR=0"; do
      name=${spec%%:*}; env_args=(); [ -n "${spec#*:}" ] && IFS=, read -ra env_args <<<"${spec#*:}"
      for layers in 8 1; do
        [ "$layers" = 1 ] && [ "$round" = 2 ] && continue
        fused_per_tail "stripe_${name}_L${layers}_r$round" \
          "stripe per tail: $name, $layers layer(s) (round $round)" 1,2,3,4,5 "$layers" --d-model 896
      done
    done
  done
fi

if [ -n "${LMOE_CHECK_BASE:-}" ] && compgen -G "$logs/*_base.json" >/dev/null; then
  # Every bench that ran with both trees, side by side (benchmarks/bench_ab.py: this − base per row).
  stage "A/B: this tree against $LMOE_CHECK_BASE"
  python3 benchmarks/bench_ab.py --dir "$logs" --json "$logs/ab.json" | tee "$logs/ab.md"
  rc[ab]=${PIPESTATUS[0]}
fi


summary
