// The CUDA layer's routed-experts stage, on one of two paths:
//
//   host:   counting sort of the slots by expert on the host → slot order to the device → gather
//           z rows by expert → per active expert: up (and gate) cuBLASLt GEMMs, fp32 out →
//           activation → per active expert: down GEMM
//   device: the same sort by a kernel → one grouped GEMM for every expert's up (and gate) rows,
//           gathering z's rows and applying the activation → one grouped GEMM for the down rows
//           (no host read: capturable)
//
// then the weighted combine into routed [T, l]. MXFP4 experts kept packed (LayerWeights::
// experts_packed()) stay packed on the device and take the device path, whose grouped GEMMs
// dequantize them in their main loop (the bits of the dequantized experts); the host path's
// cuBLASLt GEMMs read dense weights only and refuse them. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "core/layer_executor.hpp"
#include "cuda/gemm/cublaslt_gemm.hpp"
#include "cuda/layer/layer_router.hpp"
#include "cuda/layer/layer_stage_support.hpp"
#include "cuda/runtime/mapped_host_buffer.hpp"

namespace lmoe::cuda {

class RoutedExperts {
 public:
  // `inter`: this rank's slice of each routed expert's intermediate dim.
  RoutedExperts(const LayerConfig& config, DType dtype, std::int64_t inter,
                const LayerWeights& weights);
  ~RoutedExperts();
  RoutedExperts(const RoutedExperts&) = delete;
  RoutedExperts& operator=(const RoutedExperts&) = delete;

  // Whether the experts are held as MXFP4 (they then take the device path only).
  bool packed() const { return experts_.packed(); }
  // Waits until the last upload of the slot order has left the host buffer.
  void wait_for_order_upload() const;
  // Workspaces for `rows` tokens (the caller has waited for the work that used the old ones).
  void reserve(std::int64_t rows);

  // routed [T, l] = round(Σ_j w_tj · o_tj), o_tj = round(act(z_t·G_eᵀ, z_t·U_eᵀ)) · D_eᵀ in fp32.
  // The host path: reads the router's host routing once router_end has passed, into `routing`.
  // Dense experts only (packed(): lmoe::Error).
  void run_on_host(std::int64_t tokens, const LayerRouter& router, cudaEvent_t router_end,
                   Routing& routing, const DeviceBuffer& latent, MatrixView routed,
                   CublasLtGemm& gemm, cudaStream_t stream);
  // The device path: the same rows, sums and roundings, sized on the device.
  void run_on_device(std::int64_t tokens, const LayerRouter& router, const DeviceBuffer& latent,
                     MatrixView routed, cudaStream_t stream);

 private:
  std::size_t bytes(std::int64_t elements) const {
    return static_cast<std::size_t>(elements) * dtype_size(dtype_);
  }
  std::int64_t slots(std::int64_t tokens) const { return tokens * config_.router.top_k; }
  std::int64_t sort_slots(std::int64_t tokens, const LayerRouter& router, cudaEvent_t router_end,
                          Routing& routing, cudaStream_t stream);

  LayerConfig config_;
  DType dtype_;
  std::int64_t inter_;           // this rank's slice of each routed expert's intermediate dim
  DeviceExpertWeights experts_;  // gate [E, I_r, l] or empty (relu2), up [E, I_r, l],
                                 // down [E, l, I_r]; dense or MXFP4
  cudaEvent_t order_copied_ = nullptr;  // order_host_ may be rewritten

  DeviceBuffer order_device_;    // row of each slot [T·k] int32, then token of each grouped row
  MappedHostBuffer order_host_;  // the same, on the host (page-locked: copies are asynchronous)
  // Grouped rows (G = grouped_rows(T·k)): each expert's rows together, padded.
  DeviceBuffer gathered_;            // [G, l] z rows grouped by expert
  DeviceBuffer expert_up_acc_;       // [G, I_r] fp32
  DeviceBuffer expert_gate_acc_;     // [G, I_r] fp32 (gated)
  DeviceBuffer hidden_;              // [G, I_r] storage dtype
  DeviceBuffer slot_out_;            // [G, l] fp32
  std::vector<std::int64_t> first_;  // [E + 1] first gathered row of each expert (host path)
  DeviceBuffer sorted_first_;        // [E + 1] int32, the same on the device (device path)
};

}  // namespace lmoe::cuda
