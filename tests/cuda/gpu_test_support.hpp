// What every GPU test file needs: a clean skip where no GPU is visible, and CUDA calls checked.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "cuda/cuda_tail_executor.hpp"

// Skips the test (with the reason) where no CUDA GPU is visible, as on the CI machine.
#define SKIP_WITHOUT_GPU()                                             \
  do {                                                                 \
    if (lmoe::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU"; \
  } while (0)

inline void cuda_ok(cudaError_t status) { ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status); }
