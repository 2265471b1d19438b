// Checks that the layer tests of every backend share: one input's run (run_layer_on_threads with
// keep_partials) against fp64 math computed with the run's own routing — the partials summed over
// ranks and y within the layer's tolerances — and y against the tail contract of the partials the
// layer produced (docs/numerics.md, "The layer").
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "core/host_math.hpp"
#include "lmoe/layer_reference.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/tools/layer_runner.hpp"

namespace lmoe::testing {

inline std::vector<double> to_double(const HostTensor& tensor) {
  std::vector<double> values(static_cast<std::size_t>(tensor.numel()));
  for (std::int64_t i = 0; i < tensor.numel(); ++i) values[i] = tensor.get(i);
  return values;
}

// Every rank's y has the same bits, and every rank routed identically (ids and weight bits).
inline void check_ranks_agree(const LayerInputRun& result) {
  EXPECT_TRUE(result.ranks_identical);
  const Routing& routing = result.ranks[0].routing;
  for (const LayerRankResult& rank : result.ranks) {
    EXPECT_EQ(rank.routing.expert_ids, routing.expert_ids);
    EXPECT_EQ(rank.routing.weights, routing.weights);
  }
}

// `exact` is the fp64 layer on x with the run's routing; `full` the tp = 1 weights. `label` names
// the run in LMOE_PRINT_ERRORS=1 output ("MEASURE <label> routed … shared … y …": normwise and row
// errors).
inline void check_partials_and_y(const LayerConfig& config, float eps, DType dtype,
                                 const LayerInputRun& result, const LayerWeights& full,
                                 const ExactLayer& exact, const std::string& label) {
  const int tp = static_cast<int>(result.ranks.size());
  const std::int64_t tokens = result.ranks[0].y.shape()[0];

  // The partials, summed over ranks in fp64, against fp64 math.
  std::vector<double> routed_sum(exact.routed.size(), 0.0), shared_sum(exact.shared.size(), 0.0);
  for (const LayerRankResult& rank : result.ranks) {
    const std::vector<double> r = to_double(rank.routed), s = to_double(rank.shared);
    for (std::size_t i = 0; i < r.size(); ++i) routed_sum[i] += r[i];
    for (std::size_t i = 0; i < s.size(); ++i) shared_sum[i] += s[i];
  }
  const LayerComparison routed_cmp =
      compare_layer(routed_sum, exact.routed, config.d_latent, dtype);
  EXPECT_TRUE(routed_cmp.ok()) << "routed: normwise " << routed_cmp.normwise_error << " row "
                               << routed_cmp.max_row_error;
  const LayerComparison shared_cmp = compare_layer(shared_sum, exact.shared, config.d_model, dtype);
  EXPECT_TRUE(shared_cmp.ok()) << "shared: normwise " << shared_cmp.normwise_error << " row "
                               << shared_cmp.max_row_error;

  // The tail ran on exactly these partials: y is within the tail contract's bound of them (bit for
  // bit on the CPU in practice; the bound covers another GEMM order).
  TailCase tail;
  tail.dims = config.tail_dims();
  tail.eps = eps;
  tail.latent_norm = config.latent_norm;
  tail.dtype = dtype;
  tail.tp = tp;
  tail.num_tokens = tokens;
  tail.routed = HostTensor(dtype, {tp, tokens, config.d_latent});
  tail.shared = HostTensor(dtype, {tp, tokens, config.d_model});
  for (int r = 0; r < tp; ++r) {
    cpu::copy(result.ranks[r].routed.matrix(), tail.routed.slice_matrix(r));
    cpu::copy(result.ranks[r].shared.matrix(), tail.shared.slice_matrix(r));
  }
  tail.norm_weight = full.latent_norm;
  tail.up_proj_weight = full.latent_up;
  const TailTier tier = *result.ranks[0].tier;
  const ContractReference contract = reference_tail(tail, contract_of(tier));
  const Comparison tail_cmp = compare(result.ranks[0].y.matrix(), contract, exact.y);
  EXPECT_EQ(tail_cmp.beyond_bound, 0) << "tier " << tier_name(tier);

  // y against fp64 math of the whole layer.
  const LayerComparison y_cmp = compare_layer(result.ranks[0].y.matrix(), exact.y);
  if (std::getenv("LMOE_PRINT_ERRORS")) {
    std::cerr << "MEASURE " << label << " routed " << routed_cmp.normwise_error << " "
              << routed_cmp.max_row_error << " shared " << shared_cmp.normwise_error << " "
              << shared_cmp.max_row_error << " y " << y_cmp.normwise_error << " "
              << y_cmp.max_row_error << "\n";
  }
  EXPECT_TRUE(y_cmp.ok()) << "y: normwise " << y_cmp.normwise_error << " (tolerance "
                          << y_cmp.normwise_tolerance << "), row " << y_cmp.max_row_error
                          << " (tolerance " << y_cmp.row_tolerance << ")";
}

}  // namespace lmoe::testing
