// What the CUDA layer's stages share: weight uploads, sizes in bytes and the rows of the
// expert-grouped buffers. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

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
  // The routed experts in `dtype`. Packed MXFP4 experts are dequantized here, one weight at a
  // time: the GEMMs read dense weights (a packed grouped GEMM is not written yet).
  DeviceExpertWeights(const LayerWeights& weights, DType dtype)
      : gate(upload_dense(weights, &LayerWeights::expert_gate, dtype)),
        up(upload_dense(weights, &LayerWeights::expert_up, dtype)),
        down(upload_dense(weights, &LayerWeights::expert_down, dtype)) {}
  DeviceBuffer gate, up, down;

 private:
  static DeviceBuffer upload_dense(const LayerWeights& weights, HostTensor LayerWeights::*member,
                                   DType dtype) {
    HostTensor scratch;
    return upload(dense_expert_weight(weights, member, dtype, scratch));
  }
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
