// What a latent MoE layer is built with (LayerOptions), and the time of each stage of its forward
// (LayerStageTimes). Plain data, the same for every backend.
#pragma once

#include <cstdint>

#include "lmoe/backend.hpp"
#include "lmoe/dtype.hpp"
#include "lmoe/layer_weights.hpp"
#include "lmoe/tier_policy.hpp"

namespace lmoe {

struct LayerOptions {
  LayerConfig config;
  DType dtype = DType::bf16;
  float rms_norm_eps = 1e-5f;
  Backend backend = Backend::cpu;
  PolicyConfig policy;  // the tail's tier policy
  // Ranks exchange a fingerprint of the configuration (at construction) and of each call and its
  // routing (per forward), so that a rank with bad input, another configuration or another routing
  // makes every rank fail with the same error. Must be the same on every rank.
  bool check_ranks_agree = true;
  // The tail's (TailOptions::max_tokens); the cuda layer also sizes its workspaces for it at
  // construction, so that forwards of up to max_tokens can be captured in a CUDA graph at once.
  std::int64_t max_tokens = 0;
  // cuda: eager forwards take the routed experts' device path too (captured ones always do, and so
  // does every forward of MXFP4 experts kept packed), so that an eager forward and a replay of its
  // graph give the same bits (LMOE_LAYER_DEVICE_EXPERTS=1 sets it for every layer). Ignored by the
  // cpu backend.
  bool device_experts = false;
};

// Seconds of each stage of the last forward on this rank: host wall time on the CPU backend, CUDA
// events on the cuda backend, where `shared` overlaps the other stages (docs/layer.md).
struct LayerStageTimes {
  double router = 0;
  double down_projection = 0;
  double experts = 0;
  double shared = 0;
  double tail = 0;
  // The whole forward's wall time where stages overlap (cuda: shared runs on a second stream, so
  // the sum of the stages counts that overlap twice): from the first stage's start to the tail's
  // end. 0 where the stages run one after another (cpu), and total() is the wall time.
  double forward = 0;
  double total() const { return router + down_projection + experts + shared + tail; }
  double wall() const { return forward > 0 ? forward : total(); }
};

}  // namespace lmoe
