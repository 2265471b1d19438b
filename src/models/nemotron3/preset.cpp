// NVIDIA Nemotron 3: Super (d 4096, l 1024) and Ultra (d 8192, l 2048).
#include "models/model_presets.hpp"

namespace lmoe::models {

std::vector<ModelPreset> nemotron3_presets() {
  return {
      {"nemotron-3-super", "Nemotron 3 Super latent MoE tail (d 4096, l 1024)", {4096, 1024}, 1e-5f,
       DType::bf16},
      {"nemotron-3-ultra", "Nemotron 3 Ultra latent MoE tail (d 8192, l 2048)", {8192, 2048}, 1e-5f,
       DType::bf16},
  };
}

}  // namespace lmoe::models
