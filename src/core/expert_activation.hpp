// The experts' activations, one definition for the CPU backend (F = float) and the fp64 reference
// (F = double); docs/numerics.md, "The layer", states them.
#pragma once

#include <algorithm>
#include <cmath>

#include "lmoe/dims.hpp"

namespace lmoe {

template <typename F>
F sigmoid_of(F x) {
  return F(1) / (F(1) + std::exp(-x));
}

// gate is ignored by relu2 (not gated).
template <typename F>
F activate(const LayerConfig& config, F gate, F up) {
  switch (config.activation) {
    case ExpertActivation::silu_glu: return (gate * sigmoid_of(gate)) * up;
    case ExpertActivation::situ_glu: {
      const F beta = static_cast<F>(config.activation_beta);
      const F beta_linear = static_cast<F>(config.activation_linear_beta);
      return ((beta * std::tanh(gate / beta)) * sigmoid_of(gate)) *
             (beta_linear * std::tanh(up / beta_linear));
    }
    case ExpertActivation::relu2: {
      const F positive = std::max(up, F(0));
      return positive * positive;
    }
  }
  return F(0);
}

}  // namespace lmoe
