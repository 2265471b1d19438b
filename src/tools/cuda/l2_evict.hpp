// Evicts the current device's L2 between two timed forwards (`lmoe bench --cold-l2`): back to back,
// a tail's weights would stay in L2 from one replay to the next (a 6.4 MB stripe wholly, part of
// K3's 51 MB w_up on a 50 MB L2), which a model, running other layers between two calls of a tail,
// never sees. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda/runtime/device_buffer.hpp"

namespace lmoe::cuda {

class L2Evictor {
 public:
  // On the current device: a buffer of max(2 x its L2, 64 MiB), zeroed on `stream`, which this
  // waits for (the zeros must be there before any evict, on whatever stream).
  explicit L2Evictor(cudaStream_t stream);

  // Enqueues a read of the whole buffer on `stream`. A read, not a write: dirty lines would be
  // written back while the next (timed) forward runs and add to its memory traffic.
  void evict(cudaStream_t stream) const;

  // Enqueues a read of [data, data + bytes) on `stream` (whole 16-byte vectors; data 16-byte
  // aligned): after evict(), the forward's inputs are back in L2, as the kernels that produced them
  // in a model would have left them.
  void touch(const void* data, std::size_t bytes, cudaStream_t stream) const;

  std::size_t bytes() const { return buffer_.bytes(); }

 private:
  DeviceBuffer buffer_;  // all zero, read 16 bytes at a time
  DeviceBuffer sink_;    // one word, written only on a data-dependent condition that keeps the
                         // loads (its value means nothing)
  int blocks_ = 0;       // enough to fill every SM
};

}  // namespace lmoe::cuda
