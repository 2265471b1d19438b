// What every GPU test file needs: a clean skip where no GPU is visible, and CUDA calls checked.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "cuda/cuda_tail_executor.hpp"

// Skips the test (with the reason) where no CUDA GPU is visible, as on the CI machine.
#define SKIP_WITHOUT_GPU()                                             \
  do {                                                                 \
    if (lmoe::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU"; \
  } while (0)

inline void cuda_ok(cudaError_t status) {
  ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
}

// An environment variable set (or, with a null value, unset) for one scope, then restored.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* previous = std::getenv(name)) previous_ = previous;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (previous_) {
      setenv(name_, previous_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> previous_;
};
