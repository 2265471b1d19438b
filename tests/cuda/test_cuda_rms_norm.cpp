// The CUDA RMSNorm against cpu::rms_norm, bit for bit: both follow the contract's canonical order
// (docs/numerics.md), so every output must carry the same bits, on fresh random rows of every dtype
// and shape the kernels dispatch on (rows per block, chunks per lane, the re-reading and scalar
// paths), and on signed zeros, subnormals, infinities and NaN. The one freedom: a NaN output's sign
// and payload. Every test that launches a kernel skips where no GPU is visible.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/fast_random.hpp"
#include "core/host_math.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/tail/cuda_tail_executor.hpp"
#include "cuda/tail/launchers.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/tensor.hpp"

namespace {

using lmoe::DType;
using lmoe::HostTensor;

constexpr DType kDtypes[] = {DType::bf16, DType::f16, DType::f32};

// Rows of random magnitude (2^-8 … 2^8, so that squares span many binades and the low bits of the
// sum matter), values of both signs; gamma near 1 and of both signs.
HostTensor random_rows(DType dtype, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  HostTensor x(dtype, {rows, cols});
  lmoe::SplitMix64 random{seed};
  for (std::int64_t t = 0; t < rows; ++t) {
    const float scale = std::ldexp(1.0f, static_cast<int>(random.next() % 17) - 8);
    for (std::int64_t j = 0; j < cols; ++j)
      x.set(t * cols + j, scale * (random.uniform() + random.uniform() - 1.0f));
  }
  return x;
}

std::vector<float> random_gamma(std::int64_t cols, std::uint64_t seed) {
  std::vector<float> gamma(static_cast<std::size_t>(cols));
  lmoe::SplitMix64 random{seed};
  for (float& g : gamma) g = (random.next() % 8 == 0 ? -1.0f : 1.0f) * (0.5f + random.uniform());
  return gamma;
}

// launch_rms_norm on device copies. `shift` elements of padding before x and out move them off
// 16-byte alignment (the scalar path) when it is not a multiple of the vector width.
HostTensor run_cuda_norm(const HostTensor& x, const std::vector<float>& gamma, float eps,
                         std::int64_t shift = 0) {
  const std::int64_t rows = x.shape()[0], cols = x.shape()[1];
  const std::size_t esize = lmoe::dtype_size(x.dtype());
  const std::size_t pad = static_cast<std::size_t>(shift) * esize;
  lmoe::cuda::DeviceBuffer d_x(pad + x.nbytes()), d_out(pad + x.nbytes()),
      d_gamma(gamma.size() * sizeof(float));
  LMOE_CUDA_CHECK(cudaMemcpy(d_x.at(pad), x.data(), x.nbytes(), cudaMemcpyHostToDevice));
  LMOE_CUDA_CHECK(
      cudaMemcpy(d_gamma.data(), gamma.data(), d_gamma.bytes(), cudaMemcpyHostToDevice));
  cudaStream_t stream = nullptr;
  LMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Poisoned: an element the kernel does not write reads as NaN with every bit set.
  LMOE_CUDA_CHECK(cudaMemsetAsync(d_out.data(), 0xff, d_out.bytes(), stream));
  LMOE_CUDA_CHECK(lmoe::cuda::launch_rms_norm(d_x.at(pad),
                                              static_cast<const float*>(d_gamma.data()),
                                              d_out.at(pad), rows, cols, eps, x.dtype(), stream));
  LMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  LMOE_CUDA_CHECK(cudaStreamDestroy(stream));
  HostTensor out(x.dtype(), x.shape());
  LMOE_CUDA_CHECK(cudaMemcpy(out.data(), d_out.at(pad), out.nbytes(), cudaMemcpyDeviceToHost));
  return out;
}

HostTensor run_cpu_norm(const HostTensor& x, const std::vector<float>& gamma, float eps) {
  HostTensor out(x.dtype(), x.shape());
  out.fill_bytes(std::byte{0xff});
  lmoe::cpu::rms_norm(x.matrix(), gamma, eps, out.matrix());
  return out;
}

std::uint32_t element_bits(const HostTensor& t, std::int64_t i) {
  const std::size_t esize = lmoe::dtype_size(t.dtype());
  std::uint32_t bits = 0;
  std::memcpy(&bits, t.data() + static_cast<std::size_t>(i) * esize, esize);  // little-endian
  return bits;
}

// Elements whose bits differ, a NaN matching any NaN (its sign and payload are not specified:
// x86 makes 0 · inf a negative NaN, CUDA a positive one). Reports the first few.
std::int64_t count_mismatches(const HostTensor& expected, const HostTensor& actual) {
  const std::int64_t cols = expected.shape().back();
  std::int64_t mismatches = 0;
  for (std::int64_t i = 0; i < expected.numel(); ++i) {
    const float e = expected.get(i), a = actual.get(i);
    const bool same =
        std::isnan(e) ? std::isnan(a) : element_bits(expected, i) == element_bits(actual, i);
    if (!same && mismatches++ < 5) {
      ADD_FAILURE() << "row " << i / cols << " col " << i % cols << ": cpu " << e << " (0x"
                    << std::hex << element_bits(expected, i) << ") cuda " << a << " (0x"
                    << element_bits(actual, i) << std::dec << ")";
    }
  }
  return mismatches;
}

std::string case_name(DType dtype, std::int64_t rows, std::int64_t cols) {
  return std::string(lmoe::dtype_name(dtype)) + " T=" + std::to_string(rows) +
         " l=" + std::to_string(cols);
}

// ---- random rows --------------------------------------------------------------------------------

class CudaRmsNorm : public ::testing::TestWithParam<DType> {};

// The model shapes (Nemotron 3's l = 1024 … K3's 3584 and wider): 1, 2 and 4 rows per block, 1, 2
// and 4 chunks per lane; T = 1 (decode), odd T, and a prefill batch.
TEST_P(CudaRmsNorm, ModelShapesMatchTheCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  const DType dtype = GetParam();
  for (std::int64_t cols : {192, 1024, 2048, 3584, 4096, 8192}) {
    for (std::int64_t rows : {1, 7, 129, 8192}) {
      SCOPED_TRACE(case_name(dtype, rows, cols));
      const std::uint64_t seed =
          static_cast<std::uint64_t>(rows * 100003 + cols) * 3 + static_cast<std::uint64_t>(dtype);
      const HostTensor x = random_rows(dtype, rows, cols, seed);
      const std::vector<float> gamma = random_gamma(cols, seed + 1);
      EXPECT_EQ(count_mismatches(run_cpu_norm(x, gamma, 1e-5f), run_cuda_norm(x, gamma, 1e-5f)), 0);
    }
  }
}

// Every other path: l = 1, l < 8, l not a multiple of 8 (scalar); 2 and 4 warps per row whose last
// warp is partly empty (l = 264, 520); a lane with one chunk more than the others (l = 2056); 8
// chunks per lane (l = 16384); rows too long for registers (re-read); unaligned x and out (scalar).
TEST_P(CudaRmsNorm, OtherShapesAndAlignmentsMatchTheCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  const DType dtype = GetParam();
  struct Shape {
    std::int64_t cols, shift;
  };
  for (const Shape shape : {Shape{1, 0}, Shape{5, 0}, Shape{8, 0}, Shape{13, 0}, Shape{264, 0},
                            Shape{520, 0}, Shape{2051, 0}, Shape{2056, 0}, Shape{16384, 0},
                            Shape{16392, 0}, Shape{20000, 0}, Shape{3584, 1}, Shape{192, 3}}) {
    for (std::int64_t rows : {1, 7, 129}) {
      SCOPED_TRACE(case_name(dtype, rows, shape.cols) + " shift=" + std::to_string(shape.shift));
      const std::uint64_t seed =
          static_cast<std::uint64_t>(rows * 7 + shape.cols) * 5 + static_cast<std::uint64_t>(dtype);
      const HostTensor x = random_rows(dtype, rows, shape.cols, seed);
      const std::vector<float> gamma = random_gamma(shape.cols, seed + 1);
      EXPECT_EQ(count_mismatches(run_cpu_norm(x, gamma, 1e-5f),
                                 run_cuda_norm(x, gamma, 1e-5f, shape.shift)),
                0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, CudaRmsNorm, ::testing::ValuesIn(kDtypes),
                         [](const auto& info) {
                           return std::string(lmoe::dtype_name(info.param));
                         });

// ---- special values -----------------------------------------------------------------------------

// Rows of: ±0 only; ±0 among subnormals and normals; subnormals only; a +inf; a NaN; values whose
// squares overflow fp32 (not representable in f16: there, large normals). With eps = 1e-5 and with
// eps = 0, where a row whose squares are all 0 gets rstd = +inf (0 · inf = NaN, subnormal · inf =
// ±inf).
HostTensor special_rows(DType dtype, std::int64_t cols) {
  const float tiny = dtype == DType::f16 ? 0x1p-24f : 0x1p-133f;  // a subnormal of the dtype
  const float huge = dtype == DType::f16 ? 60000.0f : 0x1p100f;
  HostTensor x(dtype, {6, cols});
  for (std::int64_t j = 0; j < cols; ++j) {
    const float sign = j % 2 ? -1.0f : 1.0f;
    const float mixed[] = {-0.0f, 0.0f, tiny, -3 * tiny, 1.5f, -0.75f, 0x1p-100f};
    x.set(0 * cols + j, sign * 0.0f);
    x.set(1 * cols + j, mixed[j % 7]);
    x.set(2 * cols + j, j % 3 == 0 ? -0.0f : sign * static_cast<float>(j % 5 + 1) * tiny);
    x.set(3 * cols + j, j == cols / 2 ? INFINITY : sign * 0.5f);
    x.set(4 * cols + j, j == cols - 1 ? NAN : sign * 2.0f);
    x.set(5 * cols + j, j % 4 == 1 ? sign * huge : sign * 3.0f);
  }
  return x;
}

TEST(CudaRmsNormSpecialValues, SignedZerosSubnormalsInfAndNanMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : kDtypes) {
    for (std::int64_t cols : {13, 192, 1024, 3584, 20000}) {
      for (float eps : {1e-5f, 0.0f}) {
        SCOPED_TRACE(case_name(dtype, 6, cols) + " eps=" + std::to_string(eps));
        const HostTensor x = special_rows(dtype, cols);
        const std::vector<float> gamma = random_gamma(cols, static_cast<std::uint64_t>(cols));
        const HostTensor expected = run_cpu_norm(x, gamma, eps);
        EXPECT_EQ(count_mismatches(expected, run_cuda_norm(x, gamma, eps)), 0);

        // The rows do produce what they are for: −0, NaN, and with eps = 0 an infinite rstd.
        std::int64_t negative_zeros = 0, nans = 0, infinities = 0;
        for (std::int64_t i = 0; i < expected.numel(); ++i) {
          const float v = expected.get(i);
          negative_zeros += v == 0.0f && std::signbit(v);
          nans += std::isnan(v);
          infinities += std::isinf(v);
        }
        EXPECT_GT(negative_zeros, 0);
        EXPECT_GE(nans, cols + 1);  // the NaN row, and the +inf element of the inf row
        if (eps == 0.0f) {
          EXPECT_GE(nans, 2 * cols);  // and the zero row
        }
        // Without eps, an all-subnormal bf16/f32 row squares to 0: its nonzero elements become
        // ±inf.
        if (eps == 0.0f && dtype != DType::f16) {
          EXPECT_GT(infinities, 0);
        }
      }
    }
  }
}

// ---- the launcher's arguments -------------------------------------------------------------------

TEST(CudaRmsNormLauncher, RejectsEmptyRowsAndNegativeCountsAndSkipsZeroRows) {
  // No kernel is launched for any of these, so no GPU is needed.
  const float gamma = 1.0f;
  float x = 1.0f, out = 0.0f;
  EXPECT_EQ(lmoe::cuda::launch_rms_norm(&x, &gamma, &out, 1, 0, 1e-5f, DType::f32, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(lmoe::cuda::launch_rms_norm(&x, &gamma, &out, -1, 1, 1e-5f, DType::f32, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(lmoe::cuda::launch_rms_norm(&x, &gamma, &out, 0, 1, 1e-5f, DType::f32, nullptr),
            cudaSuccess);
  EXPECT_EQ(out, 0.0f);
  // A row count on the device is read by the register kernels only: a row too short for them
  // (cols % 8 != 0) is refused before any launch.
  const std::int32_t rows_device = 1;
  EXPECT_EQ(
      lmoe::cuda::launch_rms_norm(&x, &gamma, &out, 1, 1, 1e-5f, DType::f32, nullptr, &rows_device),
      cudaErrorInvalidValue);
}

}  // namespace
