// Launchers of the layer's kernels (src/cuda/layer_kernels.cuh): raw device pointers, sizes and a
// stream in, a cudaError_t out (the launch error). Host code only. The formulas are those of the
// CPU executor and router (docs/numerics.md, "The layer").
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "lmoe/dims.hpp"
#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

// out [rows, cols] fp32 = x [rows, cols] in `dtype`, exactly (the router GEMM's fp32 operand).
cudaError_t launch_to_float(const void* x, float* out, std::int64_t count, DType dtype,
                            cudaStream_t stream);

// The most experts the router kernel holds in shared memory (two fp32 values each).
inline constexpr std::int64_t kMaxRouterExperts = 4096;

// select_experts (include/lmoe/router.hpp) on the device: logits [T, E] fp32 → ids [T, k] (best
// first) and weights [T, k]. `bias` holds E values when config.correction_bias, else it is null.
// One block per token; selection ranks every eligible expert against all others with the CPU
// router's total order (no atomics, no order-dependent reductions), so it depends only on the
// logits' bits.
cudaError_t launch_route(const float* logits, const float* bias, std::int64_t num_tokens,
                         const RouterConfig& config, std::int32_t* ids, float* weights,
                         cudaStream_t stream);

// dst [count, cols] = src [rows[i], :] for i < count; src and dst contiguous in `dtype`.
cudaError_t launch_gather_rows(const void* src, const std::int32_t* rows, void* dst,
                               std::int64_t count, std::int64_t cols, DType dtype,
                               cudaStream_t stream);

// out [count] = round(act(gate, up)) (docs/numerics.md, "The layer"); gate is ignored (may be null)
// for relu2.
cudaError_t launch_activation(const float* gate, const float* up, void* out, std::int64_t count,
                              const LayerConfig& config, DType dtype, cudaStream_t stream);

// routed [T, l] = round(Σ_j w[t, j] · slot_out[slot_rows[t·k + j], :]): each product rounded to
// fp32, summed in slot order starting from the j = 0 product, rounded once (the CPU's order).
cudaError_t launch_combine(const float* slot_out, const std::int32_t* slot_rows,
                           const float* weights, void* routed, std::int64_t num_tokens,
                           std::int64_t top_k, std::int64_t cols, DType dtype, cudaStream_t stream);

}  // namespace lmoe::cuda
