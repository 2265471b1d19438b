#include "cuda/fused/fused_tail_launch.hpp"

#include <algorithm>

#include "cuda/fused/fused_tail.cuh"

namespace lmoe::cuda {

namespace {

constexpr int kRowsClasses[] = {16, 32, 64, 128, 256};

template <typename T>
const void* kernel_for(int rows_class) {
  switch (rows_class) {
    case 16: return reinterpret_cast<const void*>(fused_tail_kernel<T, 16>);
    case 32: return reinterpret_cast<const void*>(fused_tail_kernel<T, 32>);
    case 64: return reinterpret_cast<const void*>(fused_tail_kernel<T, 64>);
    case 128: return reinterpret_cast<const void*>(fused_tail_kernel<T, 128>);
    case 256: return reinterpret_cast<const void*>(fused_tail_kernel<T, 256>);
    default: return nullptr;
  }
}

const void* kernel_for(int rows_class, DType dtype) {
  switch (dtype) {
    case DType::bf16: return kernel_for<__nv_bfloat16>(rows_class);
    case DType::f16: return kernel_for<__half>(rows_class);
    case DType::f32: return nullptr;
  }
  return nullptr;
}

std::size_t shared_bytes_of(int rows_class) {
  switch (rows_class) {
    case 16: return FusedShape<16>::kSharedBytes;
    case 32: return FusedShape<32>::kSharedBytes;
    case 64: return FusedShape<64>::kSharedBytes;
    case 128: return FusedShape<128>::kSharedBytes;
    default: return FusedShape<256>::kSharedBytes;
  }
}

}  // namespace

int fused_rows_class(std::int64_t tokens) {
  for (int rows : kRowsClasses) {
    if (tokens <= rows) return rows;
  }
  return 0;
}

std::size_t fused_tail_shared_bytes(std::int64_t tokens) {
  return shared_bytes_of(fused_rows_class(tokens));
}

cudaError_t fused_tail_blocks_per_sm(std::int64_t max_tokens, DType dtype, int* blocks) {
  const int largest = fused_rows_class(max_tokens);
  if (largest == 0) return cudaErrorInvalidValue;
  int fewest = 1 << 30;
  for (int rows : kRowsClasses) {
    if (rows > largest) break;
    const void* kernel = kernel_for(rows, dtype);
    if (kernel == nullptr) return cudaErrorInvalidValue;
    const int bytes = static_cast<int>(shared_bytes_of(rows));
    cudaError_t status =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (status != cudaSuccess) return status;
    int count = 0;
    status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kernel, kFusedThreads, bytes);
    if (status != cudaSuccess) return status;
    fewest = std::min(fewest, count);
  }
  *blocks = fewest;
  return cudaSuccess;
}

cudaError_t launch_fused_tail(const FusedTailParams& p, DType dtype, cudaStream_t stream) {
  const int rows = fused_rows_class(p.tokens);
  const void* kernel = rows ? kernel_for(rows, dtype) : nullptr;
  if (kernel == nullptr || p.grid < 1) return cudaErrorInvalidValue;
  FusedTailParams params = p;
  void* args[] = {&params};
  return cudaLaunchKernel(kernel, dim3(static_cast<unsigned>(p.grid)), dim3(kFusedThreads), args,
                          shared_bytes_of(rows), stream);
}

}  // namespace lmoe::cuda
