// One MXFP4 weight's value (an e2m1 code times its block's E8M0 scale) as fp32, the same arithmetic
// on the host and on the device, so that a CPU test checks the grouped GEMM's dequantization
// against Mxfp4Tensor::dequantize for every code and scale. The product has at most two significant
// bits and lies in 2^-128 … 6 · 2^127, so fp32 holds it exactly (subnormal at the bottom: device
// code must not flush denormals, and lmoe builds without -ftz) and rounding it to bf16 is exact;
// f16 rounds it once, as the dequantizing load does. Included by .cu files: no standard-library
// calls in the device branch.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LMOE_MXFP4_HOST_DEVICE __host__ __device__
#else
#define LMOE_MXFP4_HOST_DEVICE
#endif

namespace lmoe::cuda {

LMOE_MXFP4_HOST_DEVICE inline float mxfp4_float_of_bits(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// 2^(scale − 127) for an E8M0 byte: the byte is fp32's exponent field, except 0 (2^-127, a
// subnormal: the mantissa's top bit) and 255 (NaN, which a load refuses).
LMOE_MXFP4_HOST_DEVICE inline float e8m0_factor(std::uint32_t scale) {
  const std::uint32_t bits = scale == 0 ? 0x00400000u : scale == 255 ? 0x7fc00000u : scale << 23;
  return mxfp4_float_of_bits(bits);
}

// The e2m1 code `nibble` (bit 3 the sign, bits 2–1 the exponent, bit 0 the mantissa) times
// `factor` (e8m0_factor). Its magnitude bits placed under fp32's exponent field read as the e2m1
// value times 2^-126 (code 1, 0.5, becomes the subnormal 2^-127; 0 stays ±0), so two exact
// multiplications by powers of two give the value: no table and no branch per weight.
LMOE_MXFP4_HOST_DEVICE inline float e2m1_times(std::uint32_t nibble, float factor) {
  const float scaled_down = mxfp4_float_of_bits(((nibble & 0x7u) << 22) | ((nibble & 0x8u) << 28));
  return scaled_down * 0x1p126f * factor;
}

// The e2m1 code of weight v (0 … 7) of four code bytes read as a little-endian word: byte j holds
// weights 2j (low nibble) and 2j + 1 (high nibble), so weight v sits at bits 4v … 4v + 3.
LMOE_MXFP4_HOST_DEVICE inline std::uint32_t mxfp4_code(std::uint32_t codes, int v) {
  return (codes >> (4 * v)) & 0xfu;
}

// A row's `used` (1 or 2) scales of a chunk start `offset` (0 … 3) bytes into an aligned 4-byte
// word: of that word (`word` 0) and the next (1), how many leading bytes to copy (0 … 4) so that
// both scales arrive and nothing past the last one is read.
LMOE_MXFP4_HOST_DEVICE inline int mxfp4_scale_copy_bytes(int offset, int used, int word) {
  const int bytes = offset + used - 4 * word;
  return bytes < 0 ? 0 : bytes > 4 ? 4 : bytes;
}

}  // namespace lmoe::cuda
