// The CPU RMSNorm follows the contract's canonical summation order (docs/numerics.md) exactly: rows
// crafted so that other orders give other fp32 sums, and random rows of every shape against a
// second, independently written version of the order.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "core/host_math.hpp"
#include "lmoe/error.hpp"
#include "lmoe/tensor.hpp"

namespace {

using lmoe::DType;

constexpr float k2Pow24 = 16777216.0f;  // 2^24: adding 1 to it is a tie that rounds back down

std::uint32_t bits_of(float value) { return std::bit_cast<std::uint32_t>(value); }

// The halving tree written as a recursion: s[i] += s[i + h] for h = 128 … 1 sums the lanes whose
// index is ≡ first (mod stride) as (lanes ≡ first mod 2·stride) + (lanes ≡ first + stride mod
// 2·stride).
float lane_tree(const std::vector<float>& lanes, int first, int stride) {
  if (stride == static_cast<int>(lanes.size())) return lanes[static_cast<std::size_t>(first)];
  const float low = lane_tree(lanes, first, 2 * stride);
  const float high = lane_tree(lanes, first + stride, 2 * stride);
  return low + high;
}

// ss of a row in the canonical order, written independently of cpu::rms_norm_sum_of_squares.
float canonical_sum_of_squares(const std::vector<float>& row) {
  std::vector<float> squares(row.size());
  for (std::size_t j = 0; j < row.size(); ++j) squares[j] = row[j] * row[j];
  std::vector<float> lanes(256, 0.0f);
  for (std::size_t j = 0; j < row.size(); ++j) lanes[(j / 8) % 256] += squares[j];
  return lane_tree(lanes, 0, 1);
}

float column_order_sum_of_squares(const std::vector<float>& row) {
  float sum = 0.0f;
  for (float v : row) {
    const float square = v * v;
    sum += square;
  }
  return sum;
}

float sum_of_squares(const std::vector<float>& row) {
  std::vector<float> squares(row.size());
  for (std::size_t j = 0; j < row.size(); ++j) squares[j] = row[j] * row[j];
  return lmoe::cpu::rms_norm_sum_of_squares(squares);
}

// A row of zeros with the given (index, value) entries.
std::vector<float> sparse_row(std::size_t cols,
                              std::initializer_list<std::pair<std::size_t, float>> entries) {
  std::vector<float> row(cols, 0.0f);
  for (const auto& [index, value] : entries) row[index] = value;
  return row;
}

// Lane 0 holds 2^24 (x = 4096), lanes 16 and 144 hold 1 each. The halving tree adds lanes 16 and
// 144 first (h = 128: 1 + 1 = 2) and then 2^24 + 2 exactly; column order, a warp-first tree (lane 0
// meets lane 16 first) or a contiguous split all add a lone 1 to 2^24, which rounds back to 2^24.
TEST(RmsNormOrder, HalvingTreePairsLaneIWithLaneIPlus128First) {
  const auto row = sparse_row(1160, {{0, 4096.0f}, {16 * 8, 1.0f}, {144 * 8, 1.0f}});
  EXPECT_EQ(sum_of_squares(row), k2Pow24 + 2.0f);
  EXPECT_EQ(canonical_sum_of_squares(row), k2Pow24 + 2.0f);
  EXPECT_EQ(column_order_sum_of_squares(row), k2Pow24);
}

// A lane adds its squares in increasing j, across its chunks too: lane 0 holds x_0 = x_1 = 1 (chunk
// 0) and x_2048 = 4096 (chunk 256): 1 + 1 = 2 first, then 2^24 + 2 exactly; the reverse order loses
// both.
TEST(RmsNormOrder, ALaneAddsItsChunksInIncreasingOrder) {
  const auto row = sparse_row(2049, {{0, 1.0f}, {1, 1.0f}, {2048, 4096.0f}});
  EXPECT_EQ(sum_of_squares(row), k2Pow24 + 2.0f);
  EXPECT_EQ(canonical_sum_of_squares(row), k2Pow24 + 2.0f);
}

// Within a chunk the adds are sequential: 2^24 then seven 1s, each lost (a pairwise order inside
// the chunk would keep some).
TEST(RmsNormOrder, AChunkIsAddedSequentially) {
  const auto row = sparse_row(
      16,
      {{0, 4096.0f}, {1, 1.0f}, {2, 1.0f}, {3, 1.0f}, {4, 1.0f}, {5, 1.0f}, {6, 1.0f}, {7, 1.0f}});
  EXPECT_EQ(sum_of_squares(row), k2Pow24);
}

// The norm's output shows the order: lane 0 = 2^24 and lanes 1 … 255 = 1. Column order loses every
// 1 (ss = 2^24); the tree keeps them in pairs: 2^24 + 2 + 4 + … + 128 = 2^24 + 254 (each partial
// exact).
TEST(RmsNormOrder, OutputFollowsTheCanonicalSumNotTheColumnOrder) {
  const std::int64_t cols = 2048;
  std::vector<float> row(cols, 0.0f);
  row[0] = 4096.0f;
  for (std::size_t lane = 1; lane < 256; ++lane) row[lane * 8] = 1.0f;
  ASSERT_EQ(canonical_sum_of_squares(row), k2Pow24 + 254.0f);
  ASSERT_EQ(column_order_sum_of_squares(row), k2Pow24);

  lmoe::HostTensor x(DType::f32, {1, cols}), out(DType::f32, {1, cols});
  for (std::int64_t j = 0; j < cols; ++j) x.set(j, row[static_cast<std::size_t>(j)]);
  const std::vector<float> gamma(cols, 1.0f);
  out.fill_bytes(std::byte{0xff});
  lmoe::cpu::rms_norm(x.matrix(), gamma, 0.0f, out.matrix());

  const float canonical_rstd = 1.0f / std::sqrt((k2Pow24 + 254.0f) / static_cast<float>(cols));
  const float column_rstd = 1.0f / std::sqrt(k2Pow24 / static_cast<float>(cols));
  ASSERT_NE(bits_of(4096.0f * canonical_rstd),
            bits_of(4096.0f * column_rstd));  // the row discriminates
  EXPECT_EQ(bits_of(out.get(0)), bits_of(4096.0f * canonical_rstd));
  EXPECT_EQ(bits_of(out.get(8)), bits_of(1.0f * canonical_rstd));
  EXPECT_EQ(bits_of(out.get(1)), bits_of(0.0f));
}

// Random rows of every shape and dtype, bit for bit against the independent version of the order
// and the contract's formula: l = 1, l < 8, l not a multiple of 8, several chunks per lane.
class RmsNormShapes : public ::testing::TestWithParam<DType> {};

TEST_P(RmsNormShapes, MatchTheCanonicalOrderBitForBit) {
  const DType dtype = GetParam();
  const std::int64_t rows = 5;
  for (std::int64_t cols : {1, 2, 5, 7, 8, 9, 13, 192, 250, 2047, 2051, 3584, 5000}) {
    SCOPED_TRACE("l=" + std::to_string(cols));
    std::mt19937_64 rng(static_cast<std::uint64_t>(cols) * 7919u +
                        static_cast<std::uint64_t>(dtype));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    lmoe::HostTensor x(dtype, {rows, cols}), out(dtype, {rows, cols});
    for (std::int64_t t = 0; t < rows; ++t) {
      // Rows of different magnitudes, so that the low bits of the squares matter.
      const float scale = std::ldexp(1.0f, static_cast<int>(t * 3) - 6);
      for (std::int64_t j = 0; j < cols; ++j) x.set(t * cols + j, scale * normal(rng));
    }
    std::vector<float> gamma(static_cast<std::size_t>(cols));
    for (float& g : gamma)
      g = lmoe::bf16_bits_to_float(lmoe::float_to_bf16_bits(1.0f + 0.1f * normal(rng)));
    const float eps = 1e-5f;
    out.fill_bytes(std::byte{0xff});
    lmoe::cpu::rms_norm(x.matrix(), gamma, eps, out.matrix());

    std::int64_t mismatches = 0, order_matters = 0;
    for (std::int64_t t = 0; t < rows; ++t) {
      std::vector<float> row(static_cast<std::size_t>(cols));
      for (std::int64_t j = 0; j < cols; ++j)
        row[static_cast<std::size_t>(j)] = x.get(t * cols + j);
      const float ss = canonical_sum_of_squares(row);
      order_matters += ss != column_order_sum_of_squares(row);
      const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(cols) + eps);
      lmoe::HostTensor expected(dtype, {cols});
      for (std::int64_t j = 0; j < cols; ++j) {
        expected.set(
            j, (row[static_cast<std::size_t>(j)] * rstd) * gamma[static_cast<std::size_t>(j)]);
        const std::size_t esize = lmoe::dtype_size(dtype);
        mismatches += std::memcmp(expected.data() + j * esize, out.data() + (t * cols + j) * esize,
                                  esize) != 0;
      }
    }
    EXPECT_EQ(mismatches, 0);
    // Long random rows do exercise an order that differs from column order.
    if (cols >= 2047) {
      EXPECT_GT(order_matters, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, RmsNormShapes,
                         ::testing::Values(DType::bf16, DType::f16, DType::f32),
                         [](const auto& info) {
                           return std::string(lmoe::dtype_name(info.param));
                         });

// l = 1: ss = x², rstd = 1 / sqrt(x² + eps).
TEST(RmsNorm, OneColumn) {
  lmoe::HostTensor x(DType::f32, {3, 1}), out(DType::f32, {3, 1});
  const float values[] = {3.0f, -0.5f, 1e-3f};
  for (int t = 0; t < 3; ++t) x.set(t, values[t]);
  const std::vector<float> gamma = {2.0f};
  lmoe::cpu::rms_norm(x.matrix(), gamma, 1e-5f, out.matrix());
  for (int t = 0; t < 3; ++t) {
    const float square = values[t] * values[t];
    const float rstd = 1.0f / std::sqrt(square / 1.0f + 1e-5f);
    EXPECT_EQ(bits_of(out.get(t)), bits_of((values[t] * rstd) * 2.0f)) << "row " << t;
  }
}

// Signed zeros survive, and eps = 0 on a zero row gives rstd = +inf and NaN outputs (0 · inf).
TEST(RmsNorm, SignedZerosAndAZeroRowWithoutEps) {
  const std::int64_t cols = 12;
  lmoe::HostTensor x(DType::bf16, {2, cols}), out(DType::bf16, {2, cols});
  for (std::int64_t j = 0; j < cols; ++j) {
    x.set(j, j % 2 ? -0.0f : 0.0f);              // row 0: ±0 only
    x.set(cols + j, j % 3 == 0 ? -0.0f : 1.5f);  // row 1: some −0
  }
  const std::vector<float> gamma(cols, 1.0f);
  lmoe::cpu::rms_norm(x.matrix(), gamma, 1e-5f, out.matrix());
  for (std::int64_t j = 0; j < cols; ++j) {
    EXPECT_EQ(std::signbit(out.get(j)), j % 2 == 1) << j;
    EXPECT_EQ(out.get(j), 0.0f) << j;
    if (j % 3 == 0) {
      EXPECT_TRUE(std::signbit(out.get(cols + j)) && out.get(cols + j) == 0.0f) << j;
    }
  }
  lmoe::cpu::rms_norm(x.matrix(), gamma, 0.0f, out.matrix());
  for (std::int64_t j = 0; j < cols; ++j) EXPECT_TRUE(std::isnan(out.get(j))) << j;
}

TEST(RmsNorm, ShapeMismatchIsAnError) {
  lmoe::HostTensor x(DType::f32, {2, 8}), out(DType::f32, {2, 8});
  const std::vector<float> gamma(7, 1.0f);
  EXPECT_THROW(lmoe::cpu::rms_norm(x.matrix(), gamma, 1e-5f, out.matrix()), lmoe::Error);
}

}  // namespace
