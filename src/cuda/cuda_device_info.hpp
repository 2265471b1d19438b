// What a GPU and its CUDA stack are, for benchmark records. Host code only.
#pragma once

#include <optional>
#include <string>

namespace lmoe::cuda {

struct DeviceInfo {
  int device = 0;
  int device_count = 0;
  std::string name;  // "NVIDIA H200"
  int compute_major = 0, compute_minor = 0;
  int driver_version = 0;   // cudaDriverGetVersion: 1000·major + 10·minor
  int runtime_version = 0;  // cudaRuntimeGetVersion
};

// Throws lmoe::Error when the device cannot be queried.
DeviceInfo device_info(int device = 0);

// "2.28.3" in builds with NCCL (LMOE_HAS_NCCL); nullopt otherwise.
std::optional<std::string> nccl_version();

}  // namespace lmoe::cuda
