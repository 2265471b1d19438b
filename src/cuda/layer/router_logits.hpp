// The router's logits at decode sizes (T ≤ kRouterDecodeMaxTokens) for a bf16 layer, in one pass
// over the fp32 router weight: launcher, shapes and the partials' layout. Host code only; the
// kernel is in router_logits.cuh (docs/layer.md, "The router at decode sizes").
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lmoe::cuda {

// The largest T the decode logits kernel takes (its accumulators are registers: 16 token tiles).
inline constexpr std::int64_t kRouterDecodeMaxTokens = 128;
// Experts per block (8 warps of 16), k per pipeline stage, stages in flight.
inline constexpr int kRouterLogitsWarps = 8;
inline constexpr int kRouterLogitsExperts = 16 * kRouterLogitsWarps;
inline constexpr int kRouterLogitsChunk = 64;
inline constexpr int kRouterLogitsStages = 4;

// How many K splits the kernel cuts d into: a function of E and d only (never of T or the device),
// so a token's logits, and so its routing, do not depend on the batch it came in or on the GPU.
// About 120 blocks in all: one wave on a 132-SM H100 or H200 where T's registers allow only one
// block per SM.
int router_logits_splits(std::int64_t experts, std::int64_t d_model);

// Whether the decode kernel takes these shapes: 1 ≤ T ≤ kRouterDecodeMaxTokens, d a multiple of
// kRouterLogitsChunk, E ≥ 1.
bool router_logits_fits(std::int64_t tokens, std::int64_t d_model, std::int64_t experts);

// partial [S, T, E] fp32, S = router_logits_splits(E, d): split s's share of x [T, d] (bf16,
// 16-byte aligned) times weight [E, d]ᵀ (fp32), over its contiguous k range. Every product is exact
// (the weight is split in registers into its three bf16 parts, core/router_weight_split.hpp); the
// high part's products and the two lower parts' are summed in fp32 on tensor cores in two
// accumulators, then added (high + low) once. Expert e's logit is then Σ_s partial[s, t, e] in
// split order (the route kernel's RouterLogitLayout{S, T·E, E}). Returns cudaErrorInvalidValue for
// shapes that do not fit or an x that is not 16-byte aligned.
cudaError_t launch_router_logits(const void* x, const float* weight, std::int64_t tokens,
                                 std::int64_t d_model, std::int64_t experts, float* partial,
                                 cudaStream_t stream);

// Loads the kernel's variants (and sets their shared memory sizes) on the current device, so that
// no forward loads a module (layer_kernels.hpp, prepare_layer_kernels).
cudaError_t prepare_router_logits();

}  // namespace lmoe::cuda
