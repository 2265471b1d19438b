// The grouped GEMM's MXFP4 weight operand (grouped_gemm.cuh): a chunk of 64 k of each B row is
// loaded packed — 32 bytes of e2m1 codes and its 2 E8M0 scales — and dequantized into the swizzled
// bf16/f16 rows that the dense path's ldmatrix reads, so the MMAs, their order and the epilogue are
// the dense path's: the same bits as B holding Mxfp4Tensor::dequantize's values.
//
// Why this scheme: the packed bytes of a stage come by cp.async, as dense rows do, so kStages − 1
// chunks stay in flight while the block converts and multiplies; the conversion runs after the
// stage's wait, from the stage's packed area into one bf16 tile shared by all stages, then one
// __syncthreads hands the tile to the warps' ldmatrix. Converting in registers after ldmatrix would
// skip that barrier but needs the mma fragment's k order in the packed bytes; one tile costs 128
// bytes a row of shared memory and keeps every tile shape's MMA loop unchanged.
//
// Scales: a row's scales for chunk c are bytes 2c and 2c + 1 of its K/32, at any byte address
// (K/32 is odd for K = 32·odd), and cp.async copies 4 bytes at least, aligned. So each row copies
// the two aligned words that hold them, with a source size that stops at the last scale byte the
// chunk uses (never past the row's own bytes at the end of the tensor), and the conversion finds
// them at the address's offset in the word. Device code only.
#pragma once

#include <cstdint>

#include "cuda/gemm/mxfp4_decode.hpp"
#include "cuda/gemm/warp_mma.cuh"

namespace lmoe::cuda {

// One group's MXFP4 matrix [N, K]: blocks [N, K/2] bytes, scales [N, K/32] bytes.
struct Mxfp4Matrix {
  const std::uint8_t* blocks;
  const std::uint8_t* scales;
};

inline constexpr int kMxfp4ChunkBytes = 32;  // a row's codes for 64 k
inline constexpr int kMxfp4ScaleBytes = 8;   // the two aligned words holding its 2 scales

// A packed stage's layout after the A rows (kBRows · (32 + 8) bytes, GroupedShape::kStageBytes):
// each B row's 32 code bytes, then each row's 8 bytes of scale words.
template <class Shape>
struct Mxfp4Stage {
  static constexpr int kCodes = 0;
  static constexpr int kScales = Shape::kBRows * kMxfp4ChunkBytes;
};

// 4 bytes global → shared, of which the first `bytes` (0 … 4) are read and the rest are zeros.
__device__ inline void cp_async4_first(std::uint32_t shared, const void* global, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(shared), "l"(global), "r"(bytes)
               : "memory");
}

// The byte address of a row's first scale of chunk c.
__device__ inline const std::uint8_t* mxfp4_chunk_scales(const Mxfp4Matrix& m, std::int64_t col,
                                                         std::int64_t k, int c) {
  return m.scales + col * (k / 32) + 2 * c;
}

// The B row `row` of the tile (up rows, then gate rows): its matrix and column. By value: a
// reference chosen at run time would put both matrices in local memory.
template <class Shape>
__device__ inline Mxfp4Matrix mxfp4_row_matrix(const Mxfp4Matrix& up, const Mxfp4Matrix& gate,
                                               int row, std::int64_t col0, std::int64_t& col) {
  const bool gate_row = Shape::kGated && row >= Shape::kColsN;
  col = col0 + (gate_row ? row - Shape::kColsN : row);
  return gate_row ? gate : up;
}

// Chunk c (k = 64c … 64c + 63) of the tile's B rows, packed, into the stage's packed area at
// `packed`: rows at or past N and codes at or past K are zeros (+0 weights, as the dense path's
// zero fill). `blocks_base` and `scales_base` (16- and 4-byte aligned) stand in for the source of
// copies that read nothing. All threads of the block call it.
template <class Shape>
__device__ inline void mxfp4_load_chunk(const Mxfp4Matrix& up, const Mxfp4Matrix& gate,
                                        const std::uint8_t* blocks_base,
                                        const std::uint8_t* scales_base, std::int64_t col0,
                                        std::int64_t n, std::int64_t k, int c,
                                        std::uint32_t packed) {
  const int tid = static_cast<int>(threadIdx.x);
  const std::int64_t k0 = static_cast<std::int64_t>(c) * 64;
  // Codes: two 16-byte halves a row (k0 … k0 + 31 and k0 + 32 … k0 + 63); K/2 is a multiple of 16.
  for (int i = tid; i < Shape::kBRows * 2; i += Shape::kThreads) {
    const int row = i >> 1, half = i & 1;
    std::int64_t col = 0;
    const Mxfp4Matrix m = mxfp4_row_matrix<Shape>(up, gate, row, col0, col);
    const bool valid = col < n && k0 + half * 32 < k;
    const std::uint8_t* src = valid ? m.blocks + col * (k / 2) + k0 / 2 + half * 16 : blocks_base;
    cp_async16(packed + Mxfp4Stage<Shape>::kCodes + row * kMxfp4ChunkBytes + half * 16, src, valid);
  }
  // Scales: the aligned words holding the chunk's 1 or 2 scale bytes (one where K ends inside it).
  const int used = k0 + 32 < k ? 2 : 1;
  for (int i = tid; i < Shape::kBRows * 2; i += Shape::kThreads) {
    const int row = i >> 1, word = i & 1;
    std::int64_t col = 0;
    const Mxfp4Matrix m = mxfp4_row_matrix<Shape>(up, gate, row, col0, col);
    const std::uint8_t* first = mxfp4_chunk_scales(m, col, k, c);
    const int offset = static_cast<int>(reinterpret_cast<std::uintptr_t>(first) & 3);
    const int bytes = col < n ? mxfp4_scale_copy_bytes(offset, used, word) : 0;
    const std::uint8_t* src = bytes > 0 ? first - offset + 4 * word : scales_base;
    cp_async4_first(packed + Mxfp4Stage<Shape>::kScales + row * kMxfp4ScaleBytes + word * 4, src,
                    bytes);
  }
}

// Two weights as T in one 32-bit word, the first in the low half (the lower address).
template <typename T>
__device__ inline std::uint32_t mxfp4_pack2(float first, float second);
template <>
__device__ inline std::uint32_t mxfp4_pack2<__nv_bfloat16>(float first, float second) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(first, second);
  return *reinterpret_cast<const std::uint32_t*>(&pair);
}
template <>
__device__ inline std::uint32_t mxfp4_pack2<__half>(float first, float second) {
  const __half2 pair = __floats2half2_rn(first, second);
  return *reinterpret_cast<const std::uint32_t*>(&pair);
}

// Eight consecutive weights of a row from their 4 code bytes (byte j: the low nibble the even
// column, the high nibble the odd one) and their block's factor, as 16 bytes of T.
template <typename T>
__device__ inline uint4 mxfp4_dequantize8(std::uint32_t codes, float factor) {
  std::uint32_t words[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    words[j] = mxfp4_pack2<T>(e2m1_times(mxfp4_code(codes, 2 * j), factor),
                              e2m1_times(mxfp4_code(codes, 2 * j + 1), factor));
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// The stage's packed chunk c (at `packed`, generic address of shared memory) into the bf16/f16 B
// tile at `b_tile` (the same, kBRows rows of 128 bytes, 16-byte parts swizzled as swizzle128).
// All threads of the block call it, after the stage's wait and barrier.
template <typename T, class Shape>
__device__ inline void mxfp4_dequantize_chunk(const Mxfp4Matrix& up, const Mxfp4Matrix& gate,
                                              std::int64_t col0, std::int64_t k, int c,
                                              const unsigned char* packed, unsigned char* b_tile) {
  const int tid = static_cast<int>(threadIdx.x);
  // Part p of a row: columns 8p … 8p + 7 of the chunk, 4 code bytes, the scale of half p / 4.
  for (int i = tid; i < Shape::kBRows * 8; i += Shape::kThreads) {
    const int row = i >> 3, part = i & 7;
    std::int64_t col = 0;
    const Mxfp4Matrix m = mxfp4_row_matrix<Shape>(up, gate, row, col0, col);
    const int offset =
        static_cast<int>(reinterpret_cast<std::uintptr_t>(mxfp4_chunk_scales(m, col, k, c)) & 3);
    const std::uint32_t codes = *reinterpret_cast<const std::uint32_t*>(
        packed + Mxfp4Stage<Shape>::kCodes + row * kMxfp4ChunkBytes + part * 4);
    const std::uint32_t scale =
        packed[Mxfp4Stage<Shape>::kScales + row * kMxfp4ScaleBytes + offset + (part >> 2)];
    *reinterpret_cast<uint4*>(b_tile + swizzle128(row, part)) =
        mxfp4_dequantize8<T>(codes, e8m0_factor(scale));
  }
}

}  // namespace lmoe::cuda
