// Model dimensions of the latent MoE tail and layer, and the named presets (`--preset NAME`).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "lmoe/dtype.hpp"

namespace lmoe {

struct TailDims {
  std::int64_t d_model = 0;   // d: hidden size
  std::int64_t d_latent = 0;  // l: latent size the routed experts work in
};

// How a routed or shared expert turns its up-projection(s) into the input of its down-projection.
enum class ExpertActivation : std::uint8_t {
  silu_glu,  // gated: silu(g) · u
  situ_glu,  // gated: β·tanh(g/β)·sigmoid(g) · β_lin·tanh(u/β_lin)
  relu2,     // not gated: max(u, 0)²
};
std::string_view activation_name(ExpertActivation activation);
// Gated activations read two projections (gate g and up u); relu2 reads only u.
inline bool is_gated(ExpertActivation activation) { return activation != ExpertActivation::relu2; }

// How the router turns logits into scores.
enum class RouterScore : std::uint8_t { sigmoid, softmax };
std::string_view router_score_name(RouterScore score);

// The routing of a latent MoE layer (include/lmoe/router.hpp implements it).
struct RouterConfig {
  std::int64_t num_experts = 0;  // E
  std::int64_t top_k = 0;        // k experts per token
  // Grouped top-k: experts form n_group equal groups of consecutive ids; only the topk_group
  // groups with the largest group scores are eligible. n_group = 1 disables grouping.
  std::int64_t n_group = 1;
  std::int64_t topk_group = 1;
  RouterScore score = RouterScore::sigmoid;
  // An fp32 per-expert bias added to the scores to *select* experts (never to weight them).
  bool correction_bias = true;
  // Weights = the selected unbiased scores divided by their sum (else the scores themselves),
  // then multiplied by routed_scaling_factor.
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
};

// The whole latent MoE layer: router on the full-width input, latent down-projection d → l,
// routed experts in latent space, shared experts at d, then the tail (TailDims).
struct LayerConfig {
  std::int64_t d_model = 0;   // d
  std::int64_t d_latent = 0;  // l
  RouterConfig router;
  std::int64_t expert_intermediate = 0;  // I: intermediate size of one routed expert
  std::int64_t num_shared_experts = 0;   // shared experts, fused into one MLP of width
  std::int64_t shared_intermediate = 0;  // num_shared_experts × shared_intermediate
  ExpertActivation activation = ExpertActivation::silu_glu;  // routed and shared experts alike
  float activation_beta = 1.0f;                              // situ_glu: β of the gate
  float activation_linear_beta = 1.0f;  // situ_glu: β_lin of the up projection
  // Whether the model normalizes the reduced routed latent before the up-projection (the tail's
  // RMSNorm). Without it (Nemotron 3) the tail runs with TailOptions::latent_norm = false: the cpu
  // backend only, for now.
  bool latent_norm = true;

  TailDims tail_dims() const { return {d_model, d_latent}; }
  std::int64_t shared_width() const { return num_shared_experts * shared_intermediate; }
};

// Why `config` cannot describe a layer run on tp ranks (names the field and the expected value),
// or nullopt. tp = 0 checks the config alone.
std::optional<std::string> validate_layer_config(const LayerConfig& config, int tp = 0);

// The same layer at smaller size for quick CPU runs: d, l and the intermediate sizes divided by
// `divisor` (kept multiples of 8), the expert count divided too but kept ≥ 2·top_k and a multiple
// of n_group. divisor = 1 returns the config unchanged.
LayerConfig scale_down(const LayerConfig& config, int divisor);

// Where a checkpoint keeps one layer's tensors: names with "{layer}" and, for routed experts,
// "{expert}" placeholders. Empty names: the model has no such tensor.
struct LayerTensorNames {
  std::string router_weight;  // [E, d]
  std::string router_bias;    // [E]
  std::string latent_down;    // [l, d]
  std::string latent_norm;    // [l]
  std::string latent_up;      // [d, l]
  std::string expert_gate;    // [I, l] per expert (gated activations)
  std::string expert_up;      // [I, l] per expert
  std::string expert_down;    // [l, I] per expert
  std::string shared_gate;    // [S, d] (gated activations)
  std::string shared_up;      // [S, d]
  std::string shared_down;    // [d, S]
  // Routed experts stored as MXFP4: "<name>_packed" (U8, two e2m1 values a byte) and
  // "<name>_scale" (U8 E8M0, one per 32 values along the input dimension).
  bool experts_mxfp4 = false;
};

struct ModelPreset {
  std::string name;         // "kimi-k3"
  std::string description;  // one line for `--help` and tables
  TailDims dims;
  float rms_norm_eps = 1e-5f;
  DType dtype = DType::bf16;
  // The whole layer, where the model's layer is known (its d and l equal `dims`).
  std::optional<LayerConfig> layer = std::nullopt;
  std::optional<LayerTensorNames> tensor_names = std::nullopt;
};

// Every preset the models under src/models/ define, in a stable order.
const std::vector<ModelPreset>& model_presets();
// Throws lmoe::Error naming the known presets when `name` is unknown.
const ModelPreset& find_preset(std::string_view name);

}  // namespace lmoe
