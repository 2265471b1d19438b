// The whole layer on the GPU against the CPU: the router's selection bit for bit on identical
// logits, the router on random weights against the CPU router wherever fp32 GEMM rounding cannot
// reorder the candidates, and the layer for tp ∈ {1, 2, 4} (ranks sharing one GPU, cuda-threads),
// T ∈ {0, 1, 7, 64, 300}, bf16 (and f16, f32 at tp 2), on the small preset and on Kimi-K3- and
// Nemotron-3-like configs scaled down: partials and y against fp64 math, y against the tail's
// contract of its own partials, y and shared against the CPU layer — on the host path of the
// routed experts and on the device path (LMOE_LAYER_DEVICE_EXPERTS=1). The layer captured in a
// CUDA graph once and replayed with new inputs, bit for bit against eager forwards, tp ∈ {1, 2}
// (p2p) × T ∈ {1, 7, 64, 300}. Plus captures that would grow workspaces, the device path on f32,
// and host inputs refused.
// Every test skips where no GPU is visible.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/host_math.hpp"
#include "core/router_weight_split.hpp"
#include "cuda/gemm/cublaslt_gemm.hpp"
#include "cuda/layer/cuda_layer_executor.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/layer/layer_router.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "gpu_test_support.hpp"
#include "layer_checks.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/latent_moe_layer.hpp"
#include "lmoe/layer_reference.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/router.hpp"
#include "lmoe/tools/layer_runner.hpp"

namespace {

using lmoe::DType;
using lmoe::HostTensor;
using lmoe::LayerConfig;
using lmoe::RouterConfig;
using ::testing::HasSubstr;

constexpr std::uint64_t kWeightSeed = 23;
constexpr float kEps = 1e-5f;
constexpr double kUnit = 1.0 / (1 << 24);  // fp32 unit roundoff 2⁻²⁴

LayerConfig small_config() { return *lmoe::find_preset("small").layer; }
LayerConfig k3_like() { return lmoe::scale_down(*lmoe::find_preset("kimi-k3").layer, 8); }
// Nemotron 3 Super's router and experts (relu², 64 experts top-22 at this scale, routed scale 5)
// with the tail's RMSNorm, which LatentTail always applies (the model itself has none there).
LayerConfig nemotron_like() {
  LayerConfig config = lmoe::scale_down(*lmoe::find_preset("nemotron-3-super").layer, 8);
  config.latent_norm = true;
  return config;
}

lmoe::LayerOptions options_of(const LayerConfig& config, lmoe::Backend backend,
                              DType dtype = DType::bf16) {
  lmoe::LayerOptions options;
  options.config = config;
  options.dtype = dtype;
  options.rms_norm_eps = kEps;
  options.backend = backend;
  return options;
}

using lmoe::testing::to_double;

std::vector<float> to_float(const HostTensor& tensor) {
  std::vector<float> values(static_cast<std::size_t>(tensor.numel()));
  for (std::int64_t i = 0; i < tensor.numel(); ++i) values[i] = tensor.get(i);
  return values;
}

// ---- the router kernel on given logits
// -----------------------------------------------------------

// logits: [T, parts·E] (launch_route's logit_parts).
lmoe::Routing route_on_gpu(const std::vector<float>& logits, std::int64_t tokens,
                           const std::vector<float>& bias, const RouterConfig& config,
                           int parts = 1) {
  const std::int64_t k = config.top_k;
  lmoe::cuda::DeviceBuffer d_logits(logits.size() * sizeof(float));
  lmoe::cuda::DeviceBuffer d_bias(bias.size() * sizeof(float));
  lmoe::cuda::DeviceBuffer d_ids(static_cast<std::size_t>(tokens * k) * sizeof(std::int32_t));
  lmoe::cuda::DeviceBuffer d_weights(static_cast<std::size_t>(tokens * k) * sizeof(float));
  EXPECT_EQ(cudaMemcpy(d_logits.data(), logits.data(), d_logits.bytes(), cudaMemcpyHostToDevice),
            cudaSuccess);
  if (!bias.empty()) {
    EXPECT_EQ(cudaMemcpy(d_bias.data(), bias.data(), d_bias.bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  // Poisoned: an id or weight the kernel does not write cannot pass.
  EXPECT_EQ(cudaMemset(d_ids.data(), 0xff, d_ids.bytes()), cudaSuccess);
  EXPECT_EQ(cudaMemset(d_weights.data(), 0xff, d_weights.bytes()), cudaSuccess);
  EXPECT_EQ(lmoe::cuda::launch_route(static_cast<const float*>(d_logits.data()),
                                     static_cast<const float*>(d_bias.data()), tokens, config,
                                     static_cast<std::int32_t*>(d_ids.data()),
                                     static_cast<float*>(d_weights.data()), nullptr, parts),
            cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  lmoe::Routing routing;
  routing.num_tokens = tokens;
  routing.top_k = k;
  routing.expert_ids.resize(static_cast<std::size_t>(tokens * k));
  routing.weights.resize(routing.expert_ids.size());
  EXPECT_EQ(
      cudaMemcpy(routing.expert_ids.data(), d_ids.data(), d_ids.bytes(), cudaMemcpyDeviceToHost),
      cudaSuccess);
  EXPECT_EQ(cudaMemcpy(routing.weights.data(), d_weights.data(), d_weights.bytes(),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  return routing;
}

struct RouterCase {
  const char* name;
  RouterConfig config;
};

void PrintTo(const RouterCase& c, std::ostream* os) { *os << c.name; }

RouterConfig router_of(std::int64_t experts, std::int64_t k, std::int64_t groups,
                       std::int64_t topk_group, lmoe::RouterScore score, bool bias, bool renorm,
                       float scale) {
  return {.num_experts = experts,
          .top_k = k,
          .n_group = groups,
          .topk_group = topk_group,
          .score = score,
          .correction_bias = bias,
          .renormalize = renorm,
          .routed_scaling_factor = scale};
}

class CudaRouterSameLogits : public ::testing::TestWithParam<RouterCase> {};

// Logits on a grid of quarters offset by 0.1 (many exact ties, which the lower id must win on both
// sides; no x and −x, whose scores would sum to exactly 1) and a bias of sixteenths: the biased
// scores of different (logit, bias) pairs are ≥ 9e-5 apart, and so are the sums of two unbiased
// scores that grouped routing with a bias compares (given a zero bias there: a bias of sixteenths
// would let two groups' sums tie in exact math and round apart differently on each side). That
// is far beyond the ulp or two by which CUDA's expf may differ from the C library's, so the
// selection must be identical. A few tokens carry NaN, ±inf and −0 logits.
TEST_P(CudaRouterSameLogits, SelectsTheCpuRoutersExperts) {
  SKIP_WITHOUT_GPU();
  const RouterConfig& config = GetParam().config;
  const std::int64_t tokens = 64, experts = config.num_experts;
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> quarter(-8, 8), pick(0, static_cast<int>(experts) - 1);
  std::vector<float> logits(static_cast<std::size_t>(tokens * experts));
  for (float& logit : logits) logit = static_cast<float>(quarter(rng)) * 0.25f + 0.1f;
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), -0.0f};
  for (std::int64_t t = 0; t < 8; ++t) {
    for (float special : specials)
      logits[static_cast<std::size_t>(t * experts + pick(rng))] = special;
  }
  std::vector<float> bias;
  if (config.correction_bias) {
    for (std::int64_t e = 0; e < experts; ++e) {
      bias.push_back(config.n_group > 1 ? 0.0f : static_cast<float>(e % 4) / 16.0f);
    }
  }

  const lmoe::Routing cpu = lmoe::select_experts(logits, tokens, bias, config);
  const lmoe::Routing gpu = route_on_gpu(logits, tokens, bias, config);
  ASSERT_EQ(gpu.expert_ids, cpu.expert_ids);
  // Scores may differ by CUDA's expf (≤ 2 ulp) and the weights' sum carries that over the k terms.
  const double relative = (8.0 + 2.0 * static_cast<double>(config.top_k)) * kUnit;
  for (std::size_t i = 0; i < cpu.weights.size(); ++i) {
    if (std::isnan(cpu.weights[i])) {
      EXPECT_TRUE(std::isnan(gpu.weights[i])) << "slot " << i;
      continue;
    }
    EXPECT_NEAR(gpu.weights[i], cpu.weights[i], relative * std::abs(cpu.weights[i]) + 1e-30)
        << "slot " << i;
  }
}

// A bf16 layer's router GEMM gives each logit as three parts (x times each bf16 part of the split
// weight): the kernel's sum of the parts must route exactly as the logit itself. Here the logits
// themselves are split (H + M + L = logit exactly; non-finite ones whole in H), so the routing must
// match the unsplit one bit for bit, ids and weights.
TEST_P(CudaRouterSameLogits, ThreeLogitPartsRouteAsTheirSum) {
  SKIP_WITHOUT_GPU();
  const RouterConfig& config = GetParam().config;
  const std::int64_t tokens = 64, experts = config.num_experts;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int> pick(0, static_cast<int>(experts) - 1);
  HostTensor logits(DType::f32, {tokens, experts});
  for (std::int64_t i = 0; i < logits.numel(); ++i) logits.set(i, normal(rng));
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), -0.0f};
  for (std::int64_t t = 0; t < 8; ++t) {
    for (float special : specials) logits.set(t * experts + pick(rng), special);
  }
  std::vector<float> bias;
  if (config.correction_bias) {
    for (std::int64_t e = 0; e < experts; ++e) bias.push_back(static_cast<float>(e % 4) / 16.0f);
  }
  const HostTensor split = lmoe::split_router_weight_bf16(logits);  // [3T, E]: H, then M, then L
  std::vector<float> parts(static_cast<std::size_t>(3 * tokens * experts));
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t q = 0; q < 3; ++q) {
      for (std::int64_t e = 0; e < experts; ++e) {
        parts[static_cast<std::size_t>((t * 3 + q) * experts + e)] =
            split.get((q * tokens + t) * experts + e);
      }
    }
  }
  const lmoe::Routing whole = route_on_gpu(to_float(logits), tokens, bias, config);
  const lmoe::Routing summed = route_on_gpu(parts, tokens, bias, config, 3);
  EXPECT_EQ(summed.expert_ids, whole.expert_ids);
  ASSERT_EQ(summed.weights.size(), whole.weights.size());
  EXPECT_EQ(0, std::memcmp(summed.weights.data(), whole.weights.data(),
                           whole.weights.size() * sizeof(float)));
}

INSTANTIATE_TEST_SUITE_P(
    Configs, CudaRouterSameLogits,
    ::testing::Values(
        RouterCase{"sigmoid_bias_e64_k6",
                   router_of(64, 6, 1, 1, lmoe::RouterScore::sigmoid, true, true, 2.5f)},
        RouterCase{"grouped_e16_k4_g4_top2",
                   router_of(16, 4, 4, 2, lmoe::RouterScore::sigmoid, true, true, 1.0f)},
        RouterCase{"grouped_nobias_e64_k8_g8_top3",
                   router_of(64, 8, 8, 3, lmoe::RouterScore::sigmoid, false, true, 1.0f)},
        RouterCase{"no_renorm_e112_k16",
                   router_of(112, 16, 1, 1, lmoe::RouterScore::sigmoid, true, false, 5.0f)},
        RouterCase{"softmax_e32_k4",
                   router_of(32, 4, 1, 1, lmoe::RouterScore::softmax, false, true, 1.0f)},
        RouterCase{"e896_k16",
                   router_of(896, 16, 1, 1, lmoe::RouterScore::sigmoid, true, true, 1.0f)},
        // Nemotron 3 Super's router: k = 22 needs three representatives from each warp.
        RouterCase{"e512_k22",
                   router_of(512, 22, 1, 1, lmoe::RouterScore::sigmoid, true, true, 2.5f)},
        // Each warp's experts fall in one group, so half the warps hold no eligible expert: fewer
        // representatives than k, and every eligible expert is a candidate.
        RouterCase{"grouped_e256_k8_g8_top4",
                   router_of(256, 8, 8, 4, lmoe::RouterScore::sigmoid, true, true, 2.5f)},
        // The most experts and the largest k a layer's configuration allows.
        RouterCase{"e1024_k32",
                   router_of(1024, 32, 1, 1, lmoe::RouterScore::sigmoid, true, true, 1.0f)}),
    [](const ::testing::TestParamInfo<RouterCase>& info) { return std::string(info.param.name); });

// ---- the router from x and the weights, against the CPU router
// -----------------------------------

// Whether fp32 rounding can reorder token t's candidates. The CPU's fp32 logit lies within γ_d·A
// of the exact dot product (A = max_e Σ_i |x_ti|·|W_ei|, γ_d = d·u/(1 − d·u)). The GPU's, for a
// bf16 layer, sums 3d exact products on tensor cores and then three fp32 parts: assuming each
// tensor-core sum within 2u (they may truncate instead of rounding), within 2γ_(d+2)·A. So the two
// sides' logits differ by ≤ 3γ_(d+2)·A; the sigmoid is ¼-Lipschitz, so scores differ by
// ≤ ¾γ_(d+2)·A
// plus each side's own rounding of the sigmoid (expf within 2 ulp, the add and the division half
// an ulp each: ≤ 4u of a score ≤ 1, 8u for both) and of the bias addition (|b| < 2: 2u for
// both). Two candidates can swap only when their biased scores are within twice that, `gap`;
// a group score sums two biased scores, so groups swap only within twice `gap`.
struct Decisiveness {
  std::vector<bool> decisive;           // [T]
  std::vector<double> score_tolerance;  // [T]: how far a side's unbiased score may move
};

Decisiveness decisive_tokens(const std::vector<float>& logits, const std::vector<double>& magnitude,
                             std::int64_t tokens, std::int64_t d, const std::vector<float>& bias,
                             const RouterConfig& config) {
  const double terms = static_cast<double>(d + 2);  // the dot product, then adding three parts
  const double gamma = terms * kUnit / (1.0 - terms * kUnit);
  const std::int64_t experts = config.num_experts, group_size = experts / config.n_group;
  Decisiveness result;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double score_tol = 0.75 * gamma * magnitude[static_cast<std::size_t>(t)] + 8 * kUnit;
    const double gap = 2 * (score_tol + 2 * kUnit);
    std::vector<double> b(static_cast<std::size_t>(experts));
    for (std::int64_t e = 0; e < experts; ++e) {
      const double s = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[t * experts + e])));
      b[e] = s + (config.correction_bias ? bias[e] : 0.0);
    }
    bool ok = true;
    std::vector<bool> eligible(static_cast<std::size_t>(experts), true);
    if (config.n_group > 1) {
      std::vector<double> groups;
      for (std::int64_t g = 0; g < config.n_group; ++g) {
        std::vector<double> members(b.begin() + g * group_size, b.begin() + (g + 1) * group_size);
        std::sort(members.rbegin(), members.rend());
        groups.push_back(members[0] +
                         (config.correction_bias && group_size > 1 ? members[1] : 0.0));
      }
      std::vector<double> sorted = groups;
      std::sort(sorted.rbegin(), sorted.rend());
      const std::size_t boundary = static_cast<std::size_t>(config.topk_group);
      if (boundary < sorted.size() && sorted[boundary - 1] - sorted[boundary] <= 2 * gap)
        ok = false;
      for (std::int64_t e = 0; e < experts; ++e) {
        eligible[e] = groups[e / group_size] >= sorted[boundary - 1];
      }
    }
    std::vector<double> candidates;
    for (std::int64_t e = 0; e < experts; ++e) {
      if (eligible[e]) candidates.push_back(b[e]);
    }
    std::sort(candidates.rbegin(), candidates.rend());
    // The k chosen and their order: every gap among the first k + 1.
    for (std::int64_t j = 0;
         j < config.top_k && j + 1 < static_cast<std::int64_t>(candidates.size()); ++j) {
      if (candidates[j] - candidates[j + 1] <= gap) ok = false;
    }
    result.decisive.push_back(ok);
    result.score_tolerance.push_back(score_tol);
  }
  return result;
}

struct RoutingAgreement {
  std::vector<bool> same;  // [T]: the GPU chose the CPU router's ids, in its order
  std::int64_t decisive = 0;
  std::int64_t identical = 0;
};

// Checks the GPU's routing against the CPU router on the same x: ids exact on decisive tokens,
// weights within what the scores' tolerance allows wherever the ids agree.
RoutingAgreement check_routing_against_cpu(const LayerConfig& config,
                                           const lmoe::LayerWeights& full, const HostTensor& x,
                                           const lmoe::Routing& gpu) {
  const std::int64_t tokens = x.shape()[0], d = config.d_model, experts = config.router.num_experts;
  const std::vector<float> x32 = to_float(x), w32 = to_float(full.router_weight);
  std::vector<float> logits(static_cast<std::size_t>(tokens * experts));
  lmoe::cpu::sgemm_nt(tokens, experts, d, x32.data(), w32.data(), logits.data());
  std::vector<double> magnitude(static_cast<std::size_t>(tokens), 0.0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t e = 0; e < experts; ++e) {
      double sum = 0;
      for (std::int64_t i = 0; i < d; ++i) sum += std::abs(double(x32[t * d + i]) * w32[e * d + i]);
      magnitude[t] = std::max(magnitude[t], sum);
    }
  }
  const std::vector<float> bias =
      config.router.correction_bias ? to_float(full.router_bias) : std::vector<float>{};
  const lmoe::Routing cpu = lmoe::select_experts(logits, tokens, bias, config.router);
  const Decisiveness decisiveness =
      decisive_tokens(logits, magnitude, tokens, d, bias, config.router);

  const std::int64_t k = config.router.top_k;
  const double scale = config.router.routed_scaling_factor;
  RoutingAgreement agreement;
  agreement.same.resize(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) {
    const auto gpu_ids = gpu.ids_of(t), cpu_ids = cpu.ids_of(t);
    const bool same = std::equal(gpu_ids.begin(), gpu_ids.end(), cpu_ids.begin());
    agreement.same[t] = same;
    agreement.identical += same ? 1 : 0;
    if (decisiveness.decisive[t]) {
      ++agreement.decisive;
      EXPECT_TRUE(same) << "token " << t << ": the GPU chose other experts on a decisive token";
    }
    if (!same) continue;
    // w_j = scale · s_j / Σ s: each s moves by δ, so w_j by scale·(δ/Σ + s_j·k·δ/Σ²), plus the
    // divisions, the sum and the scaling rounding ((k + 2)·u relative).
    const double delta = decisiveness.score_tolerance[t];
    const auto cpu_w = cpu.weights_of(t), gpu_w = gpu.weights_of(t);
    double sum = 0;
    for (std::int64_t j = 0; j < k; ++j) sum += cpu_w[j] / scale;
    for (std::int64_t j = 0; j < k; ++j) {
      const double w = cpu_w[j];
      double allowed = (static_cast<double>(k) + 8) * kUnit * std::abs(w);
      allowed += config.router.renormalize
                     ? scale * (delta / sum + (w / scale) * static_cast<double>(k) * delta / sum)
                     : scale * delta;
      EXPECT_NEAR(gpu_w[j], w, allowed) << "token " << t << " slot " << j;
    }
  }
  return agreement;
}

// Random x and weights through the GPU's router GEMM and kernel (the layer on one rank) against the
// CPU router, on configs with few enough candidates that most tokens are decisive under the
// worst-case bound (at least half must be, or the check would mean little).
class CudaRouterFromWeights : public ::testing::TestWithParam<RouterCase> {};

TEST_P(CudaRouterFromWeights, MatchesTheCpuRouterWhereRoundingCannotReorder) {
  SKIP_WITHOUT_GPU();
  LayerConfig config = small_config();
  config.router = GetParam().config;
  std::vector<HostTensor> inputs = {
      lmoe::make_random_layer_input(config.d_model, 300, DType::bf16, 41),
      lmoe::make_random_layer_input(config.d_model, 7, DType::bf16, 42)};
  const lmoe::LayerWeights full =
      lmoe::make_random_layer_weights(config, DType::bf16, 1, 0, kWeightSeed);
  lmoe::LayerOptions options = options_of(config, lmoe::Backend::cuda);
  const std::vector<lmoe::LayerInputRun> runs = lmoe::run_layer_on_threads(
      options, 1, [&](int) { return full; }, inputs);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const std::int64_t tokens = inputs[i].shape()[0];
    SCOPED_TRACE("T=" + std::to_string(tokens));
    const RoutingAgreement agreement =
        check_routing_against_cpu(config, full, inputs[i], runs[i].ranks[0].routing);
    EXPECT_GE(2 * agreement.decisive, tokens)
        << "too few decisive tokens (" << agreement.decisive << " of " << tokens << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configs, CudaRouterFromWeights,
    ::testing::Values(
        RouterCase{"grouped_e16_k4_g4_top2",
                   router_of(16, 4, 4, 2, lmoe::RouterScore::sigmoid, true, true, 2.5f)},
        RouterCase{"sigmoid_e32_k4",
                   router_of(32, 4, 1, 1, lmoe::RouterScore::sigmoid, true, true, 1.0f)},
        RouterCase{"no_bias_no_renorm_e32_k4",
                   router_of(32, 4, 1, 1, lmoe::RouterScore::sigmoid, false, false, 5.0f)}),
    [](const ::testing::TestParamInfo<RouterCase>& info) { return std::string(info.param.name); });

// The router GEMM's algorithm depends on its operands' alignment, so LayerRouter reads x in place
// only when it is as aligned as its own buffer (256 bytes) and copies it there otherwise: every
// alignment must route to the same bits, ids and weights (Kimi-K3's 896 experts, top 16).
TEST(CudaRouterAlignment, XAtAnyAlignmentRoutesToTheSameBits) {
  SKIP_WITHOUT_GPU();
  LayerConfig config = small_config();
  config.router = router_of(896, 16, 1, 1, lmoe::RouterScore::sigmoid, true, true, 2.5f);
  const lmoe::LayerWeights weights =
      lmoe::make_random_layer_weights(config, DType::bf16, 1, 0, kWeightSeed);
  const std::int64_t tokens = 37, slots = tokens * config.router.top_k;
  const HostTensor x = lmoe::make_random_layer_input(config.d_model, tokens, DType::bf16, 43);
  lmoe::cuda::LayerRouter router(config, DType::bf16, weights);
  lmoe::cuda::CublasLtGemm gemm;
  lmoe::cuda::DeviceBuffer buffer(x.nbytes() + 512);
  std::vector<std::int32_t> first;
  for (const std::size_t offset : {0, 256, 2, 16, 128}) {
    SCOPED_TRACE("x at byte " + std::to_string(offset) + " of a 256-byte aligned buffer");
    auto* at = static_cast<std::byte*>(buffer.data()) + offset;
    ASSERT_EQ(cudaMemcpy(at, x.data(), x.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
    router.reserve(tokens);
    auto* host = const_cast<std::int32_t*>(router.host_routing());
    std::memset(host, 0xff, static_cast<std::size_t>(2 * slots) * 4);  // poisoned
    const lmoe::ConstMatrixView view{
        at, DType::bf16, tokens, config.d_model, config.d_model, lmoe::MemorySpace::device};
    router.route(view, false, gemm, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<std::int32_t> routing(host, host + 2 * slots);  // ids, then weights' bits
    if (first.empty()) {
      for (std::int64_t j = 0; j < slots; ++j) {
        ASSERT_GE(routing[j], 0);
        ASSERT_LT(routing[j], config.router.num_experts);
      }
      first = routing;
      continue;
    }
    EXPECT_EQ(routing, first);
  }
}

// ---- the layer
// ------------------------------------------------------------------------------------

// device_experts: the routed experts take the device path in eager forwards too.
std::vector<lmoe::LayerInputRun> run_layer(const LayerConfig& config, DType dtype,
                                           lmoe::Backend backend, int tp,
                                           const std::vector<HostTensor>& inputs,
                                           bool device_experts = false) {
  const ScopedEnv path(lmoe::kDeviceExpertsEnv, device_experts ? "1" : nullptr);
  lmoe::LayerRunOptions run;
  run.keep_partials = true;
  if (backend == lmoe::Backend::cpu) lmoe::cpu::set_blas_threads(1);
  return lmoe::run_layer_on_threads(
      options_of(config, backend, dtype), tp,
      [&](int rank) {
        return lmoe::make_random_layer_weights(config, dtype, tp, rank, kWeightSeed);
      },
      inputs, run);
}

// Rows of an fp64 [T, cols] matrix where keep[t].
std::vector<double> rows_where(const std::vector<double>& values, std::int64_t cols,
                               const std::vector<bool>& keep) {
  std::vector<double> out;
  for (std::size_t t = 0; t < keep.size(); ++t) {
    if (keep[t]) out.insert(out.end(), values.begin() + t * cols, values.begin() + (t + 1) * cols);
  }
  return out;
}

struct LayerCase {
  const char* name;
  LayerConfig config;
  int tp;
  DType dtype = DType::bf16;
  bool device_experts = false;  // the routed experts' device path (sort + grouped GEMMs)
};

std::string case_name(const LayerCase& c) {
  return std::string(c.name) + "_tp" + std::to_string(c.tp) + (c.device_experts ? "_device" : "");
}
void PrintTo(const LayerCase& c, std::ostream* os) { *os << case_name(c); }

class CudaLayerParity : public ::testing::TestWithParam<LayerCase> {};

TEST_P(CudaLayerParity, MatchesFp64AndTheCpuLayer) {
  SKIP_WITHOUT_GPU();
  const LayerCase& param = GetParam();
  const LayerConfig& config = param.config;
  const int tp = param.tp;
  const DType dtype = param.dtype;
  std::vector<HostTensor> inputs;
  for (std::int64_t tokens : {1, 7, 64, 300, 0}) {
    inputs.push_back(lmoe::make_random_layer_input(config.d_model, tokens, dtype,
                                                   300u + static_cast<std::uint64_t>(tokens)));
  }
  const lmoe::LayerWeights full = lmoe::make_random_layer_weights(config, dtype, 1, 0, kWeightSeed);
  const lmoe::LayerReference reference(config, kEps, full);
  const std::vector<lmoe::LayerInputRun> gpu =
      run_layer(config, dtype, lmoe::Backend::cuda, tp, inputs, param.device_experts);
  const std::vector<lmoe::LayerInputRun> cpu =
      run_layer(config, dtype, lmoe::Backend::cpu, tp, inputs);

  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const HostTensor& x = inputs[i];
    const std::int64_t tokens = x.shape()[0];
    SCOPED_TRACE("T=" + std::to_string(tokens));
    const lmoe::LayerInputRun& result = gpu[i];
    lmoe::testing::check_ranks_agree(result);
    const lmoe::Routing& routing = result.ranks[0].routing;
    ASSERT_EQ(routing.num_tokens, tokens);
    if (tokens == 0) {
      EXPECT_FALSE(result.ranks[0].tier.has_value());
      continue;
    }
    const lmoe::LayerStageTimes& times = result.ranks[0].times.back();
    EXPECT_GT(times.router, 0.0);
    EXPECT_GT(times.experts, 0.0);
    EXPECT_GT(times.shared, 0.0);
    EXPECT_GT(times.tail, 0.0);
    // The forward's wall time spans the first stage's start to the tail's end.
    EXPECT_GE(times.forward, times.tail);
    EXPECT_GT(times.forward, 0.0);

    // Many experts and top-k this large leave few tokens decisive under the worst-case bound, but
    // real fp32 differences are far smaller: a broken router (a wrong bias, order or group)
    // changes nearly every token, so most tokens must route as on the CPU.
    const RoutingAgreement agreement = check_routing_against_cpu(config, full, x, routing);
    EXPECT_GE(4 * agreement.identical, 3 * tokens)
        << agreement.identical << " of " << tokens << " tokens routed as on the CPU";
    const std::vector<bool>& same_routing = agreement.same;

    // The partials and y against fp64 math with the GPU's routing, y against the tail contract.
    const lmoe::ExactLayer exact = reference.run(x.matrix(), routing);
    lmoe::testing::check_partials_and_y(config, kEps, dtype, result, full, exact,
                                        case_name(param) + " T=" + std::to_string(tokens));

    // Against the CPU layer: each rank's shared partial (it does not depend on the routing), and
    // y on the tokens both routed alike, within the layer's tolerances.
    for (int r = 0; r < tp; ++r) {
      const auto cmp =
          lmoe::compare_layer(to_double(result.ranks[r].shared), to_double(cpu[i].ranks[r].shared),
                              config.d_model, dtype);
      EXPECT_TRUE(cmp.ok()) << "shared of rank " << r << " vs cpu: normwise " << cmp.normwise_error
                            << " row " << cmp.max_row_error;
    }
    std::vector<bool> comparable = same_routing;
    for (std::int64_t t = 0; t < tokens; ++t) {
      const auto a = routing.ids_of(t), b = cpu[i].ranks[0].routing.ids_of(t);
      comparable[t] = comparable[t] && std::equal(a.begin(), a.end(), b.begin());
    }
    const auto vs_cpu =
        lmoe::compare_layer(rows_where(to_double(result.ranks[0].y), config.d_model, comparable),
                            rows_where(to_double(cpu[i].ranks[0].y), config.d_model, comparable),
                            config.d_model, dtype);
    EXPECT_TRUE(vs_cpu.ok()) << "y vs cpu: normwise " << vs_cpu.normwise_error << " row "
                             << vs_cpu.max_row_error;
  }
}

std::vector<LayerCase> layer_cases() {
  std::vector<LayerCase> cases;
  for (int tp : {1, 2, 4}) {
    cases.push_back({"small", small_config(), tp});
    cases.push_back({"k3_like", k3_like(), tp});
    cases.push_back({"nemotron_like", nemotron_like(), tp});
  }
  // The other storage dtypes, held to their own (tighter) tolerances.
  cases.push_back({"small_f16", small_config(), 2, DType::f16});
  cases.push_back({"small_f32", small_config(), 2, DType::f32});
  // The device path of the routed experts (f32 has none), held to the same contract.
  for (const LayerCase& host : std::vector<LayerCase>(cases)) {
    if (host.dtype == DType::f32) continue;
    LayerCase device = host;
    device.device_experts = true;
    cases.push_back(device);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Configs, CudaLayerParity, ::testing::ValuesIn(layer_cases()),
                         [](const ::testing::TestParamInfo<LayerCase>& info) {
                           return case_name(info.param);
                         });

// ---- CUDA graphs
// ----------------------------------------------------------------------------------

struct CaptureCase {
  int tp;
  std::int64_t tokens;
};

void PrintTo(const CaptureCase& c, std::ostream* os) { *os << "tp" << c.tp << "_T" << c.tokens; }

class CudaLayerCapture : public ::testing::TestWithParam<CaptureCase> {};

// The whole forward (router, experts on the device path, shared experts on the side stream, the
// tail over p2p) captured once, then replayed with other inputs in x: each replay's y equals an
// eager forward's on the same input bit for bit (eager forwards take the device path here too, so
// that both run the same kernels; the device path against fp64 and the CPU is CudaLayerParity's).
TEST_P(CudaLayerCapture, ReplaysWithNewInputsMatchEagerForwardsBitForBit) {
  SKIP_WITHOUT_GPU();
  const auto [tp, tokens] = GetParam();
  const LayerConfig config = k3_like();
  const DType dtype = DType::bf16;
  // p2p ranks share the GPU (opt-in, docs/p2p.md); the cuda-threads communicator cannot be
  // captured.
  const ScopedEnv shared_gpu("LMOE_P2P_SHARED_GPU", "1");
  const ScopedEnv device_path(lmoe::kDeviceExpertsEnv, "1");
  std::vector<HostTensor> inputs;
  for (std::uint64_t seed : {11u, 12u, 13u}) {
    inputs.push_back(
        lmoe::make_random_layer_input(config.d_model, tokens, dtype, seed + 100 * tokens));
  }
  const std::size_t x_bytes = inputs[0].nbytes();
  lmoe::run_comm_group("p2p", tp, [&](int rank, lmoe::Communicator& comm) {
    lmoe::LayerOptions options = options_of(config, lmoe::Backend::cuda, dtype);
    options.max_tokens = tokens;  // the tail's workspaces never move (and the layer's are there)
    lmoe::LatentMoELayer layer(
        options, comm, lmoe::make_random_layer_weights(config, dtype, tp, rank, kWeightSeed));
    cudaStream_t stream = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const lmoe::cuda::DeviceBuffer x(x_bytes), y(x_bytes);
    const lmoe::ConstMatrixView x_view{x.data(),       dtype,          tokens,
                                       config.d_model, config.d_model, lmoe::MemorySpace::device};
    const lmoe::MatrixView y_view{y.data(),       dtype,          tokens,
                                  config.d_model, config.d_model, lmoe::MemorySpace::device};
    auto forward_into_y = [&](const HostTensor& input, cudaGraphExec_t graph) {
      cuda_ok(cudaMemcpyAsync(x.data(), input.data(), x_bytes, cudaMemcpyHostToDevice, stream));
      cuda_ok(cudaMemsetAsync(y.data(), 0xff, x_bytes, stream));
      if (graph) {
        cuda_ok(cudaGraphLaunch(graph, stream));
      } else {
        layer.forward(x_view, y_view, std::nullopt, stream);
      }
      cuda_ok(cudaStreamSynchronize(stream));
      std::vector<std::uint8_t> out(x_bytes);
      cuda_ok(cudaMemcpy(out.data(), y.data(), x_bytes, cudaMemcpyDeviceToHost));
      return out;
    };

    // The layer's own stages once without the tail (no peer spins yet): their cuBLASLt plans and
    // kernels are loaded before any rank waits for another (docs/p2p.md); the eager forwards then
    // warm the tail.
    {
      const std::size_t esize = lmoe::dtype_size(dtype);
      const lmoe::cuda::DeviceBuffer routed(static_cast<std::size_t>(tokens * config.d_latent) *
                                            esize);
      const lmoe::cuda::DeviceBuffer shared(x_bytes);
      cuda_ok(cudaMemcpy(x.data(), inputs[0].data(), x_bytes, cudaMemcpyHostToDevice));
      layer.forward_partials(
          x_view,
          {routed.data(), dtype, tokens, config.d_latent, config.d_latent,
           lmoe::MemorySpace::device},
          {shared.data(), dtype, tokens, config.d_model, config.d_model, lmoe::MemorySpace::device},
          stream);
      cuda_ok(cudaStreamSynchronize(stream));
      comm.barrier();
    }
    std::vector<std::vector<std::uint8_t>> eager;
    for (const HostTensor& input : inputs) eager.push_back(forward_into_y(input, nullptr));
    ASSERT_NE(layer.last_routing(), nullptr);
    EXPECT_EQ(layer.last_routing()->expert_ids.size(),
              static_cast<std::size_t>(tokens * config.router.top_k));

    cudaGraph_t graph = nullptr;
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    std::string error;
    try {
      layer.forward(x_view, y_view, std::nullopt, stream);
    } catch (const lmoe::Error& e) {
      error = e.what();
    }
    cuda_ok(cudaStreamEndCapture(stream, &graph));
    ASSERT_EQ(error, "");
    ASSERT_NE(graph, nullptr);
    EXPECT_EQ(layer.last_routing(), nullptr);  // a captured forward keeps its routing on the device
    cudaGraphExec_t exec = nullptr;
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0));
    comm.barrier();  // every rank's graph is ready before any replay spins on its peers

    // Replays in another order than the eager forwards, each input twice: nothing of a replay
    // may depend on the previous one's state.
    for (const int i : {2, 0, 1, 0}) {
      SCOPED_TRACE("input " + std::to_string(i));
      const std::vector<std::uint8_t> replay = forward_into_y(inputs[i], exec);
      EXPECT_TRUE(replay == eager[i])
          << "rank " << rank << ": a replay's y differs from the eager forward's";
    }
    cuda_ok(cudaGraphExecDestroy(exec));
    cuda_ok(cudaGraphDestroy(graph));
    cuda_ok(cudaStreamDestroy(stream));
  });
}

// `lmoe layer --graph`'s runner (run_layer_on_threads with graph = true) at one p2p rank: every
// replay's y equals the eager forward's bit for bit, one time per timed replay, and the stages come
// from the replays of the graph captured with stage events (external event nodes).
TEST(CudaLayerGraphRunner, ReplaysMatchTheEagerForwardAndTheirStagesAreTimed) {
  SKIP_WITHOUT_GPU();
  const LayerConfig config = k3_like();
  const DType dtype = DType::bf16;
  const std::vector<HostTensor> inputs = {
      lmoe::make_random_layer_input(config.d_model, 64, dtype, 31),
      lmoe::make_random_layer_input(config.d_model, 7, dtype, 32)};
  lmoe::LayerRunOptions run;
  run.comm = "p2p";
  run.graph = true;
  run.warmup = 1;
  run.repeats = 3;
  const std::vector<lmoe::LayerInputRun> results = lmoe::run_layer_on_threads(
      options_of(config, lmoe::Backend::cuda, dtype), 1,
      [&](int rank) {
        return lmoe::make_random_layer_weights(config, dtype, 1, rank, kWeightSeed);
      },
      inputs, run);
  for (const lmoe::LayerInputRun& result : results) {
    const lmoe::LayerRankResult& rank = result.ranks.front();
    EXPECT_TRUE(rank.replay_matches_eager);
    EXPECT_EQ(rank.replay_seconds.size(), 3u);
    ASSERT_EQ(rank.times.size(), 3u);
    for (const lmoe::LayerStageTimes& times : rank.times) {
      EXPECT_GT(times.router, 0);
      EXPECT_GT(times.experts, 0);
      EXPECT_GT(times.shared, 0);
      EXPECT_GT(times.tail, 0);
      EXPECT_GT(times.forward, 0);  // recorded by the replay: a captured forward alone has none
    }
    EXPECT_FALSE(rank.routing.expert_ids.empty());  // the eager forward's
  }
}

std::vector<CaptureCase> capture_cases() {
  std::vector<CaptureCase> cases;
  for (int tp : {1, 2}) {
    for (std::int64_t tokens : {1, 7, 64, 300}) cases.push_back({tp, tokens});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Graphs, CudaLayerCapture, ::testing::ValuesIn(capture_cases()),
                         [](const ::testing::TestParamInfo<CaptureCase>& info) {
                           return "tp" + std::to_string(info.param.tp) + "_T" +
                                  std::to_string(info.param.tokens);
                         });

// ---- refusals
// -------------------------------------------------------------------------------------

TEST(CudaLayer, RefusesCapturesThatWouldGrowAndHostInputs) {
  SKIP_WITHOUT_GPU();
  const LayerConfig config = small_config();
  const std::int64_t tokens = 4;
  lmoe::run_comm_group("cuda-threads", 1, [&](int, lmoe::Communicator& comm) {
    lmoe::LatentMoELayer layer(
        options_of(config, lmoe::Backend::cuda), comm,
        lmoe::make_random_layer_weights(config, DType::bf16, 1, 0, kWeightSeed));
    const HostTensor host_x = lmoe::make_random_layer_input(config.d_model, tokens, DType::bf16, 1);
    const std::size_t esize = lmoe::dtype_size(DType::bf16);
    const lmoe::cuda::DeviceBuffer x(static_cast<std::size_t>(tokens * config.d_model) * esize);
    const lmoe::cuda::DeviceBuffer routed(static_cast<std::size_t>(tokens * config.d_latent) *
                                          esize);
    const lmoe::cuda::DeviceBuffer shared(static_cast<std::size_t>(tokens * config.d_model) *
                                          esize);
    cuda_ok(cudaMemcpy(x.data(), host_x.data(), x.bytes(), cudaMemcpyHostToDevice));
    const lmoe::ConstMatrixView x_view{x.data(),       DType::bf16,    tokens,
                                       config.d_model, config.d_model, lmoe::MemorySpace::device};
    const lmoe::MatrixView routed_view{routed.data(),   DType::bf16,     tokens,
                                       config.d_latent, config.d_latent, lmoe::MemorySpace::device};
    const lmoe::MatrixView shared_view{shared.data(),  DType::bf16,    tokens,
                                       config.d_model, config.d_model, lmoe::MemorySpace::device};

    // x in host memory.
    try {
      layer.forward_partials(host_x.matrix(), routed_view, shared_view);
      ADD_FAILURE() << "a host x was accepted by the cuda layer";
    } catch (const lmoe::Error& error) {
      EXPECT_THAT(error.what(), HasSubstr("x: expected device memory"));
    }

    // A capture of the partials or of the whole forward before any forward (and without
    // max_tokens): the workspaces (and the layer's own partial buffers) would have to grow, which
    // must not touch the capturing stream.
    cudaStream_t stream = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const lmoe::cuda::DeviceBuffer y(static_cast<std::size_t>(tokens * config.d_model) * esize);
    const lmoe::MatrixView y_view{y.data(),       DType::bf16,    tokens,
                                  config.d_model, config.d_model, lmoe::MemorySpace::device};
    for (const bool whole : {false, true}) {
      SCOPED_TRACE(whole ? "forward" : "forward_partials");
      cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      std::string message;
      try {
        if (whole) {
          layer.forward(x_view, y_view, std::nullopt, stream);
        } else {
          layer.forward_partials(x_view, routed_view, shared_view, stream);
        }
      } catch (const lmoe::Error& error) {
        message = error.what();
      }
      cudaGraph_t graph = nullptr;
      cuda_ok(cudaStreamEndCapture(stream, &graph));
      if (graph) cudaGraphDestroy(graph);
      EXPECT_THAT(message, HasSubstr("they cannot grow while the stream is captured"));
    }

    // The layer still runs afterwards, and writes every element.
    cuda_ok(cudaMemsetAsync(routed.data(), 0xff, routed.bytes(), stream));
    layer.forward_partials(x_view, routed_view, shared_view, stream);
    cuda_ok(cudaStreamSynchronize(stream));
    HostTensor out(DType::bf16, {tokens, config.d_latent});
    cuda_ok(cudaMemcpy(out.data(), routed.data(), routed.bytes(), cudaMemcpyDeviceToHost));
    for (std::int64_t j = 0; j < out.numel(); ++j) ASSERT_FALSE(std::isnan(out.get(j))) << j;
    cuda_ok(cudaStreamDestroy(stream));
  });
}

// LMOE_LAYER_SERIAL_STAGES=1 moves the shared experts after the routed ones: the same kernels on
// the same data, so the same bits, on both paths; a join that let the tail read `shared` early
// would show here.
TEST(CudaLayer, SerialStagesGiveTheSameBitsAsOverlappedOnes) {
  SKIP_WITHOUT_GPU();
  const LayerConfig config = small_config();
  std::vector<HostTensor> inputs;
  for (std::int64_t tokens : {1, 64, 300}) {
    inputs.push_back(lmoe::make_random_layer_input(config.d_model, tokens, DType::bf16,
                                                   900u + static_cast<std::uint64_t>(tokens)));
  }
  for (const bool device_experts : {false, true}) {
    SCOPED_TRACE(device_experts ? "device path" : "host path");
    const auto overlapped =
        run_layer(config, DType::bf16, lmoe::Backend::cuda, 2, inputs, device_experts);
    const ScopedEnv serial(lmoe::kSerialStagesEnv, "1");
    const auto serial_run =
        run_layer(config, DType::bf16, lmoe::Backend::cuda, 2, inputs, device_experts);
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      for (int r = 0; r < 2; ++r) {
        const HostTensor& a = overlapped[i].ranks[r].y;
        const HostTensor& b = serial_run[i].ranks[r].y;
        ASSERT_EQ(a.nbytes(), b.nbytes());
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << "input " << i << " rank " << r;
      }
    }
  }
}

// Host checks only: runs without a GPU too.
TEST(CudaLayer, TheDevicePathSaysWhatItCannotRun) {
  LayerConfig config = small_config();
  EXPECT_FALSE(lmoe::cuda_device_experts_limit(config, DType::bf16, 4).has_value());
  EXPECT_FALSE(lmoe::cuda_device_experts_limit(config, DType::f16, 1).has_value());
  EXPECT_THAT(lmoe::cuda_device_experts_limit(config, DType::f32, 1).value_or(""),
              HasSubstr("dtype: the device path's grouped GEMM takes bf16 or f16, got f32"));
  config.expert_intermediate = 6;  // 3 per rank at tp 2
  EXPECT_FALSE(lmoe::cuda_device_experts_limit(config, DType::bf16, 3).has_value());
  EXPECT_THAT(lmoe::cuda_device_experts_limit(config, DType::bf16, 2).value_or(""),
              HasSubstr("expert_intermediate/tp=3: the grouped GEMM expects even row widths"));
  config = small_config();
  config.router.num_experts = 1024;
  EXPECT_FALSE(lmoe::cuda_device_experts_limit(config, DType::bf16, 1).has_value());
  config.router.num_experts = 1025;
  EXPECT_THAT(lmoe::cuda_device_experts_limit(config, DType::bf16, 1).value_or(""),
              HasSubstr("num_experts=1025 > 1024"));
}

TEST(CudaLayer, TheDevicePathRefusesF32WithTheReason) {
  SKIP_WITHOUT_GPU();
  const LayerConfig config = small_config();
  const std::int64_t tokens = 4;
  lmoe::run_comm_group("cuda-threads", 1, [&](int, lmoe::Communicator& comm) {
    const auto weights = [&] {
      return lmoe::make_random_layer_weights(config, DType::f32, 1, 0, kWeightSeed);
    };
    {
      const ScopedEnv device_path(lmoe::kDeviceExpertsEnv, "1");
      try {
        lmoe::LatentMoELayer layer(options_of(config, lmoe::Backend::cuda, DType::f32), comm,
                                   weights());
        ADD_FAILURE() << "LMOE_LAYER_DEVICE_EXPERTS=1 was accepted for an f32 layer";
      } catch (const lmoe::Error& error) {
        EXPECT_THAT(error.what(), HasSubstr("dtype: the device path's grouped GEMM takes bf16 or "
                                            "f16, got f32"));
      }
    }
    lmoe::LayerOptions options = options_of(config, lmoe::Backend::cuda, DType::f32);
    options.max_tokens = tokens;
    lmoe::LatentMoELayer layer(options, comm, weights());
    const std::size_t bytes = static_cast<std::size_t>(tokens * config.d_model) * sizeof(float);
    const lmoe::cuda::DeviceBuffer x(bytes), y(bytes);
    cuda_ok(cudaMemset(x.data(), 0, bytes));
    const lmoe::ConstMatrixView x_view{x.data(),       DType::f32,     tokens,
                                       config.d_model, config.d_model, lmoe::MemorySpace::device};
    const lmoe::MatrixView y_view{y.data(),       DType::f32,     tokens,
                                  config.d_model, config.d_model, lmoe::MemorySpace::device};
    cudaStream_t stream = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    layer.forward(x_view, y_view, std::nullopt, stream);  // eager: the host path serves f32
    cuda_ok(cudaStreamSynchronize(stream));
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    std::string message;
    try {
      layer.forward(x_view, y_view, std::nullopt, stream);
    } catch (const lmoe::Error& error) {
      message = error.what();
    }
    cudaGraph_t graph = nullptr;
    cuda_ok(cudaStreamEndCapture(stream, &graph));
    if (graph) cudaGraphDestroy(graph);
    EXPECT_THAT(message, HasSubstr("device path (no host read of the routing), which cannot run "
                                   "this layer: dtype"));
    cuda_ok(cudaStreamDestroy(stream));
  });
}

}  // namespace
