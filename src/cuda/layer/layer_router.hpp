// The CUDA layer's router stage: fp32 logits by a GEMM (a bf16 layer's over the router weight
// split into three bf16 parts, others over x converted to fp32), then the route kernel's ids and
// weights [T, k] on the device and, for eager forwards, on the host. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/layer_executor.hpp"
#include "cuda/gemm/cublaslt_gemm.hpp"
#include "cuda/layer/layer_stage_support.hpp"
#include "cuda/runtime/mapped_host_buffer.hpp"

namespace lmoe::cuda {

class LayerRouter {
 public:
  LayerRouter(const LayerConfig& config, DType dtype, const LayerWeights& weights);

  // Workspaces for `rows` tokens (the caller has waited for the work that used the old ones).
  void reserve(std::int64_t rows);

  // ids and weights [T, k] on the device, then (eager forwards: not `captured`) in the host
  // buffer, by a copy on `stream`.
  void route(ConstMatrixView x, bool captured, CublasLtGemm& gemm, cudaStream_t stream);

  // ids [T·k] int32, then weights [T·k] fp32: on the device, and the host's copy.
  const std::int32_t* device_routing() const {
    return static_cast<const std::int32_t*>(routing_device_.data());
  }
  const std::int32_t* host_routing() const {
    return static_cast<const std::int32_t*>(routing_host_.data());
  }

 private:
  std::size_t bytes(std::int64_t elements) const {
    return static_cast<std::size_t>(elements) * dtype_size(dtype_);
  }
  std::int64_t slots(std::int64_t tokens) const { return tokens * config_.router.top_k; }

  LayerConfig config_;
  DType dtype_;
  bool split_router_;           // bf16 x: the router GEMM over router_parts_
  DeviceBuffer router_weight_;  // [E, d] fp32 (not split_router_)
  DeviceBuffer router_parts_;   // [3E, d] bf16 (split_router_): core/router_weight_split.hpp
  DeviceBuffer router_bias_;    // [E] fp32, or empty

  DeviceBuffer x32_;               // [T, d] fp32 (not split_router_)
  DeviceBuffer router_x_;          // [T, d] bf16 (split_router_): an x less than 256-byte aligned
  DeviceBuffer logits_;            // [T, E] fp32, [T, 3E] with split_router_
  DeviceBuffer routing_device_;    // ids [T·k] int32, then weights [T·k] fp32
  MappedHostBuffer routing_host_;  // the same, on the host (page-locked: copies are asynchronous)
};

}  // namespace lmoe::cuda
