// Storage dtypes and their exact conversions to and from fp32 (compute is always fp32).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace lmoe {

enum class DType : std::uint8_t { f32, f16, bf16 };

std::size_t dtype_size(DType dtype);
// "f32", "f16", "bf16" — the names used on the command line.
std::string_view dtype_name(DType dtype);
// Accepts the command-line names and the safetensors names ("F32", "F16", "BF16").
DType parse_dtype(std::string_view name);
// "F32", "F16", "BF16".
std::string_view safetensors_dtype_name(DType dtype);

// Round-to-nearest-even, NaN stays NaN (quiet), ±0, ±inf and subnormals are preserved.
inline std::uint16_t float_to_bf16_bits(float value) {
  std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}

inline float bf16_bits_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

inline std::uint16_t float_to_f16_bits(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const std::uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
  if (mag >= 0x477ff000u)
    return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (mag >= 0x38800000u) {                             // normal: >= 2^-14
    const std::uint32_t rounded = mag + 0xfffu + ((mag >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
  }
  if (mag <= 0x33000000u) return static_cast<std::uint16_t>(sign);  // <= 2^-25 rounds to ±0
  // Subnormal result: the value in units of 2^-24, rounded to nearest even.
  const std::uint32_t exponent = mag >> 23;
  const std::uint32_t mantissa = (mag & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126u - exponent;
  std::uint32_t result = mantissa >> shift;
  const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rest > half || (rest == half && (result & 1u))) ++result;
  return static_cast<std::uint16_t>(sign | result);
}

inline float f16_bits_to_float(std::uint16_t half_bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(half_bits & 0x8000u) << 16;
  const std::uint32_t exponent = (half_bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = half_bits & 0x3ffu;
  if (exponent == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0)
    return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa · 2^-24, exact in fp32.
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
  return sign ? -magnitude : magnitude;
}

// Element access to a buffer of the given dtype, through fp32.
inline float load_as_float(const void* data, std::size_t index, DType dtype) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(data)[index];
    case DType::f16: return f16_bits_to_float(static_cast<const std::uint16_t*>(data)[index]);
    case DType::bf16: return bf16_bits_to_float(static_cast<const std::uint16_t*>(data)[index]);
  }
  return 0.0f;
}

inline void store_from_float(void* data, std::size_t index, DType dtype, float value) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(data)[index] = value; return;
    case DType::f16: static_cast<std::uint16_t*>(data)[index] = float_to_f16_bits(value); return;
    case DType::bf16: static_cast<std::uint16_t*>(data)[index] = float_to_bf16_bits(value); return;
  }
}

// The value a float takes once stored in `dtype` (the "round" of the numerics contract).
inline float round_to(DType dtype, float value) {
  switch (dtype) {
    case DType::f32: return value;
    case DType::f16: return f16_bits_to_float(float_to_f16_bits(value));
    case DType::bf16: return bf16_bits_to_float(float_to_bf16_bits(value));
  }
  return value;
}

}  // namespace lmoe
