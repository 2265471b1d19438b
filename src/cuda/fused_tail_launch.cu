#include "cuda/fused_tail_launch.hpp"

#include <algorithm>

#include "cuda/fused_tail.cuh"

namespace lmoe::cuda {

namespace {

template <typename T, int kMg>
const void* kernel_for(int n_tiles) {
  switch (n_tiles) {
    case 1: return reinterpret_cast<const void*>(fused_tail_kernel<T, 1, kMg>);
    case 2: return reinterpret_cast<const void*>(fused_tail_kernel<T, 2, kMg>);
    case 4: return reinterpret_cast<const void*>(fused_tail_kernel<T, 4, kMg>);
    default: return nullptr;
  }
}

template <typename T>
const void* kernel_for(int n_tiles, int m_group) {
  return m_group == 1 ? kernel_for<T, 1>(n_tiles) : m_group == 2 ? kernel_for<T, 2>(n_tiles) : nullptr;
}

const void* kernel_for(int n_tiles, int m_group, DType dtype) {
  switch (dtype) {
    case DType::bf16: return kernel_for<__nv_bfloat16>(n_tiles, m_group);
    case DType::f16: return kernel_for<__half>(n_tiles, m_group);
    case DType::f32: return nullptr;
  }
  return nullptr;
}

}  // namespace

bool fused_tile_width_supported(int n_tiles) { return n_tiles == 1 || n_tiles == 2 || n_tiles == 4; }

int fused_m_group(std::int64_t tokens) { return tokens <= 16 ? 1 : kFusedMaxMmaGroup; }

std::size_t fused_tail_shared_bytes(int n_tiles, int m_group) {
  return static_cast<std::size_t>(kFusedWarps) * static_cast<std::size_t>(m_group) * static_cast<std::size_t>(n_tiles) *
         32 * sizeof(float4);
}

cudaError_t fused_tail_blocks_per_sm(int n_tiles, DType dtype, int* blocks) {
  // The fewest blocks per SM of any m-group: the grid must fit whatever T a call brings.
  int fewest = 1 << 30;
  for (int m_group : {1, kFusedMaxMmaGroup}) {
    const void* kernel = kernel_for(n_tiles, m_group, dtype);
    if (kernel == nullptr) return cudaErrorInvalidValue;
    int count = 0;
    const cudaError_t status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kernel, kFusedThreads,
                                                                             fused_tail_shared_bytes(n_tiles, m_group));
    if (status != cudaSuccess) return status;
    fewest = std::min(fewest, count);
  }
  *blocks = fewest;
  return cudaSuccess;
}

cudaError_t launch_fused_tail(const FusedTailParams& p, int n_tiles, DType dtype, cudaStream_t stream) {
  const int m_group = fused_m_group(p.tokens);
  const void* kernel = kernel_for(n_tiles, m_group, dtype);
  if (kernel == nullptr || p.grid < 1) return cudaErrorInvalidValue;
  FusedTailParams params = p;
  void* args[] = {&params};
  return cudaLaunchKernel(kernel, dim3(static_cast<unsigned>(p.grid)), dim3(kFusedThreads), args,
                          fused_tail_shared_bytes(n_tiles, m_group), stream);
}

}  // namespace lmoe::cuda
