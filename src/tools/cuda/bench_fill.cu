#include <algorithm>

#include "cuda/runtime/dtype.cuh"
#include "tools/bench_values.hpp"
#include "tools/cuda/bench_fill.hpp"

namespace lmoe::cuda {

namespace {

// Which of bench_values.hpp's streams a fill writes.
enum class ValueStream { tail, collective };

// The values are exact in every dtype, so the store's rounding leaves them as the host has them.
template <typename T, ValueStream kStream>
__global__ void fill_bench_values_kernel(T* dst, std::int64_t count, std::uint64_t seed) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const auto index = static_cast<std::uint64_t>(i);
    dst[i] = Storage<T>::store(kStream == ValueStream::tail ? bench::value(seed, index)
                                                            : bench::collective_value(seed, index));
  }
}

template <typename T, ValueStream kStream>
cudaError_t fill_as(void* dst, std::int64_t count, std::uint64_t seed, cudaStream_t stream) {
  constexpr int kThreads = 256;
  // Not timed and never spinning: a grid that fills the GPU quickly is fine here.
  const int blocks =
      static_cast<int>(std::clamp<std::int64_t>((count + kThreads - 1) / kThreads, 1, 1024));
  fill_bench_values_kernel<T, kStream>
      <<<blocks, kThreads, 0, stream>>>(static_cast<T*>(dst), count, seed);
  return cudaGetLastError();
}

template <ValueStream kStream>
cudaError_t fill(void* dst, std::int64_t count, DType dtype, std::uint64_t seed,
                 cudaStream_t stream) {
  if (count < 0) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  switch (dtype) {
    case DType::f32: return fill_as<float, kStream>(dst, count, seed, stream);
    case DType::f16: return fill_as<__half, kStream>(dst, count, seed, stream);
    case DType::bf16: return fill_as<__nv_bfloat16, kStream>(dst, count, seed, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_fill_bench_values(void* dst, std::int64_t count, DType dtype, std::uint64_t seed,
                                     cudaStream_t stream) {
  return fill<ValueStream::tail>(dst, count, dtype, seed, stream);
}

cudaError_t launch_fill_collective_values(void* dst, std::int64_t count, DType dtype,
                                          std::uint64_t seed, cudaStream_t stream) {
  return fill<ValueStream::collective>(dst, count, dtype, seed, stream);
}

}  // namespace lmoe::cuda
