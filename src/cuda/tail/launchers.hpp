// Launchers of the CUDA kernels: raw device pointers, sizes and a stream in, a cudaError_t out
// (the launch error; execution errors surface at the next synchronizing call). Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

// The most ranks a collective reduces over in one launch.
inline constexpr int kMaxReduceInputs = 16;

// out[i] = round(Σ_r inputs[r][i]) in fp32, rank order. `out` may alias inputs[0] only.
cudaError_t launch_rank_order_reduce(const void* const* inputs, int num_inputs, void* out,
                                     std::int64_t count, DType dtype, cudaStream_t stream);

// out[i] = round(a[i] + b[i]); out may alias a or b.
cudaError_t launch_add(const void* a, const void* b, void* out, std::int64_t count, DType dtype,
                       cudaStream_t stream);

// stripe[r, c] = round(stripe[r, c] + acc[r, c]) for a [rows, cols] stripe with row stride ld;
// acc is fp32 [rows, cols], contiguous.
cudaError_t launch_accumulate_stripe(void* stripe, std::int64_t ld, const float* acc,
                                     std::int64_t rows, std::int64_t cols, DType dtype,
                                     cudaStream_t stream);

// out = round(rmsnorm(x; gamma, eps)) row by row, in the contract's canonical order (bit-identical
// to cpu::rms_norm); x and out are contiguous [rows, cols], gamma is fp32 [cols]. Any cols ≥ 1; the
// fast path needs cols % 8 == 0 and x, out and gamma 16-byte aligned. rows_device, when given,
// holds the row count on the device (at most `rows`, which sizes the grid: a graph replayed with
// another T); only the fast path with rows held in registers (cols ≤ 16384) reads it, elsewhere it
// is cudaErrorInvalidValue with nothing launched. The fast path lets a kernel launched after it
// with programmatic dependent launch start at once (rms_norm.cuh); with `programmatic` it is itself
// launched so (it may start before the stream's previous kernel ends, and waits for it before it
// reads anything; the other paths launch as usual).
cudaError_t launch_rms_norm(const void* x, const float* gamma, void* out, std::int64_t rows,
                            std::int64_t cols, float eps, DType dtype, cudaStream_t stream,
                            const std::int32_t* rows_device = nullptr, bool programmatic = false);

// *counter += the number of bytes where a and b differ (device-side checks of many results without
// a host round trip per result, e.g. long graph-replay soaks).
cudaError_t launch_count_differences(const void* a, const void* b, std::int64_t bytes,
                                     unsigned long long* counter, cudaStream_t stream);

}  // namespace lmoe::cuda
