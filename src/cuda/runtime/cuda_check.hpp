// Every CUDA runtime and cuBLASLt return code becomes an lmoe::Error naming the call, the error and
// the place (host code only; kernels report through launch errors).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <source_location>
#include <string>

#include "lmoe/error.hpp"

namespace lmoe::cuda {

inline void check(cudaError_t status, const char* call,
                  std::source_location where = std::source_location::current()) {
  if (status != cudaSuccess) {
    throw Error(std::string(call) + " failed: " + cudaGetErrorName(status) + " (" +
                    cudaGetErrorString(status) + ")",
                where);
  }
}

inline void check(cublasStatus_t status, const char* call,
                  std::source_location where = std::source_location::current()) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(std::string(call) + " failed: " + cublasLtGetStatusName(status) + " (" +
                    cublasLtGetStatusString(status) + ")",
                where);
  }
}

// The stream a null StreamHandle means: this host thread's own default stream, so that ranks on
// threads never serialize on the legacy default stream.
inline cudaStream_t stream_or_default(void* stream) {
  return stream ? static_cast<cudaStream_t>(stream) : cudaStreamPerThread;
}

}  // namespace lmoe::cuda

#define LMOE_CUDA_CHECK(call) ::lmoe::cuda::check((call), #call)
