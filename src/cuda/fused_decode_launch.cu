#include "cuda/fused_decode_launch.hpp"

#include <algorithm>

#include "cuda/fused_decode.cuh"
#include "cuda/launch_config.hpp"

namespace lmoe::cuda {

namespace {

// The kernel's M holds 8 or 16 token rows; calls of up to 8 skip the upper half's loads.
int max_tokens_of_shape(std::int64_t max_tokens) { return max_tokens <= 8 ? 8 : 16; }

const void* decode_kernel(int shape_tokens, DType dtype) {
  const bool sixteen = shape_tokens == 16;
  switch (dtype) {
    case DType::bf16:
      return sixteen ? reinterpret_cast<const void*>(fused_decode_kernel<__nv_bfloat16, 16>)
                     : reinterpret_cast<const void*>(fused_decode_kernel<__nv_bfloat16, 8>);
    case DType::f16:
      return sixteen ? reinterpret_cast<const void*>(fused_decode_kernel<__half, 16>)
                     : reinterpret_cast<const void*>(fused_decode_kernel<__half, 8>);
    case DType::f32:
      return nullptr;
  }
  return nullptr;
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
  for (int shape : {8, 16}) {
    if (shape > max_tokens_of_shape(max_tokens)) break;
    // The kernel's own static shared memory (the protocol's call record) comes off the limit.
    cudaFuncAttributes attributes{};
    if (cudaFuncGetAttributes(&attributes, decode_kernel(shape, dtype)) != cudaSuccess)
      return "the decode kernel could not query the device";
    const int dynamic_limit = limit - static_cast<int>(attributes.sharedSizeBytes);
    if (DecodeLayout::bytes(l, shape) > static_cast<std::size_t>(dynamic_limit)) {
      return "the decode kernel's normalized rows, gamma and weight rings do not fit in a block's "
             "shared memory";
    }
    if (cudaFuncSetAttribute(decode_kernel(shape, dtype),
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             dynamic_limit) != cudaSuccess) {
      return "the decode kernel's shared memory could not be raised on this device";
    }
  }
  *plan = result;
  return nullptr;
}

cudaError_t launch_fused_decode(const FusedDecodeParams& p, std::int64_t max_tokens, DType dtype,
                                const FusedDecodePlan& plan, cudaStream_t stream) {
  if (max_tokens < 1 || max_tokens > kFusedDecodeMaxTokens || plan.grid < 1)
    return cudaErrorInvalidValue;
  const int shape = max_tokens_of_shape(max_tokens);
  const void* kernel = decode_kernel(shape, dtype);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  FusedDecodeParams params = p;
  void* args[] = {&params};
  LaunchConfig config(dim3(static_cast<unsigned>(plan.grid)), dim3(kDecodeThreads),
                      DecodeLayout::bytes(p.l, shape), stream);
  config.programmatic(p.programmatic);
  return cudaLaunchKernelExC(config.get(), kernel, args);
}

}  // namespace lmoe::cuda
