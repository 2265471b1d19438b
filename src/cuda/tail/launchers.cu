#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/runtime/alignment.hpp"
#include "cuda/runtime/launch_config.hpp"
#include "cuda/tail/elementwise.cuh"
#include "cuda/tail/elementwise_grid.hpp"
#include "cuda/tail/launchers.hpp"
#include "cuda/tail/rms_norm.cuh"

namespace lmoe::cuda {

namespace {

static_assert(kMaxReduceInputs == kMaxPeers);

constexpr int kThreads = kElementwiseThreads;

int blocks_for(std::int64_t work_items) { return elementwise_blocks(work_items); }

template <typename T>
cudaError_t reduce_as(const void* const* inputs, int num_inputs, void* out, std::int64_t count,
                      cudaStream_t stream) {
  PeerInputs<T> peers{};
  bool vector = aligned16(out);
  for (int r = 0; r < num_inputs; ++r) {
    peers.ptr[r] = static_cast<const T*>(inputs[r]);
    vector = vector && aligned16(inputs[r]);
  }
  peers.count = num_inputs;
  constexpr int kVec = Vec16<T>::kSize;
  if (vector) {
    rank_order_reduce_kernel<T, true>
        <<<blocks_for(count / kVec + 1), kThreads, 0, stream>>>(peers, static_cast<T*>(out), count);
  } else {
    rank_order_reduce_kernel<T, false>
        <<<blocks_for(count), kThreads, 0, stream>>>(peers, static_cast<T*>(out), count);
  }
  return cudaGetLastError();
}

template <typename T, int kWarpsPerRow, int kChunksPerLane>
cudaError_t launch_register_norm(const T* x, const float* gamma, T* out, std::int64_t rows,
                                 const std::int32_t* rows_device, int cols, float eps,
                                 cudaStream_t stream, bool programmatic) {
  constexpr int kRowsPerBlock = 8 / kWarpsPerRow;
  LaunchConfig config(dim3(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock)),
                      dim3(kNormThreads), 0, stream);
  return cudaLaunchKernelEx(config.programmatic(programmatic).get(),
                            rms_norm_register_kernel<T, kWarpsPerRow, kChunksPerLane>, x, gamma,
                            out, rows, rows_device, cols, eps);
}

template <typename T>
cudaError_t rms_norm_as(const void* x, const float* gamma, void* out, std::int64_t rows,
                        std::int64_t cols, float eps, cudaStream_t stream,
                        const std::int32_t* rows_device, bool programmatic) {
  const auto* tx = static_cast<const T*>(x);
  auto* tout = static_cast<T*>(out);
  const int n = static_cast<int>(cols);
  // Rows start cols elements apart, so 16-byte aligned bases keep every chunk of every row aligned
  // when cols is a multiple of the chunk (8 elements: 16 or 32 bytes).
  if (cols % kNormChunk != 0 || !aligned16(x) || !aligned16(out) || !aligned16(gamma)) {
    if (rows_device != nullptr) return cudaErrorInvalidValue;  // the rereading kernel reads rows
    rms_norm_rereading_kernel<T, false>
        <<<static_cast<unsigned>(rows), kNormThreads, 0, stream>>>(tx, gamma, tout, n, eps);
    return cudaGetLastError();
  }
  // Short rows: as few warps per row as hold every chunk, several rows per block (the lanes beyond
  // them are empty, see row_sum_of_squares). Long rows: 8 warps, each lane holding ≤ 8 chunks in
  // registers (bf16: up to l = 16384); longer rows are read twice.
  const std::int64_t chunks = cols / kNormChunk;
  if (chunks <= 32)
    return launch_register_norm<T, 1, 1>(tx, gamma, tout, rows, rows_device, n, eps, stream,
                                         programmatic);
  if (chunks <= 64)
    return launch_register_norm<T, 2, 1>(tx, gamma, tout, rows, rows_device, n, eps, stream,
                                         programmatic);
  if (chunks <= 128)
    return launch_register_norm<T, 4, 1>(tx, gamma, tout, rows, rows_device, n, eps, stream,
                                         programmatic);
  const std::int64_t per_lane = (chunks + kNormLanes - 1) / kNormLanes;
  if (per_lane <= 1)
    return launch_register_norm<T, 8, 1>(tx, gamma, tout, rows, rows_device, n, eps, stream,
                                         programmatic);
  if (per_lane <= 2)
    return launch_register_norm<T, 8, 2>(tx, gamma, tout, rows, rows_device, n, eps, stream,
                                         programmatic);
  if (per_lane <= 4)
    return launch_register_norm<T, 8, 4>(tx, gamma, tout, rows, rows_device, n, eps, stream,
                                         programmatic);
  if (per_lane <= 8)
    return launch_register_norm<T, 8, 8>(tx, gamma, tout, rows, rows_device, n, eps, stream,
                                         programmatic);
  if (rows_device != nullptr) return cudaErrorInvalidValue;
  rms_norm_rereading_kernel<T, true>
      <<<static_cast<unsigned>(rows), kNormThreads, 0, stream>>>(tx, gamma, tout, n, eps);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rank_order_reduce(const void* const* inputs, int num_inputs, void* out,
                                     std::int64_t count, DType dtype, cudaStream_t stream) {
  if (num_inputs < 1 || num_inputs > kMaxReduceInputs || count < 0) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  switch (dtype) {
    case DType::f32: return reduce_as<float>(inputs, num_inputs, out, count, stream);
    case DType::f16: return reduce_as<__half>(inputs, num_inputs, out, count, stream);
    case DType::bf16: return reduce_as<__nv_bfloat16>(inputs, num_inputs, out, count, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_add(const void* a, const void* b, void* out, std::int64_t count, DType dtype,
                       cudaStream_t stream) {
  // round(a + b) in fp32 is the rank-order sum of two inputs.
  const void* inputs[2] = {a, b};
  return launch_rank_order_reduce(inputs, 2, out, count, dtype, stream);
}

cudaError_t launch_accumulate_stripe(void* stripe, std::int64_t ld, const float* acc,
                                     std::int64_t rows, std::int64_t cols, DType dtype,
                                     cudaStream_t stream) {
  if (rows < 0 || cols < 0 || ld < cols) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  const auto launch = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    // Rows of four-column multiples keep every row's float4s and Vec4s aligned.
    const bool vector =
        cols % 4 == 0 && ld % 4 == 0 && aligned16(acc) && aligned_for<Vec4<T>>(typed);
    if (vector) {
      accumulate_stripe_kernel<T, true>
          <<<blocks_for(rows * cols / 4), kThreads, 0, stream>>>(typed, ld, acc, rows, cols);
    } else {
      accumulate_stripe_kernel<T, false>
          <<<blocks_for(rows * cols), kThreads, 0, stream>>>(typed, ld, acc, rows, cols);
    }
    return cudaGetLastError();
  };
  switch (dtype) {
    case DType::f32: return launch(static_cast<float*>(stripe));
    case DType::f16: return launch(static_cast<__half*>(stripe));
    case DType::bf16: return launch(static_cast<__nv_bfloat16*>(stripe));
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_rms_norm(const void* x, const float* gamma, void* out, std::int64_t rows,
                            std::int64_t cols, float eps, DType dtype, cudaStream_t stream,
                            const std::int32_t* rows_device, bool programmatic) {
  // One block per row at most (grid.x < 2^31), and int column indices.
  if (rows < 0 || cols < 1 || cols > 0x7fffffff || rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  switch (dtype) {
    case DType::f32:
      return rms_norm_as<float>(x, gamma, out, rows, cols, eps, stream, rows_device, programmatic);
    case DType::f16:
      return rms_norm_as<__half>(x, gamma, out, rows, cols, eps, stream, rows_device, programmatic);
    case DType::bf16:
      return rms_norm_as<__nv_bfloat16>(x, gamma, out, rows, cols, eps, stream, rows_device,
                                        programmatic);
  }
  return cudaErrorInvalidValue;
}

}  // namespace lmoe::cuda

namespace lmoe::cuda {

namespace {

__global__ void count_differences_kernel(const unsigned char* a, const unsigned char* b,
                                         std::int64_t bytes, unsigned long long* counter) {
  unsigned long long differing = 0;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    differing += a[i] != b[i];
  }
  if (differing) atomicAdd(counter, differing);
}

}  // namespace

cudaError_t launch_count_differences(const void* a, const void* b, std::int64_t bytes,
                                     unsigned long long* counter, cudaStream_t stream) {
  if (bytes < 0) return cudaErrorInvalidValue;
  if (bytes == 0) return cudaSuccess;
  count_differences_kernel<<<std::min<std::int64_t>(1024, (bytes + kThreads - 1) / kThreads),
                             kThreads, 0, stream>>>(
      static_cast<const unsigned char*>(a), static_cast<const unsigned char*>(b), bytes, counter);
  return cudaGetLastError();
}

}  // namespace lmoe::cuda
