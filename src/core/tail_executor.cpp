#include "core/tail_executor.hpp"

#include "core/rank_order_reduce.hpp"

namespace lmoe {

TokenRowSplit split_token_rows(std::int64_t num_tokens, int tp, TailDims dims) {
  TokenRowSplit split;
  split.row_offsets = even_split_offsets(static_cast<std::size_t>(num_tokens), tp);
  for (int r = 0; r < tp; ++r) {
    const auto rows = static_cast<std::size_t>(split.rows(r));
    split.latent_counts.push_back(rows * static_cast<std::size_t>(dims.d_latent));
    split.model_counts.push_back(rows * static_cast<std::size_t>(dims.d_model));
  }
  return split;
}

}  // namespace lmoe
