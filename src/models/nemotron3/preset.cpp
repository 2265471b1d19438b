// NVIDIA Nemotron 3: Super (d 4096, l 1024) and Ultra (d 8192, l 2048).
//
// Super's layer from its public config.json (n_routed_experts 512, num_experts_per_tok 22,
// moe_intermediate_size 2688, moe_latent_size 1024, n_shared_experts 1 ×
// moe_shared_expert_intermediate_size 5376, n_group 1, topk_group 1, norm_topk_prob true,
// routed_scaling_factor 5.0, mlp_hidden_act relu2, sigmoid scores with e_score_correction_bias).
// Its routed sum goes through fc2_latent_proj with no RMSNorm in between (latent_norm = false).
// Ultra's layer is not described here: its expert sizes are not known to this project yet.
#include "models/model_presets.hpp"

namespace lmoe::models {

namespace {

LayerConfig nemotron3_super_layer() {
  return {.d_model = 4096,
          .d_latent = 1024,
          .router = {.num_experts = 512,
                     .top_k = 22,
                     .n_group = 1,
                     .topk_group = 1,
                     .score = RouterScore::sigmoid,
                     .correction_bias = true,
                     .renormalize = true,
                     .routed_scaling_factor = 5.0f},
          .expert_intermediate = 2688,
          .num_shared_experts = 1,
          .shared_intermediate = 5376,
          .activation = ExpertActivation::relu2,
          .latent_norm = false};
}

// nemotron_h checkpoint names: the MoE block is layer {layer}'s "mixer"; experts are not gated.
LayerTensorNames nemotron3_tensor_names() {
  const std::string mixer = "backbone.layers.{layer}.mixer.";
  LayerTensorNames names;
  names.router_weight = mixer + "gate.weight";
  names.router_bias = mixer + "gate.e_score_correction_bias";
  names.latent_down = mixer + "fc1_latent_proj.weight";
  names.latent_up = mixer + "fc2_latent_proj.weight";
  names.expert_up = mixer + "experts.{expert}.up_proj.weight";
  names.expert_down = mixer + "experts.{expert}.down_proj.weight";
  names.shared_up = mixer + "shared_experts.up_proj.weight";
  names.shared_down = mixer + "shared_experts.down_proj.weight";
  return names;
}

}  // namespace

std::vector<ModelPreset> nemotron3_presets() {
  return {
      {"nemotron-3-super",
       "Nemotron 3 Super latent MoE (d 4096, l 1024, 512 experts, top-22)",
       {4096, 1024},
       1e-5f,
       DType::bf16,
       nemotron3_super_layer(),
       nemotron3_tensor_names()},
      {"nemotron-3-ultra",
       "Nemotron 3 Ultra latent MoE tail (d 8192, l 2048)",
       {8192, 2048},
       1e-5f,
       DType::bf16},
  };
}

}  // namespace lmoe::models
