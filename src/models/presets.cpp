// The preset registry: each model folder contributes its presets; this file only lists them.
#include <string>

#include "lmoe/dims.hpp"
#include "lmoe/error.hpp"
#include "models/model_presets.hpp"

namespace lmoe {

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = [] {
    std::vector<ModelPreset> all;
    for (auto&& group :
         {models::kimi_k3_presets(), models::nemotron3_presets(), models::small_presets()}) {
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
  // Its layer exercises grouped top-k (4 groups of 4, the best 2 eligible) and a scale ≠ 1; the
  // intermediate sizes split over tp ∈ {1, 2, 4, 8}.
  const LayerConfig layer{.d_model = 384,
                          .d_latent = 192,
                          .router = {.num_experts = 16,
                                     .top_k = 4,
                                     .n_group = 4,
                                     .topk_group = 2,
                                     .routed_scaling_factor = 2.5f},
                          .expert_intermediate = 64,
                          .num_shared_experts = 2,
                          .shared_intermediate = 48,
                          .activation = ExpertActivation::silu_glu};
  // A plain naming of its own, so that loading can be tried on small checkpoints.
  const std::string moe = "layers.{layer}.moe.";
  LayerTensorNames names;
  names.router_weight = moe + "router.weight";
  names.router_bias = moe + "router.bias";
  names.latent_down = moe + "latent_down.weight";
  names.latent_norm = moe + "latent_norm.weight";
  names.latent_up = moe + "latent_up.weight";
  names.expert_gate = moe + "experts.{expert}.gate.weight";
  names.expert_up = moe + "experts.{expert}.up.weight";
  names.expert_down = moe + "experts.{expert}.down.weight";
  names.shared_gate = moe + "shared.gate.weight";
  names.shared_up = moe + "shared.up.weight";
  names.shared_down = moe + "shared.down.weight";
  // The same layer with its routed experts stored as MXFP4 ("<name>_packed", "<name>_scale"), as
  // Kimi-K3 ships them, so that packed loading can be tried on small checkpoints.
  LayerTensorNames mxfp4_names = names;
  mxfp4_names.experts_mxfp4 = true;
  return {
      {"small", "quick runs and tests (not a model)", {384, 192}, 1e-5f, DType::bf16, layer, names},
      {"small-mxfp4",
       "the small layer with MXFP4 routed experts (not a model)",
       {384, 192},
       1e-5f,
       DType::bf16,
       layer,
       mxfp4_names}};
}
}  // namespace models

}  // namespace lmoe
