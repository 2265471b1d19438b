// Latent RMSNorm, one block per row. Device code only.
#pragma once

#include <cstdint>

#include "cuda/dtype.cuh"

namespace lmoe::cuda {

// out_j = round((x_j · rstd) · gamma_j), rstd = 1 / sqrt(ss / l + eps), in fp32.
//
// The contract sums ss = Σ_j x_j² in column order. A tree reduction would change that order and can
// move an output by one ulp, which the contract's bound (made for the GEMM's order only) does not
// cover. So the block stages the row's squares in shared memory in parallel and one thread adds
// them in column order: bit-identical to the CPU at the price of l dependent adds per row
// (~7 µs at l = 3584), which is hidden across rows at prefill sizes. A faster tree variant needs a
// documented extra term in the bound first.
//
// Explicit _rn intrinsics keep nvcc from contracting x·x + ss into an FMA (the CPU rounds the
// product, then the sum) and keep division and square root IEEE-exact whatever the flags.
// Dynamic shared memory: l floats. `kVector`: x and out rows are 16-byte aligned and l is a
// multiple of the vector width.
template <typename T, bool kVector>
__global__ void rms_norm_kernel(const T* __restrict__ x, const float* __restrict__ gamma,
                                T* __restrict__ out, int cols, float eps) {
  using S = Storage<T>;
  extern __shared__ float row_squares[];  // [l]
  __shared__ float rstd_shared;
  const std::int64_t row = blockIdx.x;
  const T* x_row = x + row * cols;
  T* out_row = out + row * cols;

  if constexpr (kVector) {
    using V = Vec16<T>;
    for (int i = threadIdx.x; i < cols / V::kSize; i += blockDim.x) {
      const V v = reinterpret_cast<const V*>(x_row)[i];
#pragma unroll
      for (int k = 0; k < V::kSize; ++k) {
        const float value = S::load(v.v[k]);
        row_squares[i * V::kSize + k] = __fmul_rn(value, value);
      }
    }
  } else {
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
      const float value = S::load(x_row[j]);
      row_squares[j] = __fmul_rn(value, value);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum_squares = 0.0f;
    for (int j = 0; j < cols; ++j) sum_squares = __fadd_rn(sum_squares, row_squares[j]);
    const float mean = __fdiv_rn(sum_squares, static_cast<float>(cols));
    rstd_shared = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
  }
  __syncthreads();
  const float rstd = rstd_shared;

  if constexpr (kVector) {
    using V = Vec16<T>;
    for (int i = threadIdx.x; i < cols / V::kSize; i += blockDim.x) {
      const V v = reinterpret_cast<const V*>(x_row)[i];
      V result;
#pragma unroll
      for (int k = 0; k < V::kSize; ++k) {
        const float g = gamma[i * V::kSize + k];
        result.v[k] = S::store(__fmul_rn(__fmul_rn(S::load(v.v[k]), rstd), g));
      }
      reinterpret_cast<V*>(out_row)[i] = result;
    }
  } else {
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
      out_row[j] = S::store(__fmul_rn(__fmul_rn(S::load(x_row[j]), rstd), gamma[j]));
    }
  }
}

}  // namespace lmoe::cuda
