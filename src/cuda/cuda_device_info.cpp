#include "cuda/cuda_device_info.hpp"

#include <cuda_runtime_api.h>

#include "cuda/cuda_check.hpp"

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
