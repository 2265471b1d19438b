// Launcher of the one-launch tail for a rank holding the complete sums (tp = 1) and a few tokens
// (src/cuda/fused_tail_small_t.cuh). Host code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

// Whether the kernel serves this shape: 1 ≤ tokens ≤ 16, cols % 8 == 0, and the normalized rows
// (tokens · cols · esize) fit in the shared memory of a block.
bool fused_tail_small_t_fits(std::int64_t tokens, std::int64_t cols, DType dtype);

// Lets the kernels use the shared memory they need, on the current device. Call before launching
// (and before capturing a launch).
cudaError_t prepare_fused_tail_small_t();

// out[t, n] = round(round(Σ_k N[t, k] · w[n, k]) + shared[t, n]) for t < tokens, n < n_rows, with
// N = round(rmsnorm(x; gamma, eps)) in the canonical order. x [tokens, cols] contiguous, w rows of
// stride ldw, shared and out with row strides ld_shared and ld_out (out may be shared). x, gamma
// and w must be 16-byte aligned with ldw a multiple of 8; cudaErrorNotSupported otherwise, or when
// the shape does not fit.
cudaError_t launch_fused_tail_small_t(const void* x, const float* gamma, const void* w, std::int64_t ldw,
                                      const void* shared, std::int64_t ld_shared, void* out, std::int64_t ld_out,
                                      std::int64_t tokens, std::int64_t cols, std::int64_t n_rows, float eps,
                                      DType dtype, cudaStream_t stream);

}  // namespace lmoe::cuda
