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
};

struct LayerRankResult {
  HostTensor y;       // [T, d], poisoned (all bits set) before each forward
  HostTensor routed;  // [T, l] (keep_partials)
  HostTensor shared;  // [T, d] (keep_partials)
  Routing routing;    // the last forward's
  std::optional<TailTier> tier;
  std::vector<LayerStageTimes> times;  // one per repeat
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
