#include <algorithm>

#include "cuda/layer/layer_kernels.cuh"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/runtime/alignment.hpp"
#include "cuda/tail/elementwise_grid.hpp"

namespace lmoe::cuda {

namespace {

constexpr int kThreads = kElementwiseThreads;

int blocks_for(std::int64_t work_items) { return elementwise_blocks(work_items); }

// Calls fn(T{}) with T the storage type of `dtype`.
template <typename Fn>
cudaError_t with_storage(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32: fn(float{}); break;
    case DType::f16: fn(__half{}); break;
    case DType::bf16: fn(__nv_bfloat16{}); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_to_float(const void* x, float* out, std::int64_t count, DType dtype,
                            cudaStream_t stream) {
  if (count < 0) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  return with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    to_float_kernel<T>
        <<<blocks_for(count), kThreads, 0, stream>>>(static_cast<const T*>(x), out, count);
  });
}

cudaError_t launch_route(const float* logits, const float* bias, std::int64_t num_tokens,
                         const RouterConfig& config, std::int32_t* ids, float* weights,
                         cudaStream_t stream, int logit_parts) {
  if (num_tokens < 0 || num_tokens > 0x7fffffff || config.num_experts < 1 ||
      config.num_experts > kMaxRouterExperts || config.top_k < 1 ||
      config.top_k > config.num_experts || config.n_group < 1 ||
      config.num_experts % config.n_group != 0 || config.topk_group < 1 ||
      config.topk_group > config.n_group || (config.correction_bias && bias == nullptr) ||
      logit_parts < 1 || logit_parts > 3) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) return cudaSuccess;
  RouterParams params{};
  params.experts = static_cast<int>(config.num_experts);
  params.top_k = static_cast<int>(config.top_k);
  params.n_group = static_cast<int>(config.n_group);
  params.topk_group = static_cast<int>(config.topk_group);
  params.softmax = config.score == RouterScore::softmax;
  params.has_bias = config.correction_bias;
  params.renormalize = config.renormalize;
  params.scale = config.routed_scaling_factor;
  params.parts = logit_parts;
  const std::size_t shared_bytes =
      sizeof(float) * static_cast<std::size_t>(2 * config.num_experts + config.n_group) +
      sizeof(int) * static_cast<std::size_t>(config.n_group + config.top_k + config.num_experts);
  static_assert(kThreads % 32 == 0 && kThreads / 32 <= kRouteWarps);
  route_kernel<<<static_cast<unsigned>(num_tokens), kThreads, shared_bytes, stream>>>(
      logits, config.correction_bias ? bias : nullptr, params, ids, weights);
  return cudaGetLastError();
}

cudaError_t launch_gather_rows(const void* src, std::int64_t src_ld, const std::int32_t* rows,
                               void* dst, std::int64_t count, std::int64_t cols, DType dtype,
                               cudaStream_t stream, const std::int32_t* count_device) {
  if (count < 0 || cols < 0 || src_ld < cols) return cudaErrorInvalidValue;
  if (count == 0 || cols == 0) return cudaSuccess;
  // The widest unit that divides both pitches' bytes and both pointers.
  const std::uint64_t esize = dtype_size(dtype);
  const std::uint64_t spread =
      (static_cast<std::uint64_t>(src_ld) * esize) | (static_cast<std::uint64_t>(cols) * esize) |
      reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst);
  const auto launch = [&](auto unit) {
    using V = decltype(unit);
    const std::int64_t per = static_cast<std::int64_t>(sizeof(V) / esize);
    const std::int64_t units = cols / per;
    gather_rows_kernel<V><<<blocks_for(count * units), kThreads, 0, stream>>>(
        static_cast<const V*>(src), src_ld / per, rows, static_cast<V*>(dst), count, units,
        count_device);
    return cudaGetLastError();
  };
  if (spread % 16 == 0) return launch(uint4{});
  if (spread % 8 == 0) return launch(uint2{});
  if (spread % 4 == 0) return launch(std::uint32_t{});
  return launch(std::uint16_t{});
}

cudaError_t launch_activation(const float* gate, const float* up, void* out, std::int64_t count,
                              const LayerConfig& config, DType dtype, cudaStream_t stream) {
  if (count < 0 || (is_gated(config.activation) && gate == nullptr)) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  const ActivationParams params = activation_params_of(config);
  const float* gate_in = is_gated(config.activation) ? gate : nullptr;
  return with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vector =
        aligned16(up) && (gate_in == nullptr || aligned16(gate_in)) && aligned_for<Vec4<T>>(out);
    if (vector) {
      activation_kernel<T, true><<<blocks_for(count / 4 + 1), kThreads, 0, stream>>>(
          gate_in, up, static_cast<T*>(out), count, params);
    } else {
      activation_kernel<T, false><<<blocks_for(count), kThreads, 0, stream>>>(
          gate_in, up, static_cast<T*>(out), count, params);
    }
  });
}

cudaError_t launch_combine(const float* slot_out, const std::int32_t* slot_rows,
                           const float* weights, void* routed, std::int64_t num_tokens,
                           std::int64_t top_k, std::int64_t cols, DType dtype,
                           cudaStream_t stream) {
  if (num_tokens < 0 || top_k < 1 || cols < 0) return cudaErrorInvalidValue;
  if (num_tokens == 0 || cols == 0) return cudaSuccess;
  return with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    // Rows of four-column multiples keep every row's float4s and Vec4s aligned.
    const bool vector = cols % 4 == 0 && aligned16(slot_out) && aligned_for<Vec4<T>>(routed);
    if (vector) {
      combine_kernel<T, true><<<blocks_for(num_tokens * cols / 4), kThreads, 0, stream>>>(
          slot_out, slot_rows, weights, static_cast<T*>(routed), num_tokens, top_k, cols);
    } else {
      combine_kernel<T, false><<<blocks_for(num_tokens * cols), kThreads, 0, stream>>>(
          slot_out, slot_rows, weights, static_cast<T*>(routed), num_tokens, top_k, cols);
    }
  });
}

cudaError_t prepare_layer_kernels(DType dtype) {
  cudaFuncAttributes attributes{};
  cudaError_t status = cudaFuncGetAttributes(&attributes, route_kernel);
  if (status != cudaSuccess) return status;
  status = cudaFuncSetAttribute(
      sort_slots_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(sizeof(int) * ((kSortWarps + 1) * kSortMaxExperts + 1)));
  if (status != cudaSuccess) return status;
  const cudaError_t typed = with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    for (const void* kernel : {reinterpret_cast<const void*>(to_float_kernel<T>),
                               reinterpret_cast<const void*>(activation_kernel<T, false>),
                               reinterpret_cast<const void*>(activation_kernel<T, true>),
                               reinterpret_cast<const void*>(combine_kernel<T, false>),
                               reinterpret_cast<const void*>(combine_kernel<T, true>)}) {
      if (status == cudaSuccess) status = cudaFuncGetAttributes(&attributes, kernel);
    }
  });
  for (const void* kernel : {reinterpret_cast<const void*>(gather_rows_kernel<uint4>),
                             reinterpret_cast<const void*>(gather_rows_kernel<uint2>),
                             reinterpret_cast<const void*>(gather_rows_kernel<std::uint32_t>),
                             reinterpret_cast<const void*>(gather_rows_kernel<std::uint16_t>)}) {
    if (status == cudaSuccess) status = cudaFuncGetAttributes(&attributes, kernel);
  }
  return status != cudaSuccess ? status : typed;
}

cudaError_t launch_sort_slots(const std::int32_t* ids, std::int64_t slot_count,
                              std::int64_t experts, std::int64_t top_k, std::int64_t row_align,
                              std::int32_t* first, std::int32_t* row_of_slot,
                              std::int32_t* token_of_row, cudaStream_t stream) {
  if (slot_count < 0 || experts < 1 || experts > kSortMaxExperts || top_k < 1 || row_align < 1 ||
      slot_count + (row_align - 1) * std::min(experts, slot_count) > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  const int shared_bytes = static_cast<int>(sizeof(int) * (kSortWarps * experts + experts + 1));
  const cudaError_t status = cudaFuncSetAttribute(
      sort_slots_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
  if (status != cudaSuccess) return status;
  sort_slots_kernel<<<1, kSortThreads, shared_bytes, stream>>>(
      ids, slot_count, static_cast<int>(experts), static_cast<int>(top_k),
      static_cast<int>(row_align), first, row_of_slot, token_of_row);
  return cudaGetLastError();
}

}  // namespace lmoe::cuda
