// How a region of LL lines (cuda/fused_ll.cuh) starts. The call of epoch e writes the lines of
// parity e & 1 with the flag e, so parity 0 only ever holds even flags and parity 1 odd ones once
// written. Parity 0 starts with odd flags and parity 1 with 0 (even): a line no sender has written
// yet never carries the epoch its receiver waits for, not even once the epochs wrap to 0 (a call
// of epoch 0 reads parity 0). Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace lmoe::cuda {

// The byte parity 0's lines start filled with: every 32-bit word 0x01010101, an odd flag.
inline constexpr int kLlParity0StartByte = 0x01;

// Sets a region's two parities (parity 1 parity_bytes after parity 0) as lines start, before any
// call can read them: synchronous with the host, not ordered with any stream.
inline cudaError_t start_ll_lines(std::byte* parity0, std::int64_t parity_bytes) {
  if (parity_bytes == 0) return cudaSuccess;
  const auto bytes = static_cast<std::size_t>(parity_bytes);
  const cudaError_t status = cudaMemset(parity0, kLlParity0StartByte, bytes);
  if (status != cudaSuccess) return status;
  return cudaMemset(parity0 + parity_bytes, 0, bytes);
}

}  // namespace lmoe::cuda
