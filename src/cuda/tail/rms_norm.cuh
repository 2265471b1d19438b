// Latent RMSNorm in the contract's canonical order (docs/numerics.md). Device code only.
#pragma once

#include <cstdint>

#include "core/rms_norm_order.hpp"
#include "cuda/runtime/dtype.cuh"
#include "cuda/runtime/hopper_async.cuh"

namespace lmoe::cuda {

// out_j = round((x_j · rstd) · gamma_j), rstd = 1 / sqrt(ss / l + eps), in fp32, where ss = Σ_j
// x_j² in the canonical order that cpu::rms_norm follows too (core/rms_norm_order.hpp): element j
// belongs to lane (j / 8) mod 256, a lane adds its squares in increasing j from +0, and the 256
// lane sums are combined by the halving tree s[i] += s[i + h], h = 128, 64, …, 1. A lane is a
// thread: the order is a block's natural reduction, so the GPU matches the CPU bit for bit at
// speed.
//
// Explicit _rn intrinsics keep nvcc from contracting x·x + s into an FMA (the contract rounds the
// product, then the sum) and keep division and square root IEEE-exact whatever the flags.
inline constexpr int kNormChunk = kRmsNormChunk;  // elements per lane step: a 16-byte bf16 vector
inline constexpr int kNormLanes = kRmsNormLanes;  // lanes of the order
inline constexpr int kNormThreads = kNormLanes;   // a block holds one row's lanes, or several rows'
static_assert(kNormChunk == 8 && kNormLanes == 256, "the kernels below hard-wire 8 warps of lanes");

// One chunk of a row in registers: 8 elements as 16-byte vectors (one for bf16/f16, two for f32).
template <typename T>
struct NormChunk {
  static constexpr int kVectors = kNormChunk * static_cast<int>(sizeof(T)) / 16;
  Vec16<T> vec[kVectors];

  __device__ void load(const T* chunk_start) {
#pragma unroll
    for (int i = 0; i < kVectors; ++i) vec[i] = reinterpret_cast<const Vec16<T>*>(chunk_start)[i];
  }
  __device__ void store(T* chunk_start) const {
#pragma unroll
    for (int i = 0; i < kVectors; ++i) reinterpret_cast<Vec16<T>*>(chunk_start)[i] = vec[i];
  }
  __device__ T& at(int k) { return vec[k / Vec16<T>::kSize].v[k % Vec16<T>::kSize]; }
  __device__ const T& at(int k) const { return vec[k / Vec16<T>::kSize].v[k % Vec16<T>::kSize]; }
};

// The lane's squares added in increasing j.
template <typename T>
__device__ float add_chunk_squares(float lane_sum, const NormChunk<T>& chunk) {
#pragma unroll
  for (int k = 0; k < kNormChunk; ++k) {
    const float value = Storage<T>::load(chunk.at(k));
    lane_sum = __fadd_rn(lane_sum, __fmul_rn(value, value));
  }
  return lane_sum;
}

// chunk ← round((chunk · rstd) · gamma[0 … 8)); gamma 16-byte aligned.
template <typename T>
__device__ void normalize_chunk(NormChunk<T>& chunk, const float* __restrict__ gamma, float rstd) {
  const float4 g0 = reinterpret_cast<const float4*>(gamma)[0];
  const float4 g1 = reinterpret_cast<const float4*>(gamma)[1];
  const float g[kNormChunk] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
#pragma unroll
  for (int k = 0; k < kNormChunk; ++k) {
    chunk.at(k) =
        Storage<T>::store(__fmul_rn(__fmul_rn(Storage<T>::load(chunk.at(k)), rstd), g[k]));
  }
}

// Levels h = 16 … 1 of the canonical tree: a warp's xor butterfly, whose every lane ends with the
// tree's s[0] because fp32 addition is commutative.
__device__ inline float warp_tree_of_lane_sums(float lane_sum) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset /= 2) {
    lane_sum = __fadd_rn(lane_sum, __shfl_xor_sync(0xffffffffu, lane_sum, offset));
  }
  return lane_sum;
}

// The whole tree over one row's 32·kWarpsPerRow lane sums already in shared memory
// (row_lane_sums[i]: lane i's sum): the levels h ≥ 32 from memory (128, 64, 32 for 8 warps per
// row), then the warp's butterfly.
// Every lane of the calling warp gets the row's sum. Reads only: the caller synchronizes between
// the writes of the lane sums and this call.
template <int kWarpsPerRow>
__device__ float tree_of_lane_sums(const float* row_lane_sums) {
  // v[w] = s[i + 32·w] for this thread's i = lane mod 32.
  const int i = static_cast<int>(threadIdx.x) % 32;
  float v[kWarpsPerRow];
#pragma unroll
  for (int w = 0; w < kWarpsPerRow; ++w) v[w] = row_lane_sums[i + 32 * w];
#pragma unroll
  for (int half = kWarpsPerRow / 2; half >= 1; half /= 2) {
#pragma unroll
    for (int w = 0; w < half; ++w) v[w] = __fadd_rn(v[w], v[w + half]);
  }
  return warp_tree_of_lane_sums(v[0]);
}

// Σ of the row's lane sums by the canonical tree. The row's lanes 0 … 32·kWarpsPerRow − 1 are the
// consecutive threads starting at a multiple of 32·kWarpsPerRow; lanes beyond them hold no element,
// and the tree levels that would add them (h ≥ 32·kWarpsPerRow) add +0, which changes no lane sum
// (a sum of squares is never −0), so they are skipped. Levels h = 128, 64, 32 cross warps through
// `lane_sums` (kNormThreads floats of shared memory); h = 16 … 1 are a warp's xor butterfly. Every
// thread of the block must call it (it holds a barrier when kWarpsPerRow > 1).
template <int kWarpsPerRow>
__device__ float row_sum_of_squares(float lane_sum, float* lane_sums) {
  static_assert(kWarpsPerRow == 1 || kWarpsPerRow == 2 || kWarpsPerRow == 4 || kWarpsPerRow == 8);
  if constexpr (kWarpsPerRow > 1) {
    lane_sums[threadIdx.x] = lane_sum;
    __syncthreads();
    const int first = static_cast<int>(threadIdx.x) / (32 * kWarpsPerRow) * (32 * kWarpsPerRow);
    return tree_of_lane_sums<kWarpsPerRow>(lane_sums + first);
  } else {
    return warp_tree_of_lane_sums(lane_sum);
  }
}

__device__ inline float rms_norm_rstd(float sum_squares, int cols, float eps) {
  const float mean = __fdiv_rn(sum_squares, static_cast<float>(cols));
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
}

// Blocks per SM to ask registers for. A lane holding ≤ 32 bytes of the row (bf16/f16: ≤ 2 chunks,
// l ≤ 4096; f32: 1 chunk) fits in 32 registers, i.e. 8 blocks of 256 threads per SM: the most bytes
// in flight for a kernel that only streams. Larger rows get what the compiler needs (no spills).
template <typename T>
constexpr int norm_min_blocks(int chunks_per_lane) {
  return chunks_per_lane * kNormChunk * static_cast<int>(sizeof(T)) <= 32 ? 8 : 1;
}

// The fast path: cols a multiple of 8, x, out and gamma 16-byte aligned, and the row held in
// registers between the sum and the output (one read and one write of x per element).
// rows_device, when not null, holds the row count on the device (a graph replayed with another T;
// at most `rows`, which sizes the grid). A kernel launched after it with programmatic dependent
// launch may start at once (its prologue, e.g. weight copies, overlaps this kernel; it waits with
// griddepcontrol.wait before reading `out`). It may itself be launched so (launch_rms_norm's
// `programmatic`): it waits for the kernel before it before it reads anything.
// kWarpsPerRow warps hold a row (32·kWarpsPerRow lanes; fewer than 8 only when the row has at most
// that many chunks), so a block of kNormThreads holds 8 / kWarpsPerRow rows. kChunksPerLane ≥
// ceil(chunks / 256), the chunks lane i holds being i, i + 256, i + 512, …
template <typename T, int kWarpsPerRow, int kChunksPerLane>
__global__ void __launch_bounds__(kNormThreads, norm_min_blocks<T>(kChunksPerLane))
    rms_norm_register_kernel(const T* __restrict__ x, const float* __restrict__ gamma,
                             T* __restrict__ out, std::int64_t rows,
                             const std::int32_t* __restrict__ rows_device, int cols, float eps) {
  pdl_launch_dependents();
  pdl_wait();  // launched programmatically: x, gamma and the row count may be the last kernel's
  constexpr int kRowLanes = 32 * kWarpsPerRow;
  if (rows_device != nullptr) rows = min(rows, static_cast<std::int64_t>(*rows_device));
  constexpr int kRowsPerBlock = kNormThreads / kRowLanes;
  static_assert(kWarpsPerRow == 8 || kChunksPerLane == 1);
  __shared__ float lane_sums[kNormThreads];
  const int lane = static_cast<int>(threadIdx.x) % kRowLanes;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock +
                           static_cast<int>(threadIdx.x) / kRowLanes;
  const bool row_active = row < rows;
  const int num_chunks = cols / kNormChunk;
  const T* x_row = x + row * cols;

  // Every load is issued before the first use, so a thread has all its 16-byte loads in flight.
  NormChunk<T> chunks[kChunksPerLane];
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) {
    const int chunk = lane + k * kNormLanes;
    if (row_active && chunk < num_chunks) chunks[k].load(x_row + chunk * kNormChunk);
  }
  float lane_sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) {
    const int chunk = lane + k * kNormLanes;
    if (row_active && chunk < num_chunks) lane_sum = add_chunk_squares(lane_sum, chunks[k]);
  }
  const float rstd =
      rms_norm_rstd(row_sum_of_squares<kWarpsPerRow>(lane_sum, lane_sums), cols, eps);
  if (!row_active) return;

  T* out_row = out + row * cols;
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) {
    const int chunk = lane + k * kNormLanes;
    if (chunk < num_chunks) {
      normalize_chunk(chunks[k], gamma + chunk * kNormChunk, rstd);
      chunks[k].store(out_row + chunk * kNormChunk);
    }
  }
}

// Any row, one block of 256 lanes per row, reading x twice (the second read mostly from L2).
// kVector: the fast path's alignment holds but the row is too long for registers; otherwise scalar
// loads (cols not a multiple of 8, or unaligned pointers).
template <typename T, bool kVector>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_rereading_kernel(const T* __restrict__ x, const float* __restrict__ gamma,
                              T* __restrict__ out, int cols, float eps) {
  __shared__ float lane_sums[kNormThreads];
  const int lane = static_cast<int>(threadIdx.x);
  const std::int64_t row = blockIdx.x;
  const T* x_row = x + row * cols;
  T* out_row = out + row * cols;
  const int num_chunks = (cols + kNormChunk - 1) / kNormChunk;

  float lane_sum = 0.0f;
  for (int chunk = lane; chunk < num_chunks; chunk += kNormLanes) {
    if constexpr (kVector) {
      NormChunk<T> values;
      values.load(x_row + chunk * kNormChunk);
      lane_sum = add_chunk_squares(lane_sum, values);
    } else {
      const int end = min(chunk * kNormChunk + kNormChunk, cols);
      for (int j = chunk * kNormChunk; j < end; ++j) {
        const float value = Storage<T>::load(x_row[j]);
        lane_sum = __fadd_rn(lane_sum, __fmul_rn(value, value));
      }
    }
  }
  const float rstd = rms_norm_rstd(row_sum_of_squares<8>(lane_sum, lane_sums), cols, eps);

  if constexpr (kVector) {
    for (int chunk = lane; chunk < num_chunks; chunk += kNormLanes) {
      NormChunk<T> values;
      values.load(x_row + chunk * kNormChunk);
      normalize_chunk(values, gamma + chunk * kNormChunk, rstd);
      values.store(out_row + chunk * kNormChunk);
    }
  } else {
    for (int j = lane; j < cols; j += kNormThreads) {
      out_row[j] =
          Storage<T>::store(__fmul_rn(__fmul_rn(Storage<T>::load(x_row[j]), rstd), gamma[j]));
    }
  }
}

}  // namespace lmoe::cuda
