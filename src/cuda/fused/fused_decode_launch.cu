#include "cuda/fused/fused_decode_launch.hpp"

#include <algorithm>

#include "cuda/fused/fused_decode.cuh"
#include "cuda/runtime/launch_config.hpp"

namespace lmoe::cuda {

namespace {

// The kernel's instances: M holds 16 token rows, and calls of up to 8 skip the upper half's
// loads; the pair instance (4 rows, one group of weight rows a block, two blocks an SM) takes the
// calls of up to FusedDecodePlan::pair_tokens rows where the plan allows it.
struct DecodeShape {
  int tokens;  // rows of N
  int groups;  // groups of 8 weight rows a block, at most
  int blocks;  // blocks an SM
};
constexpr DecodeShape kEight{8, kDecodeMaxGroups, 1};
constexpr DecodeShape kSixteen{16, kDecodeMaxGroups, 1};
constexpr DecodeShape kPair{kFusedDecodePairTokens, 1, 2};

DecodeShape shape_for(std::int64_t max_tokens, bool pair) {
  if (pair) return kPair;
  return max_tokens <= 8 ? kEight : kSixteen;
}

template <typename T>
const void* decode_kernel_of(const DecodeShape& shape) {
  if (shape.blocks == 2) return reinterpret_cast<const void*>(fused_decode_kernel<T, 4, 1, 2>);
  return shape.tokens == 16 ? reinterpret_cast<const void*>(fused_decode_kernel<T, 16, 8, 1>)
                            : reinterpret_cast<const void*>(fused_decode_kernel<T, 8, 8, 1>);
}

const void* decode_kernel(const DecodeShape& shape, DType dtype) {
  switch (dtype) {
    case DType::bf16: return decode_kernel_of<__nv_bfloat16>(shape);
    case DType::f16: return decode_kernel_of<__half>(shape);
    case DType::f32: return nullptr;
  }
  return nullptr;
}

std::size_t decode_bytes(const DecodeShape& shape, std::int64_t rows, std::int64_t l, int grid) {
  const int depth = shape.tokens <= 8 ? kDecodeDepth<8> : kDecodeDepth<16>;
  return DecodeLayout::bytes(l, shape.tokens, shape.groups,
                             DecodeLayout::ring_slots(rows, l, grid, depth));
}

// Whether two blocks of the pair instance fit on an SM with this grid: one group of weight rows a
// block, and twice the block's shared memory (with the block's reserve), threads and registers
// within an SM's. Its shared-memory limit is raised and its carveout set to the most shared memory
// when it does.
bool pair_fits(std::int64_t rows, std::int64_t l, int grid, DType dtype, int device) {
  if ((rows / 8 + grid - 1) / grid > kPair.groups) return false;
  int per_sm = 0, reserved = 0, threads = 0, registers = 0;
  if (cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerMultiProcessor, device) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&registers, cudaDevAttrMaxRegistersPerMultiprocessor, device) !=
          cudaSuccess) {
    return false;
  }
  const void* kernel = decode_kernel(kPair, dtype);
  cudaFuncAttributes attributes{};
  if (kernel == nullptr || cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) return false;
  const std::size_t block = decode_bytes(kPair, rows, l, grid) + attributes.sharedSizeBytes +
                            static_cast<std::size_t>(reserved);
  if (2 * block > static_cast<std::size_t>(per_sm) || 2 * kDecodeThreads > threads ||
      2 * kDecodeThreads * attributes.numRegs > registers) {
    return false;
  }
  // The kernel's limit: what two blocks an SM may each take (not this plan's bytes: the attribute
  // belongs to the kernel, and another FusedTail with other dims may be launching it too).
  const int dynamic = per_sm / 2 - static_cast<int>(attributes.sharedSizeBytes) - reserved;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic) ==
             cudaSuccess &&
         cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                              cudaSharedmemCarveoutMaxShared) == cudaSuccess;
}

}  // namespace

const char* fused_decode_plan(std::int64_t rows, std::int64_t l, std::int64_t max_tokens,
                              DType dtype, FusedDecodePlan* plan, int max_grid) {
  if (dtype != DType::bf16 && dtype != DType::f16) return "the decode kernel runs bf16 and f16";
  if (max_tokens < 1 || max_tokens > kFusedDecodeMaxTokens)
    return "the decode kernel takes 1 … 16 tokens";
  if (rows % 8 != 0 || rows < 8 || l % 16 != 0 || l < 16)
    return "the decode kernel needs d % 8 == 0 and l % 16 == 0";
  int device = 0, sms = 0, limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    return "the decode kernel could not query the device";
  }
  FusedDecodePlan result;
  const int blocks = max_grid > 0 ? std::min(max_grid, sms) : sms;
  result.grid = static_cast<int>(std::clamp<std::int64_t>(rows / 8, 1, blocks));
  if ((rows / 8 + result.grid - 1) / result.grid > kDecodeMaxGroups)
    return "the decode kernel takes at most 8 groups of 8 rows of w_up per SM";
  // Every shape a call of up to max_tokens rows may launch: its shared memory must fit, and the
  // kernel is allowed all a block may have, here (not at launch, which may be inside a graph
  // capture). The device's whole limit, not this call's bytes: the attribute belongs to the kernel,
  // and another FusedTail with other dims may be launching it too.
  for (const DecodeShape& shape : {kEight, kSixteen}) {
    if (shape.tokens > shape_for(max_tokens, false).tokens) break;
    // The kernel's own static shared memory (the protocol's call record) comes off the limit.
    cudaFuncAttributes attributes{};
    if (cudaFuncGetAttributes(&attributes, decode_kernel(shape, dtype)) != cudaSuccess)
      return "the decode kernel could not query the device";
    const int dynamic_limit = limit - static_cast<int>(attributes.sharedSizeBytes);
    if (decode_bytes(shape, rows, l, result.grid) > static_cast<std::size_t>(dynamic_limit)) {
      return "the decode kernel's normalized rows, gamma and weight rings do not fit in a block's "
             "shared memory";
    }
    if (cudaFuncSetAttribute(decode_kernel(shape, dtype),
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             dynamic_limit) != cudaSuccess) {
      return "the decode kernel's shared memory could not be raised on this device";
    }
  }
  if (pair_fits(rows, l, result.grid, dtype, device)) result.pair_tokens = kFusedDecodePairTokens;
  *plan = result;
  return nullptr;
}

int fused_decode_resident_blocks(std::int64_t rows, std::int64_t l, std::int64_t max_tokens,
                                 DType dtype, const FusedDecodePlan& plan, bool programmatic) {
  if (max_tokens < 1 || max_tokens > kFusedDecodeMaxTokens || plan.grid < 1) return 0;
  const DecodeShape shape = shape_for(max_tokens, programmatic && max_tokens <= plan.pair_tokens);
  const void* kernel = decode_kernel(shape, dtype);
  int blocks = 0;
  if (kernel == nullptr || cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                               &blocks, kernel, kDecodeThreads,
                               decode_bytes(shape, rows, l, plan.grid)) != cudaSuccess) {
    return 0;
  }
  return blocks;
}

cudaError_t launch_fused_decode(const FusedDecodeParams& p, std::int64_t max_tokens, DType dtype,
                                const FusedDecodePlan& plan, cudaStream_t stream) {
  if (max_tokens < 1 || max_tokens > kFusedDecodeMaxTokens || plan.grid < 1)
    return cudaErrorInvalidValue;
  const bool pair = p.programmatic && max_tokens <= plan.pair_tokens;
  // The pair instance has no exchange (one rank only: FusedTail plans it at tp = 1 alone).
  if (pair && p.protocol.tp > 1) return cudaErrorInvalidValue;
  const DecodeShape shape = shape_for(max_tokens, pair);
  const void* kernel = decode_kernel(shape, dtype);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  FusedDecodeParams params = p;
  // Unset (< 0): 4 of a warp's first items ask early, all of them in the pair instance (whose
  // blocks enter while the kernel before runs, so that its weights land before the inputs are
  // asked for).
  if (params.early_items < 0) params.early_items = pair ? kFusedDecodeMaxEarlyItems : 4;
  void* args[] = {&params};
  LaunchConfig config(dim3(static_cast<unsigned>(plan.grid)), dim3(kDecodeThreads),
                      decode_bytes(shape, p.rows, p.l, plan.grid), stream);
  config.programmatic(p.programmatic);
  return cudaLaunchKernelExC(config.get(), kernel, args);
}

}  // namespace lmoe::cuda
