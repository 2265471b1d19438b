// The router's logits at decode sizes: x [T, d] bf16 times the fp32 router weight [E, d]ᵀ in one
// pass over the weight (its bytes set the pace: 25.7 MB at Kimi-K3's 896 × 7168), on tensor cores
// with every product exact. Device code only; the launcher is router_logits.cu.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/gemm/warp_mma.cuh"
#include "cuda/layer/router_logits.hpp"

namespace lmoe::cuda {

// Shared memory of one stage: the weight's 128 rows × 64 k (fp32, 256-byte rows, their 16-byte
// pieces XOR-swizzled by the row's parity), then x's rows × 64 k (bf16, 160-byte pitch: the four
// rows one phase of B-fragment reads touches fall in four different groups of 8 banks).
inline constexpr int kRouterWeightStageBytes = kRouterLogitsExperts * kRouterLogitsChunk * 4;
inline constexpr int kRouterXPitchBytes = kRouterLogitsChunk * 2 + 32;
__host__ __device__ inline constexpr int router_logits_stage_bytes(int token_tiles) {
  return kRouterWeightStageBytes + token_tiles * 8 * kRouterXPitchBytes;
}

// Piece `piece` (16 bytes) of weight row `row` in a stage: odd rows swap the halves of each 128
// bytes, so the two rows that one phase of a warp's float4 reads touches use different banks.
__device__ inline int router_weight_offset(int row, int piece) {
  return row * (kRouterLogitsChunk * 4) + ((piece ^ ((row & 1) << 2)) << 4);
}

// Two weights (a first, the lower k slot) as the three bf16 pairs of their split
// (core/router_weight_split.hpp, bit for bit): H = w truncated to bf16, M = (w − H) truncated,
// L = w − H − M rounded to bf16 (exact for |w| ≥ 2⁻¹¹⁰); a non-finite w is H whole, M = L = 0.
__device__ inline void split_weight_pair(float a, float b, std::uint32_t& high,
                                         std::uint32_t& middle, std::uint32_t& low) {
  std::uint32_t h[2], m[2], l[2];
  const float w[2] = {a, b};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const std::uint32_t bits = __float_as_uint(w[i]);
    if (isfinite(w[i])) {
      const float rest = __fsub_rn(w[i], __uint_as_float(bits & 0xffff0000u));  // exact
      const float mid = __uint_as_float(__float_as_uint(rest) & 0xffff0000u);
      h[i] = bits >> 16;
      m[i] = __float_as_uint(mid) >> 16;
      l[i] = __bfloat16_as_ushort(__float2bfloat16_rn(__fsub_rn(rest, mid)));
    } else {
      h[i] = isnan(w[i]) ? 0x7fc0u : bits >> 16;
      m[i] = 0;
      l[i] = 0;
    }
  }
  high = h[0] | (h[1] << 16);
  middle = m[0] | (m[1] << 16);
  low = l[0] | (l[1] << 16);
}

// Grid (⌈E / 128⌉ expert tiles, S splits of d), 8 warps. Block (tile, s) streams weight rows
// [128·tile, +128) over split s's chunks of 64 k through a ring of kRouterLogitsStages cp.async
// stages (x's rows of the chunk beside them); warp w owns 16 of the rows as the mma's M and every
// token as N (kTokenTiles tiles of 8). Within a 16-k step a thread's A and B fragments hold the
// same four consecutive k (the mma's k slots are a fixed permutation of them, which the contract's
// free summation order allows). Per output, the H products accumulate in one fp32 accumulator and
// the M and L products in another (2⁻⁸ smaller, so its roundings are 2⁻⁸ smaller too): the error
// of an fp32 GEMM part of the split path, plus one add. The order is fixed by the shapes alone.
template <int kTokenTiles>
__global__ void __launch_bounds__(kRouterLogitsWarps * 32, 1)
    router_logits_kernel(const __nv_bfloat16* __restrict__ x, const float* __restrict__ weight,
                         int tokens, int d_model, int experts, float* __restrict__ partial) {
  extern __shared__ __align__(16) unsigned char router_logits_smem[];
  constexpr int kStageBytes = router_logits_stage_bytes(kTokenTiles);
  constexpr int kPieces = kRouterLogitsChunk / 4;  // 16-byte pieces of a weight row's chunk
  constexpr int kXPieces = kRouterLogitsChunk / 8;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int group = lane / 4, quad = lane % 4;  // the mma fragments' row group and k quad
  const int first_expert = static_cast<int>(blockIdx.x) * kRouterLogitsExperts;
  const int split = static_cast<int>(blockIdx.y), splits = static_cast<int>(gridDim.y);
  const int chunks = d_model / kRouterLogitsChunk;
  const int chunk_begin = static_cast<int>(static_cast<std::int64_t>(chunks) * split / splits);
  const int chunk_count =
      static_cast<int>(static_cast<std::int64_t>(chunks) * (split + 1) / splits) - chunk_begin;
  const std::uint32_t smem_base =
      static_cast<std::uint32_t>(__cvta_generic_to_shared(router_logits_smem));

  // Rows past E and tokens past T are zeros (cp.async with no source bytes).
  const auto load_chunk = [&](int chunk, int stage) {
    const std::int64_t k0 = static_cast<std::int64_t>(chunk_begin + chunk) * kRouterLogitsChunk;
    const std::uint32_t weight_stage = smem_base + stage * kStageBytes;
    for (int i = tid; i < kRouterLogitsExperts * kPieces; i += kRouterLogitsWarps * 32) {
      const int row = i / kPieces, piece = i % kPieces;
      const bool valid = first_expert + row < experts;
      const float* source = weight +
                            (valid ? first_expert + row : 0) * static_cast<std::int64_t>(d_model) +
                            k0 + piece * 4;
      cp_async16(weight_stage + router_weight_offset(row, piece), source, valid);
    }
    const std::uint32_t x_stage = weight_stage + kRouterWeightStageBytes;
    for (int i = tid; i < kTokenTiles * 8 * kXPieces; i += kRouterLogitsWarps * 32) {
      const int row = i / kXPieces, piece = i % kXPieces;
      const bool valid = row < tokens;
      const __nv_bfloat16* source =
          x + (valid ? row : 0) * static_cast<std::int64_t>(d_model) + k0 + piece * 8;
      cp_async16(x_stage + row * kRouterXPitchBytes + piece * 16, source, valid);
    }
  };

  float high_sum[kTokenTiles][4] = {}, low_sum[kTokenTiles][4] = {};
#pragma unroll
  for (int i = 0; i < kRouterLogitsStages - 1; ++i) {
    if (i < chunk_count) load_chunk(i, i);
    cp_async_commit();
  }
  const int row0 = warp * 16 + group;  // and row0 + 8: the same parity
  for (int chunk = 0; chunk < chunk_count; ++chunk) {
    cp_async_wait<kRouterLogitsStages - 2>();
    __syncthreads();  // the chunk has landed, and every warp is done with the stage reloaded next
    const int next = chunk + kRouterLogitsStages - 1;
    if (next < chunk_count) load_chunk(next, next % kRouterLogitsStages);
    cp_async_commit();

    const unsigned char* stage = router_logits_smem + (chunk % kRouterLogitsStages) * kStageBytes;
    const unsigned char* x_stage = stage + kRouterWeightStageBytes;
#pragma unroll
    for (int step = 0; step < kRouterLogitsChunk / 16; ++step) {
      const int piece = step * 4 + quad;  // k = 16·step + 4·quad … + 3
      const float4 upper =
          *reinterpret_cast<const float4*>(stage + router_weight_offset(row0, piece));
      const float4 lower =
          *reinterpret_cast<const float4*>(stage + router_weight_offset(row0 + 8, piece));
      // A fragments: registers 0 and 2 hold row0's k slots (2q, 2q+1) and (2q+8, 2q+9), 1 and 3
      // row0 + 8's; those slots are k 4q … 4q + 3 here.
      std::uint32_t high[4], middle[4], low[4];
      split_weight_pair(upper.x, upper.y, high[0], middle[0], low[0]);
      split_weight_pair(lower.x, lower.y, high[1], middle[1], low[1]);
      split_weight_pair(upper.z, upper.w, high[2], middle[2], low[2]);
      split_weight_pair(lower.z, lower.w, high[3], middle[3], low[3]);
#pragma unroll
      for (int tile = 0; tile < kTokenTiles; ++tile) {
        if (tile * 8 >= tokens) break;
        const uint2 pair = *reinterpret_cast<const uint2*>(
            x_stage + (tile * 8 + group) * kRouterXPitchBytes + step * 32 + quad * 8);
        const std::uint32_t b[2] = {pair.x, pair.y};
        mma_m16n8k16<__nv_bfloat16>(high_sum[tile], high, b);
        mma_m16n8k16<__nv_bfloat16>(low_sum[tile], middle, b);
        mma_m16n8k16<__nv_bfloat16>(low_sum[tile], low, b);
      }
    }
  }
  cp_async_wait<0>();

  // C fragments: registers (0, 1) are row0's tokens (2q, 2q+1) of the tile, (2, 3) row0 + 8's.
#pragma unroll
  for (int tile = 0; tile < kTokenTiles; ++tile) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int expert = first_expert + row0 + (i / 2) * 8;
      const int token = tile * 8 + quad * 2 + i % 2;
      if (expert < experts && token < tokens) {
        partial[(static_cast<std::int64_t>(split) * tokens + token) * experts + expert] =
            __fadd_rn(high_sum[tile][i], low_sum[tile][i]);
      }
    }
  }
}

}  // namespace lmoe::cuda
