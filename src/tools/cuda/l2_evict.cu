#include <algorithm>
#include <cstdint>

#include "cuda/runtime/alignment.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "lmoe/error.hpp"
#include "tools/cuda/l2_evict.hpp"

namespace lmoe::cuda {

namespace {

constexpr int kThreads = 256;
constexpr std::size_t kMinBytes = std::size_t{64} << 20;

// Plain loads (the default evict-normal policy): a streaming or evict-first hint would let the
// buffer's lines replace each other instead of what the forward left in L2.
__global__ void read_buffer_kernel(const uint4* __restrict__ data, std::size_t count,
                                   unsigned int* __restrict__ sink) {
  unsigned int folded = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const uint4 v = data[i];
    folded ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  // Depends on every load, so none can be removed; never true for the zeroed buffer and about once
  // in 2^32 threads for real data (touched inputs), so the threads do not all store to one word.
  if (folded == 0x9e3779b9u) *sink = folded;
}

}  // namespace

L2Evictor::L2Evictor(cudaStream_t stream) {
  int device = 0, l2_bytes = 0, sms = 0, threads_per_sm = 0;
  LMOE_CUDA_CHECK(cudaGetDevice(&device));
  LMOE_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  LMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  LMOE_CUDA_CHECK(
      cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
  const std::size_t bytes = std::max(2 * static_cast<std::size_t>(l2_bytes), kMinBytes);
  buffer_ = DeviceBuffer(bytes);  // a multiple of 16: 64 MiB or twice an L2 of whole lines
  sink_ = DeviceBuffer(sizeof(unsigned int));
  // On `stream`, not the legacy default stream, which a non-blocking stream does not wait for.
  LMOE_CUDA_CHECK(cudaMemsetAsync(buffer_.data(), 0, buffer_.bytes(), stream));
  LMOE_CUDA_CHECK(cudaMemsetAsync(sink_.data(), 0, sink_.bytes(), stream));
  LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  blocks_ = std::max(1, sms) * std::max(1, threads_per_sm / kThreads);
}

void L2Evictor::evict(cudaStream_t stream) const { touch(buffer_.data(), buffer_.bytes(), stream); }

void L2Evictor::touch(const void* data, std::size_t bytes, cudaStream_t stream) const {
  LMOE_CHECK(aligned16(data), "L2Evictor::touch: the buffer must be 16-byte aligned");
  const std::size_t vectors = bytes / sizeof(uint4);
  if (vectors == 0) return;
  const int blocks = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(blocks_),
                                                            (vectors + kThreads - 1) / kThreads));
  read_buffer_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint4*>(data), vectors,
                                                      static_cast<unsigned int*>(sink_.data()));
  LMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace lmoe::cuda
