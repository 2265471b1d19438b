#include "core/validation.hpp"

#include <cmath>
#include <cstddef>

#include "lmoe/error.hpp"
#include "lmoe/tier_policy.hpp"

namespace lmoe {

namespace {

std::string expected(const char* name, const std::string& what, const std::string& got) {
  return std::string(name) + ": expected " + what + ", got " + got;
}

std::string dims_of(ConstMatrixView view) {
  return "[" + std::to_string(view.rows) + ", " + std::to_string(view.cols) + "]";
}

bool overlaps(ConstMatrixView a, ConstMatrixView b) {
  if (a.rows == 0 || b.rows == 0) return false;
  const auto* a_begin = static_cast<const std::byte*>(a.data);
  const auto* b_begin = static_cast<const std::byte*>(b.data);
  const std::size_t a_bytes = static_cast<std::size_t>(a.rows * a.ld) * a.element_size();
  const std::size_t b_bytes = static_cast<std::size_t>(b.rows * b.ld) * b.element_size();
  return a_begin < b_begin + b_bytes && b_begin < a_begin + a_bytes;
}

}  // namespace

std::optional<std::string> check_matrix(const char* name, ConstMatrixView view, DType dtype,
                                        MemorySpace space, std::int64_t rows, std::int64_t cols) {
  if (view.dtype != dtype) {
    return expected(name, "dtype " + std::string(dtype_name(dtype)),
                    std::string(dtype_name(view.dtype)));
  }
  if (view.rows != rows || view.cols != cols) {
    return expected(name, "shape [" + std::to_string(rows) + ", " + std::to_string(cols) + "]",
                    dims_of(view));
  }
  if (view.rows > 0 && view.data == nullptr) return std::string(name) + ": data is null";
  if (view.rows > 1 && view.ld != view.cols) {
    return expected(name, "a contiguous tensor (row stride " + std::to_string(view.cols) + ")",
                    "row stride " + std::to_string(view.ld));
  }
  if (view.space != space) {
    return expected(name, space == MemorySpace::host ? "host memory" : "device memory",
                    view.space == MemorySpace::host ? "host memory" : "device memory");
  }
  return std::nullopt;
}

std::optional<std::string> validate_options(const TailOptions& options, int tp) {
  const TailDims& dims = options.dims;
  if (dims.d_model <= 0)
    return expected("d_model", "a positive size", std::to_string(dims.d_model));
  if (dims.d_latent <= 0)
    return expected("d_latent", "a positive size", std::to_string(dims.d_latent));
  if (tp < 1) return expected("tp", "at least 1 rank", std::to_string(tp));
  if (!(options.rms_norm_eps >= 0.0f) || !std::isfinite(options.rms_norm_eps)) {
    return expected("rms_norm_eps", "a finite value >= 0", std::to_string(options.rms_norm_eps));
  }
  if (options.max_tokens < 0) {
    return expected("max_tokens", "0 (grow on demand) or a positive token count",
                    std::to_string(options.max_tokens));
  }
  // Ranges a caller builds by hand get the checks a table's get when it is read.
  if (!options.policy.ranges.value.empty()) {
    try {
      validate_tier_ranges(options.policy.ranges.value, "policy.ranges");
    } catch (const Error& error) {
      return error.message();
    }
  }
  return std::nullopt;
}

std::optional<std::string> validate_weights(const TailOptions& options, ConstMatrixView norm_weight,
                                            ConstMatrixView up_proj_weight) {
  const TailDims& dims = options.dims;
  ConstMatrixView gamma = norm_weight;
  if (gamma.rows == dims.d_latent && gamma.cols == 1) {  // accept an [l, 1] column as [1, l]
    gamma.rows = 1;
    gamma.cols = dims.d_latent;
    gamma.ld = dims.d_latent;
  }
  if (auto error =
          check_matrix("norm_weight", gamma, options.dtype, MemorySpace::host, 1, dims.d_latent)) {
    return error;
  }
  return check_matrix("up_proj_weight", up_proj_weight, options.dtype, MemorySpace::host,
                      dims.d_model, dims.d_latent);
}

std::optional<std::string> validate_call(const TailOptions& options, MemorySpace space,
                                         ConstMatrixView routed, ConstMatrixView shared,
                                         ConstMatrixView out) {
  const TailDims& dims = options.dims;
  if (routed.rows < 0)
    return expected("routed", "a non-negative token count", std::to_string(routed.rows));
  const std::int64_t tokens = routed.rows;
  if (options.max_tokens > 0 && tokens > options.max_tokens) {
    return expected(
        "routed",
        "at most max_tokens=" + std::to_string(options.max_tokens) + " rows (set at construction)",
        std::to_string(tokens) + " rows");
  }
  if (auto error = check_matrix("routed", routed, options.dtype, space, tokens, dims.d_latent))
    return error;
  if (auto error = check_matrix("shared", shared, options.dtype, space, tokens, dims.d_model))
    return error;
  if (auto error = check_matrix("out", out, options.dtype, space, tokens, dims.d_model))
    return error;
  if (overlaps(out, routed)) return std::string("out: must not overlap routed");
  if (overlaps(out, shared) && out.data != shared.data) {
    return std::string("out: must be either the shared buffer itself or not overlap it");
  }
  if (overlaps(routed, shared)) return std::string("routed: must not overlap shared");
  return std::nullopt;
}

std::optional<std::string> generic_tier_limit(TailTier tier, const TailProblem& problem) {
  const std::int64_t d = problem.dims.d_model;
  switch (tier) {
    case TailTier::fused:
    case TailTier::column:
      if (d % problem.tp != 0) {
        return "d_model=" + std::to_string(d) +
               " is not divisible by tp=" + std::to_string(problem.tp) +
               " (the tier splits the hidden size into tp stripes)";
      }
      return std::nullopt;
    case TailTier::token:
      if (problem.num_tokens < problem.tp) {
        return "T=" + std::to_string(problem.num_tokens) + " < tp=" + std::to_string(problem.tp) +
               " (the tier gives every rank at least one token row)";
      }
      return std::nullopt;
    case TailTier::overlap: return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace lmoe
