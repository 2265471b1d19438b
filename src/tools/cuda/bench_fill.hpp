// The benchmark's inputs generated on the device (the values of src/core/bench_values.hpp, which
// the host regenerates for the contract check). Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

// dst[i] = bench::value(seed, i) stored in dtype, for i < count; dst is device memory.
cudaError_t launch_fill_bench_values(void* dst, std::int64_t count, DType dtype, std::uint64_t seed,
                                     cudaStream_t stream);

}  // namespace lmoe::cuda
