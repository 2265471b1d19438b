#include "lmoe/router.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "lmoe/error.hpp"

namespace lmoe {

namespace {

// The ranking order of experts (and of groups): larger value first, equal values by lower index,
// NaN after every number. A strict total order on distinct indices, so sorting is deterministic.
bool ranks_before(float value_a, std::int32_t index_a, float value_b, std::int32_t index_b) {
  const bool nan_a = std::isnan(value_a);
  const bool nan_b = std::isnan(value_b);
  if (nan_a != nan_b) return nan_b;
  if (!nan_a && value_a != value_b) return value_a > value_b;
  return index_a < index_b;
}

void scores_of_row(const float* logits, std::int64_t experts, RouterScore score, float* out) {
  if (score == RouterScore::sigmoid) {
    for (std::int64_t e = 0; e < experts; ++e) out[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    return;
  }
  float max_logit = logits[0];
  for (std::int64_t e = 1; e < experts; ++e) max_logit = std::max(max_logit, logits[e]);
  float sum = 0.0f;
  for (std::int64_t e = 0; e < experts; ++e) {
    out[e] = std::exp(logits[e] - max_logit);
    sum += out[e];
  }
  for (std::int64_t e = 0; e < experts; ++e) out[e] /= sum;
}

}  // namespace

Routing select_experts(std::span<const float> logits, std::int64_t num_tokens,
                       std::span<const float> bias, const RouterConfig& config) {
  LayerConfig check;
  check.d_model = check.d_latent = check.expert_intermediate = 1;
  check.router = config;
  if (auto error = validate_layer_config(check)) throw Error("router config: " + *error);
  const std::int64_t experts = config.num_experts;
  LMOE_CHECK(num_tokens >= 0, "router: num_tokens must be ≥ 0, got " + std::to_string(num_tokens));
  LMOE_CHECK(static_cast<std::int64_t>(logits.size()) == num_tokens * experts,
             "router: logits hold " + std::to_string(logits.size()) + " values, expected T × E = " +
                 std::to_string(num_tokens) + " × " + std::to_string(experts));
  const std::size_t bias_size = config.correction_bias ? static_cast<std::size_t>(experts) : 0;
  LMOE_CHECK(bias.size() == bias_size, "router: correction bias holds " +
                                           std::to_string(bias.size()) + " values, expected " +
                                           std::to_string(bias_size));

  Routing routing;
  routing.num_tokens = num_tokens;
  routing.top_k = config.top_k;
  routing.expert_ids.resize(static_cast<std::size_t>(num_tokens * config.top_k));
  routing.weights.resize(routing.expert_ids.size());

  const std::int64_t group_size = experts / config.n_group;
  std::vector<float> scores(static_cast<std::size_t>(experts));
  std::vector<float> biased(static_cast<std::size_t>(experts));
  std::vector<float> group_scores(static_cast<std::size_t>(config.n_group));
  std::vector<std::int32_t> groups(static_cast<std::size_t>(config.n_group));
  std::vector<std::int32_t> candidates;
  candidates.reserve(static_cast<std::size_t>(experts));
  auto by_bias = [&biased](std::int32_t a, std::int32_t b) {
    return ranks_before(biased[a], a, biased[b], b);
  };

  for (std::int64_t t = 0; t < num_tokens; ++t) {
    scores_of_row(logits.data() + t * experts, experts, config.score, scores.data());
    for (std::int64_t e = 0; e < experts; ++e) {
      biased[e] =
          config.correction_bias ? scores[e] + bias[static_cast<std::size_t>(e)] : scores[e];
    }

    candidates.clear();
    if (config.n_group > 1) {
      for (std::int64_t g = 0; g < config.n_group; ++g) {
        // The group's two best experts in ranking order (one when the group has one).
        std::int32_t first = static_cast<std::int32_t>(g * group_size);
        std::int32_t second = -1;
        for (std::int32_t e = first + 1; e < (g + 1) * group_size; ++e) {
          if (by_bias(e, first)) {
            second = first;
            first = e;
          } else if (second < 0 || by_bias(e, second)) {
            second = e;
          }
        }
        float value = biased[first];
        if (config.correction_bias && second >= 0) value = biased[first] + biased[second];
        group_scores[static_cast<std::size_t>(g)] = value;
        groups[static_cast<std::size_t>(g)] = static_cast<std::int32_t>(g);
      }
      std::partial_sort(groups.begin(), groups.begin() + config.topk_group, groups.end(),
                        [&group_scores](std::int32_t a, std::int32_t b) {
                          return ranks_before(group_scores[a], a, group_scores[b], b);
                        });
      // Eligible experts in id order, so that the candidate list does not depend on group ranks.
      std::sort(groups.begin(), groups.begin() + config.topk_group);
      for (std::int64_t i = 0; i < config.topk_group; ++i) {
        const std::int32_t g = groups[static_cast<std::size_t>(i)];
        for (std::int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
          candidates.push_back(static_cast<std::int32_t>(e));
        }
      }
    } else {
      for (std::int64_t e = 0; e < experts; ++e) candidates.push_back(static_cast<std::int32_t>(e));
    }
    std::partial_sort(candidates.begin(), candidates.begin() + config.top_k, candidates.end(),
                      by_bias);

    std::int32_t* ids = routing.expert_ids.data() + t * config.top_k;
    float* weights = routing.weights.data() + t * config.top_k;
    float sum = 0.0f;
    for (std::int64_t j = 0; j < config.top_k; ++j) {
      ids[j] = candidates[static_cast<std::size_t>(j)];
      weights[j] = scores[static_cast<std::size_t>(ids[j])];
      sum += weights[j];
    }
    for (std::int64_t j = 0; j < config.top_k; ++j) {
      float weight = weights[j];
      if (config.renormalize) weight = sum > 0.0f ? weight / sum : 0.0f;
      weights[j] = weight * config.routed_scaling_factor;
    }
  }
  return routing;
}

}  // namespace lmoe
