// The whole tail of one rank that holds the complete sums (tp = 1) in one launch, for a few tokens:
//   Y[t, n] = round(round(Σ_k N[t, k] · W[n, k]) + shared[t, n]),  N = round(rmsnorm(x))
// — the overlap/fused contract with a single rank, so Σ_r x_r = x and Σ_r shared_r = shared.
// Decode is bound by reading W (51 MB at Kimi-K3 dims, ~12 µs on an H200); the unfused path adds a
// launch and a round trip through memory for the norm and for the add around the GEMM. Device code.
#pragma once

#include <cstdint>

#include "cuda/rms_norm.cuh"

namespace lmoe::cuda {

inline constexpr int kFusedThreads = 256;      // the norm's 256 lanes, and 8 warps for the product
inline constexpr int kFusedRowsPerWarp = 4;    // rows of W a warp streams at once (loads in flight)
inline constexpr int kFusedRowsPerBlock = kFusedThreads / 32 * kFusedRowsPerWarp;
inline constexpr int kFusedMaxTokens = 16;

// Every block normalizes all `tokens` rows of x into shared memory ([tokens][cols], the canonical
// order of rms_norm.cuh, so N is bit-identical to the standalone norm's), then each warp computes
// kFusedRowsPerWarp rows of W against all of them: lane i takes the 8-element chunks i, i + 32, …
// of a W row (16-byte loads), keeps kMaxT fp32 sums per row, and the warp adds its lanes' sums at
// the end. The products' order differs from cuBLASLt's; the contract leaves the GEMM's order free.
// Requires cols % 8 == 0 and 16-byte aligned x, gamma and W rows (the launcher checks).
template <typename T, int kMaxT>
__global__ void __launch_bounds__(kFusedThreads)
    fused_tail_small_t_kernel(const T* __restrict__ x, const float* __restrict__ gamma, const T* __restrict__ w,
                              std::int64_t ldw, const T* shared, std::int64_t ld_shared, T* out, std::int64_t ld_out,
                              int tokens, int cols, int n_rows, float eps) {
  extern __shared__ __align__(16) unsigned char fused_smem[];
  T* normed = reinterpret_cast<T*>(fused_smem);  // [tokens][cols]
  __shared__ float lane_sums[kNormThreads];
  const int thread = static_cast<int>(threadIdx.x);
  const int num_chunks = cols / kNormChunk;

  for (int t = 0; t < tokens; ++t) {
    const T* row = x + static_cast<std::int64_t>(t) * cols;
    float lane_sum = 0.0f;
    for (int chunk = thread; chunk < num_chunks; chunk += kNormLanes) {
      NormChunk<T> values;
      values.load(row + chunk * kNormChunk);
      lane_sum = add_chunk_squares(lane_sum, values);
    }
    const float rstd = rms_norm_rstd(row_sum_of_squares<8>(lane_sum, lane_sums), cols, eps);
    for (int chunk = thread; chunk < num_chunks; chunk += kNormLanes) {
      NormChunk<T> values;
      values.load(row + chunk * kNormChunk);
      normalize_chunk(values, gamma + chunk * kNormChunk, rstd);
      values.store(normed + static_cast<std::int64_t>(t) * cols + chunk * kNormChunk);
    }
    __syncthreads();  // lane_sums is reused by the next row; normed is read by every warp below
  }

  const int warp = thread / 32, lane = thread % 32;
  const int first_row = static_cast<int>(blockIdx.x) * kFusedRowsPerBlock + warp * kFusedRowsPerWarp;
  float acc[kFusedRowsPerWarp][kMaxT];
#pragma unroll
  for (int r = 0; r < kFusedRowsPerWarp; ++r) {
#pragma unroll
    for (int t = 0; t < kMaxT; ++t) acc[r][t] = 0.0f;
  }
  for (int chunk = lane; chunk < num_chunks; chunk += 32) {
    NormChunk<T> weights[kFusedRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kFusedRowsPerWarp; ++r) {
      const int n = min(first_row + r, n_rows - 1);  // rows past the end repeat the last; not written
      weights[r].load(w + static_cast<std::int64_t>(n) * ldw + chunk * kNormChunk);
    }
#pragma unroll
    for (int t = 0; t < kMaxT; ++t) {
      if (t < tokens) {
        NormChunk<T> activations;
        activations.load(normed + static_cast<std::int64_t>(t) * cols + chunk * kNormChunk);
#pragma unroll
        for (int k = 0; k < kNormChunk; ++k) {
          const float a = Storage<T>::load(activations.at(k));
#pragma unroll
          for (int r = 0; r < kFusedRowsPerWarp; ++r) {
            acc[r][t] = fmaf(Storage<T>::load(weights[r].at(k)), a, acc[r][t]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kFusedRowsPerWarp; ++r) {
    const int n = first_row + r;
#pragma unroll
    for (int t = 0; t < kMaxT; ++t) {
      float sum = acc[r][t];
#pragma unroll
      for (int offset = 16; offset >= 1; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (lane == t && t < tokens && n < n_rows) {
        // Read before write: out may be the shared buffer itself.
        const float partial = Storage<T>::load(shared[static_cast<std::int64_t>(t) * ld_shared + n]);
        const float up = Storage<T>::load(Storage<T>::store(sum));  // round(U)
        out[static_cast<std::int64_t>(t) * ld_out + n] = Storage<T>::store(__fadd_rn(up, partial));
      }
    }
  }
}

}  // namespace lmoe::cuda
