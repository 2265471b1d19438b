// LayerConfig checks and the scaled-down variant for quick CPU runs.
#include <algorithm>
#include <cmath>
#include <string>

#include "lmoe/dims.hpp"

namespace lmoe {

std::string_view activation_name(ExpertActivation activation) {
  switch (activation) {
    case ExpertActivation::silu_glu: return "silu_glu";
    case ExpertActivation::situ_glu: return "situ_glu";
    case ExpertActivation::relu2: return "relu2";
  }
  return "?";
}

std::string_view router_score_name(RouterScore score) {
  switch (score) {
    case RouterScore::sigmoid: return "sigmoid";
    case RouterScore::softmax: return "softmax";
  }
  return "?";
}

namespace {

std::string num(std::int64_t value) { return std::to_string(value); }

}  // namespace

std::optional<std::string> validate_layer_config(const LayerConfig& config, int tp) {
  const RouterConfig& router = config.router;
  if (config.d_model < 1) return "d_model: expected ≥ 1, got " + num(config.d_model);
  if (config.d_latent < 1) return "d_latent: expected ≥ 1, got " + num(config.d_latent);
  if (router.num_experts < 1 || router.num_experts > 1024) {
    return "num_experts: expected 1 … 1024, got " + num(router.num_experts);
  }
  if (router.top_k < 1 || router.top_k > 32 || router.top_k > router.num_experts) {
    return "top_k: expected 1 … min(32, num_experts = " + num(router.num_experts) + "), got " +
           num(router.top_k);
  }
  if (router.n_group < 1 || router.num_experts % router.n_group != 0) {
    return "n_group: expected a divisor of num_experts = " + num(router.num_experts) + ", got " +
           num(router.n_group);
  }
  if (router.topk_group < 1 || router.topk_group > router.n_group) {
    return "topk_group: expected 1 … n_group = " + num(router.n_group) + ", got " +
           num(router.topk_group);
  }
  const std::int64_t eligible = router.topk_group * (router.num_experts / router.n_group);
  if (eligible < router.top_k) {
    return "topk_group: its " + num(router.topk_group) + " group(s) of " +
           num(router.num_experts / router.n_group) +
           " experts hold fewer than top_k = " + num(router.top_k) + " experts";
  }
  if (!std::isfinite(router.routed_scaling_factor) || router.routed_scaling_factor <= 0.0f) {
    return "routed_scaling_factor: expected a finite value > 0, got " +
           std::to_string(router.routed_scaling_factor);
  }
  if (config.expert_intermediate < 1) {
    return "expert_intermediate: expected ≥ 1, got " + num(config.expert_intermediate);
  }
  if (config.num_shared_experts < 0 || config.shared_intermediate < 0) {
    return "shared experts: expected a count and an intermediate size ≥ 0, got " +
           num(config.num_shared_experts) + " × " + num(config.shared_intermediate);
  }
  if (config.activation == ExpertActivation::situ_glu &&
      !(std::isfinite(config.activation_beta) && config.activation_beta > 0.0f &&
        std::isfinite(config.activation_linear_beta) && config.activation_linear_beta > 0.0f)) {
    return "situ_glu: expected finite betas > 0, got " + std::to_string(config.activation_beta) +
           " and " + std::to_string(config.activation_linear_beta);
  }
  if (tp > 0) {
    // Each rank holds an equal slice of every expert's intermediate dimension.
    if (config.expert_intermediate % tp != 0) {
      return "expert_intermediate: expected a multiple of tp = " + std::to_string(tp) + ", got " +
             num(config.expert_intermediate);
    }
    if (config.shared_width() % tp != 0) {
      return "shared experts: width " + num(config.num_shared_experts) + " × " +
             num(config.shared_intermediate) + " = " + num(config.shared_width()) +
             " is not a multiple of tp = " + std::to_string(tp);
    }
  }
  return std::nullopt;
}

LayerConfig scale_down(const LayerConfig& config, int divisor) {
  if (divisor <= 1) return config;
  // Multiples of 8 keep every size divisible by tp ∈ {1, 2, 4, 8}.
  auto shrink = [divisor](std::int64_t size) {
    const std::int64_t scaled = (size / divisor + 7) / 8 * 8;
    return std::max<std::int64_t>(8, scaled);
  };
  LayerConfig small = config;
  small.d_model = shrink(config.d_model);
  small.d_latent = shrink(config.d_latent);
  small.expert_intermediate = shrink(config.expert_intermediate);
  if (config.shared_intermediate > 0)
    small.shared_intermediate = shrink(config.shared_intermediate);

  RouterConfig& router = small.router;
  const std::int64_t groups = router.n_group;
  // Enough experts that top-k still chooses (≥ 2k) and the eligible groups still hold k.
  std::int64_t experts =
      std::max({config.router.num_experts / divisor, 2 * router.top_k,
                (router.top_k * groups + router.topk_group - 1) / router.topk_group});
  experts = (experts + groups - 1) / groups * groups;
  router.num_experts = std::min(experts, config.router.num_experts);
  return small;
}

}  // namespace lmoe
