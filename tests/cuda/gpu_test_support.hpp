// What every GPU test file needs: a clean skip where no GPU is visible, CUDA calls checked, and
// random inputs for the collectives.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda/cuda_tail_executor.hpp"
#include "lmoe/dtype.hpp"

// Skips the test (with the reason) where no CUDA GPU is visible, as on the CI machine.
#define SKIP_WITHOUT_GPU()                                             \
  do {                                                                 \
    if (lmoe::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU"; \
  } while (0)

inline void cuda_ok(cudaError_t status) { ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status); }

// `count` normal values in `dtype`, from `seed`: sums of them round differently in another order,
// so only the rank-order sum matches bit for bit.
inline std::vector<std::byte> random_values(std::size_t count, lmoe::DType dtype, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::byte> bytes(count * lmoe::dtype_size(dtype));
  for (std::size_t i = 0; i < count; ++i) lmoe::store_from_float(bytes.data(), i, dtype, normal(rng));
  return bytes;
}
