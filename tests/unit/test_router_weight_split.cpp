// split_router_weight_bf16: three bf16 parts that sum to each fp32 router weight exactly.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/router_weight_split.hpp"
#include "lmoe/error.hpp"

namespace {

using lmoe::DType;
using lmoe::HostTensor;
using ::testing::HasSubstr;

HostTensor weight_of(const std::vector<float>& values, std::int64_t rows) {
  HostTensor weight(DType::f32, {rows, static_cast<std::int64_t>(values.size()) / rows});
  for (std::size_t i = 0; i < values.size(); ++i)
    weight.set(static_cast<std::int64_t>(i), values[i]);
  return weight;
}

// Every w: H + M + L == w in exact arithmetic, and (H + M) + L == w in fp32 too (the order the
// router kernel adds the three GEMM outputs in would not matter for a single product).
void expect_exact_split(const std::vector<float>& values, std::int64_t rows) {
  const HostTensor weight = weight_of(values, rows);
  const HostTensor parts = lmoe::split_router_weight_bf16(weight);
  ASSERT_EQ(parts.dtype(), DType::bf16);
  ASSERT_EQ(parts.shape(), (std::vector<std::int64_t>{3 * rows, weight.shape()[1]}));
  const std::int64_t count = weight.numel();
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < count; ++i) {
    const float w = weight.get(i);
    const float h = parts.get(i), m = parts.get(count + i), l = parts.get(2 * count + i);
    const double exact = static_cast<double>(h) + static_cast<double>(m) + static_cast<double>(l);
    if ((exact != static_cast<double>(w) || (h + m) + l != w) && ++wrong <= 5) {
      ADD_FAILURE() << "w = " << w << " (bits " << std::hex << std::bit_cast<std::uint32_t>(w)
                    << std::dec << "): " << h << " + " << m << " + " << l;
    }
  }
  EXPECT_EQ(wrong, 0);
}

TEST(RouterWeightSplit, PartsSumToEveryWeightExactly) {
  std::mt19937 random(7);
  // A router's scale (fan-in ~1/sqrt(d)), then magnitudes from 2^-100 to 2^100, both signs.
  std::uniform_real_distribution<float> small(-0.05f, 0.05f);
  std::uniform_real_distribution<float> exponent(-100.0f, 100.0f);
  std::vector<float> values;
  for (int i = 0; i < 4096; ++i) values.push_back(small(random));
  for (int i = 0; i < 4096; ++i) {
    const float magnitude = std::exp2(exponent(random));
    values.push_back(i % 2 ? magnitude : -magnitude);
  }
  expect_exact_split(values, 16);
}

TEST(RouterWeightSplit, CraftedWeights) {
  const float max = std::numeric_limits<float>::max();
  expect_exact_split(
      {
          0.0f,
          1.0f,
          -1.0f,
          std::bit_cast<float>(0x3f7fffffu),            // every significand bit set
          std::bit_cast<float>(0x3f808081u),            // M and L both used
          std::bit_cast<float>(0x3f80ffffu),            // every bit of M and L set
          std::bit_cast<float>(0x0c800001u),            // 2^-102 · (1 + 2^-23): L near its floor
          std::bit_cast<float>(0x00800000u) * 0x1p30f,  // 2^-96
          max,
          -max,
      },
      1);
  // −0 splits into −0 + 0 + 0: the same value (the GEMM sums products; no sign survives a sum
  // with +0 anyway).
  const HostTensor parts = lmoe::split_router_weight_bf16(weight_of({-0.0f}, 1));
  EXPECT_EQ(parts.get(0) + parts.get(1) + parts.get(2), 0.0f);
}

TEST(RouterWeightSplit, NonFiniteWeightsGoWholeIntoTheFirstPart) {
  const float inf = std::numeric_limits<float>::infinity();
  const HostTensor parts = lmoe::split_router_weight_bf16(weight_of({inf, -inf, std::nanf("")}, 1));
  EXPECT_EQ(parts.get(0), inf);
  EXPECT_EQ(parts.get(1), -inf);
  EXPECT_TRUE(std::isnan(parts.get(2)));
  for (std::int64_t i = 3; i < 9; ++i) EXPECT_EQ(parts.get(i), 0.0f) << i;
}

TEST(RouterWeightSplit, RefusesWhatIsNotAnF32Matrix) {
  EXPECT_THAT(
      [] {
        try {
          lmoe::split_router_weight_bf16(HostTensor(DType::bf16, {2, 3}));
        } catch (const lmoe::Error& error) {
          return std::string(error.what());
        }
        return std::string();
      }(),
      HasSubstr("router weight: expected a 2-D f32 tensor [E, d], got bf16 [2, 3]"));
  EXPECT_THROW(lmoe::split_router_weight_bf16(HostTensor(DType::f32, {6})), lmoe::Error);
}

}  // namespace
