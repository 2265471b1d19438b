#include "lmoe/layer_reference.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/expert_activation.hpp"
#include "core/host_math.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

std::vector<double> to_double(const HostTensor& tensor) {
  std::vector<double> values(static_cast<std::size_t>(tensor.numel()));
  for (std::int64_t i = 0; i < tensor.numel(); ++i)
    values[static_cast<std::size_t>(i)] = tensor.get(i);
  return values;
}

std::vector<double> to_double(ConstMatrixView view) {
  const std::vector<float> values = cpu::to_float(view);  // exact: every storage dtype fits fp32
  return {values.begin(), values.end()};
}

// c [m, n] = a [m, k] · w [n, k]ᵀ in fp64.
void gemm_nt(std::int64_t m, std::int64_t n, std::int64_t k, const double* a, const double* w,
             double* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::fill(c, c + m * n, 0.0);
    return;
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), 1.0, a, static_cast<int>(k), w, static_cast<int>(k), 0.0, c,
              static_cast<int>(n));
}

// out [rows, out_size] = act(a · gateᵀ, a · upᵀ) · downᵀ for a [rows, in], gate and up
// [width, in], down [out_size, width].
void mlp(const LayerConfig& config, std::int64_t rows, std::int64_t in, std::int64_t width,
         std::int64_t out_size, const double* a, const double* gate, const double* up,
         const double* down, std::vector<double>& out) {
  std::vector<double> g(static_cast<std::size_t>(rows * width), 0.0), u(g.size());
  if (gate != nullptr) gemm_nt(rows, width, in, a, gate, g.data());
  gemm_nt(rows, width, in, a, up, u.data());
  for (std::size_t i = 0; i < u.size(); ++i) u[i] = activate<double>(config, g[i], u[i]);
  out.resize(static_cast<std::size_t>(rows * out_size));
  gemm_nt(rows, out_size, width, u.data(), down, out.data());
}

bool ranks_before(double a, std::int32_t ia, double b, std::int32_t ib) {
  if (std::isnan(a) != std::isnan(b)) return std::isnan(b);
  if (!std::isnan(a) && a != b) return a > b;
  return ia < ib;
}

}  // namespace

std::vector<double> exact_router_logits(const LayerWeights& weights, ConstMatrixView x) {
  const std::vector<double> x64 = to_double(x);
  const std::vector<double> w = to_double(weights.router_weight);
  const std::int64_t experts = weights.router_weight.shape()[0];
  std::vector<double> logits(static_cast<std::size_t>(x.rows * experts));
  gemm_nt(x.rows, experts, x.cols, x64.data(), w.data(), logits.data());
  return logits;
}

ExactRouting exact_router(const RouterConfig& config, std::span<const double> logits,
                          std::int64_t num_tokens, std::span<const float> bias) {
  const std::int64_t experts = config.num_experts, k = config.top_k;
  const std::int64_t group_size = experts / config.n_group;
  ExactRouting result;
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    std::vector<double> scores(static_cast<std::size_t>(experts)), biased(scores.size());
    const double* row = logits.data() + t * experts;
    if (config.score == RouterScore::sigmoid) {
      for (std::int64_t e = 0; e < experts; ++e) scores[e] = sigmoid_of(row[e]);
    } else {
      const double max_logit = *std::max_element(row, row + experts);
      double sum = 0;
      for (std::int64_t e = 0; e < experts; ++e) sum += std::exp(row[e] - max_logit);
      for (std::int64_t e = 0; e < experts; ++e) scores[e] = std::exp(row[e] - max_logit) / sum;
    }
    for (std::int64_t e = 0; e < experts; ++e) {
      biased[e] = scores[e] + (config.correction_bias ? static_cast<double>(bias[e]) : 0.0);
    }
    std::vector<std::int32_t> order(static_cast<std::size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    auto by_bias = [&](std::int32_t a, std::int32_t b) {
      return ranks_before(biased[a], a, biased[b], b);
    };
    std::vector<bool> eligible(static_cast<std::size_t>(experts), true);
    if (config.n_group > 1) {
      std::vector<double> group_score(static_cast<std::size_t>(config.n_group));
      for (std::int64_t g = 0; g < config.n_group; ++g) {
        std::vector<std::int32_t> members(order.begin() + g * group_size,
                                          order.begin() + (g + 1) * group_size);
        std::sort(members.begin(), members.end(), by_bias);
        group_score[g] = biased[members[0]];
        if (config.correction_bias && members.size() > 1) group_score[g] += biased[members[1]];
      }
      std::vector<std::int32_t> groups(static_cast<std::size_t>(config.n_group));
      std::iota(groups.begin(), groups.end(), 0);
      std::sort(groups.begin(), groups.end(), [&](std::int32_t a, std::int32_t b) {
        return ranks_before(group_score[a], a, group_score[b], b);
      });
      std::fill(eligible.begin(), eligible.end(), false);
      for (std::int64_t i = 0; i < config.topk_group; ++i) {
        for (std::int64_t e = groups[i] * group_size; e < (groups[i] + 1) * group_size; ++e)
          eligible[e] = true;
      }
    }
    std::vector<std::int32_t> candidates;
    for (std::int32_t e = 0; e < experts; ++e) {
      if (eligible[e]) candidates.push_back(e);
    }
    std::sort(candidates.begin(), candidates.end(), by_bias);
    double sum = 0;
    for (std::int64_t j = 0; j < k; ++j) sum += scores[candidates[j]];
    for (std::int64_t j = 0; j < k; ++j) {
      result.expert_ids.push_back(candidates[j]);
      double weight = scores[candidates[j]];
      if (config.renormalize) weight = sum > 0 ? weight / sum : 0.0;
      result.weights.push_back(weight * config.routed_scaling_factor);
    }
  }
  return result;
}

struct LayerReference::Weights {
  std::vector<double> latent_down, gate, up, down, shared_gate, shared_up, shared_down, gamma,
      latent_up;
};

LayerReference::LayerReference(const LayerConfig& config, float eps, const LayerWeights& weights)
    : config_(config), eps_(eps) {
  auto converted = std::make_shared<Weights>();
  Weights& w = *converted;
  w.latent_down = to_double(weights.latent_down);
  // Packed experts by the values the layer computes with: dequantized to its storage dtype (that
  // of every weight but the router's).
  const DType dtype = weights.latent_down.dtype();
  HostTensor scratch;
  w.gate = to_double(dense_expert_weight(weights, &LayerWeights::expert_gate, dtype, scratch));
  w.up = to_double(dense_expert_weight(weights, &LayerWeights::expert_up, dtype, scratch));
  w.down = to_double(dense_expert_weight(weights, &LayerWeights::expert_down, dtype, scratch));
  w.shared_gate = to_double(weights.shared_gate);
  w.shared_up = to_double(weights.shared_up);
  w.shared_down = to_double(weights.shared_down);
  w.gamma = to_double(weights.latent_norm);
  w.latent_up = to_double(weights.latent_up);
  weights_ = std::move(converted);
}

ExactLayer exact_layer(const LayerConfig& config, float eps, const LayerWeights& weights,
                       ConstMatrixView x, const Routing& routing) {
  return LayerReference(config, eps, weights).run(x, routing);
}

ExactLayer LayerReference::run(ConstMatrixView x, const Routing& routing) const {
  const LayerConfig& config = config_;
  const Weights& w = *weights_;
  LMOE_CHECK(routing.num_tokens == x.rows, "exact_layer: the routing is for " +
                                               std::to_string(routing.num_tokens) +
                                               " tokens, x has " + std::to_string(x.rows));
  const std::int64_t tokens = x.rows, d = config.d_model, l = config.d_latent, k = routing.top_k;
  const std::int64_t inter = config.expert_intermediate, shared_width = config.shared_width();
  const bool gated = is_gated(config.activation);
  const std::vector<double> x64 = to_double(x);

  ExactLayer result;
  result.routed.assign(static_cast<std::size_t>(tokens * l), 0.0);
  result.shared.assign(static_cast<std::size_t>(tokens * d), 0.0);
  result.y.assign(static_cast<std::size_t>(tokens * d), 0.0);
  if (tokens == 0) return result;

  std::vector<double> z(static_cast<std::size_t>(tokens * l));
  gemm_nt(tokens, l, d, x64.data(), w.latent_down.data(), z.data());

  // Routed experts: each expert's tokens at once; o · w added to the token's row.
  std::vector<std::vector<std::int64_t>> slots(static_cast<std::size_t>(config.router.num_experts));
  for (std::int64_t s = 0; s < tokens * k; ++s) slots[routing.expert_ids[s]].push_back(s);
  std::vector<double> rows, out;
  for (std::size_t e = 0; e < slots.size(); ++e) {
    const std::int64_t count = static_cast<std::int64_t>(slots[e].size());
    if (count == 0) continue;
    rows.resize(static_cast<std::size_t>(count * l));
    for (std::int64_t i = 0; i < count; ++i) {
      std::copy_n(z.data() + slots[e][i] / k * l, l, rows.data() + i * l);
    }
    const std::size_t matrix = e * static_cast<std::size_t>(inter * l);
    mlp(config, count, l, inter, l, rows.data(), gated ? w.gate.data() + matrix : nullptr,
        w.up.data() + matrix, w.down.data() + matrix, out);
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int64_t slot = slots[e][i];
      const double weight = routing.weights[static_cast<std::size_t>(slot)];
      double* routed = result.routed.data() + slot / k * l;
      for (std::int64_t c = 0; c < l; ++c)
        routed[c] += weight * out[static_cast<std::size_t>(i * l + c)];
    }
  }

  if (shared_width > 0) {
    mlp(config, tokens, d, shared_width, d, x64.data(), gated ? w.shared_gate.data() : nullptr,
        w.shared_up.data(), w.shared_down.data(), result.shared);
  }

  std::vector<double> normed(static_cast<std::size_t>(tokens * l));
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double* routed = result.routed.data() + t * l;
    double squares = 0;
    for (std::int64_t c = 0; c < l; ++c) squares += routed[c] * routed[c];
    if (!config_.latent_norm) {  // the routed sum goes to the up-projection as it is
      std::copy_n(routed, l, normed.data() + t * l);
      continue;
    }
    const double rstd = 1.0 / std::sqrt(squares / static_cast<double>(l) + eps_);
    for (std::int64_t c = 0; c < l; ++c) normed[t * l + c] = routed[c] * rstd * w.gamma[c];
  }
  gemm_nt(tokens, d, l, normed.data(), w.latent_up.data(), result.y.data());
  for (std::size_t i = 0; i < result.y.size(); ++i) result.y[i] += result.shared[i];
  return result;
}

// Measured on the small preset (tp 1, 2, 4; T 1 … 300; every activation): worst normwise error
// 4.6e-3 (bf16), 5.6e-4 (f16), 5.2e-7 (f32); worst element 0.025, 2.8e-3, 2.8e-6 of its row's RMS.
// The tolerances leave a factor of 2 to 6 (docs/numerics.md, "The layer").
double layer_normwise_tolerance(DType dtype) {
  switch (dtype) {
    case DType::bf16: return 1e-2;
    case DType::f16: return 1.5e-3;
    case DType::f32: return 3e-6;
  }
  return 0;
}

double layer_row_tolerance(DType dtype) {
  switch (dtype) {
    case DType::bf16: return 0.06;
    case DType::f16: return 8e-3;
    case DType::f32: return 1.5e-5;
  }
  return 0;
}

LayerComparison compare_layer(const std::vector<double>& y, const std::vector<double>& exact,
                              std::int64_t cols, DType dtype) {
  LMOE_CHECK(y.size() == exact.size() && cols > 0, "compare_layer: sizes differ");
  LayerComparison result;
  result.normwise_tolerance = layer_normwise_tolerance(dtype);
  result.row_tolerance = layer_row_tolerance(dtype);
  double diff_squares = 0, exact_squares = 0;
  const std::int64_t rows = static_cast<std::int64_t>(y.size()) / cols;
  for (std::int64_t r = 0; r < rows; ++r) {
    double row_squares = 0;
    for (std::int64_t c = 0; c < cols; ++c)
      row_squares += exact[r * cols + c] * exact[r * cols + c];
    const double rms = std::sqrt(row_squares / static_cast<double>(cols));
    exact_squares += row_squares;
    for (std::int64_t c = 0; c < cols; ++c) {
      const double diff = y[r * cols + c] - exact[r * cols + c];
      diff_squares += diff * diff;
      double relative = rms > 0 ? std::abs(diff) / rms : (diff == 0 ? 0.0 : std::abs(diff) / 0.0);
      if (std::isnan(relative)) relative = std::numeric_limits<double>::infinity();
      result.max_row_error = std::max(result.max_row_error, relative);
    }
  }
  result.normwise_error =
      exact_squares > 0 ? std::sqrt(diff_squares / exact_squares) : std::sqrt(diff_squares);
  if (std::isnan(result.normwise_error))
    result.normwise_error = std::numeric_limits<double>::infinity();
  return result;
}

LayerComparison compare_layer(ConstMatrixView y, const std::vector<double>& exact) {
  return compare_layer(to_double(y), exact, y.cols, y.dtype);
}

}  // namespace lmoe
