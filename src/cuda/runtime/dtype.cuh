// Storage dtypes on the device: load to fp32, store with one round-to-nearest-even (the contract's
// round()). The CUDA intrinsics round to nearest even and keep ±0, ±inf, subnormals and NaN.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lmoe::cuda {

template <typename T>
struct Storage;

template <>
struct Storage<float> {
  __device__ static float load(float v) { return v; }
  __device__ static float store(float v) { return v; }
};

template <>
struct Storage<__half> {
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};

template <>
struct Storage<__nv_bfloat16> {
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

// A 16-byte vector of T, for loads and stores of 16 bytes per thread.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// Four T, for a thread that turns one float4 of fp32 values into four stored ones.
template <typename T>
struct alignas(4 * sizeof(T)) Vec4 {
  T v[4];
};

}  // namespace lmoe::cuda
