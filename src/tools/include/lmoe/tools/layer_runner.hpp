// Runs LatentMoELayer on every rank at once (ranks on threads of this process): the harness behind
// `lmoe layer` and the layer tests. Each rank builds its layer once and runs every input.
#pragma once

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "lmoe/latent_moe_layer.hpp"

namespace lmoe {

struct LayerRunOptions {
  std::string comm;  // thread-group communicator (comm_group.hpp); empty: the backend's default
  std::optional<TailTier> tier;  // force the tail's tier
  int warmup = 0;                // untimed forwards per input before the timed ones
  int repeats = 1;               // timed forwards per input; the output of the last one is kept
  bool keep_partials = false;    // also run forward_partials and keep routed/shared
  // cuda only: per input, one forward captured into a CUDA graph (and one more with stage events),
  // replayed `warmup` times untimed and `repeats` times timed (docs/layer.md, "lmoe layer
  // --graph"); the layer is built with max_tokens ≥ every T and its eager forwards on the device
  // path, so that a replay's y can be held to the eager forward's bits.
  bool graph = false;
  bool cold_l2 = false;  // graph: the device's L2 evicted (then x read back) before each replay
};

struct LayerRankResult {
  HostTensor y;       // [T, d], poisoned (all bits set) before each forward
  HostTensor routed;  // [T, l] (keep_partials)
  HostTensor shared;  // [T, d] (keep_partials)
  Routing routing;    // the last forward's
  std::optional<TailTier> tier;
  // One per repeat; graph: from the replays of the graph captured with stage events.
  std::vector<LayerStageTimes> times;
  // graph: the seconds of each timed replay (CUDA events around it on the rank's stream), and
  // whether a replay's y had the eager forward's bits (y is the replay's, routing the eager one's).
  std::vector<double> replay_seconds;
  bool replay_matches_eager = true;
  // cuda, rank 0: how much the device memory in use on rank 0's GPU grew while every rank built
  // its layer (weights, workspaces; every rank's where the ranks share that GPU); −1 elsewhere.
  std::int64_t layer_device_bytes = -1;
};

struct LayerInputRun {
  std::vector<LayerRankResult> ranks;  // one per rank
  bool ranks_identical = true;         // every rank's y has the same bits
};

// `weights(rank)` makes rank `rank`'s weights (called on that rank's thread). Returns one entry
// per input. Errors on any rank are rethrown (the first root cause).
std::vector<LayerInputRun> run_layer_on_threads(
    const LayerOptions& options, int tp, const std::function<LayerWeights(int rank)>& weights,
    std::span<const HostTensor> inputs, const LayerRunOptions& run = {});

}  // namespace lmoe
