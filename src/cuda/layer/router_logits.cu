#include <algorithm>

#include "cuda/layer/layer_kernels.hpp"
#include "cuda/layer/router_logits.cuh"
#include "cuda/layer/router_logits.hpp"

namespace lmoe::cuda {

namespace {

// Blocks the splits aim for: one wave where a block fills an SM (132-SM H100 and H200).
constexpr std::int64_t kTargetBlocks = 120;

template <int kTokenTiles>
cudaError_t launch_tiles(const void* x, const float* weight, std::int64_t tokens,
                         std::int64_t d_model, std::int64_t experts, float* partial,
                         cudaStream_t stream) {
  constexpr int kBytes = router_logits_stage_bytes(kTokenTiles) * kRouterLogitsStages;
  const cudaError_t status = cudaFuncSetAttribute(
      router_logits_kernel<kTokenTiles>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (status != cudaSuccess) return status;
  const dim3 grid(
      static_cast<unsigned>((experts + kRouterLogitsExperts - 1) / kRouterLogitsExperts),
      static_cast<unsigned>(router_logits_splits(experts, d_model)));
  router_logits_kernel<kTokenTiles><<<grid, kRouterLogitsWarps * 32, kBytes, stream>>>(
      static_cast<const __nv_bfloat16*>(x), weight, static_cast<int>(tokens),
      static_cast<int>(d_model), static_cast<int>(experts), partial);
  return cudaGetLastError();
}

template <int kTokenTiles>
cudaError_t prepare_tiles() {
  return cudaFuncSetAttribute(router_logits_kernel<kTokenTiles>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              router_logits_stage_bytes(kTokenTiles) * kRouterLogitsStages);
}

}  // namespace

int router_logits_splits(std::int64_t experts, std::int64_t d_model) {
  const std::int64_t tiles = (experts + kRouterLogitsExperts - 1) / kRouterLogitsExperts;
  const std::int64_t wanted = (kTargetBlocks + tiles - 1) / tiles;
  const std::int64_t most =
      std::min<std::int64_t>(d_model / kRouterLogitsChunk, kMaxRouterLogitParts);
  return static_cast<int>(std::clamp<std::int64_t>(wanted, 1, std::max<std::int64_t>(most, 1)));
}

bool router_logits_fits(std::int64_t tokens, std::int64_t d_model, std::int64_t experts) {
  return tokens >= 1 && tokens <= kRouterDecodeMaxTokens && d_model >= kRouterLogitsChunk &&
         d_model % kRouterLogitsChunk == 0 && d_model <= 0x7fffffff && experts >= 1 &&
         experts <= 0x7fffffff;
}

cudaError_t launch_router_logits(const void* x, const float* weight, std::int64_t tokens,
                                 std::int64_t d_model, std::int64_t experts, float* partial,
                                 cudaStream_t stream) {
  if (!router_logits_fits(tokens, d_model, experts) ||
      reinterpret_cast<std::uintptr_t>(x) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(weight) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  // The fewest token tiles of 8 that hold T (a power of two: five variants).
  if (tokens <= 8) return launch_tiles<1>(x, weight, tokens, d_model, experts, partial, stream);
  if (tokens <= 16) return launch_tiles<2>(x, weight, tokens, d_model, experts, partial, stream);
  if (tokens <= 32) return launch_tiles<4>(x, weight, tokens, d_model, experts, partial, stream);
  if (tokens <= 64) return launch_tiles<8>(x, weight, tokens, d_model, experts, partial, stream);
  return launch_tiles<16>(x, weight, tokens, d_model, experts, partial, stream);
}

cudaError_t prepare_router_logits() {
  for (const cudaError_t status : {prepare_tiles<1>(), prepare_tiles<2>(), prepare_tiles<4>(),
                                   prepare_tiles<8>(), prepare_tiles<16>()}) {
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace lmoe::cuda
