#include "lmoe/reference.hpp"

#include <cblas.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "core/host_math.hpp"
#include "core/rank_order_reduce.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

TailCase empty_case(TailDims dims, float eps, DType dtype, int tp, std::int64_t tokens) {
  LMOE_CHECK(tp >= 1 && tokens >= 0 && dims.d_model > 0 && dims.d_latent > 0,
             "invalid case: tp, T or dims out of range");
  return {.dims = dims,
          .eps = eps,
          .dtype = dtype,
          .tp = tp,
          .num_tokens = tokens,
          .routed = HostTensor(dtype, {tp, tokens, dims.d_latent}),
          .shared = HostTensor(dtype, {tp, tokens, dims.d_model}),
          .norm_weight = HostTensor(dtype, {dims.d_latent}),
          .up_proj_weight = HostTensor(dtype, {dims.d_model, dims.d_latent})};
}

// Spacing of the storage dtype's values near magnitude x (its ulp there).
double ulp_of(DType dtype, double x) {
  int mantissa_bits = 0;
  int min_exponent = 0;  // exponent of the smallest normal
  switch (dtype) {
    case DType::f32:
      mantissa_bits = 23;
      min_exponent = -126;
      break;
    case DType::f16:
      mantissa_bits = 10;
      min_exponent = -14;
      break;
    case DType::bf16:
      mantissa_bits = 7;
      min_exponent = -126;
      break;
  }
  x = std::fabs(x);
  int exponent = min_exponent;
  if (x > 0 && std::isfinite(x)) exponent = std::max(min_exponent, std::ilogb(x));
  return std::ldexp(1.0, exponent - mantissa_bits);
}

std::vector<const void*> rank_slices(const HostTensor& stacked) {
  std::vector<const void*> slices;
  for (std::int64_t r = 0; r < stacked.shape()[0]; ++r)
    slices.push_back(stacked.slice_matrix(r).data);
  return slices;
}

// The unit roundoff u of round-to-nearest in the storage dtype: |round(x) − x| <= u·|x| (also for
// sums that land among the subnormals, which are exact).
double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::f32: return std::ldexp(1.0, -24);
    case DType::f16: return std::ldexp(1.0, -11);
    case DType::bf16: return std::ldexp(1.0, -8);
  }
  return 0;
}

// γ_k = k·u / (1 − k·u): a sum of k + 1 terms, in any order, with each partial sum rounded, is off
// by at most γ_k · Σ|terms| (Higham, Accuracy and Stability of Numerical Algorithms, §4.2).
double gamma_of(double k, double unit) { return k * unit / (1.0 - k * unit); }

// How far a rank sum in an unspecified order with intermediate roundings (NCCL) can be from the
// contract's: for each element of the reduced tensor, with A = Σ_r |x_r| and c the contract's
// value,
//   |ĉ − c| <= |ĉ − Σ x_r| + |Σ x_r − c| <= γ_{tp−1}(u) A + γ_{tp−1}(2⁻²⁴) A + ulp(|c|) / 2,
// the first term for the tree NCCL builds (any tree of tp leaves has at most tp − 1 roundings on a
// path), the others for the contract's fp32 rank-order sum and its one rounding.
std::vector<double> reduction_slack(const HostTensor& stacked, const HostTensor& reduced, int tp) {
  const DType dtype = reduced.dtype();
  const std::int64_t count = reduced.numel();
  const double per_magnitude =
      gamma_of(tp - 1, unit_roundoff(dtype)) + gamma_of(tp - 1, std::ldexp(1.0, -24));
  std::vector<double> slack(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) {
    double magnitude = 0;
    for (int r = 0; r < tp; ++r) magnitude += std::fabs(stacked.get(r * count + i));
    slack[static_cast<std::size_t>(i)] =
        per_magnitude * magnitude +
        0.5 * ulp_of(dtype, std::fabs(static_cast<double>(reduced.get(i))));
  }
  return slack;
}

// A bound on |N̂ − N| per element of the normalized latent [T, l] when the reduced latent L̂ differs
// from the contract's L by at most `latent_slack` per element. For a row with ρ = sqrt(Σ L²/l +
// eps) and τ = ‖latent_slack‖₂ / √l (so |ρ̂ − ρ| <= τ by the triangle inequality):
//   n̂_j − n_j = γ_j (δ_j / ρ̂ + L_j (ρ − ρ̂) / (ρ ρ̂))  ⇒  |n̂_j − n_j| <= |γ_j| (Δ_j + |L_j| τ / ρ) /
//   (ρ − τ).
// Both sides are evaluated in fp32 (relative error at most ε = γ_{l+2}/2 + γ_6 in 2⁻²⁴: the sum of
// squares, the mean and eps, the square root, its reciprocal and two products) and rounded once.
// Rows where τ >= ρ / 2 (a latent about as small as its own rounding) get a slack so large that
// nothing is judged there (finite, so that the GEMM with |W| never forms ∞ · 0).
std::vector<float> norm_slack(const HostTensor& latent, const HostTensor& normed,
                              const HostTensor& gamma, const std::vector<double>& latent_slack,
                              float eps) {
  const DType dtype = latent.dtype();
  const std::int64_t tokens = latent.shape()[0], l = latent.shape()[1];
  const double f32_unit = std::ldexp(1.0, -24);
  const double eval = 0.5 * gamma_of(static_cast<double>(l + 2), f32_unit) + gamma_of(6, f32_unit);
  std::vector<float> slack(static_cast<std::size_t>(tokens * l));
  for (std::int64_t t = 0; t < tokens; ++t) {
    double squares = 0, slack_squares = 0;
    for (std::int64_t j = 0; j < l; ++j) {
      const double x = latent.get(t * l + j);
      squares += x * x;
      slack_squares += latent_slack[static_cast<std::size_t>(t * l + j)] *
                       latent_slack[static_cast<std::size_t>(t * l + j)];
    }
    const double rho = std::sqrt(squares / static_cast<double>(l) + eps);
    const double tau = std::sqrt(slack_squares / static_cast<double>(l));
    for (std::int64_t j = 0; j < l; ++j) {
      const std::size_t i = static_cast<std::size_t>(t * l + j);
      if (!(tau < 0.5 * rho)) {
        slack[i] = 1e30f;
        continue;
      }
      const double x = latent.get(t * l + j), g = std::fabs(static_cast<double>(gamma.get(j)));
      const double ideal = std::fabs(x) * g / rho;
      const double moved = g * (latent_slack[i] + std::fabs(x) * tau / rho) / (rho - tau);
      const double evaluated = moved + eval * (2 * ideal + moved);
      const double stored = std::fabs(static_cast<double>(normed.get(t * l + j)));
      slack[i] = static_cast<float>(1.01 * (evaluated + ulp_of(dtype, 2 * stored + evaluated)));
    }
  }
  return slack;
}

}  // namespace

TailCase make_random_case(TailDims dims, float eps, DType dtype, int tp, std::int64_t tokens,
                          std::uint64_t seed) {
  TailCase c = empty_case(dims, eps, dtype, tp, tokens);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::int64_t i = 0; i < c.routed.numel(); ++i) c.routed.set(i, normal(rng));
  for (std::int64_t i = 0; i < c.shared.numel(); ++i) c.shared.set(i, normal(rng));
  for (std::int64_t i = 0; i < c.norm_weight.numel(); ++i)
    c.norm_weight.set(i, 1.0f + 0.1f * normal(rng));
  const float w_scale = 1.0f / std::sqrt(static_cast<float>(dims.d_latent));
  for (std::int64_t i = 0; i < c.up_proj_weight.numel(); ++i) {
    c.up_proj_weight.set(i, w_scale * normal(rng));
  }
  return c;
}

TailCase make_exact_case(TailDims dims, DType dtype, int tp, std::int64_t tokens,
                         std::uint64_t seed) {
  TailCase c = empty_case(dims, 0.0f, dtype, tp, tokens);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> small(-3, 3);
  std::uniform_int_distribution<int> gamma(-4, 4);
  std::uniform_int_distribution<int> sign(0, 1);
  const std::int64_t latent = tokens * dims.d_latent;
  for (std::int64_t i = 0; i < latent; ++i) {
    // Rank partials are small integers whose sum is ±2, so that rms = 2 and rstd = 0.5 exactly.
    int rest = sign(rng) ? 2 : -2;
    for (int r = 0; r + 1 < tp; ++r) {
      const int part = small(rng);
      c.routed.set(r * latent + i, static_cast<float>(part));
      rest -= part;
    }
    c.routed.set(static_cast<std::int64_t>(tp - 1) * latent + i, static_cast<float>(rest));
  }
  for (std::int64_t i = 0; i < c.shared.numel(); ++i)
    c.shared.set(i, static_cast<float>(small(rng)));
  for (std::int64_t i = 0; i < c.norm_weight.numel(); ++i)
    c.norm_weight.set(i, static_cast<float>(gamma(rng)));
  for (std::int64_t i = 0; i < c.up_proj_weight.numel(); ++i) {
    c.up_proj_weight.set(i, static_cast<float>(small(rng)));
  }
  return c;
}

Contract contract_of(TailTier tier) {
  return tier == TailTier::column ? Contract::column : Contract::reduce_then_add;
}

ContractReference reference_tail(const TailCase& c, Contract contract, ReductionOrder reductions) {
  const std::int64_t tokens = c.num_tokens, d = c.dims.d_model, l = c.dims.d_latent;
  const std::size_t td = static_cast<std::size_t>(tokens * d);
  ContractReference ref;
  ref.y = HostTensor(c.dtype, {tokens, d});
  ref.bound.assign(td, 0.0);
  if (tokens == 0) return ref;
  // With one rank nothing is summed, so every order is the contract's.
  const bool reordered = reductions == ReductionOrder::unspecified && c.tp > 1;

  // N = round(rmsnorm(round(Σ routed_r))), or round(Σ routed_r) without the norm
  HostTensor latent(c.dtype, {tokens, l});
  reduce_in_rank_order(rank_slices(c.routed), latent.data(), static_cast<std::size_t>(tokens * l),
                       c.dtype);
  HostTensor normed = latent;
  if (c.latent_norm)
    cpu::rms_norm(latent.matrix(), cpu::to_float(c.norm_weight.matrix()), c.eps, normed.matrix());

  const std::vector<float> w = cpu::to_float(c.up_proj_weight.matrix());
  const std::vector<float> u = cpu::gemm_fp32(normed.matrix(), w.data(), d);  // unrounded
  // |N| · |W|ᵀ bounds how far two fp32 summation orders of the GEMM can drift apart.
  std::vector<float> abs_n = cpu::to_float(normed.matrix()), abs_w = w;
  for (float& v : abs_n) v = std::fabs(v);
  for (float& v : abs_w) v = std::fabs(v);
  const auto abs_product = [&](const std::vector<float>& a) {  // a [T, l] · |W|ᵀ → [T, d]
    std::vector<float> product(td);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(tokens),
                static_cast<int>(d), static_cast<int>(l), 1.0f, a.data(), static_cast<int>(l),
                abs_w.data(), static_cast<int>(l), 0.0f, product.data(), static_cast<int>(d));
    return product;
  };
  const std::vector<float> magnitude = abs_product(abs_n);
  const double unit = std::ldexp(1.0, -24);
  const double gamma_k = static_cast<double>(l) * unit / (1.0 - static_cast<double>(l) * unit);
  const double f32_unit = std::ldexp(1.0, -23);

  // Δ_U: how far another implementation's unrounded U may be from ours. In rank order it differs
  // only by the GEMM's order, e = 2 γ_l |N|·|W|ᵀ; a reordered latent moves N by up to Δ_N, which
  // the GEMM carries as (1 + γ_l) Δ_N · |W|ᵀ.
  std::vector<float> moved_u;
  if (reordered) {
    const std::vector<double> latent_slack = reduction_slack(c.routed, latent, c.tp);
    if (c.latent_norm) {
      moved_u = abs_product(norm_slack(latent, normed, c.norm_weight, latent_slack, c.eps));
    } else {  // N is the latent: it moves by the latent's own slack (rounded up to fp32)
      std::vector<float> slack(latent_slack.size());
      for (std::size_t i = 0; i < slack.size(); ++i)
        slack[i] = static_cast<float>(1.01 * latent_slack[i]);
      moved_u = abs_product(slack);
    }
  }
  const auto u_slack = [&](std::size_t i) {
    const double e = 2.0 * gamma_k * magnitude[i] * 1.01;
    return reordered ? e + (1.0 + gamma_k) * 1.01 * moved_u[i] : e;
  };
  const double reorder_gamma = reordered ? gamma_of(c.tp - 1, unit_roundoff(c.dtype)) : 0.0;

  if (contract == Contract::reduce_then_add) {
    // Y = round(round(U) + round(Σ shared_r))
    HostTensor shared_sum(c.dtype, {tokens, d});
    reduce_in_rank_order(rank_slices(c.shared), shared_sum.data(), td, c.dtype);
    const std::vector<double> shared_slack =
        reordered ? reduction_slack(c.shared, shared_sum, c.tp) : std::vector<double>(td, 0.0);
    for (std::size_t i = 0; i < td; ++i) {
      const float rounded_u = round_to(c.dtype, u[i]);
      const float y = rounded_u + shared_sum.get(static_cast<std::int64_t>(i));
      ref.y.set(static_cast<std::int64_t>(i), y);
      const double e = u_slack(i);
      const double du = e + ulp_of(c.dtype, std::fabs(u[i]) + e) + shared_slack[i];
      ref.bound[i] = du + ulp_of(c.dtype, std::fabs(static_cast<double>(y)) + du);
    }
    return ref;
  }

  // column: shared'_r = round(shared_r + U) inside rank r's stripe, shared_r elsewhere;
  // Y = round(Σ_r shared'_r) in rank order.
  const std::int64_t stripe = d / c.tp;
  LMOE_CHECK(stripe * c.tp == d, "column contract needs d_model divisible by tp");
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t j = 0; j < d; ++j) {
      const std::int64_t owner = j / stripe;
      const std::size_t i = static_cast<std::size_t>(t * d + j);
      float acc = 0.0f;
      double magnitude_sum = 0.0;
      double owner_value = 0.0;
      for (int r = 0; r < c.tp; ++r) {
        float value = c.shared.get(r * tokens * d + static_cast<std::int64_t>(i));
        if (r == owner) {
          value = round_to(c.dtype, value + u[i]);
          owner_value = value;
        }
        acc = r == 0 ? value : acc + value;
        magnitude_sum += std::fabs(value);
      }
      const float y = round_to(c.dtype, acc);
      ref.y.set(static_cast<std::int64_t>(i), y);
      const double e = u_slack(i);
      const double d_owner = e + ulp_of(c.dtype, std::fabs(owner_value) + e);
      // The sum of the partials: the contract's fp32 rank order, plus, when reordered, what tp − 1
      // roundings in the storage dtype can add to the (perturbed) partials' magnitude.
      const double d_sum = d_owner + c.tp * f32_unit * (magnitude_sum + d_owner) +
                           reorder_gamma * (magnitude_sum + d_owner);
      ref.bound[i] = d_sum + ulp_of(c.dtype, std::fabs(static_cast<double>(y)) + d_sum);
    }
  }
  return ref;
}

std::vector<double> exact_tail(const TailCase& c) {
  const std::int64_t tokens = c.num_tokens, d = c.dims.d_model, l = c.dims.d_latent;
  std::vector<double> y(static_cast<std::size_t>(tokens * d), 0.0);
  if (tokens == 0) return y;
  std::vector<double> normed(static_cast<std::size_t>(tokens * l));
  for (std::int64_t t = 0; t < tokens; ++t) {
    double sum_squares = 0;
    for (std::int64_t j = 0; j < l; ++j) {
      double x = 0;
      for (int r = 0; r < c.tp; ++r) x += c.routed.get((r * tokens + t) * l + j);
      normed[static_cast<std::size_t>(t * l + j)] = x;
      sum_squares += x * x;
    }
    if (!c.latent_norm) continue;
    const double rstd = 1.0 / std::sqrt(sum_squares / static_cast<double>(l) + c.eps);
    for (std::int64_t j = 0; j < l; ++j)
      normed[static_cast<std::size_t>(t * l + j)] *= rstd * c.norm_weight.get(j);
  }
  std::vector<double> w(static_cast<std::size_t>(d * l));
  for (std::size_t i = 0; i < w.size(); ++i)
    w[i] = c.up_proj_weight.get(static_cast<std::int64_t>(i));
  for (std::int64_t r = 0; r < c.tp; ++r) {
    for (std::int64_t i = 0; i < tokens * d; ++i)
      y[static_cast<std::size_t>(i)] += c.shared.get(r * tokens * d + i);
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(tokens),
              static_cast<int>(d), static_cast<int>(l), 1.0, normed.data(), static_cast<int>(l),
              w.data(), static_cast<int>(l), 1.0, y.data(), static_cast<int>(d));
  return y;
}

double fp64_tolerance(DType dtype) {
  switch (dtype) {
    case DType::bf16: return 1e-2;
    case DType::f16: return 2e-3;
    case DType::f32: return 1e-4;
  }
  return 0;
}

Comparison compare(ConstMatrixView y, const ContractReference& reference,
                   const std::vector<double>& exact) {
  Comparison result;
  const ConstMatrixView ref = reference.y.matrix();
  LMOE_CHECK(y.rows == ref.rows && y.cols == ref.cols && y.dtype == ref.dtype,
             "compare: output shape or dtype differs from the reference");
  const std::size_t esize = y.element_size();
  double diff_squares = 0, exact_squares = 0;
  for (std::int64_t t = 0; t < y.rows; ++t) {
    for (std::int64_t j = 0; j < y.cols; ++j) {
      const std::size_t i = static_cast<std::size_t>(t * y.cols + j);
      ++result.elements;
      const auto* got_bytes = static_cast<const std::byte*>(y.data) + y.offset(t, j) * esize;
      const auto* want_bytes = static_cast<const std::byte*>(ref.data) + ref.offset(t, j) * esize;
      if (std::memcmp(got_bytes, want_bytes, esize) != 0) ++result.bit_mismatches;
      const double got = load_as_float(y.data, y.offset(t, j), y.dtype);
      const double want = load_as_float(ref.data, ref.offset(t, j), ref.dtype);
      const double error = std::fabs(got - want);
      if (std::isnan(got) != std::isnan(want) || error > reference.bound[i]) ++result.beyond_bound;
      if (reference.bound[i] > 0 && std::isfinite(error)) {
        result.max_error_over_bound =
            std::max(result.max_error_over_bound, error / reference.bound[i]);
      } else if (!std::isfinite(error) && !(std::isnan(got) && std::isnan(want))) {
        result.max_error_over_bound = std::numeric_limits<double>::infinity();
      }
      diff_squares += (got - exact[i]) * (got - exact[i]);
      exact_squares += exact[i] * exact[i];
    }
  }
  result.normwise_tolerance = fp64_tolerance(y.dtype);
  result.normwise_error =
      exact_squares > 0 ? std::sqrt(diff_squares / exact_squares) : std::sqrt(diff_squares);
  if (std::isnan(result.normwise_error))
    result.normwise_error = std::numeric_limits<double>::infinity();
  return result;
}

}  // namespace lmoe
