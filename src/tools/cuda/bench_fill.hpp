// The benchmarks' inputs generated on the device (the values of src/tools/bench_values.hpp, which
// the host regenerates for the checks). Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

// dst[i] = bench::value(seed, i) stored in dtype, for i < count; dst is device memory.
cudaError_t launch_fill_bench_values(void* dst, std::int64_t count, DType dtype, std::uint64_t seed,
                                     cudaStream_t stream);

// dst[i] = bench::collective_value(seed, i) stored in dtype, for i < count (the collectives'
// benchmark: src/tools/collective_check.hpp); dst is device memory.
cudaError_t launch_fill_collective_values(void* dst, std::int64_t count, DType dtype,
                                          std::uint64_t seed, cudaStream_t stream);

}  // namespace lmoe::cuda
