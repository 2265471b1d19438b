#include "cuda/fused_tail_launch.hpp"

#include "cuda/fused_tail.cuh"

namespace lmoe::cuda {

namespace {

template <typename T>
const void* kernel_for(int n_tiles) {
  switch (n_tiles) {
    case 1: return reinterpret_cast<const void*>(fused_tail_kernel<T, 1>);
    case 2: return reinterpret_cast<const void*>(fused_tail_kernel<T, 2>);
    case 4: return reinterpret_cast<const void*>(fused_tail_kernel<T, 4>);
    default: return nullptr;
  }
}

const void* kernel_for(int n_tiles, DType dtype) {
  switch (dtype) {
    case DType::bf16: return kernel_for<__nv_bfloat16>(n_tiles);
    case DType::f16: return kernel_for<__half>(n_tiles);
    case DType::f32: return nullptr;
  }
  return nullptr;
}

}  // namespace

bool fused_tile_width_supported(int n_tiles) { return n_tiles == 1 || n_tiles == 2 || n_tiles == 4; }

std::size_t fused_tail_shared_bytes(int n_tiles) {
  return static_cast<std::size_t>(kFusedWarps) * static_cast<std::size_t>(n_tiles) * 32 * sizeof(float4);
}

cudaError_t fused_tail_blocks_per_sm(int n_tiles, DType dtype, int* blocks) {
  const void* kernel = kernel_for(n_tiles, dtype);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, kFusedThreads, fused_tail_shared_bytes(n_tiles));
}

cudaError_t launch_fused_tail(const FusedTailParams& p, int n_tiles, DType dtype, cudaStream_t stream) {
  const void* kernel = kernel_for(n_tiles, dtype);
  if (kernel == nullptr || p.grid < 1) return cudaErrorInvalidValue;
  FusedTailParams params = p;
  void* args[] = {&params};
  return cudaLaunchKernel(kernel, dim3(static_cast<unsigned>(p.grid)), dim3(kFusedThreads), args,
                          fused_tail_shared_bytes(n_tiles), stream);
}

}  // namespace lmoe::cuda
