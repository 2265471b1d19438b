// An owning allocation of page-locked host memory, mapped into every device's address space and
// zeroed: records that kernels write and the host reads without a CUDA call, and host ends of
// asynchronous copies. Freed by its destructor, so that a constructor that throws after allocating
// one leaks nothing. Empty for zero bytes. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstring>
#include <memory>

#include "cuda/runtime/cuda_check.hpp"

namespace lmoe::cuda {

class MappedHostBuffer {
 public:
  MappedHostBuffer() = default;
  explicit MappedHostBuffer(std::size_t bytes) {
    if (bytes == 0) return;
    void* data = nullptr;
    // Portable: any thread's current device may hand it to its kernels (ranks on other GPUs).
    LMOE_CUDA_CHECK(cudaHostAlloc(&data, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
    data_.reset(data);
    std::memset(data, 0, bytes);
  }

  // With unified addressing (every device lmoe runs on) the host address is the device's too.
  void* data() const { return data_.get(); }

 private:
  struct FreeHost {
    void operator()(void* data) const { cudaFreeHost(data); }
  };
  std::unique_ptr<void, FreeHost> data_;
};

}  // namespace lmoe::cuda
