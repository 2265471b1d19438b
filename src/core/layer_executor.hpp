// The interface between LatentMoELayer and a backend: everything before the tail, i.e. the router,
// the latent down-projection, the routed experts and the shared experts of one rank.
#pragma once

#include <string_view>

#include "lmoe/communicator.hpp"
#include "lmoe/latent_moe_layer.hpp"
#include "lmoe/router.hpp"
#include "lmoe/tensor.hpp"

namespace lmoe {

class LayerExecutor {
 public:
  virtual ~LayerExecutor() = default;
  virtual std::string_view backend_name() const = 0;
  virtual MemorySpace memory_space() const = 0;
  // Inputs are validated by the caller. x [T, d] → this rank's partials: routed [T, l] (its slice
  // of every selected expert, weighted and summed) and shared [T, d]. Fills the router,
  // down_projection, experts and shared entries of `times`.
  virtual void run(ConstMatrixView x, MatrixView routed, MatrixView shared, LayerStageTimes& times,
                   StreamHandle stream) = 0;
  // The last run's routing in host memory, or nullptr where it stays on the device.
  virtual const Routing* host_routing() const { return nullptr; }
};

}  // namespace lmoe
