// The grouped GEMM's MXFP4 arithmetic (cuda/gemm/mxfp4_decode.hpp, the same functions the kernel
// runs) on the host: every e2m1 code times every E8M0 scale gives mxfp4_value's fp32 bits, and
// rounded to bf16 and f16 the bits Mxfp4Tensor::dequantize stores; the codes of a packed word come
// in the checkpoint's nibble order; the scale words' copies cover the chunk's scales and no more.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cuda/gemm/mxfp4_decode.hpp"
#include "lmoe/dtype.hpp"
#include "lmoe/layer_weights.hpp"

namespace {

using lmoe::DType;

std::uint32_t bits_of(float value) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

TEST(Mxfp4Decode, EveryCodeTimesEveryScaleIsMxfp4ValueExactly) {
  for (std::uint32_t scale = 0; scale < 255; ++scale) {
    for (std::uint32_t nibble = 0; nibble < 16; ++nibble) {
      const float want =
          lmoe::mxfp4_value(static_cast<std::uint8_t>(nibble), static_cast<std::uint8_t>(scale));
      const float got = lmoe::cuda::e2m1_times(nibble, lmoe::cuda::e8m0_factor(scale));
      ASSERT_EQ(bits_of(got), bits_of(want)) << "code " << nibble << " scale " << scale;
    }
  }
  // 255 is NaN (a load refuses it), for every code, zero included.
  for (std::uint32_t nibble = 0; nibble < 16; ++nibble)
    EXPECT_TRUE(std::isnan(lmoe::cuda::e2m1_times(nibble, lmoe::cuda::e8m0_factor(255))));
}

// One expert of 16 rows × 32 columns: row r's scale is 16·r (2^-127 … 2^113: subnormal bf16, f16's
// underflow and overflow included), byte j of every row holds codes (j, 15 − j) so that every code
// sits in both nibbles. Rounded to the dtype, each value is what dequantize stores, bit for bit.
TEST(Mxfp4Decode, RoundedToBf16AndF16ItIsWhatDequantizeStores) {
  lmoe::Mxfp4Tensor tensor({1, 16, 32});
  for (std::size_t row = 0; row < 16; ++row) {
    tensor.scales[row] = static_cast<std::uint8_t>(16 * row);
    for (std::size_t j = 0; j < 16; ++j)
      tensor.blocks[row * 16 + j] = static_cast<std::uint8_t>(j | ((15 - j) << 4));
  }
  for (const DType dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(lmoe::dtype_name(dtype));
    const lmoe::HostTensor dense = tensor.dequantize(dtype);
    for (std::int64_t row = 0; row < 16; ++row) {
      const float factor = lmoe::cuda::e8m0_factor(tensor.scales[row]);
      for (int word = 0; word < 4; ++word) {
        std::uint32_t codes = 0;
        std::memcpy(&codes, tensor.blocks.data() + row * 16 + word * 4, sizeof(codes));
        for (int v = 0; v < 8; ++v) {
          const std::int64_t col = word * 8 + v;
          const float got = lmoe::round_to(
              dtype, lmoe::cuda::e2m1_times(lmoe::cuda::mxfp4_code(codes, v), factor));
          ASSERT_EQ(bits_of(got), bits_of(dense.get(row * 32 + col)))
              << "row " << row << " col " << col;
        }
      }
    }
  }
}

// For every start offset in the first word and 1 or 2 scales: the bytes copied from the two words
// are exactly those up to the last scale, so both scales arrive and nothing after them is read.
TEST(Mxfp4Decode, ScaleWordCopiesStopAtTheLastScale) {
  for (int offset = 0; offset < 4; ++offset) {
    for (int used = 1; used <= 2; ++used) {
      SCOPED_TRACE("offset " + std::to_string(offset) + ", scales " + std::to_string(used));
      const int first = lmoe::cuda::mxfp4_scale_copy_bytes(offset, used, 0);
      const int second = lmoe::cuda::mxfp4_scale_copy_bytes(offset, used, 1);
      EXPECT_GE(first, 0);
      EXPECT_LE(first, 4);
      EXPECT_GE(second, 0);
      EXPECT_LE(second, 4);
      EXPECT_EQ(second > 0 ? 4 + second : first, offset + used);  // the bytes up to the last scale
      EXPECT_TRUE(second == 0 || first == 4);  // the second word only after the whole first
    }
  }
}

}  // namespace
