// Presets contributed by each model folder (src/models/<model>/preset.cpp).
#pragma once

#include <vector>

#include "lmoe/dims.hpp"

namespace lmoe::models {

std::vector<ModelPreset> kimi_k3_presets();
std::vector<ModelPreset> nemotron3_presets();
std::vector<ModelPreset> small_presets();

}  // namespace lmoe::models
