// What the CUDA layer's stages share: weight uploads (routed experts dense or MXFP4), sizes in
// bytes and the rows of the expert-grouped buffers. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/layer/device_mxfp4_weight.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "lmoe/layer_weights.hpp"
#include "lmoe/tensor.hpp"

namespace lmoe::cuda {

// Each expert's rows in the grouped buffers start at a multiple of this many rows (16-byte aligned
// operands for any row width: 8 rows of ≥ 2-byte elements span a multiple of 16 bytes).
inline constexpr std::int64_t kExpertRowAlign = 8;

inline DeviceBuffer upload(const HostTensor& tensor) {
  DeviceBuffer buffer(tensor.nbytes());
  if (tensor.nbytes()) {
    LMOE_CUDA_CHECK(
        cudaMemcpy(buffer.data(), tensor.data(), tensor.nbytes(), cudaMemcpyHostToDevice));
  }
  return buffer;
}

// One set of experts' weights on the device (routed or shared): gate (empty without one), up, down.
struct DeviceExpertWeights {
  DeviceExpertWeights(const HostTensor& gate_weight, const HostTensor& up_weight,
                      const HostTensor& down_weight)
      : gate(upload(gate_weight)), up(upload(up_weight)), down(upload(down_weight)) {}
  // The routed experts as `weights` hold them: dense, or MXFP4 (weights.experts_packed(): the
  // dense buffers are then empty and the packed ones hold blocks and scales, never dequantized
  // here; the grouped GEMM dequantizes them in its main loop).
  explicit DeviceExpertWeights(const LayerWeights& weights)
      : gate(upload(weights.expert_gate)),
        up(upload(weights.expert_up)),
        down(upload(weights.expert_down)),
        packed_gate(weights.expert_gate_mxfp4),
        packed_up(weights.expert_up_mxfp4),
        packed_down(weights.expert_down_mxfp4) {}
  bool packed() const { return packed_up.blocks.bytes() > 0; }

  DeviceBuffer gate, up, down;
  DeviceMxfp4Weight packed_gate, packed_up, packed_down;  // empty unless packed (gate: and gated)
};

inline cudaEvent_t make_event(bool timing) {
  cudaEvent_t event = nullptr;
  LMOE_CUDA_CHECK(
      cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming));
  return event;
}

inline void* offset(const DeviceBuffer& buffer, std::size_t byte_offset) {
  return buffer.at(byte_offset);
}

inline std::size_t floats(std::int64_t elements) {
  return static_cast<std::size_t>(elements) * sizeof(float);
}

// Rows of the expert-grouped buffers for `slot_count` slots of `experts` experts: each active
// expert's rows padded to a multiple of kExpertRowAlign.
inline std::int64_t grouped_rows(std::int64_t slot_count, std::int64_t experts) {
  return slot_count + (kExpertRowAlign - 1) * std::min(experts, slot_count);
}

}  // namespace lmoe::cuda
