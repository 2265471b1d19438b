#include "lmoe/reference.hpp"

#include <cblas.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "comm/rank_order_reduce.hpp"
#include "cpu/cpu_math.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

TailCase empty_case(TailDims dims, float eps, DType dtype, int tp, std::int64_t tokens) {
  LMOE_CHECK(tp >= 1 && tokens >= 0 && dims.d_model > 0 && dims.d_latent > 0,
             "invalid case: tp, T or dims out of range");
  TailCase c;
  c.dims = dims;
  c.eps = eps;
  c.dtype = dtype;
  c.tp = tp;
  c.num_tokens = tokens;
  c.routed = HostTensor(dtype, {tp, tokens, dims.d_latent});
  c.shared = HostTensor(dtype, {tp, tokens, dims.d_model});
  c.norm_weight = HostTensor(dtype, {dims.d_latent});
  c.up_proj_weight = HostTensor(dtype, {dims.d_model, dims.d_latent});
  return c;
}

// Spacing of the storage dtype's values near magnitude x (its ulp there).
double ulp_of(DType dtype, double x) {
  int mantissa_bits = 0;
  int min_exponent = 0;  // exponent of the smallest normal
  switch (dtype) {
    case DType::f32: mantissa_bits = 23; min_exponent = -126; break;
    case DType::f16: mantissa_bits = 10; min_exponent = -14; break;
    case DType::bf16: mantissa_bits = 7; min_exponent = -126; break;
  }
  x = std::fabs(x);
  int exponent = min_exponent;
  if (x > 0 && std::isfinite(x)) exponent = std::max(min_exponent, std::ilogb(x));
  return std::ldexp(1.0, exponent - mantissa_bits);
}

std::vector<const void*> rank_slices(const HostTensor& stacked) {
  std::vector<const void*> slices;
  for (std::int64_t r = 0; r < stacked.shape()[0]; ++r) slices.push_back(stacked.slice_matrix(r).data);
  return slices;
}

}  // namespace

TailCase make_random_case(TailDims dims, float eps, DType dtype, int tp, std::int64_t tokens,
                          std::uint64_t seed) {
  TailCase c = empty_case(dims, eps, dtype, tp, tokens);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::int64_t i = 0; i < c.routed.numel(); ++i) c.routed.set(i, normal(rng));
  for (std::int64_t i = 0; i < c.shared.numel(); ++i) c.shared.set(i, normal(rng));
  for (std::int64_t i = 0; i < c.norm_weight.numel(); ++i) c.norm_weight.set(i, 1.0f + 0.1f * normal(rng));
  const float w_scale = 1.0f / std::sqrt(static_cast<float>(dims.d_latent));
  for (std::int64_t i = 0; i < c.up_proj_weight.numel(); ++i) {
    c.up_proj_weight.set(i, w_scale * normal(rng));
  }
  return c;
}

TailCase make_exact_case(TailDims dims, DType dtype, int tp, std::int64_t tokens, std::uint64_t seed) {
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
  for (std::int64_t i = 0; i < c.shared.numel(); ++i) c.shared.set(i, static_cast<float>(small(rng)));
  for (std::int64_t i = 0; i < c.norm_weight.numel(); ++i) c.norm_weight.set(i, static_cast<float>(gamma(rng)));
  for (std::int64_t i = 0; i < c.up_proj_weight.numel(); ++i) {
    c.up_proj_weight.set(i, static_cast<float>(small(rng)));
  }
  return c;
}

Contract contract_of(TailTier tier) {
  return tier == TailTier::column ? Contract::column : Contract::reduce_then_add;
}

ContractReference reference_tail(const TailCase& c, Contract contract) {
  const std::int64_t tokens = c.num_tokens, d = c.dims.d_model, l = c.dims.d_latent;
  const std::size_t td = static_cast<std::size_t>(tokens * d);
  ContractReference ref;
  ref.y = HostTensor(c.dtype, {tokens, d});
  ref.bound.assign(td, 0.0);
  if (tokens == 0) return ref;

  // N = round(rmsnorm(round(Σ routed_r)))
  HostTensor latent(c.dtype, {tokens, l});
  reduce_in_rank_order(rank_slices(c.routed), latent.data(), static_cast<std::size_t>(tokens * l), c.dtype);
  HostTensor normed(c.dtype, {tokens, l});
  cpu::rms_norm(latent.matrix(), cpu::to_float(c.norm_weight.matrix()), c.eps, normed.matrix());

  const std::vector<float> w = cpu::to_float(c.up_proj_weight.matrix());
  const std::vector<float> u = cpu::gemm_fp32(normed.matrix(), w.data(), d);  // unrounded
  // |N| · |W|ᵀ bounds how far two fp32 summation orders of the GEMM can drift apart.
  std::vector<float> abs_n = cpu::to_float(normed.matrix()), abs_w = w;
  for (float& v : abs_n) v = std::fabs(v);
  for (float& v : abs_w) v = std::fabs(v);
  std::vector<float> magnitude(td);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(tokens), static_cast<int>(d),
              static_cast<int>(l), 1.0f, abs_n.data(), static_cast<int>(l), abs_w.data(),
              static_cast<int>(l), 0.0f, magnitude.data(), static_cast<int>(d));
  const double unit = std::ldexp(1.0, -24);
  const double gamma_k = static_cast<double>(l) * unit / (1.0 - static_cast<double>(l) * unit);
  const double f32_unit = std::ldexp(1.0, -23);

  if (contract == Contract::reduce_then_add) {
    // Y = round(round(U) + round(Σ shared_r))
    HostTensor shared_sum(c.dtype, {tokens, d});
    reduce_in_rank_order(rank_slices(c.shared), shared_sum.data(), td, c.dtype);
    for (std::size_t i = 0; i < td; ++i) {
      const float rounded_u = round_to(c.dtype, u[i]);
      const float y = rounded_u + shared_sum.get(static_cast<std::int64_t>(i));
      ref.y.set(static_cast<std::int64_t>(i), y);
      const double e = 2.0 * gamma_k * magnitude[i] * 1.01;
      const double du = e + ulp_of(c.dtype, std::fabs(u[i]) + e);
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
      const double e = 2.0 * gamma_k * magnitude[i] * 1.01;
      const double d_owner = e + ulp_of(c.dtype, std::fabs(owner_value) + e);
      const double d_sum = d_owner + c.tp * f32_unit * (magnitude_sum + d_owner);
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
    const double rstd = 1.0 / std::sqrt(sum_squares / static_cast<double>(l) + c.eps);
    for (std::int64_t j = 0; j < l; ++j) normed[static_cast<std::size_t>(t * l + j)] *= rstd * c.norm_weight.get(j);
  }
  std::vector<double> w(static_cast<std::size_t>(d * l));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = c.up_proj_weight.get(static_cast<std::int64_t>(i));
  for (std::int64_t r = 0; r < c.tp; ++r) {
    for (std::int64_t i = 0; i < tokens * d; ++i) y[static_cast<std::size_t>(i)] += c.shared.get(r * tokens * d + i);
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(tokens), static_cast<int>(d),
              static_cast<int>(l), 1.0, normed.data(), static_cast<int>(l), w.data(), static_cast<int>(l),
              1.0, y.data(), static_cast<int>(d));
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

Comparison compare(ConstMatrixView y, const ContractReference& reference, const std::vector<double>& exact) {
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
        result.max_error_over_bound = std::max(result.max_error_over_bound, error / reference.bound[i]);
      } else if (!std::isfinite(error) && !(std::isnan(got) && std::isnan(want))) {
        result.max_error_over_bound = std::numeric_limits<double>::infinity();
      }
      diff_squares += (got - exact[i]) * (got - exact[i]);
      exact_squares += exact[i] * exact[i];
    }
  }
  result.normwise_tolerance = fp64_tolerance(y.dtype);
  result.normwise_error = exact_squares > 0 ? std::sqrt(diff_squares / exact_squares) : std::sqrt(diff_squares);
  if (std::isnan(result.normwise_error)) result.normwise_error = std::numeric_limits<double>::infinity();
  return result;
}

}  // namespace lmoe
