// Kimi-K3: hidden 7168, latent 3584, RMSNorm eps 1e-5, bf16 (DESIGN.md §1).
#include "models/model_presets.hpp"

namespace lmoe::models {

std::vector<ModelPreset> kimi_k3_presets() {
  return {{"kimi-k3", "Kimi-K3 latent MoE tail (d 7168, l 3584)", {7168, 3584}, 1e-5f, DType::bf16}};
}

}  // namespace lmoe::models
