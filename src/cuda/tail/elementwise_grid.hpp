// The grid of the grid-stride elementwise kernels (the tail's adds and accumulates, the layer's
// activation, combine and row gather): 256 threads a block, one block per 256 work items, up to
// 4096 blocks (a GPU holds ~1000 such blocks at once; the rest start as blocks finish, which
// measured faster than a grid of what fits at once: docs/perf.md).
//
// These kernels never wait on another rank, so a full grid cannot keep a peer's spinning kernel
// from running where ranks share a GPU: their blocks finish and free the SMs (small grids per rank
// are for the kernels that spin, docs/p2p.md). A cap of one block per SM would starve the
// layer's combine of memory bandwidth (docs/perf.md).
#pragma once

#include <algorithm>
#include <cstdint>

namespace lmoe::cuda {

inline constexpr int kElementwiseThreads = 256;
inline constexpr std::int64_t kElementwiseMaxBlocks = 4096;

inline int elementwise_blocks(std::int64_t work_items) {
  return static_cast<int>(std::clamp<std::int64_t>(
      (work_items + kElementwiseThreads - 1) / kElementwiseThreads, 1, kElementwiseMaxBlocks));
}

}  // namespace lmoe::cuda
