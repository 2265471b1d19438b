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

// The current device's compute capability as 10·major + minor (90 for an H200), cached per device
// (cheap enough to ask at every launch, and allowed while a stream captures a graph); 0 when no
// device answers (no GPU), with the CUDA error cleared.
int current_compute_capability();

// "2.28.3" in builds with NCCL (LMOE_HAS_NCCL); nullopt otherwise.
std::optional<std::string> nccl_version();

}  // namespace lmoe::cuda
