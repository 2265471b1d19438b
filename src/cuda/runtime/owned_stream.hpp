// A non-blocking CUDA stream owned by one rank for the duration of a run (the tail's and the
// layer's runners). Its destructor waits for the stream's work before destroying it.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/runtime/cuda_check.hpp"

namespace lmoe::cuda {

class OwnedStream {
 public:
  OwnedStream() { LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~OwnedStream() {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace lmoe::cuda
