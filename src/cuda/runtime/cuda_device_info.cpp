#include "cuda/runtime/cuda_device_info.hpp"

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstddef>

#include "cuda/runtime/cuda_check.hpp"

#ifdef LMOE_HAS_NCCL
#include <nccl.h>
#endif

namespace lmoe::cuda {

DeviceInfo device_info(int device) {
  DeviceInfo info;
  info.device = device;
  LMOE_CUDA_CHECK(cudaGetDeviceCount(&info.device_count));
  cudaDeviceProp properties{};
  LMOE_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
  info.name = properties.name;
  info.compute_major = properties.major;
  info.compute_minor = properties.minor;
  LMOE_CUDA_CHECK(cudaDriverGetVersion(&info.driver_version));
  LMOE_CUDA_CHECK(cudaRuntimeGetVersion(&info.runtime_version));
  return info;
}

int current_compute_capability() {
  // One slot per device ordinal (0: not asked yet); a race only asks twice for the same value.
  static std::array<std::atomic<int>, 64> cache{};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) {
    (void)cudaGetLastError();
    return 0;
  }
  if (static_cast<std::size_t>(device) < cache.size()) {
    if (const int known = cache[device].load(std::memory_order_relaxed); known != 0) return known;
  }
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  const int capability = 10 * major + minor;
  if (static_cast<std::size_t>(device) < cache.size())
    cache[device].store(capability, std::memory_order_relaxed);
  return capability;
}

std::optional<std::string> nccl_version() {
#ifdef LMOE_HAS_NCCL
  int code = 0;
  if (ncclGetVersion(&code) != ncclSuccess) return std::nullopt;
  // NCCL >= 2.9 encodes major·10000 + minor·100 + patch.
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." +
         std::to_string(code % 100);
#else
  return std::nullopt;
#endif
}

}  // namespace lmoe::cuda
