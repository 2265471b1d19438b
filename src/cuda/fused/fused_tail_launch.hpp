// Launcher of the fused decode tail kernel (cuda/fused_tail.cuh). Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/fused/fused_tail_types.hpp"
#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

// The kernel comes in shapes by the most rows a call may bring (16, 32, 64, 128 or 256): the
// smallest that holds `tokens` rows.
int fused_rows_class(std::int64_t tokens);

// Dynamic shared memory of one block of the shape for `tokens` rows (its cp.async stages).
std::size_t fused_tail_shared_bytes(std::int64_t tokens);

// How many blocks fit on one SM for every shape a call of up to `max_tokens` rows may launch (the
// fewest: the grid must fit whatever T a call brings). Raises each shape's dynamic shared-memory
// limit on the current device first (needed before it can launch).
cudaError_t fused_tail_blocks_per_sm(std::int64_t max_tokens, DType dtype, int* blocks);

// Launches p.grid blocks of the shape for p.tokens rows; dtype bf16 or f16.
cudaError_t launch_fused_tail(const FusedTailParams& p, DType dtype, cudaStream_t stream);

}  // namespace lmoe::cuda
