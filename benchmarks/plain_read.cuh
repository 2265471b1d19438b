// The probes' baseline: a plain grid-stride read of `vectors` 16-byte vectors (streaming loads,
// folded into one word that is never stored for real inputs, so the loads stay). Device code;
// benchmarks only, each program including it once (a kernel cannot be inline).
#pragma once

#include <cstdint>

namespace lmoe::bench {

__global__ void plain_read_kernel(const uint4* w, std::int64_t vectors, unsigned* sink) {
  unsigned acc = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < vectors; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(w + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

}  // namespace lmoe::bench
