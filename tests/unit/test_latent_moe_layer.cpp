// The whole layer on the CPU: for tp ∈ {1, 2, 4} and T ∈ {1, 7, 64, 300}, every rank's output is
// identical, the routing equals the tp = 1 routing bit for bit and the fp64 router's ids, the
// summed partials match fp64 math, the tail gets exactly those partials (its own contract, bit for
// bit), and y matches fp64 math and the tp = 1 run within the layer's tolerance
// (docs/numerics.md, "The layer"). Plus each activation, f32, T = 0, the tp-independent random
// weights, and bad input reported on every rank.
#include "lmoe/latent_moe_layer.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>

#include "core/host_math.hpp"
#include "layer_checks.hpp"
#include "lmoe/error.hpp"
#include "lmoe/layer_reference.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/threads_communicator.hpp"
#include "lmoe/tools/layer_runner.hpp"

namespace {

using lmoe::DType;
using lmoe::HostTensor;
using lmoe::LayerConfig;
using ::testing::HasSubstr;

constexpr std::uint64_t kWeightSeed = 11;
constexpr float kEps = 1e-5f;

LayerConfig small_config() { return *lmoe::find_preset("small").layer; }

lmoe::LayerOptions options_of(const LayerConfig& config, DType dtype) {
  lmoe::LayerOptions options;
  options.config = config;
  options.dtype = dtype;
  options.rms_norm_eps = kEps;
  return options;
}

using lmoe::testing::to_double;

std::vector<lmoe::LayerInputRun> run(const LayerConfig& config, DType dtype, int tp,
                                     const std::vector<HostTensor>& inputs,
                                     std::optional<lmoe::TailTier> tier = std::nullopt) {
  lmoe::LayerRunOptions options;
  options.keep_partials = true;
  options.tier = tier;
  return lmoe::run_layer_on_threads(
      options_of(config, dtype), tp,
      [&](int rank) {
        return lmoe::make_random_layer_weights(config, dtype, tp, rank, kWeightSeed);
      },
      inputs, options);
}

// Checks one input's run on tp ranks: the routing against fp64, then layer_checks.hpp.
void check_run(const LayerConfig& config, DType dtype, int tp, const HostTensor& x,
               const lmoe::LayerInputRun& result, const lmoe::LayerWeights& full) {
  const std::int64_t tokens = x.shape()[0];
  lmoe::testing::check_ranks_agree(result);
  const lmoe::Routing& routing = result.ranks[0].routing;
  if (tokens == 0) return;

  // The router against fp64 (logits from x and the router weight in fp64).
  const std::vector<double> logits = lmoe::exact_router_logits(full, x.matrix());
  std::vector<float> bias;
  for (std::int64_t e = 0; e < full.router_bias.numel(); ++e)
    bias.push_back(full.router_bias.get(e));
  const lmoe::ExactRouting exact_routing = lmoe::exact_router(config.router, logits, tokens, bias);
  EXPECT_EQ(routing.expert_ids, exact_routing.expert_ids);
  for (std::size_t i = 0; i < exact_routing.weights.size(); ++i) {
    EXPECT_NEAR(routing.weights[i], exact_routing.weights[i],
                1e-5 * config.router.routed_scaling_factor);
  }

  const lmoe::ExactLayer exact = lmoe::exact_layer(config, kEps, full, x.matrix(), routing);
  lmoe::testing::check_partials_and_y(config, kEps, dtype, result, full, exact,
                                      "dtype=" + std::string(lmoe::dtype_name(dtype)) + " tp=" +
                                          std::to_string(tp) + " T=" + std::to_string(tokens));
}

class CpuLayerParity : public ::testing::TestWithParam<int> {
 protected:
  static void SetUpTestSuite() { lmoe::cpu::set_blas_threads(1); }
};

TEST_P(CpuLayerParity, MatchesFp64AndTpOne) {
  const int tp = GetParam();
  const LayerConfig config = small_config();
  const DType dtype = DType::bf16;
  std::vector<HostTensor> inputs;
  for (std::int64_t tokens : {1, 7, 64, 300}) {
    inputs.push_back(lmoe::make_random_layer_input(config.d_model, tokens, dtype,
                                                   100u + static_cast<std::uint64_t>(tokens)));
  }
  const lmoe::LayerWeights full = lmoe::make_random_layer_weights(config, dtype, 1, 0, kWeightSeed);
  const std::vector<lmoe::LayerInputRun> results = run(config, dtype, tp, inputs);
  const std::vector<lmoe::LayerInputRun> single = tp == 1 ? results : run(config, dtype, 1, inputs);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    SCOPED_TRACE("tp=" + std::to_string(tp) + " T=" + std::to_string(inputs[i].shape()[0]));
    check_run(config, dtype, tp, inputs[i], results[i], full);
    // The routing does not depend on tp, bit for bit; y differs from tp = 1 only by the order of
    // the experts' intermediate sums.
    EXPECT_EQ(results[i].ranks[0].routing.expert_ids, single[i].ranks[0].routing.expert_ids);
    EXPECT_EQ(results[i].ranks[0].routing.weights, single[i].ranks[0].routing.weights);
    const lmoe::LayerComparison vs_tp1 =
        lmoe::compare_layer(results[i].ranks[0].y.matrix(), to_double(single[i].ranks[0].y));
    EXPECT_TRUE(vs_tp1.ok()) << "vs tp=1: normwise " << vs_tp1.normwise_error << " row "
                             << vs_tp1.max_row_error;
  }
}

INSTANTIATE_TEST_SUITE_P(Tp, CpuLayerParity, ::testing::Values(1, 2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "tp" + std::to_string(info.param);
                         });

struct VariantParam {
  const char* name;
  LayerConfig config;
  DType dtype;
  std::optional<lmoe::TailTier> tier;
};

void PrintTo(const VariantParam& param, std::ostream* os) { *os << param.name; }

class CpuLayerVariant : public ::testing::TestWithParam<VariantParam> {
 protected:
  static void SetUpTestSuite() { lmoe::cpu::set_blas_threads(1); }
};

TEST_P(CpuLayerVariant, MatchesFp64) {
  const VariantParam& param = GetParam();
  const int tp = 2;
  std::vector<HostTensor> inputs = {
      lmoe::make_random_layer_input(param.config.d_model, 64, param.dtype, 5),
      lmoe::make_random_layer_input(param.config.d_model, 0, param.dtype, 6)};
  const lmoe::LayerWeights full =
      lmoe::make_random_layer_weights(param.config, param.dtype, 1, 0, kWeightSeed);
  const std::vector<lmoe::LayerInputRun> results =
      run(param.config, param.dtype, tp, inputs, param.tier);
  check_run(param.config, param.dtype, tp, inputs[0], results[0], full);
  if (param.tier) {
    EXPECT_EQ(results[0].ranks[0].tier, param.tier);
  }
  // T = 0 runs nothing and is no error.
  EXPECT_FALSE(results[1].ranks[0].tier.has_value());
  EXPECT_EQ(results[1].ranks[0].y.numel(), 0);
}

LayerConfig with(LayerConfig config, lmoe::ExpertActivation activation) {
  config.activation = activation;
  if (activation == lmoe::ExpertActivation::situ_glu) {
    config.activation_beta = 4.0f;
    config.activation_linear_beta = 25.0f;
  }
  return config;
}

LayerConfig relu2_ungrouped() {
  LayerConfig config = with(small_config(), lmoe::ExpertActivation::relu2);
  config.router.n_group = 1;
  config.router.topk_group = 1;
  config.router.routed_scaling_factor = 5.0f;
  config.num_shared_experts = 1;
  config.shared_intermediate = 128;
  return config;
}

// Nemotron 3's shape: relu² experts, scale 5, and no RMSNorm between the routed sum and the
// latent up-projection.
LayerConfig relu2_no_latent_norm() {
  LayerConfig config = relu2_ungrouped();
  config.latent_norm = false;
  return config;
}

LayerConfig no_shared_no_bias() {
  LayerConfig config = small_config();
  config.num_shared_experts = 0;
  config.shared_intermediate = 0;
  config.router.correction_bias = false;
  config.router.renormalize = false;
  return config;
}

INSTANTIATE_TEST_SUITE_P(
    Variants, CpuLayerVariant,
    ::testing::Values(
        VariantParam{"situ_glu", with(small_config(), lmoe::ExpertActivation::situ_glu),
                     DType::bf16, std::nullopt},
        VariantParam{"relu2_scale5", relu2_ungrouped(), DType::bf16, std::nullopt},
        VariantParam{"relu2_no_latent_norm", relu2_no_latent_norm(), DType::bf16, std::nullopt},
        VariantParam{"no_shared_no_bias", no_shared_no_bias(), DType::bf16, lmoe::TailTier::column},
        VariantParam{"f32_token_tier", small_config(), DType::f32, lmoe::TailTier::token},
        VariantParam{"f16_fused_tier", small_config(), DType::f16, lmoe::TailTier::fused}),
    [](const ::testing::TestParamInfo<VariantParam>& info) {
      return std::string(info.param.name);
    });

TEST(LayerWeights, RandomSlicesOfEveryTpAreTheTpOneWeights) {
  const LayerConfig config = small_config();
  const lmoe::LayerWeights full = lmoe::make_random_layer_weights(config, DType::bf16, 1, 0, 3);
  const std::int64_t l = config.d_latent, d = config.d_model, inter = config.expert_intermediate;
  const std::int64_t shared = config.shared_width();
  for (int tp : {2, 4}) {
    for (int rank = 0; rank < tp; ++rank) {
      const lmoe::LayerWeights part =
          lmoe::make_random_layer_weights(config, DType::bf16, tp, rank, 3);
      EXPECT_FALSE(lmoe::validate_layer_weights(config, DType::bf16, tp, part).has_value());
      EXPECT_TRUE(same_bits(part.router_weight, full.router_weight));
      EXPECT_TRUE(same_bits(part.latent_up, full.latent_up));
      const std::int64_t ir = inter / tp, sr = shared / tp;
      for (std::int64_t e = 0; e < config.router.num_experts; e += 5) {
        for (std::int64_t i = 0; i < ir; ++i) {
          for (std::int64_t j = 0; j < l; j += 7) {
            ASSERT_EQ(part.expert_up.get((e * ir + i) * l + j),
                      full.expert_up.get((e * inter + rank * ir + i) * l + j));
            ASSERT_EQ(part.expert_gate.get((e * ir + i) * l + j),
                      full.expert_gate.get((e * inter + rank * ir + i) * l + j));
            ASSERT_EQ(part.expert_down.get((e * l + j) * ir + i),
                      full.expert_down.get((e * l + j) * inter + rank * ir + i));
          }
        }
      }
      for (std::int64_t i = 0; i < sr; ++i) {
        for (std::int64_t j = 0; j < d; j += 11) {
          ASSERT_EQ(part.shared_up.get(i * d + j), full.shared_up.get((rank * sr + i) * d + j));
          ASSERT_EQ(part.shared_down.get(j * sr + i),
                    full.shared_down.get(j * shared + rank * sr + i));
        }
      }
    }
  }
  // Another seed gives other weights.
  EXPECT_FALSE(same_bits(lmoe::make_random_layer_weights(config, DType::bf16, 1, 0, 4).expert_up,
                         full.expert_up));
}

TEST(LayerConfig, PresetsAndScaledDownConfigsAreValid) {
  for (const lmoe::ModelPreset& preset : lmoe::model_presets()) {
    if (!preset.layer) continue;
    SCOPED_TRACE(preset.name);
    EXPECT_EQ(preset.layer->d_model, preset.dims.d_model);
    EXPECT_EQ(preset.layer->d_latent, preset.dims.d_latent);
    for (int divisor : {1, 2, 8, 64}) {
      const LayerConfig scaled = lmoe::scale_down(*preset.layer, divisor);
      EXPECT_FALSE(lmoe::validate_layer_config(scaled, 8).has_value()) << "divisor " << divisor;
      EXPECT_EQ(scaled.router.top_k, preset.layer->router.top_k);
    }
  }
  const LayerConfig k3 = *lmoe::find_preset("kimi-k3").layer;
  EXPECT_EQ(k3.router.num_experts, 896);
  EXPECT_EQ(k3.router.top_k, 16);
  EXPECT_EQ(k3.shared_width(), 2 * 3072);
  const LayerConfig k3_small = lmoe::scale_down(k3, 8);
  EXPECT_EQ(k3_small.d_model, 896);
  EXPECT_EQ(k3_small.router.num_experts, 112);
  const LayerConfig nemotron = *lmoe::find_preset("nemotron-3-super").layer;
  EXPECT_EQ(nemotron.router.num_experts, 512);
  EXPECT_EQ(nemotron.router.top_k, 22);
  EXPECT_EQ(nemotron.activation, lmoe::ExpertActivation::relu2);
  EXPECT_EQ(nemotron.router.routed_scaling_factor, 5.0f);
}

// Builds a layer on every rank with per-rank changes; returns each rank's error message.
std::vector<std::string> construct_errors(
    int tp, const std::function<void(int, LayerConfig&, lmoe::LayerWeights&)>& change) {
  std::vector<std::string> messages(static_cast<std::size_t>(tp));
  lmoe::run_on_threads(tp, [&](int rank, lmoe::Communicator& comm) {
    LayerConfig config = small_config();
    lmoe::LayerWeights weights = lmoe::make_random_layer_weights(config, DType::bf16, tp, rank, 1);
    change(rank, config, weights);
    try {
      lmoe::LatentMoELayer layer(options_of(config, DType::bf16), comm, std::move(weights));
      messages[rank] = "no error";
    } catch (const lmoe::Error& error) {
      messages[rank] = error.message();
    }
  });
  return messages;
}

// The layer's tail agrees on the tier policy at construction: ranks whose policies differ are
// refused on every rank, naming the setting.
TEST(LayerErrors, RanksWithDifferentTierPoliciesAreRefusedOnEveryRank) {
  for (int tp : {2, 4}) {
    std::vector<std::string> messages(static_cast<std::size_t>(tp));
    lmoe::run_on_threads(tp, [&](int rank, lmoe::Communicator& comm) {
      const LayerConfig config = small_config();
      lmoe::LayerOptions options = options_of(config, DType::bf16);
      if (rank == tp - 1) options.policy.forced_tier.value = lmoe::TailTier::token;
      try {
        lmoe::LatentMoELayer layer(
            options, comm, lmoe::make_random_layer_weights(config, DType::bf16, tp, rank, 1));
        messages[rank] = "no error";
      } catch (const lmoe::Error& error) {
        messages[rank] = error.message();
      }
    });
    for (const std::string& message : messages) {
      EXPECT_EQ(message, "ranks' tier policies differ: rank 0 tier=auto, rank " +
                             std::to_string(tp - 1) + " tier=token");
    }
  }
}

TEST(LayerErrors, BadConstructionFailsOnEveryRankNamingTheCause) {
  // One rank's weight has the wrong shape: every rank reports that tensor.
  auto messages = construct_errors(2, [](int rank, LayerConfig&, lmoe::LayerWeights& weights) {
    if (rank == 1) weights.expert_up = HostTensor(DType::bf16, {16, 31, 192});
  });
  for (const std::string& message : messages) {
    EXPECT_THAT(message, HasSubstr("rank 1: layer weight expert_up: expected [16, 32, 192] bf16 "
                                   "(tp 2), got [16, 31, 192] bf16"));
  }
  // A missing bias, on rank 0.
  messages = construct_errors(2, [](int rank, LayerConfig&, lmoe::LayerWeights& weights) {
    if (rank == 0) weights.router_bias = HostTensor();
  });
  for (const std::string& message : messages) {
    EXPECT_THAT(
        message,
        HasSubstr("rank 0: layer weight router_bias: expected [16] f32 (tp 2), got absent"));
  }
  // Different replicated weights on two ranks.
  messages = construct_errors(2, [](int rank, LayerConfig&, lmoe::LayerWeights& weights) {
    if (rank == 1) weights.router_weight.set(3, 9.0f);
  });
  for (const std::string& message : messages) {
    EXPECT_THAT(message, HasSubstr("ranks disagree on the layer configuration"));
  }
  // An intermediate size tp does not divide; a model without the latent norm.
  messages = construct_errors(
      2, [](int, LayerConfig& config, lmoe::LayerWeights&) { config.expert_intermediate = 63; });
  for (const std::string& message : messages) {
    EXPECT_THAT(
        message,
        HasSubstr("layer config: expert_intermediate: expected a multiple of tp = 2, got 63"));
  }
  messages = construct_errors(4, [](int, LayerConfig& config, lmoe::LayerWeights&) {
    config.num_shared_experts = 3;
    config.shared_intermediate = 50;
  });
  for (const std::string& message : messages) {
    EXPECT_THAT(message,
                HasSubstr("shared experts: width 3 × 50 = 150 is not a multiple of tp = 4"));
  }
}

TEST(LayerErrors, BadInputFailsOnEveryRank) {
  const LayerConfig config = small_config();
  const int tp = 2;
  std::vector<std::string> messages(tp);
  lmoe::run_on_threads(tp, [&](int rank, lmoe::Communicator& comm) {
    lmoe::LatentMoELayer layer(options_of(config, DType::bf16), comm,
                               lmoe::make_random_layer_weights(config, DType::bf16, tp, rank, 1));
    // Rank 1 passes x with the wrong width; rank 0's own call is fine.
    HostTensor x = lmoe::make_random_layer_input(rank == 1 ? 383 : 384, 5, DType::bf16, 1);
    HostTensor y(DType::bf16, {5, 384});
    try {
      layer.forward(x.matrix(), y.matrix());
      messages[rank] = "no error";
    } catch (const lmoe::Error& error) {
      messages[rank] = error.message();
    }
    // Then a y of the wrong dtype on both.
    HostTensor good = lmoe::make_random_layer_input(384, 5, DType::bf16, 1);
    HostTensor y32(DType::f32, {5, 384});
    try {
      layer.forward(good.matrix(), y32.matrix());
      messages[rank] += " | no error";
    } catch (const lmoe::Error& error) {
      messages[rank] += " | " + error.message();
    }
    // Then another x on each rank: the ranks route differently and must not sum their partials.
    HostTensor other =
        lmoe::make_random_layer_input(384, 5, DType::bf16, 10u + static_cast<std::uint64_t>(rank));
    try {
      layer.forward(other.matrix(), y.matrix());
      messages[rank] += " | no error";
    } catch (const lmoe::Error& error) {
      messages[rank] += " | " + error.message();
    }
  });
  for (const std::string& message : messages) {
    EXPECT_THAT(message, HasSubstr("rank 1: x: expected shape [5, 384], got [5, 383]"));
    EXPECT_THAT(message, HasSubstr("| rank 0: y: expected dtype bf16, got f32"));
    EXPECT_THAT(message, HasSubstr("| ranks disagree on the routing: rank 0 has routing hash"));
  }
}

}  // namespace
