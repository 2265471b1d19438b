// Storage dtype conversions: f16 against the compiler's _Float16, bf16 against an independent
// round-to-nearest-even reference computed in double, plus dtype names and sizes.
#include "lmoe/dtype.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "lmoe/error.hpp"

namespace {

using lmoe::DType;

std::uint32_t bits_of(float value) { return std::bit_cast<std::uint32_t>(value); }
float float_of(std::uint32_t bits) { return std::bit_cast<float>(bits); }

bool is_nan_f16(std::uint16_t half) { return (half & 0x7c00u) == 0x7c00u && (half & 0x3ffu) != 0; }
bool is_nan_bf16(std::uint16_t half) { return (half & 0x7f80u) == 0x7f80u && (half & 0x7fu) != 0; }

std::uint16_t compiler_f16_bits(float value) {
  return std::bit_cast<std::uint16_t>(static_cast<_Float16>(value));
}
float compiler_f16_to_float(std::uint16_t half) {
  return static_cast<float>(std::bit_cast<_Float16>(half));
}

// float → bf16 by choosing, in double, the nearer of the two bf16 neighbours of `value` (ties to
// the even mantissa). Written without the library's bit trick so the two can disagree.
std::uint16_t reference_bf16_bits(float value) {
  const std::uint32_t bits = bits_of(value);
  if (std::isnan(value)) return 0x7fc0;  // callers compare NaN as "both NaN"
  if (std::isinf(value)) return static_cast<std::uint16_t>(bits >> 16);
  const std::uint32_t sign = bits & 0x80000000u;
  const std::uint32_t toward_zero = bits & 0x7fff0000u;  // magnitude truncated to bf16
  if (toward_zero == (bits & 0x7fffffffu)) return static_cast<std::uint16_t>(bits >> 16);
  const std::uint32_t away = toward_zero + 0x10000u;
  const double magnitude = std::fabs(static_cast<double>(value));
  const double low = static_cast<double>(float_of(toward_zero));
  // Past the largest finite bf16 the next step up is 2^128 (IEEE overflow rounds as if it existed).
  const double high =
      away == 0x7f800000u ? std::ldexp(1.0, 128) : static_cast<double>(float_of(away));
  std::uint32_t chosen;
  if (magnitude - low < high - magnitude) {
    chosen = toward_zero;
  } else if (magnitude - low > high - magnitude) {
    chosen = away;
  } else {
    chosen = ((toward_zero >> 16) & 1u) ? away : toward_zero;
  }
  return static_cast<std::uint16_t>((sign | chosen) >> 16);
}

// ---------------------------------------------------------------------------------------------
// f16

TEST(DTypeF16, EveryHalfDecodesLikeTheCompiler) {
  int nan_count = 0;
  for (std::uint32_t h = 0; h <= 0xffffu; ++h) {
    const auto half = static_cast<std::uint16_t>(h);
    const float ours = lmoe::f16_bits_to_float(half);
    const float compiler = compiler_f16_to_float(half);
    if (is_nan_f16(half)) {
      ++nan_count;
      ASSERT_TRUE(std::isnan(ours)) << std::hex << h;
      ASSERT_TRUE(std::isnan(compiler)) << std::hex << h;
      // The sign of a NaN survives decoding.
      ASSERT_EQ(std::signbit(ours), (half & 0x8000u) != 0) << std::hex << h;
    } else {
      ASSERT_EQ(bits_of(ours), bits_of(compiler)) << "half 0x" << std::hex << h;
    }
  }
  EXPECT_EQ(nan_count, 2 * 1023);  // guards the NaN classifier itself
}

TEST(DTypeF16, EveryHalfRoundTripsThroughFloat) {
  for (std::uint32_t h = 0; h <= 0xffffu; ++h) {
    const auto half = static_cast<std::uint16_t>(h);
    const std::uint16_t back = lmoe::float_to_f16_bits(lmoe::f16_bits_to_float(half));
    if (is_nan_f16(half)) {
      ASSERT_TRUE(is_nan_f16(back)) << std::hex << h;
      ASSERT_EQ(back & 0x8000u, half & 0x8000u) << std::hex << h;
      ASSERT_NE(back & 0x200u, 0u) << "NaN must come back quiet, half 0x" << std::hex << h;
    } else {
      ASSERT_EQ(back, half) << "half 0x" << std::hex << h;
    }
  }
}

// Compares one float with the compiler's conversion; NaN only has to stay NaN.
void expect_f16_like_compiler(float value) {
  const std::uint16_t ours = lmoe::float_to_f16_bits(value);
  const std::uint16_t compiler = compiler_f16_bits(value);
  if (std::isnan(value)) {
    ASSERT_TRUE(is_nan_f16(ours)) << "float 0x" << std::hex << bits_of(value);
    ASSERT_TRUE(is_nan_f16(compiler)) << "float 0x" << std::hex << bits_of(value);
  } else {
    ASSERT_EQ(ours, compiler) << "float 0x" << std::hex << bits_of(value) << " = " << value;
  }
}

TEST(DTypeF16, RandomFloatBitPatternsRoundLikeTheCompiler) {
  std::mt19937 rng(20240611);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  // Uniform bit patterns are mostly far outside f16's range, so half of the draws keep the
  // exponent where f16 has normals, subnormals, its overflow edge and its zero edge.
  std::uniform_int_distribution<std::uint32_t> exponent(127 - 27, 127 + 17);
  for (int i = 0; i < 1'000'000; ++i) {
    std::uint32_t bits = any_bits(rng);
    if (i % 2) bits = (bits & 0x807fffffu) | (exponent(rng) << 23);
    expect_f16_like_compiler(float_of(bits));
    if (HasFatalFailure()) return;
  }
}

TEST(DTypeF16, EveryRoundingBoundaryMatchesTheCompiler) {
  // For every float whose top 19 bits name an f16-sized step, try the low bits around the
  // normal-range halfway point (0x1000) and the ends of the interval.
  const std::uint32_t lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff};
  for (std::uint32_t top = 0; top < (1u << 19); ++top) {
    for (std::uint32_t low : lows) {
      expect_f16_like_compiler(float_of((top << 13) | low));
      if (HasFatalFailure()) return;
    }
  }
}

TEST(DTypeF16, HandPickedEdges) {
  EXPECT_EQ(lmoe::float_to_f16_bits(0.0f), 0x0000);
  EXPECT_EQ(lmoe::float_to_f16_bits(-0.0f), 0x8000);
  EXPECT_EQ(lmoe::float_to_f16_bits(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(lmoe::float_to_f16_bits(-std::numeric_limits<float>::infinity()), 0xfc00);
  // Largest finite half is 65504; 65520 is the halfway point to 2^16 and rounds to inf.
  EXPECT_EQ(lmoe::float_to_f16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(lmoe::float_to_f16_bits(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(lmoe::float_to_f16_bits(65520.0f), 0x7c00);
  EXPECT_EQ(lmoe::float_to_f16_bits(-65520.0f), 0xfc00);
  // Smallest subnormal is 2^-24; exactly 2^-25 is a tie with 0 and rounds to even (0).
  EXPECT_EQ(lmoe::float_to_f16_bits(0x1p-24f), 0x0001);
  EXPECT_EQ(lmoe::float_to_f16_bits(0x1p-25f), 0x0000);
  EXPECT_EQ(lmoe::float_to_f16_bits(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(lmoe::float_to_f16_bits(-0x1p-25f), 0x8000);
  // 1.5 · 2^-24 ties between subnormals 1 and 2 → 2 (even); 2.5 · 2^-24 → 2.
  EXPECT_EQ(lmoe::float_to_f16_bits(1.5f * 0x1p-24f), 0x0002);
  EXPECT_EQ(lmoe::float_to_f16_bits(2.5f * 0x1p-24f), 0x0002);
  // The largest subnormal rounds up into the smallest normal 2^-14.
  EXPECT_EQ(lmoe::float_to_f16_bits(0x1p-14f - 0x1p-26f), 0x0400);
  EXPECT_EQ(lmoe::float_to_f16_bits(0x1p-14f), 0x0400);
  // 1 + 2^-11 ties → 1.0; 1 + 3·2^-11 ties → 1 + 2^-9 (even mantissa 2).
  EXPECT_EQ(lmoe::float_to_f16_bits(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(lmoe::float_to_f16_bits(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_TRUE(is_nan_f16(lmoe::float_to_f16_bits(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(is_nan_f16(lmoe::float_to_f16_bits(float_of(0x7f800001u))));  // signalling NaN
  EXPECT_TRUE(is_nan_f16(lmoe::float_to_f16_bits(float_of(0xff800001u))));
}

// ---------------------------------------------------------------------------------------------
// bf16

TEST(DTypeBf16, EveryBf16DecodesToTheSameTopBits) {
  for (std::uint32_t h = 0; h <= 0xffffu; ++h) {
    ASSERT_EQ(bits_of(lmoe::bf16_bits_to_float(static_cast<std::uint16_t>(h))), h << 16)
        << std::hex << h;
  }
}

TEST(DTypeBf16, EveryBf16RoundTripsThroughFloat) {
  int nan_count = 0;
  for (std::uint32_t h = 0; h <= 0xffffu; ++h) {
    const auto half = static_cast<std::uint16_t>(h);
    const float value = lmoe::bf16_bits_to_float(half);
    const std::uint16_t back = lmoe::float_to_bf16_bits(value);
    if (is_nan_bf16(half)) {
      ++nan_count;
      ASSERT_TRUE(std::isnan(value));
      // NaN stays NaN, keeps its sign and payload, and comes back quiet.
      ASSERT_EQ(back, half | 0x40u) << std::hex << h;
    } else {
      ASSERT_EQ(back, half) << "bf16 0x" << std::hex << h;
    }
  }
  EXPECT_EQ(nan_count, 2 * 127);
}

TEST(DTypeBf16, TiesRoundToEvenByHand) {
  struct Case {
    std::uint32_t float_bits;
    std::uint16_t bf16;
  };
  const Case cases[] = {
      {0x3f808000u, 0x3f80},                         // 1 + half ulp, even below → down
      {0x3f818000u, 0x3f82},                         // odd below → up
      {0x3f807fffu, 0x3f80},                         // just under half → down
      {0x3f808001u, 0x3f81},                         // just over half → up
      {0xbf808000u, 0xbf80},                         // negative ties mirror the positive ones
      {0xbf818000u, 0xbf82}, {0x3f80ffffu, 0x3f81},  // carry into the next mantissa
      {0x3fffffffu, 0x4000},                         // carry into the exponent
      {0x7f7f7fffu, 0x7f7f},  // largest finite stays finite just under the tie
      {0x7f7f8000u, 0x7f80},  // the tie above the largest finite (odd) overflows to inf
      {0xff7f8000u, 0xff80}, {0x7f7e8000u, 0x7f7e},  // an even tie near the top stays finite
      {0x00008000u, 0x0000},                         // subnormal ties: even below → down
      {0x00018000u, 0x0002},                         // odd below → up
      {0x00007fffu, 0x0000}, {0x00008001u, 0x0001},
      {0x80008000u, 0x8000},  // a negative value that rounds to zero keeps its sign
      {0x00000001u, 0x0000},  // the smallest float subnormal rounds to +0
      {0x007f8000u, 0x0080},  // the largest subnormal tie rounds up into the smallest normal
  };
  for (const Case& c : cases) {
    EXPECT_EQ(lmoe::float_to_bf16_bits(float_of(c.float_bits)), c.bf16)
        << "float 0x" << std::hex << c.float_bits;
    EXPECT_EQ(reference_bf16_bits(float_of(c.float_bits)), c.bf16)
        << "reference disagrees with the hand-made table at 0x" << std::hex << c.float_bits;
  }
}

TEST(DTypeBf16, ZerosInfinitiesAndNaN) {
  EXPECT_EQ(lmoe::float_to_bf16_bits(0.0f), 0x0000);
  EXPECT_EQ(lmoe::float_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(bits_of(lmoe::bf16_bits_to_float(0x8000)), 0x80000000u);
  EXPECT_EQ(lmoe::float_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(lmoe::float_to_bf16_bits(-std::numeric_limits<float>::infinity()), 0xff80);
  // The largest float is above the bf16 overflow tie and becomes inf.
  EXPECT_EQ(lmoe::float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);
  // NaN whose payload lives only in the low 16 bits must not truncate to inf.
  EXPECT_TRUE(is_nan_bf16(lmoe::float_to_bf16_bits(float_of(0x7f800001u))));
  EXPECT_TRUE(is_nan_bf16(lmoe::float_to_bf16_bits(float_of(0xff800001u))));
  EXPECT_EQ(lmoe::float_to_bf16_bits(float_of(0xff800001u)) & 0x8000u, 0x8000u);
  // All-ones payload: rounding must not carry a NaN into the sign bit or zero.
  EXPECT_EQ(lmoe::float_to_bf16_bits(float_of(0x7fffffffu)), 0x7fffu);
  EXPECT_TRUE(is_nan_bf16(lmoe::float_to_bf16_bits(std::numeric_limits<float>::quiet_NaN())));
}

TEST(DTypeBf16, SubnormalsArePreserved) {
  // Every bf16 subnormal is an exact float subnormal and survives the round trip (no FTZ).
  for (std::uint16_t m = 1; m < 0x80; ++m) {
    const float value = lmoe::bf16_bits_to_float(m);
    ASSERT_EQ(std::fpclassify(value), FP_SUBNORMAL) << m;
    ASSERT_EQ(lmoe::float_to_bf16_bits(value), m);
    ASSERT_EQ(lmoe::float_to_bf16_bits(-value), m | 0x8000u);
  }
  EXPECT_EQ(lmoe::bf16_bits_to_float(0x0001), 0x1p-133f);
}

TEST(DTypeBf16, RandomFloatsMatchTheDoubleReference) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 1'000'000; ++i) {
    std::uint32_t bits = any_bits(rng);
    // A quarter of the draws land exactly on a tie or one unit either side of it.
    if (i % 4 == 1) bits = (bits & 0xffff0000u) | 0x8000u;
    if (i % 4 == 2) bits = (bits & 0xffff0000u) | 0x7fffu;
    if (i % 4 == 3) bits = (bits & 0xffff0000u) | 0x8001u;
    const float value = float_of(bits);
    const std::uint16_t ours = lmoe::float_to_bf16_bits(value);
    if (std::isnan(value)) {
      ASSERT_TRUE(is_nan_bf16(ours)) << std::hex << bits;
      ASSERT_EQ(ours & 0x8000u, (bits >> 16) & 0x8000u) << std::hex << bits;
    } else {
      ASSERT_EQ(ours, reference_bf16_bits(value)) << "float 0x" << std::hex << bits;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// round_to, load/store, names and sizes

TEST(DTypeRoundTo, IsTheStoredValue) {
  EXPECT_EQ(lmoe::round_to(DType::f32, 1.0f + 0x1p-20f), 1.0f + 0x1p-20f);
  EXPECT_EQ(lmoe::round_to(DType::bf16, 1.0f + 0x1p-8f), 1.0f);  // tie → even
  EXPECT_EQ(lmoe::round_to(DType::bf16, 1.0f + 0x1p-8f + 0x1p-20f), 1.0f + 0x1p-7f);
  EXPECT_EQ(lmoe::round_to(DType::f16, 1.0f + 0x1p-11f), 1.0f);  // tie → even
  EXPECT_EQ(lmoe::round_to(DType::f16, 1.0f + 0x1p-11f + 0x1p-20f), 1.0f + 0x1p-10f);
  EXPECT_EQ(lmoe::round_to(DType::f16, 1e6f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(lmoe::round_to(DType::bf16, 1e6f), 999424.0f);
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    EXPECT_EQ(bits_of(lmoe::round_to(dtype, -0.0f)), 0x80000000u) << lmoe::dtype_name(dtype);
    EXPECT_TRUE(std::isnan(lmoe::round_to(dtype, std::numeric_limits<float>::quiet_NaN())));
  }
  EXPECT_EQ(lmoe::round_to(DType::f16, 0x1p-24f), 0x1p-24f);  // smallest f16 subnormal
  EXPECT_EQ(lmoe::round_to(DType::f16, 0x1p-25f), 0.0f);
}

TEST(DTypeRoundTo, IsIdempotentAndAgreesWithTheBitConversions) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  for (int i = 0; i < 100'000; ++i) {
    const float value = normal(rng);
    const float as_bf16 = lmoe::round_to(DType::bf16, value);
    const float as_f16 = lmoe::round_to(DType::f16, value);
    ASSERT_EQ(bits_of(as_bf16), bits_of(lmoe::bf16_bits_to_float(reference_bf16_bits(value))));
    ASSERT_EQ(bits_of(as_f16), bits_of(compiler_f16_to_float(compiler_f16_bits(value))));
    ASSERT_EQ(bits_of(lmoe::round_to(DType::bf16, as_bf16)), bits_of(as_bf16));
    ASSERT_EQ(bits_of(lmoe::round_to(DType::f16, as_f16)), bits_of(as_f16));
    ASSERT_EQ(bits_of(lmoe::round_to(DType::f32, value)), bits_of(value));
  }
}

TEST(DTypeLoadStore, GoesThroughTheStorageDtype) {
  std::vector<float> f32(3, 0.0f);
  std::vector<std::uint16_t> f16(3, 0xdead), bf16(3, 0xdead);
  const float value = 1.0f + 0x1p-9f + 0x1p-12f;  // not representable in either 16-bit type
  lmoe::store_from_float(f32.data(), 1, DType::f32, value);
  lmoe::store_from_float(f16.data(), 1, DType::f16, value);
  lmoe::store_from_float(bf16.data(), 1, DType::bf16, value);
  EXPECT_EQ(f32[1], value);
  EXPECT_EQ(f16[1], lmoe::float_to_f16_bits(value));
  EXPECT_EQ(bf16[1], lmoe::float_to_bf16_bits(value));
  // Neighbours untouched: the index addresses elements of the dtype, not bytes.
  EXPECT_EQ(f16[0], 0xdead);
  EXPECT_EQ(f16[2], 0xdead);
  EXPECT_EQ(bf16[0], 0xdead);
  EXPECT_EQ(bf16[2], 0xdead);
  EXPECT_EQ(lmoe::load_as_float(f32.data(), 1, DType::f32), value);
  EXPECT_EQ(lmoe::load_as_float(f16.data(), 1, DType::f16), lmoe::round_to(DType::f16, value));
  EXPECT_EQ(lmoe::load_as_float(bf16.data(), 1, DType::bf16), lmoe::round_to(DType::bf16, value));
}

TEST(DTypeNames, ParseAcceptsCommandLineAndSafetensorsNames) {
  EXPECT_EQ(lmoe::parse_dtype("f32"), DType::f32);
  EXPECT_EQ(lmoe::parse_dtype("F32"), DType::f32);
  EXPECT_EQ(lmoe::parse_dtype("fp32"), DType::f32);
  EXPECT_EQ(lmoe::parse_dtype("float32"), DType::f32);
  EXPECT_EQ(lmoe::parse_dtype("f16"), DType::f16);
  EXPECT_EQ(lmoe::parse_dtype("F16"), DType::f16);
  EXPECT_EQ(lmoe::parse_dtype("fp16"), DType::f16);
  EXPECT_EQ(lmoe::parse_dtype("float16"), DType::f16);
  EXPECT_EQ(lmoe::parse_dtype("bf16"), DType::bf16);
  EXPECT_EQ(lmoe::parse_dtype("BF16"), DType::bf16);
  EXPECT_EQ(lmoe::parse_dtype("bfloat16"), DType::bf16);
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    EXPECT_EQ(lmoe::parse_dtype(lmoe::dtype_name(dtype)), dtype);
    EXPECT_EQ(lmoe::parse_dtype(lmoe::safetensors_dtype_name(dtype)), dtype);
  }
  EXPECT_EQ(lmoe::dtype_name(DType::bf16), "bf16");
  EXPECT_EQ(lmoe::dtype_name(DType::f16), "f16");
  EXPECT_EQ(lmoe::dtype_name(DType::f32), "f32");
  EXPECT_EQ(lmoe::safetensors_dtype_name(DType::bf16), "BF16");
  EXPECT_EQ(lmoe::safetensors_dtype_name(DType::f16), "F16");
  EXPECT_EQ(lmoe::safetensors_dtype_name(DType::f32), "F32");
}

std::string parse_dtype_error(const std::string& name) {
  try {
    lmoe::parse_dtype(name);
  } catch (const lmoe::Error& error) {
    return error.message();
  }
  ADD_FAILURE() << "parse_dtype('" << name << "') did not throw";
  return "";
}

TEST(DTypeNames, UnknownNamesThrowAPinnedMessage) {
  EXPECT_EQ(parse_dtype_error("fp8"), "unknown dtype 'fp8': expected bf16, f16 or f32");
  EXPECT_EQ(parse_dtype_error(""), "unknown dtype '': expected bf16, f16 or f32");
  // Near misses: names are matched exactly (no trimming, no case folding beyond the listed ones).
  EXPECT_EQ(parse_dtype_error("bf16 "), "unknown dtype 'bf16 ': expected bf16, f16 or f32");
  EXPECT_EQ(parse_dtype_error("Bf16"), "unknown dtype 'Bf16': expected bf16, f16 or f32");
  EXPECT_EQ(parse_dtype_error("f64"), "unknown dtype 'f64': expected bf16, f16 or f32");
  // what() carries the place, message() does not.
  try {
    lmoe::parse_dtype("int8");
    FAIL() << "no throw";
  } catch (const lmoe::Error& error) {
    EXPECT_THAT(std::string(error.what()), testing::HasSubstr("core/dtype.cpp:"));
    EXPECT_THAT(std::string(error.what()), testing::EndsWith(error.message()));
  }
}

TEST(DTypeNames, SizesAndInvalidEnumValues) {
  EXPECT_EQ(lmoe::dtype_size(DType::f32), 4u);
  EXPECT_EQ(lmoe::dtype_size(DType::f16), 2u);
  EXPECT_EQ(lmoe::dtype_size(DType::bf16), 2u);
  const auto bogus = static_cast<DType>(7);
  try {
    lmoe::dtype_size(bogus);
    FAIL() << "dtype_size accepted an invalid enum value";
  } catch (const lmoe::Error& error) {
    EXPECT_EQ(error.message(), "invalid DType value 7");
  }
  EXPECT_THROW(lmoe::dtype_name(bogus), lmoe::Error);
  EXPECT_THROW(lmoe::safetensors_dtype_name(bogus), lmoe::Error);
}

}  // namespace
