// The preset registry: each model folder contributes its presets; this file only lists them.
#include <string>

#include "lmoe/dims.hpp"
#include "lmoe/error.hpp"
#include "models/model_presets.hpp"

namespace lmoe {

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = [] {
    std::vector<ModelPreset> all;
    for (auto&& group : {models::kimi_k3_presets(), models::nemotron3_presets(),
                         models::small_presets()}) {
      all.insert(all.end(), group.begin(), group.end());
    }
    return all;
  }();
  return presets;
}

const ModelPreset& find_preset(std::string_view name) {
  std::string known;
  for (const ModelPreset& preset : model_presets()) {
    if (preset.name == name) return preset;
    known += (known.empty() ? "" : ", ") + preset.name;
  }
  throw Error("unknown preset '" + std::string(name) + "': expected one of " + known);
}

namespace models {
std::vector<ModelPreset> small_presets() {
  // Not a model: dims small enough for tests and quick runs, divisible by 8·tp for tp ∈ {1,2,3,4,8}
  // (d = 384 = 2^7·3 and l = 192 = 2^6·3), so every tier and the fused stripe alignment apply.
  return {{"small", "quick runs and tests (not a model)", {384, 192}, 1e-5f, DType::bf16}};
}
}  // namespace models

}  // namespace lmoe
