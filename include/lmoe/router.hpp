// The router of a latent MoE layer: scores from fp32 logits, an fp32 correction bias that only
// selects, grouped top-k with a stable tie-break, and weights from the unbiased scores.
//
// Selection is a pure function of the logits' bits, so every rank that computes the same logits
// routes identically (docs/numerics.md, "The layer").
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "lmoe/dims.hpp"

namespace lmoe {

struct Routing {
  std::int64_t num_tokens = 0;
  std::int64_t top_k = 0;
  // [T, k]: token t's experts in rank order (best first) and their weights.
  std::vector<std::int32_t> expert_ids;
  std::vector<float> weights;

  std::span<const std::int32_t> ids_of(std::int64_t token) const {
    return std::span(expert_ids)
        .subspan(static_cast<std::size_t>(token * top_k), static_cast<std::size_t>(top_k));
  }
  std::span<const float> weights_of(std::int64_t token) const {
    return std::span(weights).subspan(static_cast<std::size_t>(token * top_k),
                                      static_cast<std::size_t>(top_k));
  }
};

// Routes T tokens from their logits [T, E] (fp32, row-major). `bias` holds E values when
// config.correction_bias, else it is empty. Per token, in fp32:
//   s_e = sigmoid(logit_e)  (softmax: exp(logit_e − max) / Σ_e' exp(logit_e' − max), ids in order)
//   b_e = s_e + bias_e      (b_e = s_e without a bias)
//   n_group > 1: a group's score is the sum of its two largest b (its largest b without a bias);
//                the topk_group best groups are eligible.
//   the k best eligible experts by b; ties (equal b, +0 = −0) go to the lower id; NaN ranks last.
//   w_j = s_(e_j) / Σ_i s_(e_i) · routed_scaling_factor (the sum in rank order from +0; weights are
//   0 when it is 0); without renormalize w_j = s_(e_j) · routed_scaling_factor.
// Throws lmoe::Error naming the argument when sizes disagree or the config is invalid.
Routing select_experts(std::span<const float> logits, std::int64_t num_tokens,
                       std::span<const float> bias, const RouterConfig& config);

}  // namespace lmoe
