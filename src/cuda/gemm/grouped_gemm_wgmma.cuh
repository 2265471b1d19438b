// The grouped GEMM of grouped_gemm.cuh on Hopper's warpgroup MMA (wgmma, sm_90a only): the same
// parameters, the same tile → group lookup, the same loads and the same epilogue formulas, with
// the block's products issued by its warpgroups as asynchronous m64n128k16 wgmma steps that read
// both operands straight from shared memory (no ldmatrix, no fragment registers for A and B).
//
// Choices, and why:
// - Block tile 128 rows × 128 B rows (tile `wgmma`), two warpgroups (256 threads), each owning 64
//   of the rows and all 128 B rows: one m64n128k16 per warpgroup per k16 step. `wgmma_m256`: 256
//   rows, four warpgroups, 4 stages — an expert of up to 256 rows (K3 at T = 8192: ~146) in one
//   row tile, so its weights are streamed once instead of twice; the benchmark says which wins.
//   Gated blocks hold 64 up rows, then the 64 gate rows of the same columns, so the accumulator
//   columns c (up) and c + 64 (gate) of a row land in the same thread (d[i] and d[i + 32]) and the
//   activation is computed in registers. An n256 tile would halve the A traffic per FLOP but
//   doubles the accumulators (128 registers per thread); 128 first.
// - A warpgroup whose 64 rows hold none of the group's rows issues no wgmma (a group of 146 rows
//   has a second 128-row tile of 18 rows: one warpgroup works, the other only loads). Rows of a
//   tile past the group's end are zeros up to the next 16 rows and are never stored; rows further
//   on are not loaded (whatever the stage holds only reaches output rows that are not stored: each
//   output row depends on its own A row alone).
// - Loads: cp.async 16-byte copies by all threads (A rows are gathered through a_rows, which
//   Hopper's TMA cannot do), into the 128-byte swizzled layout that wgmma's descriptor reads
//   (warpgroup_mma.cuh derives the address of every element); stages 1024-byte aligned.
// - Pipeline of kStages stages (5 for 128 rows, 4 for 256: 160 and 192 KiB): chunk
//   i + kStages − 2 is loaded while chunk i is multiplied and chunk i − 1's wgmma may still run
//   (wgmma_wait<1>: one group stays in flight across the barrier), so 96 KiB of copies are in
//   flight per block. The stage refilled at iteration i held chunk i − 2, whose wgmma every
//   warpgroup waited for before the barrier of iteration i.
// - Summation order over K as in the other tiles: 64-wide chunks in order, in each the four k16
//   steps in order, each a wgmma into accumulators that start at zero (the hardware's order inside
//   a k16 step).
// - MXFP4 weights (kPacked shapes): a stage holds A's rows and B's packed rows (Mxfp4Stage); after
//   the stage's barrier all threads dequantize B into one of two bf16/f16 tiles in the same
//   swizzled layout (grouped_gemm_mxfp4.cuh), fence it for the async proxy, and a second barrier
//   hands it to the wgmma. Two tiles, because chunk i − 1's wgmma may still read its tile while
//   chunk i's is written; chunk i − 2's, whose tile is reused, is done everywhere after the first
//   barrier. The same values feed the same wgmma steps: the dense tile's bits.
// Only the sm_90a pass has a body; other architectures trap, and the host launches this kernel only
// on compute 9.0 (grouped_gemm.cu). Device code only.
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped_gemm.cuh"
#include "cuda/gemm/warpgroup_mma.cuh"

namespace lmoe::cuda {

// kRowsM / 64 warpgroups, each 64 of the rows × all kBRows = 128 B rows; kPacked: MXFP4 weights.
template <int kRowsMT, int kStagesT, bool kGatedT, bool kPackedT = false>
struct GroupedWgmmaShape {
  static constexpr int kRowsM = kRowsMT;
  static constexpr int kBRows = 128;  // wgmma's N: up rows, then gate rows
  static constexpr int kColsN = kGatedT ? kBRows / 2 : kBRows;  // output columns per block
  static constexpr bool kGated = kGatedT;
  static constexpr bool kPacked = kPackedT;
  static constexpr int kWarpgroups = kRowsM / 64;
  static constexpr int kThreads = kWarpgroups * 128;
  static constexpr int kStages = kStagesT;
  // The two dequantized B tiles (kPacked), then the stages.
  static constexpr int kBTileBytes = kPacked ? 2 * kBRows * 128 : 0;
  static constexpr int kStageBytes =
      kRowsM * 128 + (kPacked ? kBRows * (kMxfp4ChunkBytes + kMxfp4ScaleBytes) : kBRows * 128);
  // Dynamic shared memory starts after the static variables: 1 KiB of slack to align it to 1024.
  static constexpr int kSharedBytes = kBTileBytes + kStages * kStageBytes + 1024;
  static_assert(kRowsM % 64 == 0 && kRowsM <= 256, "whole m64 warpgroup tiles, ≤ 512 threads");
  static_assert(kStageBytes % 1024 == 0 && (kRowsM * 128) % 1024 == 0 && kBTileBytes % 1024 == 0,
                "1024-byte swizzle atoms");
  static_assert(kStages >= 3, "a stage for the loads, one being multiplied, one draining");
  static_assert(kSharedBytes + kRowsM * 8 + 64 <= 227 * 1024, "an H200 block's shared memory");
};

// Stores one warpgroup's m64n128 accumulators through the output mode (grouped_store): thread t
// holds d[4j + e] at row 16·(t / 32 % 4) + t % 32 / 4 + 8·(e / 2) of its 64, column
// 8j + 2·(t % 4) + e % 2 (warpgroup_mma.cuh); gated blocks hold the gate 64 columns further.
// `row_base` is this thread's first row in the tile; rows past the group's end and columns past N
// are not stored.
template <typename T, class Shape>
__device__ inline void grouped_wgmma_store(const GroupedGemmParams& p,
                                           const GroupedBlockTile<T>& tile, const float (&acc)[64],
                                           int row_base) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  constexpr int kOutBlocks = Shape::kColsN / 8;
#pragma unroll
  for (int j = 0; j < kOutBlocks; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = row_base + (e >= 2 ? 8 : 0);
      const std::int64_t col = tile.col0 + 8 * j + 2 * (lane % 4) + (e & 1);
      if (r >= tile.rows_here || col >= p.n) continue;
      const std::int64_t at = static_cast<std::int64_t>(tile.row0 + r) * p.ldc + col;
      if constexpr (Shape::kGated) {
        grouped_store<T>(p, at, acc[4 * j + e], acc[4 * (j + kOutBlocks) + e]);
      } else {
        grouped_store<T>(p, at, acc[4 * j + e], 0.0f);
      }
    }
  }
}

template <typename T, class Shape>
__global__ void __launch_bounds__(Shape::kThreads, 1)
    grouped_gemm_wgmma_kernel(GroupedGemmParams p) {
#if LMOE_HAS_WGMMA
  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  const GroupedBlockTile<T> tile = grouped_block_tile<T, Shape>(p);
  if (tile.group < 0) return;
  const int tid = static_cast<int>(threadIdx.x);
  const int rows_here = tile.rows_here;
  const int a_rows_used = (rows_here + 15) / 16 * 16;
  const std::uint32_t raw = static_cast<std::uint32_t>(__cvta_generic_to_shared(wgmma_smem));
  const std::uint32_t b_tiles = (raw + 1023u) & ~1023u;  // kPacked: the two dequantized B tiles
  [[maybe_unused]] unsigned char* const b_tiles_generic = wgmma_smem + (b_tiles - raw);
  const std::uint32_t smem = b_tiles + Shape::kBTileBytes;
  const int chunks = static_cast<int>((p.k + kGroupedTileK - 1) / kGroupedTileK);
  auto load_chunk = [&](int c) {
    grouped_load_chunk<T, Shape>(p, tile, a_rows_used, c,
                                 smem + (c % Shape::kStages) * Shape::kStageBytes);
  };

  // Broadcast from lane 0 so that the compiler sees values uniform over the warp: a wgmma under a
  // branch it takes for divergent makes ptxas serialize every wgmma of the kernel.
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
  const bool multiplies = __shfl_sync(0xffffffffu, warpgroup * 64 < rows_here ? 1 : 0, 0) != 0;
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
  wgmma_pin(acc);  // the zeros are in the registers before the first wgmma reads them

  // Chunks 0 … kStages − 3 first; iteration i commits chunk i + kStages − 2 (an empty group past
  // the last chunk keeps the count uniform), so waiting until kStages − 3 groups are pending
  // leaves chunk i landed.
#pragma unroll
  for (int c = 0; c < Shape::kStages - 2; ++c) {
    if (c < chunks) load_chunk(c);
    cp_async_commit();
  }
  for (int i = 0; i < chunks; ++i) {
    cp_async_wait<Shape::kStages - 3>();
    fence_proxy_async_shared();  // this thread's copies of chunk i, visible to wgmma's reads
    __syncthreads();  // every thread's copies of chunk i; chunk i − 2's wgmma done everywhere
    const std::uint32_t a_stage = smem + (i % Shape::kStages) * Shape::kStageBytes;
    std::uint32_t b_rows = a_stage + Shape::kRowsM * 128;
    if constexpr (Shape::kPacked) {
      // Into the tile chunk i − 2 read, from the stage's packed rows.
      const int b_tile = (i & 1) * Shape::kBRows * 128;
      mxfp4_dequantize_chunk<T, Shape>(tile.b_packed, tile.b2_packed, tile.col0, p.k, i,
                                       b_tiles_generic + (b_rows - b_tiles),
                                       b_tiles_generic + b_tile);
      fence_proxy_async_shared();  // this thread's stores, visible to wgmma's reads
      __syncthreads();             // the whole tile before any warpgroup's wgmma
      b_rows = b_tiles + b_tile;
    }
    if (multiplies) {
      const std::uint32_t a_rows = a_stage + warpgroup * 64 * 128;  // this warpgroup's 8 atoms
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kGroupedTileK / 16; ++ks) {
        wgmma_m64n128k16<T>(acc, wgmma_descriptor_128b(a_rows + ks * 32),
                            wgmma_descriptor_128b(b_rows + ks * 32));
      }
      wgmma_commit();
    }
    // The copies of chunk i + kStages − 2 go out while the tensor cores multiply chunk i, into the
    // stage of chunk i − 2.
    if (i + Shape::kStages - 2 < chunks) load_chunk(i + Shape::kStages - 2);
    cp_async_commit();
    // Chunk i − 1's group is done: its stage is refilled after the next barrier. Chunk i's group
    // still owns `acc`: nothing may touch it before the next wgmma or the final wait (ptxas would
    // insert a wait there).
    if (multiplies) wgmma_wait<1>();
  }
  cp_async_wait<0>();
  wgmma_wait<0>();  // on every path (none pending where !multiplies), or ptxas inserts one
  wgmma_pin(acc);
  if (!multiplies) return;

  grouped_wgmma_store<T, Shape>(p, tile, acc, warpgroup * 64 + (tid / 32 % 4) * 16 + tid % 32 / 4);
#else
  (void)p;
  __trap();  // no wgmma on this architecture: the host never launches it here
#endif
}

}  // namespace lmoe::cuda
