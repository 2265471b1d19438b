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

// The most experts the router kernel takes (three 4-byte values each in shared memory, 12 KB):
// the most a layer's configuration allows.
inline constexpr std::int64_t kMaxRouterExperts = 1024;

// select_experts (include/lmoe/router.hpp) on the device: logits [T, E] fp32 → ids [T, k] (best
// first) and weights [T, k]. With logit_parts > 1 (at most 3) the logits come as [T, parts·E]
// (the router GEMM on a split weight, core/router_weight_split.hpp) and expert e's logit is
// (part 0 + part 1) + part 2 of its column, in fp32. `bias` holds E values when
// config.correction_bias, else it is null. One block per token; selection ranks the candidates
// for the k best (layer_kernels.cuh) with the CPU router's total order, so it depends only on the
// logits' bits.
cudaError_t launch_route(const float* logits, const float* bias, std::int64_t num_tokens,
                         const RouterConfig& config, std::int32_t* ids, float* weights,
                         cudaStream_t stream, int logit_parts = 1);

// dst [i, :cols] = src [rows[i], :cols] for i < count (pitches src_ld and cols elements of
// `dtype`), or for i < min(count, *count_device) when count_device is set (a row count that
// stays on the device, e.g. first[E] of the slot sort: rows past it are left alone). A bit copy,
// 16 bytes at a time where the pitches and pointers allow.
cudaError_t launch_gather_rows(const void* src, std::int64_t src_ld, const std::int32_t* rows,
                               void* dst, std::int64_t count, std::int64_t cols, DType dtype,
                               cudaStream_t stream, const std::int32_t* count_device = nullptr);

// out [count] = round(act(gate, up)) (docs/numerics.md, "The layer"); gate is ignored (may be null)
// for relu2.
cudaError_t launch_activation(const float* gate, const float* up, void* out, std::int64_t count,
                              const LayerConfig& config, DType dtype, cudaStream_t stream);

// routed [T, l] = round(Σ_j w[t, j] · slot_out[slot_rows[t·k + j], :]): each product rounded to
// fp32, summed in slot order starting from the j = 0 product, rounded once (the CPU's order).
cudaError_t launch_combine(const float* slot_out, const std::int32_t* slot_rows,
                           const float* weights, void* routed, std::int64_t num_tokens,
                           std::int64_t top_k, std::int64_t cols, DType dtype, cudaStream_t stream);

// The routed slots sorted by expert on the device (the executor's host counting sort, bit for
// bit): ids [S = T·k] → first [E + 1] (each expert's first grouped row, rows padded to a multiple
// of row_align), row_of_slot [S], token_of_row [first[E]] (padding rows hold token 0; rows past
// first[E] of a bound-sized buffer are left alone). E ≤ kSortMaxExperts; one block, no host read.
inline constexpr std::int64_t kSortMaxExperts = 1024;
// Loads every kernel of this file for `dtype` on the current device (and sets the sort's shared
// memory size), so that no forward loads a module: under lazy loading a kernel's first load may
// wait for the GPU's running kernels, e.g. a p2p peer that spins on this rank (docs/p2p.md).
cudaError_t prepare_layer_kernels(DType dtype);
cudaError_t launch_sort_slots(const std::int32_t* ids, std::int64_t slot_count,
                              std::int64_t experts, std::int64_t top_k, std::int64_t row_align,
                              std::int32_t* first, std::int32_t* row_of_slot,
                              std::int32_t* token_of_row, cudaStream_t stream);

}  // namespace lmoe::cuda
