// Launcher of the fused decode tail kernel (cuda/fused_tail.cuh). Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/fused_tail_types.hpp"
#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

// Block-tiles of n_tiles·8 output columns: 1, 2 or 4 n-tiles of 8 (wider tiles reuse each loaded
// row of N for more columns; narrower ones spread a narrow stripe over more SMs).
bool fused_tile_width_supported(int n_tiles);

// m-tiles of 16 tokens per pass for a call of up to `tokens` rows (p.tokens: with tokens_device,
// the most rows a replay may bring).
int fused_m_group(std::int64_t tokens);

// Dynamic shared memory of one block (the warps' partial sums of one m-group).
std::size_t fused_tail_shared_bytes(int n_tiles, int m_group);

// How many blocks of the kernel fit on one SM (registers, shared memory, threads).
cudaError_t fused_tail_blocks_per_sm(int n_tiles, DType dtype, int* blocks);

// Launches p.grid blocks; dtype bf16 or f16.
cudaError_t launch_fused_tail(const FusedTailParams& p, int n_tiles, DType dtype, cudaStream_t stream);

}  // namespace lmoe::cuda
