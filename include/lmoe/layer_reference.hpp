// The layer in fp64 from full (tp = 1) weights with no intermediate rounding, and how an
// implementation's results are judged against it (docs/numerics.md, "The layer").
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "lmoe/dims.hpp"
#include "lmoe/layer_weights.hpp"
#include "lmoe/router.hpp"
#include "lmoe/tensor.hpp"

namespace lmoe {

struct ExactLayer {
  std::vector<double> routed;  // [T, l]: Σ_r routed_r
  std::vector<double> shared;  // [T, d]: Σ_r shared_r
  std::vector<double> y;       // [T, d]
};

// x [T, d] and `weights` (tp = 1) in their storage dtypes, read exactly. The routing is taken as
// given (ids and fp32 weights: the router is judged on its own), so that a near-tie the fp32 and
// fp64 routers break differently does not change which experts the two sides sum.
ExactLayer exact_layer(const LayerConfig& config, float eps, const LayerWeights& weights,
                       ConstMatrixView x, const Routing& routing);

// The same for many inputs: the weights are converted to fp64 once.
class LayerReference {
 public:
  LayerReference(const LayerConfig& config, float eps, const LayerWeights& weights);
  ExactLayer run(ConstMatrixView x, const Routing& routing) const;

 private:
  struct Weights;
  LayerConfig config_;
  float eps_;
  std::shared_ptr<const Weights> weights_;
};

// The router in fp64 from x and the tp = 1 weights: logits, scores and weights in fp64, selection
// by the rules of select_experts.
struct ExactRouting {
  std::vector<std::int32_t> expert_ids;  // [T, k]
  std::vector<double> weights;           // [T, k]
};
ExactRouting exact_router(const RouterConfig& config, std::span<const double> logits,
                          std::int64_t num_tokens, std::span<const float> bias);
std::vector<double> exact_router_logits(const LayerWeights& weights, ConstMatrixView x);

struct LayerComparison {
  double normwise_error = 0;  // ‖y − exact‖ / ‖exact‖
  double max_row_error = 0;   // max over elements of |y − exact| / rms(exact row)
  double normwise_tolerance = 0;
  double row_tolerance = 0;
  bool ok() const { return normwise_error <= normwise_tolerance && max_row_error <= row_tolerance; }
};
// Tolerances: normwise 1e-2 (bf16), 1.5e-3 (f16), 3e-6 (f32); per element 0.06, 8e-3, 1.5e-5 of
// its row's RMS. NaN never passes.
double layer_normwise_tolerance(DType dtype);
double layer_row_tolerance(DType dtype);
LayerComparison compare_layer(ConstMatrixView y, const std::vector<double>& exact);
// The same for an fp64 result (e.g. a sum of partials done in fp64).
LayerComparison compare_layer(const std::vector<double>& y, const std::vector<double>& exact,
                              std::int64_t cols, DType dtype);

}  // namespace lmoe
