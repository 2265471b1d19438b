// The elementwise kernels of the layer and the column tier, each on its two paths (four columns per
// thread where the pointers and widths allow it, one element per thread where they do not): the
// weighted combine and the stripe accumulate against the CPU's loops bit for bit, the activation's
// four-wide path against its one-wide path. Outputs are poisoned first; sizes leave a remainder
// past the last whole vector. Every test skips where no GPU is visible.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/layer/layer_kernels.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/tail/launchers.hpp"
#include "gpu_test_support.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/dtype.hpp"

namespace {

using lmoe::DType;
using lmoe::cuda::DeviceBuffer;

constexpr std::uint8_t kPoisonByte = 0x7f;

template <typename T>
DeviceBuffer upload(const std::vector<T>& values, std::size_t extra_bytes = 0) {
  DeviceBuffer buffer(values.size() * sizeof(T) + extra_bytes);
  EXPECT_EQ(cudaMemset(buffer.data(), kPoisonByte, buffer.bytes()), cudaSuccess);
  EXPECT_EQ(
      cudaMemcpy(buffer.data(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice),
      cudaSuccess);
  return buffer;
}

std::vector<std::uint8_t> download(const void* device, std::size_t bytes) {
  std::vector<std::uint8_t> host(bytes);
  EXPECT_EQ(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

std::vector<float> normal_floats(std::size_t count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

const char* byte_offset(const void* p, std::size_t bytes) {
  return static_cast<const char*>(p) + bytes;
}

// ---- the weighted combine ----------------------------------------------------------------------

// The CPU executor's loop: products and sums rounded one by one in slot order, rounded once to
// the storage dtype.
std::vector<std::uint8_t> host_combine(const std::vector<float>& slot_out,
                                       const std::vector<std::int32_t>& slot_rows,
                                       const std::vector<float>& weights, std::int64_t tokens,
                                       std::int64_t top_k, std::int64_t cols, DType dtype) {
  std::vector<std::uint8_t> out(static_cast<std::size_t>(tokens * cols) * lmoe::dtype_size(dtype));
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t c = 0; c < cols; ++c) {
      float sum = 0.0f;
      for (std::int64_t j = 0; j < top_k; ++j) {
        const std::size_t slot = static_cast<std::size_t>(t * top_k + j);
        const float product =
            weights[slot] * slot_out[static_cast<std::size_t>(slot_rows[slot] * cols + c)];
        sum = j == 0 ? product : sum + product;
      }
      lmoe::store_from_float(out.data(), static_cast<std::size_t>(t * cols + c), dtype, sum);
    }
  }
  return out;
}

// cols 64 (four-wide), 62 (one-wide: rows not multiples of four), and 64 with the output one
// element off its alignment (one-wide); top-k 1, 3, 4, 5 and 16 (batches of four slots, whole and
// partial); −0 products kept (a weight of −0 on slot 0).
TEST(Combine, BothPathsGiveTheCpuLoopsBits) {
  SKIP_WITHOUT_GPU();
  const std::int64_t tokens = 37;
  for (const DType dtype : {DType::bf16, DType::f32}) {
    for (const std::int64_t top_k : {1, 3, 4, 5, 16}) {
      for (const auto& [cols, misalign] :
           std::vector<std::pair<std::int64_t, int>>{{64, 0}, {62, 0}, {64, 1}}) {
        SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)) + " top_k " + std::to_string(top_k) +
                     " cols " + std::to_string(cols) + " misalign " + std::to_string(misalign));
        const std::int64_t slots = tokens * top_k;
        const std::uint64_t seed = static_cast<std::uint64_t>(top_k * 1000 + cols + misalign);
        const std::vector<float> slot_out =
            normal_floats(static_cast<std::size_t>(slots * cols), seed);
        std::vector<float> weights = normal_floats(static_cast<std::size_t>(slots), seed + 1);
        weights[0] = -0.0f;
        std::vector<std::int32_t> slot_rows(static_cast<std::size_t>(slots));
        std::iota(slot_rows.begin(), slot_rows.end(), 0);
        std::shuffle(slot_rows.begin(), slot_rows.end(), std::mt19937(static_cast<unsigned>(seed)));

        const std::size_t esize = lmoe::dtype_size(dtype);
        const std::size_t out_bytes = static_cast<std::size_t>(tokens * cols) * esize;
        const DeviceBuffer d_slot_out = upload(slot_out), d_rows = upload(slot_rows),
                           d_weights = upload(weights);
        DeviceBuffer d_out(out_bytes + 16);
        ASSERT_EQ(cudaMemset(d_out.data(), kPoisonByte, d_out.bytes()), cudaSuccess);
        void* out = const_cast<char*>(byte_offset(d_out.data(), misalign * esize));
        ASSERT_EQ(lmoe::cuda::launch_combine(static_cast<const float*>(d_slot_out.data()),
                                             static_cast<const std::int32_t*>(d_rows.data()),
                                             static_cast<const float*>(d_weights.data()), out,
                                             tokens, top_k, cols, dtype, nullptr),
                  cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<std::uint8_t> got = download(d_out.data(), d_out.bytes());
        const std::vector<std::uint8_t> want =
            host_combine(slot_out, slot_rows, weights, tokens, top_k, cols, dtype);
        ASSERT_EQ(std::memcmp(got.data() + misalign * esize, want.data(), out_bytes), 0);
        // Nothing written before or after the output.
        for (std::size_t b = 0; b < misalign * esize; ++b) ASSERT_EQ(got[b], kPoisonByte);
        for (std::size_t b = misalign * esize + out_bytes; b < got.size(); ++b) {
          ASSERT_EQ(got[b], kPoisonByte) << "byte " << b;
        }
      }
    }
  }
}

// ---- the column tier's stripe accumulate --------------------------------------------------------

// A stripe of cols columns at column `offset` of a [rows, ld] matrix, accumulated from a
// contiguous fp32 [rows, cols]: four-wide (64 of 72, offset 8), one-wide (62 of 72; 64 of 70;
// offset 1), against the CPU's round(acc + C); the columns outside the stripe untouched.
TEST(AccumulateStripe, BothPathsGiveTheCpusBits) {
  SKIP_WITHOUT_GPU();
  const std::int64_t rows = 33;
  struct Shape {
    std::int64_t cols, ld, offset;
  };
  for (const DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    for (const Shape shape :
         {Shape{64, 72, 8}, Shape{62, 72, 8}, Shape{64, 70, 4}, Shape{64, 72, 1}}) {
      SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)) + " cols " + std::to_string(shape.cols) +
                   " ld " + std::to_string(shape.ld) + " offset " + std::to_string(shape.offset));
      const std::size_t esize = lmoe::dtype_size(dtype);
      const std::vector<float> acc =
          normal_floats(static_cast<std::size_t>(rows * shape.cols), shape.cols + shape.ld);
      const std::vector<float> c_values =
          normal_floats(static_cast<std::size_t>(rows * shape.ld), shape.offset + 7);
      std::vector<std::uint8_t> c(static_cast<std::size_t>(rows * shape.ld) * esize);
      for (std::size_t i = 0; i < c_values.size(); ++i) {
        lmoe::store_from_float(c.data(), i, dtype, c_values[i]);
      }
      std::vector<std::uint8_t> want = c;
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t col = 0; col < shape.cols; ++col) {
          const std::size_t at = static_cast<std::size_t>(r * shape.ld + shape.offset + col);
          const float sum = acc[static_cast<std::size_t>(r * shape.cols + col)] +
                            lmoe::load_as_float(c.data(), at, dtype);
          lmoe::store_from_float(want.data(), at, dtype, sum);
        }
      }
      const DeviceBuffer d_acc = upload(acc), d_c = upload(c);
      void* stripe = const_cast<char*>(byte_offset(d_c.data(), shape.offset * esize));
      ASSERT_EQ(lmoe::cuda::launch_accumulate_stripe(stripe, shape.ld,
                                                     static_cast<const float*>(d_acc.data()), rows,
                                                     shape.cols, dtype, nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(download(d_c.data(), c.size()), want);
    }
  }
}

// ---- the experts' activation --------------------------------------------------------------------

// The four-wide path (gate, up and out aligned) gives the one-wide path's bits (the same inputs one
// element off their alignment), for every activation, with a remainder past the last four.
TEST(Activation, FourWideGivesOneWidesBits) {
  SKIP_WITHOUT_GPU();
  const std::int64_t count = 4099;
  for (const DType dtype : {DType::bf16, DType::f32}) {
    for (const auto activation :
         {lmoe::ExpertActivation::silu_glu, lmoe::ExpertActivation::situ_glu,
          lmoe::ExpertActivation::relu2}) {
      SCOPED_TRACE(std::string(lmoe::dtype_name(dtype)) + " " +
                   std::string(lmoe::activation_name(activation)));
      lmoe::LayerConfig config;
      config.activation = activation;
      config.activation_beta = 4.0f;
      config.activation_linear_beta = 25.0f;
      std::vector<float> gate = normal_floats(static_cast<std::size_t>(count + 1), 11);
      std::vector<float> up = normal_floats(static_cast<std::size_t>(count + 1), 12);
      for (float& v : up) v *= 30.0f;  // through tanh(u / β_lin)'s curve, not only its linear part
      const DeviceBuffer d_gate = upload(gate), d_up = upload(up);
      const std::size_t esize = lmoe::dtype_size(dtype), out_bytes = count * esize;
      DeviceBuffer aligned(out_bytes), shifted(out_bytes + esize);
      for (const DeviceBuffer* b : {&aligned, &shifted}) {
        ASSERT_EQ(cudaMemset(b->data(), kPoisonByte, b->bytes()), cudaSuccess);
      }
      const auto* g = static_cast<const float*>(d_gate.data());
      const auto* u = static_cast<const float*>(d_up.data());
      // Four-wide on elements 1 … count of the inputs (copied to aligned buffers), one-wide on the
      // same elements read one float past the buffers' (16-byte aligned) starts.
      const std::vector<float> gate_tail(gate.begin() + 1, gate.end()),
          up_tail(up.begin() + 1, up.end());
      const DeviceBuffer d_gate_tail = upload(gate_tail), d_up_tail = upload(up_tail);
      ASSERT_EQ(lmoe::cuda::launch_activation(static_cast<const float*>(d_gate_tail.data()),
                                              static_cast<const float*>(d_up_tail.data()),
                                              aligned.data(), count, config, dtype, nullptr),
                cudaSuccess);
      ASSERT_EQ(lmoe::cuda::launch_activation(g + 1, u + 1,
                                              const_cast<char*>(byte_offset(shifted.data(), esize)),
                                              count, config, dtype, nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<std::uint8_t> four = download(aligned.data(), out_bytes);
      const std::vector<std::uint8_t> one = download(byte_offset(shifted.data(), esize), out_bytes);
      ASSERT_EQ(four, one);
      // Not the poison: every element written.
      for (std::int64_t i = 0; i < count; ++i) {
        ASSERT_FALSE(std::all_of(four.begin() + i * esize, four.begin() + (i + 1) * esize,
                                 [](std::uint8_t b) { return b == kPoisonByte; }))
            << "element " << i;
      }
    }
  }
}

}  // namespace
