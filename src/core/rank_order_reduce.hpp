// The one reduction every host communicator uses, so that all of them follow the contract alike.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "lmoe/dtype.hpp"

namespace lmoe {

// out[i] = round(Σ_r inputs[r][i]) for i < count: fp32 accumulation that starts from rank 0's
// value (so −0 + −0 stays −0) and adds the others in rank order; one rounding to `dtype`.
// `out` may alias inputs[0] only; it must not alias any other input.
void reduce_in_rank_order(std::span<const void* const> inputs, void* out, std::size_t count,
                          DType dtype);

// Splits `count` elements into `parts` contiguous chunks whose sizes differ by at most one
// (the first count % parts chunks are one longer). Returns parts + 1 offsets.
std::vector<std::size_t> even_split_offsets(std::size_t count, int parts);

}  // namespace lmoe
