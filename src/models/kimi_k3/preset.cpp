// Kimi-K3: hidden 7168, latent 3584, RMSNorm eps 1e-5, bf16 (DESIGN.md §1), and its latent MoE
// layer.
//
// Layer values: DESIGN.md gives 896 experts, top-16, shared experts 2 × 3072, sigmoid routing with
// an fp32 correction bias and scale 1.0. The rest comes from public descriptions of the released
// config.json (FlashInfer's "Kimi K3-family MegaMoE" page: num_experts 896,
// routed_expert_hidden_size 3584, moe_intermediate_size 3072, num_experts_per_token 16, hidden_act
// "situ"; an independent C engine's notes: SiTU-GLU β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin) with
// activation_situ_beta 4 and activation_situ_linear_beta 25, top-16 over the biased scores without
// expert groups, weights the renormalized unbiased scores). Not read from the checkpoint itself:
// check them against its config.json before trusting a loaded layer's numbers.
#include "models/model_presets.hpp"

namespace lmoe::models {

namespace {

LayerConfig kimi_k3_layer() {
  return {.d_model = 7168,
          .d_latent = 3584,
          .router = {.num_experts = 896,
                     .top_k = 16,
                     .n_group = 1,
                     .topk_group = 1,
                     .score = RouterScore::sigmoid,
                     .correction_bias = true,
                     .renormalize = true,
                     .routed_scaling_factor = 1.0f},
          .expert_intermediate = 3072,
          .num_shared_experts = 2,
          .shared_intermediate = 3072,
          .activation = ExpertActivation::situ_glu,
          .activation_beta = 4.0f,
          .activation_linear_beta = 25.0f,
          .latent_norm = true};
}

// The checkpoint's names (language-model tensors of the multimodal release carry the
// "language_model." prefix); routed experts are MXFP4 (w1 = gate, w3 = up, w2 = down).
LayerTensorNames kimi_k3_tensor_names() {
  const std::string moe = "language_model.model.layers.{layer}.block_sparse_moe.";
  LayerTensorNames names;
  names.router_weight = moe + "gate.weight";
  names.router_bias = moe + "gate.e_score_correction_bias";
  names.latent_down = moe + "routed_expert_down_proj.weight";
  names.latent_norm = moe + "routed_expert_norm.weight";
  names.latent_up = moe + "routed_expert_up_proj.weight";
  names.expert_gate = moe + "experts.{expert}.w1.weight";
  names.expert_up = moe + "experts.{expert}.w3.weight";
  names.expert_down = moe + "experts.{expert}.w2.weight";
  names.shared_gate = moe + "shared_experts.gate_proj.weight";
  names.shared_up = moe + "shared_experts.up_proj.weight";
  names.shared_down = moe + "shared_experts.down_proj.weight";
  names.experts_mxfp4 = true;
  return names;
}

}  // namespace

std::vector<ModelPreset> kimi_k3_presets() {
  return {{"kimi-k3",
           "Kimi-K3 latent MoE (d 7168, l 3584, 896 experts, top-16)",
           {7168, 3584},
           1e-5f,
           DType::bf16,
           kimi_k3_layer(),
           kimi_k3_tensor_names()}};
}

}  // namespace lmoe::models
