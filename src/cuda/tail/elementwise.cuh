// Elementwise kernels: the rank-order reduce behind the same-GPU collectives (with two inputs it is
// also the add of the reduce-then-add contract). Device code only.
#pragma once

#include <cstdint>

#include "cuda/runtime/dtype.cuh"

namespace lmoe::cuda {

inline constexpr int kMaxPeers = 16;

// Peer input pointers passed by value (trivially copyable, lives in kernel parameter space).
template <typename T>
struct PeerInputs {
  const T* ptr[kMaxPeers];
  int count;
};

// out[i] = round(Σ_r in_r[i]): fp32, starting from rank 0's value (so −0 + −0 stays −0) and adding
// ranks 1 … n−1 in order — the contract's rank sum, bit for bit. `kVector`: every pointer is
// 16-byte aligned, so a thread moves 16 bytes per input; the tail past the last whole vector is
// scalar.
template <typename T, bool kVector>
// `out` may alias an input: each element is read by the thread that writes it, before it writes it.
__global__ void rank_order_reduce_kernel(PeerInputs<T> inputs, T* out, std::int64_t count) {
  using S = Storage<T>;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::int64_t scalar_begin = 0;
  if constexpr (kVector) {
    using V = Vec16<T>;
    const std::int64_t vectors = count / V::kSize;
    for (std::int64_t i = first; i < vectors; i += stride) {
      float acc[V::kSize];
      const V v0 = reinterpret_cast<const V*>(inputs.ptr[0])[i];
#pragma unroll
      for (int k = 0; k < V::kSize; ++k) acc[k] = S::load(v0.v[k]);
      for (int r = 1; r < inputs.count; ++r) {
        const V vr = reinterpret_cast<const V*>(inputs.ptr[r])[i];
#pragma unroll
        for (int k = 0; k < V::kSize; ++k) acc[k] = __fadd_rn(acc[k], S::load(vr.v[k]));
      }
      V result;
#pragma unroll
      for (int k = 0; k < V::kSize; ++k) result.v[k] = S::store(acc[k]);
      reinterpret_cast<V*>(out)[i] = result;
    }
    scalar_begin = vectors * V::kSize;
  }
  for (std::int64_t i = scalar_begin + first; i < count; i += stride) {
    float acc = S::load(inputs.ptr[0][i]);
    for (int r = 1; r < inputs.count; ++r) acc = __fadd_rn(acc, S::load(inputs.ptr[r][i]));
    out[i] = S::store(acc);
  }
}

// stripe[r, c] = round(stripe[r, c] + acc[r, c]): the column tier's "accumulator plus C, rounded
// once", with the GEMM's unrounded fp32 accumulator acc [rows, cols] (contiguous) and a column
// stripe of a wider storage-dtype matrix (row stride ld). kVector: cols and ld multiples of four,
// acc 16-byte aligned and the stripe aligned to four elements, so a thread moves four columns at
// once.
template <typename T, bool kVector>
__global__ void accumulate_stripe_kernel(T* stripe, std::int64_t ld, const float* __restrict__ acc,
                                         std::int64_t rows, std::int64_t cols) {
  using S = Storage<T>;
  constexpr int kWidth = kVector ? 4 : 1;  // columns per thread
  const std::int64_t units = cols / kWidth;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < rows * units; i += stride) {
    const std::int64_t row = i / units, col = (i - row * units) * kWidth;
    if constexpr (kVector) {
      const float4 a = reinterpret_cast<const float4*>(acc)[i];
      auto* element = reinterpret_cast<Vec4<T>*>(stripe + row * ld + col);
      Vec4<T> c = *element;
      c.v[0] = S::store(__fadd_rn(a.x, S::load(c.v[0])));
      c.v[1] = S::store(__fadd_rn(a.y, S::load(c.v[1])));
      c.v[2] = S::store(__fadd_rn(a.z, S::load(c.v[2])));
      c.v[3] = S::store(__fadd_rn(a.w, S::load(c.v[3])));
      *element = c;
    } else {
      T& element = stripe[row * ld + col];
      element = S::store(__fadd_rn(acc[i], S::load(element)));
    }
  }
}

}  // namespace lmoe::cuda
