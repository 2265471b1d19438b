#include <algorithm>

#include "cuda/runtime/dtype.cuh"
#include "tools/bench_values.hpp"
#include "tools/cuda/bench_fill.hpp"

namespace lmoe::cuda {

namespace {

// The values are exact in every dtype, so the store's rounding leaves them as the host has them.
template <typename T>
__global__ void fill_bench_values_kernel(T* dst, std::int64_t count, std::uint64_t seed) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    dst[i] = Storage<T>::store(bench::value(seed, static_cast<std::uint64_t>(i)));
  }
}

template <typename T>
cudaError_t fill_as(void* dst, std::int64_t count, std::uint64_t seed, cudaStream_t stream) {
  constexpr int kThreads = 256;
  // Not timed and never spinning: a grid that fills the GPU quickly is fine here.
  const int blocks =
      static_cast<int>(std::clamp<std::int64_t>((count + kThreads - 1) / kThreads, 1, 1024));
  fill_bench_values_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(dst), count, seed);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_fill_bench_values(void* dst, std::int64_t count, DType dtype, std::uint64_t seed,
                                     cudaStream_t stream) {
  if (count < 0) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  switch (dtype) {
    case DType::f32: return fill_as<float>(dst, count, seed, stream);
    case DType::f16: return fill_as<__half>(dst, count, seed, stream);
    case DType::bf16: return fill_as<__nv_bfloat16>(dst, count, seed, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace lmoe::cuda
