// The grid of the grid-stride elementwise kernels (the tail's adds and accumulates, the layer's
// activation, combine and row gather): 256 threads a block, one block per 256 work items, up to
// 4096 blocks (a GPU holds ~1000 such blocks at once; the rest start as blocks finish; the
// experts' row gather at K3's T = 8192 took 412 µs with 4096 blocks and 491 with 1184 in two
// runs on an H200).
//
// These kernels never wait on another rank, so a full grid cannot keep a peer's spinning kernel
// from running where ranks share a GPU: their blocks finish and free the SMs (small grids per rank
// are for the kernels that spin, docs/p2p.md). A cap of 128 blocks, one per SM, held the layer's
// combine to 0.4 TB/s: 4.5 ms at Kimi-K3's T = 8192 on one H200 (docs/perf.md, session 9).
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
