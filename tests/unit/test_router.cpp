// The router: against the fp64 router (ids exact, weights within fp32 rounding) at the models'
// sizes and with groups; ties go to the lower id (experts and groups); the correction bias changes
// the selection but never the weights; NaN ranks last; bad configurations name the field.
#include "lmoe/router.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "lmoe/error.hpp"
#include "lmoe/layer_reference.hpp"

namespace {

using lmoe::RouterConfig;
using lmoe::RouterScore;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

RouterConfig config_of(std::int64_t experts, std::int64_t top_k, std::int64_t groups = 1,
                       std::int64_t topk_group = 1, float scale = 1.0f) {
  return {.num_experts = experts,
          .top_k = top_k,
          .n_group = groups,
          .topk_group = topk_group,
          .routed_scaling_factor = scale};
}

struct RandomCase {
  std::vector<float> logits;
  std::vector<float> bias;
};

RandomCase random_case(const RouterConfig& config, std::int64_t tokens, unsigned seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> logit(0.0f, 2.0f);
  std::uniform_real_distribution<float> bias(-0.05f, 0.05f);
  RandomCase c;
  c.logits.resize(static_cast<std::size_t>(tokens * config.num_experts));
  for (float& value : c.logits) value = logit(generator);
  if (config.correction_bias) {
    c.bias.resize(static_cast<std::size_t>(config.num_experts));
    for (float& value : c.bias) value = bias(generator);
  }
  return c;
}

struct Fp64Param {
  const char* name;
  RouterConfig config;
};

void PrintTo(const Fp64Param& param, std::ostream* os) { *os << param.name; }

class RouterVsFp64 : public ::testing::TestWithParam<Fp64Param> {};

// The fp32 router must pick the fp64 router's experts in its order, except where two experts'
// fp64 biased scores are so close that fp32 rounding (sigmoid, bias addition: a few units of 2^-24)
// can order them either way. Weights are compared by expert id.
TEST_P(RouterVsFp64, IdsExactWeightsWithinRounding) {
  const RouterConfig& config = GetParam().config;
  const std::int64_t tokens = 300, k = config.top_k, experts = config.num_experts;
  const RandomCase c = random_case(config, tokens, 7u + static_cast<unsigned>(config.num_experts));
  const lmoe::Routing routing = lmoe::select_experts(c.logits, tokens, c.bias, config);
  const std::vector<double> logits64(c.logits.begin(), c.logits.end());
  const lmoe::ExactRouting exact = lmoe::exact_router(config, logits64, tokens, c.bias);
  ASSERT_EQ(routing.expert_ids.size(), exact.expert_ids.size());

  std::int64_t exact_tokens = 0;
  for (std::int64_t t = 0; t < tokens; ++t) {
    SCOPED_TRACE("token " + std::to_string(t));
    // fp64 biased scores (the softmax case has no bias; its near-ties are judged the same way).
    std::vector<double> biased(static_cast<std::size_t>(experts));
    double softmax_sum = 0, max_logit = *std::max_element(logits64.begin() + t * experts,
                                                          logits64.begin() + (t + 1) * experts);
    for (std::int64_t e = 0; e < experts; ++e)
      softmax_sum += std::exp(logits64[t * experts + e] - max_logit);
    for (std::int64_t e = 0; e < experts; ++e) {
      const double logit = logits64[t * experts + e];
      biased[e] = config.score == RouterScore::sigmoid ? 1.0 / (1.0 + std::exp(-logit))
                                                       : std::exp(logit - max_logit) / softmax_sum;
      if (config.correction_bias) biased[e] += c.bias[e];
    }
    bool same = true;
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t mine = routing.ids_of(t)[j], theirs = exact.expert_ids[t * k + j];
      if (mine == theirs) continue;
      same = false;
      EXPECT_LE(std::abs(biased[mine] - biased[theirs]), 8 * 0x1p-24)
          << "slot " << j << ": expert " << mine << " instead of " << theirs << " is no near-tie";
    }
    if (same) ++exact_tokens;
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t expert = exact.expert_ids[t * k + j];
      const auto mine = std::find(routing.ids_of(t).begin(), routing.ids_of(t).end(), expert);
      if (!same || mine == routing.ids_of(t).end()) continue;  // a near-tie at the k-th place
      const double weight = exact.weights[t * k + j];
      // fp32 sigmoid, sum, division and scale: a few roundings of 2^-24 each, plus the sum's k
      // terms.
      const double tolerance = (8.0 + static_cast<double>(k)) * 0x1p-24 * std::abs(weight);
      EXPECT_NEAR(routing.weights_of(t)[mine - routing.ids_of(t).begin()], weight, tolerance);
    }
    // Weights of a renormalized token sum to the scale.
    double sum = 0;
    for (float w : routing.weights_of(t)) sum += w;
    EXPECT_NEAR(sum, config.routed_scaling_factor, 1e-5 * config.routed_scaling_factor);
  }
  // Near-ties are rare: almost every token matches the fp64 router exactly.
  EXPECT_GE(exact_tokens, tokens - 3);
}

RouterConfig softmax_config() {
  RouterConfig config = config_of(64, 6);
  config.score = RouterScore::softmax;
  config.correction_bias = false;
  return config;
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, RouterVsFp64,
    ::testing::Values(Fp64Param{"K3_896_top16", config_of(896, 16)},
                      Fp64Param{"Nemotron3_512_top22_scale5", config_of(512, 22, 1, 1, 5.0f)},
                      Fp64Param{"E1024_top32", config_of(1024, 32)},
                      Fp64Param{"E64_top6_groups8_of3", config_of(64, 6, 8, 3, 2.5f)},
                      Fp64Param{"E256_top8_groups8_of4", config_of(256, 8, 8, 4, 2.5f)},
                      Fp64Param{"E7_top1", config_of(7, 1)},
                      Fp64Param{"softmax_E64_top6", softmax_config()}),
    [](const ::testing::TestParamInfo<Fp64Param>& info) { return std::string(info.param.name); });

TEST(Router, TiesGoToTheLowerExpertId) {
  RouterConfig config = config_of(8, 3);
  config.correction_bias = false;
  // Every score equal: experts 0, 1, 2, each weighted 1/3.
  const std::vector<float> logits(8, 0.25f);
  const lmoe::Routing routing = lmoe::select_experts(logits, 1, {}, config);
  EXPECT_THAT(routing.expert_ids, ElementsAre(0, 1, 2));
  for (float w : routing.weights) EXPECT_FLOAT_EQ(w, 1.0f / 3.0f);

  // A tie at the boundary: 5 and 6 share the third-best score; 5 wins. +0 and −0 tie too.
  const std::vector<float> boundary = {0, 0, 3, 0, 0, 1, 1, 2};
  EXPECT_THAT(lmoe::select_experts(boundary, 1, {}, config).expert_ids, ElementsAre(2, 7, 5));
  const std::vector<float> zeros = {-1, -1, -0.0f, 0.0f, -1, -1, -1, -1};
  RouterConfig two = config_of(8, 2);
  two.correction_bias = false;
  EXPECT_THAT(lmoe::select_experts(zeros, 1, {}, two).expert_ids, ElementsAre(2, 3));
}

TEST(Router, TiedGroupsGoToTheLowerGroupId) {
  // 4 groups of 2; groups 1 and 3 tie for the best group score, topk_group = 1: group 1 wins.
  RouterConfig config = config_of(8, 2, 4, 1);
  config.correction_bias = false;
  const std::vector<float> logits = {0, 0, 1, 2, 0, 0, 1, 2};
  EXPECT_THAT(lmoe::select_experts(logits, 1, {}, config).expert_ids, ElementsAre(3, 2));
}

TEST(Router, GroupsLimitTheEligibleExperts) {
  // 4 groups of 4, best 2 groups by the sum of their two best biased scores. Expert 0 has the best
  // score of all, but its group's second best is poor, so group 0 loses to groups 1 and 2.
  const RouterConfig config = config_of(16, 3, 4, 2);
  std::vector<float> logits = {5, -5, -5, -5, 2, 2, 0, 0, 1.5f, 1.5f, 0, 0, -1, -1, -1, -1};
  const std::vector<float> bias(16, 0.0f);
  EXPECT_THAT(lmoe::select_experts(logits, 1, bias, config).expert_ids, ElementsAre(4, 5, 8));
  // Without grouping expert 0 would lead.
  EXPECT_EQ(lmoe::select_experts(logits, 1, bias, config_of(16, 3)).expert_ids[0], 0);
}

TEST(Router, BiasSelectsButDoesNotWeight) {
  const RouterConfig config = config_of(6, 2, 1, 1, 2.0f);
  const std::vector<float> logits = {2.0f, 1.0f, 0.0f, -1.0f, -2.0f, -3.0f};
  std::vector<float> bias(6, 0.0f);
  const lmoe::Routing plain = lmoe::select_experts(logits, 1, bias, config);
  EXPECT_THAT(plain.expert_ids, ElementsAre(0, 1));

  bias[5] = 1.0f;  // lifts expert 5 (sigmoid(−3) ≈ 0.047) above expert 1 (≈ 0.73) for selection
  const lmoe::Routing biased = lmoe::select_experts(logits, 1, bias, config);
  EXPECT_THAT(biased.expert_ids, ElementsAre(5, 0));
  // Its weight is its unbiased score, renormalized over the selected and scaled.
  const float s5 = 1.0f / (1.0f + std::exp(3.0f)), s0 = 1.0f / (1.0f + std::exp(-2.0f));
  EXPECT_NEAR(biased.weights[0], s5 / (s5 + s0) * 2.0f, 1e-6f);
  EXPECT_NEAR(biased.weights[1], s0 / (s5 + s0) * 2.0f, 1e-6f);

  // Without renormalization the weights are the unbiased scores times the scale.
  RouterConfig raw = config;
  raw.renormalize = false;
  const lmoe::Routing unnormalized = lmoe::select_experts(logits, 1, bias, raw);
  EXPECT_FLOAT_EQ(unnormalized.weights[0], s5 * 2.0f);
  EXPECT_FLOAT_EQ(unnormalized.weights[1], s0 * 2.0f);
}

TEST(Router, NanRanksLast) {
  RouterConfig config = config_of(4, 2);
  config.correction_bias = false;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> logits = {nan, -1.0f, nan, -2.0f};
  EXPECT_THAT(lmoe::select_experts(logits, 1, {}, config).expert_ids, ElementsAre(1, 3));
}

TEST(Router, EveryRowIndependentAndDeterministic) {
  const RouterConfig config = config_of(64, 6, 8, 3);
  const RandomCase c = random_case(config, 7, 3);
  const lmoe::Routing all = lmoe::select_experts(c.logits, 7, c.bias, config);
  for (std::int64_t t = 0; t < 7; ++t) {
    const std::span<const float> row(c.logits.data() + t * 64, 64);
    const lmoe::Routing one = lmoe::select_experts(row, 1, c.bias, config);
    EXPECT_TRUE(std::equal(one.expert_ids.begin(), one.expert_ids.end(), all.ids_of(t).begin()));
    EXPECT_TRUE(std::equal(one.weights.begin(), one.weights.end(), all.weights_of(t).begin()));
  }
  EXPECT_EQ(lmoe::select_experts({}, 0, c.bias, config).expert_ids.size(), 0u);
}

TEST(Router, BadArgumentsAreNamed) {
  const std::vector<float> logits(16, 0.0f), bias(16, 0.0f);
  auto message = [&](RouterConfig config, std::span<const float> l, std::span<const float> b) {
    try {
      lmoe::select_experts(l, 1, b, config);
    } catch (const lmoe::Error& error) {
      return error.message();
    }
    return std::string("no error");
  };
  EXPECT_THAT(message(config_of(16, 33), logits, bias), HasSubstr("top_k: expected 1 … min(32"));
  EXPECT_THAT(message(config_of(2048, 4), logits, bias),
              HasSubstr("num_experts: expected 1 … 1024, got 2048"));
  EXPECT_THAT(message(config_of(16, 4, 3), logits, bias),
              HasSubstr("n_group: expected a divisor of num_experts = 16, got 3"));
  EXPECT_THAT(message(config_of(16, 4, 4, 5), logits, bias),
              HasSubstr("topk_group: expected 1 … n_group = 4, got 5"));
  EXPECT_THAT(message(config_of(16, 5, 4, 1), logits, bias),
              HasSubstr("hold fewer than top_k = 5"));
  EXPECT_THAT(message(config_of(16, 4, 1, 1, 0.0f), logits, bias),
              HasSubstr("routed_scaling_factor"));
  EXPECT_THAT(message(config_of(16, 4), std::span(logits).first(15), bias),
              HasSubstr("logits hold 15 values, expected T × E = 1 × 16"));
  EXPECT_THAT(message(config_of(16, 4), logits, std::span(bias).first(3)),
              HasSubstr("correction bias holds 3 values, expected 16"));
}

}  // namespace
