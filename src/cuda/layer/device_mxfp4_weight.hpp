// One MXFP4 weight of every routed expert on the device, as the checkpoint ships it (Mxfp4Tensor's
// blocks and scales, copied unchanged, ~3.8 times fewer bytes than bf16): the grouped GEMM reads
// it packed and dequantizes it in its main loop. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "lmoe/layer_weights.hpp"

namespace lmoe::cuda {

struct DeviceMxfp4Weight {
  DeviceMxfp4Weight() = default;
  explicit DeviceMxfp4Weight(const Mxfp4Tensor& tensor)
      : blocks(upload_bytes(tensor.blocks)), scales(upload_bytes(tensor.scales)) {
    if (!tensor.empty()) {
      blocks_per_expert = tensor.shape[1] * tensor.shape[2] / 2;
      scales_per_expert = tensor.shape[1] * tensor.shape[2] / 32;
    }
  }

  const std::uint8_t* blocks_data() const {
    return static_cast<const std::uint8_t*>(blocks.data());
  }
  const std::uint8_t* scales_data() const {
    return static_cast<const std::uint8_t*>(scales.data());
  }

  DeviceBuffer blocks;  // [E, R, C/2] e2m1 codes, two a byte (the low nibble the even column)
  DeviceBuffer scales;  // [E, R, C/32] E8M0
  // Bytes of an expert's blocks (a multiple of 16: C % 32 == 0) and of its scales.
  std::int64_t blocks_per_expert = 0;
  std::int64_t scales_per_expert = 0;

 private:
  static DeviceBuffer upload_bytes(const std::vector<std::uint8_t>& bytes) {
    DeviceBuffer buffer(bytes.size());
    if (!bytes.empty()) {
      LMOE_CUDA_CHECK(
          cudaMemcpy(buffer.data(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
    }
    return buffer;
  }
};

}  // namespace lmoe::cuda
