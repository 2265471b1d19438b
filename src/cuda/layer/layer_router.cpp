#include "cuda/layer/layer_router.hpp"

#include <cstdint>

#include "core/router_weight_split.hpp"
#include "cuda/layer/layer_kernels.hpp"

namespace lmoe::cuda {

LayerRouter::LayerRouter(const LayerConfig& config, DType dtype, const LayerWeights& weights)
    : config_(config), dtype_(dtype), split_router_(dtype == DType::bf16) {
  // A bf16 layer's router GEMM runs on tensor cores over the weight split into three bf16 parts
  // (every product exact, sums in fp32: the router contract); others convert x to fp32.
  if (split_router_) {
    router_parts_ = upload(split_router_weight_bf16(weights.router_weight));
  } else {
    router_weight_ = upload(weights.router_weight);
  }
  if (config.router.correction_bias) router_bias_ = upload(weights.router_bias);
}

void LayerRouter::reserve(std::int64_t rows) {
  const std::int64_t d = config_.d_model;
  const std::int64_t experts = config_.router.num_experts, slot_rows = slots(rows);
  x32_ = split_router_ ? DeviceBuffer() : DeviceBuffer(floats(rows * d));
  router_x_ = split_router_ ? DeviceBuffer(bytes(rows * d)) : DeviceBuffer();
  logits_ = DeviceBuffer(floats(rows * experts * (split_router_ ? 3 : 1)));
  routing_device_ = DeviceBuffer(2 * floats(slot_rows));  // ids [T·k] int32, weights [T·k] fp32
  routing_host_ = MappedHostBuffer(2 * floats(slot_rows));
}

void LayerRouter::route(ConstMatrixView x, bool captured, CublasLtGemm& gemm, cudaStream_t stream) {
  const std::int64_t tokens = x.rows, d = config_.d_model, experts = config_.router.num_experts;
  auto* ids = static_cast<std::int32_t*>(routing_device_.data());
  auto* weights = reinterpret_cast<float*>(ids + slots(tokens));
  if (split_router_) {
    // [T, 3E] fp32: x times each bf16 part of the weight (exact products, fp32 sums); the route
    // kernel adds each expert's three. The GEMM's algorithm depends on its operands' alignment
    // (up to 256 bytes, CublasLtGemm), and every rank must route alike whatever the alignment of
    // its caller's x: an x less aligned than this executor's buffer is copied into it first.
    const void* router_x = x.data;
    if (reinterpret_cast<std::uintptr_t>(x.data) % 256 != 0) {
      LMOE_CUDA_CHECK(cudaMemcpyAsync(router_x_.data(), x.data, bytes(tokens * d),
                                      cudaMemcpyDeviceToDevice, stream));
      router_x = router_x_.data();
    }
    gemm.run(router_x, router_parts_.data(), d, logits_.data(), 3 * experts, tokens, 3 * experts, d,
             DType::bf16, DType::f32, stream);
  } else {
    // The router weight is fp32: x is converted exactly, and the GEMM accumulates in fp32.
    check(launch_to_float(x.data, static_cast<float*>(x32_.data()), tokens * d, dtype_, stream),
          "launch_to_float");
    gemm.run(x32_.data(), router_weight_.data(), d, logits_.data(), experts, tokens, experts, d,
             DType::f32, DType::f32, stream);
  }
  check(launch_route(static_cast<const float*>(logits_.data()),
                     static_cast<const float*>(router_bias_.data()), tokens, config_.router, ids,
                     weights, stream, split_router_ ? 3 : 1),
        "launch_route");
  // ids and weights are adjacent: one copy. routing_host_ is free: the host read the last one
  // (the host path at once; the device path's host_routing() waits for router_end_, and a
  // forward's reserve() or this copy comes after the previous forward's router). A captured
  // forward copies nothing: a graph's replays would overwrite it behind the host's back.
  if (!captured) {
    LMOE_CUDA_CHECK(cudaMemcpyAsync(routing_host_.data(), ids, 2 * floats(slots(tokens)),
                                    cudaMemcpyDeviceToHost, stream));
  }
}

}  // namespace lmoe::cuda
