// LatentMoELayer: the object a user holds for one latent MoE layer on one rank. It owns this
// rank's weights, a LatentTail and (by reference) the communicator.
//
//   router on x [T, d] (replicated) → latent z = x · W_downᵀ [T, l] (replicated)
//   → routed experts in latent space, intermediate dim sliced over tp → routed_r [T, l]
//   → shared experts at d, intermediate dim sliced over tp → shared_r [T, d]
//   → LatentTail: Y = RMSNorm(Σ_r routed_r; gamma, eps) · w_upᵀ + Σ_r shared_r   [T, d], identical
//   on all ranks
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "lmoe/communicator.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/layer_options.hpp"
#include "lmoe/layer_weights.hpp"
#include "lmoe/router.hpp"
#include "lmoe/tensor.hpp"
#include "lmoe/tier.hpp"
#include "lmoe/tier_policy.hpp"

namespace lmoe {

class LayerExecutor;

class LatentMoELayer {
 public:
  // `weights` are this rank's (layer_weights.hpp: the router, projections and norm whole, the
  // experts' intermediate slices). Throws lmoe::Error on every rank, naming the argument or tensor,
  // when a rank's configuration or weights are invalid or ranks were built differently.
  // `comm` must outlive the layer.
  LatentMoELayer(LayerOptions options, Communicator& comm, LayerWeights weights);
  ~LatentMoELayer();
  LatentMoELayer(const LatentMoELayer&) = delete;
  LatentMoELayer& operator=(const LatentMoELayer&) = delete;

  const LayerOptions& options() const;
  int tp_rank() const;
  int tp_size() const;
  LatentTail& tail();

  // x: [T, d], the same on every rank; y: [T, d], the same on every rank afterwards. Runs the
  // tail's `tier` when given, else the policy's choice; returns the tier (nullopt for T = 0).
  std::optional<TailTier> forward(ConstMatrixView x, MatrixView y,
                                  std::optional<TailTier> tier = std::nullopt,
                                  StreamHandle stream = nullptr);

  // Everything before the tail: this rank's partials routed [T, l] and shared [T, d].
  void forward_partials(ConstMatrixView x, MatrixView routed, MatrixView shared,
                        StreamHandle stream = nullptr);

  // The bytes of the weights the layer was built from (packed MXFP4 experts count as packed; the
  // cuda backend still holds them dequantized on the device).
  const LayerWeightBytes& weight_bytes() const;

  // On the cuda backend this waits for the last forward's timing events (a captured forward has
  // none: all zero).
  const LayerStageTimes& last_times() const;
  // The last forward's routing in host memory (both backends keep a host copy of an eager
  // forward's; the cuda backend's device path reads it on request, waiting for the router), or
  // nullptr (a forward captured in a CUDA graph keeps its routing on the device).
  const Routing* last_routing() const;

  // cuda: forwards captured into a CUDA graph while this is on also record each stage's events as
  // external event nodes, so that every replay records them and replay_stage_times() reads them
  // (docs/layer.md, "Stage times"). Off by default: a graph timed whole holds only the work.
  void set_capture_stage_events(bool on);
  // The stage times of the latest replay of a graph captured with stage events, after waiting for
  // its events; throws lmoe::Error where no forward was captured so (always on the cpu backend).
  LayerStageTimes replay_stage_times() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lmoe
