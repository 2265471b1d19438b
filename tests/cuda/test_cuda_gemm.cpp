// CublasLtGemm's plan cache: one plan per (shape, dtypes, alignments), reused by later calls, and
// results that equal the CPU's bit for bit on inputs whose products and sums are exact in any
// order. Every test skips where no GPU is visible.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/host_math.hpp"
#include "cuda/gemm/cublaslt_gemm.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/tail/cuda_tail_executor.hpp"
#include "lmoe/tensor.hpp"

namespace {

using lmoe::DType;
using lmoe::HostTensor;

// Small integers: every product and partial sum is an exact fp32 integer, so any summation order
// gives the same fp32 accumulator, and round() of it is the same everywhere.
HostTensor small_integers(DType dtype, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  HostTensor t(dtype, {rows, cols});
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> value(-3, 3);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, static_cast<float>(value(rng)));
  return t;
}

TEST(CudaGemm, CachesOnePlanPerShapeAndAlignmentAndStaysExact) {
  if (lmoe::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU";
  const std::int64_t m = 37, n = 96, k = 512;
  const std::pair<DType, DType> dtypes[] = {{DType::bf16, DType::bf16},
                                            {DType::bf16, DType::f32},
                                            {DType::f16, DType::f16},
                                            {DType::f32, DType::f32}};
  for (const auto& [dtype, out_dtype] : dtypes) {
    SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)) + " -> " +
                 std::string(lmoe::dtype_name(out_dtype)));
    const HostTensor a = small_integers(dtype, m, k, 1), w = small_integers(dtype, n, k, 2);
    const std::vector<float> w32 = lmoe::cpu::to_float(w.matrix());
    HostTensor expected(out_dtype, {m, n});
    lmoe::cpu::up_project(a.matrix(), w32.data(), n, expected.matrix(), false);

    lmoe::cuda::DeviceBuffer d_a(a.nbytes()), d_w(w.nbytes()), d_out(expected.nbytes() + 256);
    LMOE_CUDA_CHECK(cudaMemcpy(d_a.data(), a.data(), a.nbytes(), cudaMemcpyHostToDevice));
    LMOE_CUDA_CHECK(cudaMemcpy(d_w.data(), w.data(), w.nbytes(), cudaMemcpyHostToDevice));
    lmoe::cuda::CublasLtGemm gemm;
    // Three calls: the first builds a plan, the second reuses it, the third writes D 16 bytes off
    // its 256-byte alignment and needs a plan of its own.
    for (const auto& [d_offset, plans] :
         {std::pair<std::size_t, std::size_t>{0, 1}, {0, 1}, {16, 2}}) {
      SCOPED_TRACE("d offset " + std::to_string(d_offset));
      void* d = d_out.at(d_offset);
      LMOE_CUDA_CHECK(cudaMemset(d_out.data(), 0xff, d_out.bytes()));
      gemm.run(d_a.data(), d_w.data(), k, d, n, m, n, k, dtype, out_dtype, cudaStreamPerThread);
      LMOE_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
      EXPECT_EQ(gemm.cached_plans(), plans);
      HostTensor actual(out_dtype, {m, n});
      LMOE_CUDA_CHECK(cudaMemcpy(actual.data(), d, actual.nbytes(), cudaMemcpyDeviceToHost));
      EXPECT_EQ(std::memcmp(actual.data(), expected.data(), expected.nbytes()), 0);
    }
  }
}

}  // namespace
