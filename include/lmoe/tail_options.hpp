// What a tail is built with (TailOptions), and the ranges of T a tail with T read on the device
// runs alike (DeviceTokenBucket). Plain data, the same for every backend.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "lmoe/backend.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/dtype.hpp"
#include "lmoe/tier.hpp"
#include "lmoe/tier_policy.hpp"

namespace lmoe {

struct TailOptions {
  TailDims dims;
  float rms_norm_eps = 1e-5f;
  // false: N = round(Σ_r routed_r), no RMSNorm (Nemotron 3 feeds the routed sum straight to its
  // latent up-projection); norm_weight is then ignored. Both backends, every tier.
  bool latent_norm = true;
  DType dtype = DType::bf16;
  Backend backend = Backend::cpu;
  // Built-in defaults; load_policy_config(process_environment()) adds a table and the environment.
  // A measured table (policy.table) must fit this tail: construction throws lmoe::Error when it was
  // measured on another GPU or for other dims, dtype, tp, backend or comm (match_tier_table), and
  // records a warning when only software versions differ (table_warnings()).
  PolicyConfig policy;
  // Before each forward, ranks exchange a fingerprint of the call (T, tier, configuration, local
  // validation result) so that a rank with bad input or a different configuration makes every
  // rank fail with the same error instead of leaving its peers waiting in a collective.
  // Must be the same on every rank (it decides whether the exchange happens at all).
  bool check_ranks_agree = true;
  // The most tokens a forward may carry. > 0: workspaces are allocated once, at construction, and
  // never move, which CUDA-graph capture requires (a larger T is an error). 0: they grow on demand
  // (a grow waits for the stream), and forwards cannot be captured.
  std::int64_t max_tokens = 0;
};

// A range of T that LatentTail::forward_device_tokens runs alike: every T in [min_tokens,
// max_tokens] runs `tier` on max_tokens rows (the fused tier reads T itself and runs T rows).
struct DeviceTokenBucket {
  std::int64_t min_tokens = 0, max_tokens = 0;
  std::optional<TailTier>
      tier;  // nullopt: no tier runs these T (a replay with one runs nothing and records an error)
  std::string reason;  // why no tier (empty when one runs)
};

}  // namespace lmoe
