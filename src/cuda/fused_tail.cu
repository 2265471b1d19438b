#include "cuda/fused_tail.hpp"

#include "cuda/alignment.hpp"
#include "cuda/fused_tail_small_t.cuh"

namespace lmoe::cuda {

namespace {

// Leaves room in the SM's shared memory for the kernel's static arrays.
constexpr std::int64_t kMaxNormedBytes = 200 * 1024;

template <typename T, int kMaxT>
cudaError_t allow_smem() {
  return cudaFuncSetAttribute(fused_tail_small_t_kernel<T, kMaxT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(kMaxNormedBytes));
}

template <typename T>
cudaError_t allow_smem_all() {
  for (const cudaError_t status : {allow_smem<T, 1>(), allow_smem<T, 2>(), allow_smem<T, 4>(), allow_smem<T, 8>(),
                                   allow_smem<T, 16>()}) {
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

template <typename T, int kMaxT>
cudaError_t launch_as(const void* x, const float* gamma, const void* w, std::int64_t ldw, const void* shared,
                      std::int64_t ld_shared, void* out, std::int64_t ld_out, int tokens, int cols, int n_rows,
                      float eps, cudaStream_t stream) {
  const int blocks = (n_rows + kFusedRowsPerBlock - 1) / kFusedRowsPerBlock;
  const std::size_t smem = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(cols) * sizeof(T);
  fused_tail_small_t_kernel<T, kMaxT><<<blocks, kFusedThreads, smem, stream>>>(
      static_cast<const T*>(x), gamma, static_cast<const T*>(w), ldw, static_cast<const T*>(shared), ld_shared,
      static_cast<T*>(out), ld_out, tokens, cols, n_rows, eps);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_tokens(const void* x, const float* gamma, const void* w, std::int64_t ldw, const void* shared,
                            std::int64_t ld_shared, void* out, std::int64_t ld_out, int tokens, int cols,
                            int n_rows, float eps, cudaStream_t stream) {
  if (tokens <= 1) return launch_as<T, 1>(x, gamma, w, ldw, shared, ld_shared, out, ld_out, tokens, cols, n_rows, eps, stream);
  if (tokens <= 2) return launch_as<T, 2>(x, gamma, w, ldw, shared, ld_shared, out, ld_out, tokens, cols, n_rows, eps, stream);
  if (tokens <= 4) return launch_as<T, 4>(x, gamma, w, ldw, shared, ld_shared, out, ld_out, tokens, cols, n_rows, eps, stream);
  if (tokens <= 8) return launch_as<T, 8>(x, gamma, w, ldw, shared, ld_shared, out, ld_out, tokens, cols, n_rows, eps, stream);
  return launch_as<T, 16>(x, gamma, w, ldw, shared, ld_shared, out, ld_out, tokens, cols, n_rows, eps, stream);
}

}  // namespace

bool fused_tail_small_t_fits(std::int64_t tokens, std::int64_t cols, DType dtype) {
  return tokens >= 1 && tokens <= kFusedMaxTokens && cols >= kNormChunk && cols % kNormChunk == 0 &&
         tokens * cols * static_cast<std::int64_t>(dtype_size(dtype)) <= kMaxNormedBytes;
}

cudaError_t prepare_fused_tail_small_t() {
  for (const cudaError_t status : {allow_smem_all<__nv_bfloat16>(), allow_smem_all<__half>(), allow_smem_all<float>()}) {
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

cudaError_t launch_fused_tail_small_t(const void* x, const float* gamma, const void* w, std::int64_t ldw,
                                      const void* shared, std::int64_t ld_shared, void* out, std::int64_t ld_out,
                                      std::int64_t tokens, std::int64_t cols, std::int64_t n_rows, float eps,
                                      DType dtype, cudaStream_t stream) {
  if (!fused_tail_small_t_fits(tokens, cols, dtype) || n_rows < 1 || !aligned16(x) || !aligned16(gamma) ||
      !aligned16(w) || ldw % kNormChunk != 0) {
    return cudaErrorNotSupported;
  }
  const int t = static_cast<int>(tokens), c = static_cast<int>(cols), n = static_cast<int>(n_rows);
  switch (dtype) {
    case DType::bf16: return dispatch_tokens<__nv_bfloat16>(x, gamma, w, ldw, shared, ld_shared, out, ld_out, t, c, n, eps, stream);
    case DType::f16: return dispatch_tokens<__half>(x, gamma, w, ldw, shared, ld_shared, out, ld_out, t, c, n, eps, stream);
    case DType::f32: return dispatch_tokens<float>(x, gamma, w, ldw, shared, ld_shared, out, ld_out, t, c, n, eps, stream);
  }
  return cudaErrorNotSupported;
}

}  // namespace lmoe::cuda
