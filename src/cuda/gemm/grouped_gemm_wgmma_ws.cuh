// The grouped GEMM of grouped_gemm.cuh as a warp-specialized wgmma kernel (tile `wgmma_ws`, sm_90a
// only): one producer warpgroup fills a ring of shared-memory stages, two consumer warpgroups
// multiply from it, and per-stage mbarriers hand the stages back and forth — no block-wide barrier
// in the main loop, so the loads of later chunks never wait for the slowest warp's products.
//
// Choices, and why:
// - Block tile 256 rows × 128 B rows (as wgmma_m256: an expert of up to 256 rows, K3 at T = 8192
//   has ~146, streams its weights once). 384 threads: warpgroup 0 produces, warpgroups 1 and 2
//   consume; consumer w owns the 64-row slices w and w + 2 (rows 64·(2s + w) …), so a group of
//   65 … 128 rows keeps both consumers busy. A slice holding no row of the group issues no wgmma.
//   Each consumer holds 2 × 64 fp32 accumulators; setmaxnreg moves registers from the producer
//   (40) to the consumers (232): 128·40 + 256·232 ≤ 64 Ki.
// - B (the expert's weights, [groups, N, K]) by the copy engine (TMA): a 3-D tensor map over
//   (K, N, groups) made on the host (grouped_gemm.cu), box 64 k × 128 rows (gated: 64 up rows
//   from b's map, then 64 gate rows from b2's, as the wgmma tile interleaves them), 128-byte
//   swizzle — the layout wgmma's descriptor reads. Rows past N and k past K arrive as zeros.
// - A (the token rows, gathered through a_rows): the copy engine cannot gather on Hopper, so the
//   producer's 128 threads issue cp.async copies of the tile's rows (zeros past K, none past the
//   group's rows rounded up to 16) into the same swizzled layout and signal the stage's full
//   barrier with cp.async.mbarrier.arrive.noinc. Without a_rows (the down call: row r is A's row
//   r), the tile's whole 64-row boxes inside the group come by TMA too (a 2-D map over
//   [max_rows, K] with pitch lda) and only the rows after the last whole box by cp.async: a box
//   never reaches past the group's rows, so never past A's end (the host knows only max_rows).
// - Stage s: full[s] expects 128 + 1 arrivals (each producer thread's copies, plus thread 0's
//   arrive.expect_tx for the B box bytes); empty[s] expects 8 (lane 0 of each consumer warp, once
//   that warp's wgmma reading the stage has completed). 4 stages of 48 KiB. Consumers keep one
//   wgmma group in flight (wgmma_wait<1>): stage c − 1 is released while chunk c multiplies.
// - Epilogue: the consumers park their accumulators in the stages (idle once both consumers'
//   last wgmmas are done: a named barrier) and all three warpgroups store them from a loop, four
//   output columns per thread per step, so the activation's code exists once instead of once per
//   accumulator register.
// - Summation order over K as in the other tiles: 64-wide chunks in order, in each the four k16
//   steps in order, each a wgmma into accumulators that start at zero — the same bits as m64.
// The host launches it only on compute 9.0, with K, lda and the weight stride multiples of 8
// elements and 16-byte aligned operands (the tensor map's row pitch), and a driver that encodes
// tensor maps; elsewhere it runs the wgmma_m256 kernel (grouped_gemm.cu). Device code only.
#pragma once

#include <cuda.h>  // CUtensorMap (the type only: nothing links libcuda)

#include <cstdint>

#include "cuda/gemm/grouped_gemm_wgmma.cuh"
#include "cuda/runtime/hopper_async.cuh"

namespace lmoe::cuda {

template <bool kGatedT>
struct GroupedWgmmaWsShape {
  static constexpr int kRowsM = 256;
  static constexpr int kBRows = 128;  // wgmma's N: up rows, then gate rows
  static constexpr int kColsN = kGatedT ? kBRows / 2 : kBRows;  // output columns per block
  static constexpr bool kGated = kGatedT;
  static constexpr bool kPacked = false;                    // dense weights only
  static constexpr int kConsumers = 2;                      // warpgroups 1 … kConsumers
  static constexpr int kSlices = kRowsM / 64 / kConsumers;  // 64-row slices per consumer
  static constexpr int kThreads = (1 + kConsumers) * 128;
  static constexpr int kStages = 4;
  static constexpr int kStageBytes = (kRowsM + kBRows) * 128;
  static constexpr int kBoxRows = kGated ? kColsN : kBRows;  // rows of one TMA box
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  // Dynamic shared memory starts after the static variables: 1 KiB of slack to align it to 1024.
  static constexpr int kSharedBytes = kStages * kStageBytes + 1024;
  // The epilogue parks each consumer's accumulators in the stages: kSlices × 64 rows of kBRows
  // floats, rows padded by 8 floats (two-way bank conflicts for the fragment's 8-byte writes).
  static constexpr int kParkedPitch = kBRows + 8;
  static constexpr int kParkedFloats = kSlices * 64 * kParkedPitch;
  static_assert(kRowsM == 64 * kConsumers * 2,
                "two m64 slices per consumer (the kernel's branches)");
  static_assert(kConsumers * kParkedFloats * 4 <= kStages * kStageBytes, "parking in the stages");
  static_assert(kStageBytes % 1024 == 0 && (kRowsM * 128) % 1024 == 0, "1024-byte swizzle atoms");
  static_assert(kSharedBytes + kRowsM * 8 + 2 * kStages * 8 + 64 <= 227 * 1024,
                "an H200 block's shared memory");
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= 64 * 1024,
                "the SM's register file");
};

// Named barriers of the kernel (0 is __syncthreads'): the consumers' (their wgmmas are done with
// the stages), and every thread's (the accumulators are parked).
inline constexpr int kWsStagesFreeBarrier = 1;
inline constexpr int kWsParkedBarrier = 2;

// The tile's parked accumulators (consumer w's 64-row slice s at parked + w · kParkedFloats +
// s · 64 · kParkedPitch) through the output mode, by all kThreads threads: four consecutive
// output columns per thread per step (one 16-byte read of the parked up and gate values each, one
// vector store), consecutive threads on consecutive columns. Tile row q · 64 + r is slice q / 2 of
// consumer q % 2, so the parked rows come in tile-row order. Columns past N, and outputs that
// grouped_store4 cannot write, go one by one.
template <typename T, class Shape>
__device__ inline void grouped_ws_store_parked(const GroupedGemmParams& p,
                                               const GroupedBlockTile<T>& tile,
                                               const float* parked) {
  constexpr int kQuads = Shape::kColsN / 4;  // four-column groups per row
  static_assert(Shape::kColsN % 4 == 0 && Shape::kParkedPitch % 4 == 0, "16-byte parked reads");
  const bool vector_fits = grouped_store4_fits(p);
  const int quads = tile.rows_here * kQuads;
#pragma unroll 1
  for (int i = static_cast<int>(threadIdx.x); i < quads; i += Shape::kThreads) {
    const int row = i / kQuads, col = i % kQuads * 4;
    const int slice = row / 64, consumer = slice % Shape::kConsumers;
    const float* at = parked + consumer * Shape::kParkedFloats +
                      ((slice / Shape::kConsumers) * 64 + row % 64) * Shape::kParkedPitch + col;
    const float4 up = *reinterpret_cast<const float4*>(at);
    const float4 gate = Shape::kGated ? *reinterpret_cast<const float4*>(at + Shape::kColsN)
                                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const std::int64_t out_col = tile.col0 + col;
    const std::int64_t out = static_cast<std::int64_t>(tile.row0 + row) * p.ldc + out_col;
    if (vector_fits && out_col + 4 <= p.n) {
      grouped_store4<T>(p, out, up, gate);
      continue;
    }
#pragma unroll 1
    for (int e = 0; e < 4 && out_col + e < p.n; ++e) {
      // Selects, not an indexed array (which would live in local memory).
      const float u = e == 0 ? up.x : e == 1 ? up.y : e == 2 ? up.z : up.w;
      const float g = e == 0 ? gate.x : e == 1 ? gate.y : e == 2 ? gate.z : gate.w;
      grouped_store<T>(p, out + e, u, g);
    }
  }
}

template <typename T, class Shape>
__global__ void __launch_bounds__(Shape::kThreads, 1)
    grouped_gemm_wgmma_ws_kernel(GroupedGemmParams p, const __grid_constant__ CUtensorMap map_b,
                                 const __grid_constant__ CUtensorMap map_b2,
                                 const __grid_constant__ CUtensorMap map_a, bool a_by_tma) {
#if LMOE_HAS_WGMMA
  extern __shared__ __align__(1024) unsigned char wgmma_ws_smem[];
  __shared__ StageBarriers<Shape::kStages> bars;
  const int tid = static_cast<int>(threadIdx.x);
  const auto full_bar = [&](int s) { return bars.full(s); };
  const auto empty_bar = [&](int s) { return bars.empty(s); };
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < Shape::kStages; ++s) {
      mbarrier_init(full_bar(s), 128 + 1);
      mbarrier_init(empty_bar(s), Shape::kConsumers * 4);
    }
    mbarrier_init_fence();
  }
  // Its block barriers also publish the barriers' initialisation to every thread.
  const GroupedBlockTile<T> tile = grouped_block_tile<T, Shape>(p);
  if (tile.group < 0) return;
  const int rows_here = tile.rows_here;
  const std::uint32_t smem_base =
      static_cast<std::uint32_t>(__cvta_generic_to_shared(wgmma_ws_smem));
  const std::uint32_t smem = (smem_base + 1023u) & ~1023u;  // the stages' 1024-byte swizzle atoms
  // The epilogue's parking place: the stages, once every wgmma is done with them.
  float* const parked = reinterpret_cast<float*>(wgmma_ws_smem + (smem - smem_base));
  const int chunks = static_cast<int>((p.k + kGroupedTileK - 1) / kGroupedTileK);
  // Broadcast from lane 0 so that the compiler sees the role uniform over the warp (a wgmma under
  // a branch it takes for divergent makes ptxas serialize every wgmma of the kernel).
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);

  if (warpgroup == 0) {
    // Producer: chunk c into stage c % kStages once the consumers have released that stage's
    // previous round (a fresh barrier passes the wait on parity 1: every stage starts empty).
    setmaxnreg<Shape::kProducerRegs, false>();
    const T* a = static_cast<const T*>(p.a);
    const int a_parts = (rows_here + 15) / 16 * 16 * 8;  // 16-byte parts of the rows used
    const int a_boxes = a_by_tma ? rows_here / 64 : 0;   // whole 64-row boxes by TMA
    const int col0 = static_cast<int>(tile.col0);
    for (int c = 0; c < chunks; ++c) {
      const int s = c % Shape::kStages;
      const std::uint32_t round = static_cast<std::uint32_t>(c / Shape::kStages);
      mbarrier_wait(empty_bar(s), (round & 1u) ^ 1u);
      const std::uint32_t stage = smem + s * Shape::kStageBytes;
      const std::uint32_t b_stage = stage + Shape::kRowsM * 128;
      if (tid == 0) {
        mbarrier_arrive_expect_tx(full_bar(s), (Shape::kBRows + a_boxes * 64) * 128);
        tma_load_3d(b_stage, &map_b, full_bar(s), c * kGroupedTileK, col0, tile.group);
        if constexpr (Shape::kGated) {
          tma_load_3d(b_stage + Shape::kColsN * 128, &map_b2, full_bar(s), c * kGroupedTileK, col0,
                      tile.group);
        }
        for (int box = 0; box < a_boxes; ++box) {
          tma_load_2d(stage + box * 64 * 128, &map_a, full_bar(s), c * kGroupedTileK,
                      tile.row0 + box * 64);
        }
      }
      const std::int64_t k0 = static_cast<std::int64_t>(c) * kGroupedTileK;
      for (int i = a_boxes * 64 * 8 + tid; i < a_parts; i += 128) {
        const int row = i >> 3, part = i & 7;
        const std::int64_t k = k0 + part * 8;
        const std::int64_t at = tile.a_offset[row];
        grouped_copy16(stage + swizzle128(row, part), a + (at < 0 ? 0 : at) + k, a, k, p.k, at >= 0,
                       p.copy_bytes);
      }
      cp_async_mbarrier_arrive_noinc(full_bar(s));
    }
    // No copy of this thread in flight past here (the consumers wait for all of them through the
    // full barriers anyway).
    cp_async_commit();
    cp_async_wait<0>();
    // Then to the epilogue below, a third of it: the producer's warps would idle while the
    // consumers compute the activation (a large share of K3's up call: docs/layer.md).
  } else {
    // Consumers.
    setmaxnreg<Shape::kConsumerRegs, true>();
    const int consumer = warpgroup - 1;
    bool slice_used[Shape::kSlices];
#pragma unroll
    for (int sl = 0; sl < Shape::kSlices; ++sl) {
      const int used = (2 * sl + consumer) * 64 < rows_here ? 1 : 0;
      slice_used[sl] = __shfl_sync(0xffffffffu, used, 0) != 0;
    }
    float acc[Shape::kSlices][64];
#pragma unroll
    for (int sl = 0; sl < Shape::kSlices; ++sl) {
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[sl][i] = 0.0f;
      wgmma_pin(acc[sl]);  // the zeros are in the registers before the first wgmma reads them
    }
    const bool releases = tid % 32 == 0;  // lane 0 of each consumer warp arrives on empty
    for (int c = 0; c < chunks; ++c) {
      const int s = c % Shape::kStages;
      mbarrier_wait(full_bar(s), static_cast<std::uint32_t>(c / Shape::kStages) & 1u);
      // The producer's cp.async copies (generic proxy) of A, visible to wgmma's reads (async
      // proxy); the B box came through the async proxy already.
      fence_proxy_async_shared();
      const std::uint32_t stage = smem + s * Shape::kStageBytes;
      const std::uint32_t b_rows = stage + Shape::kRowsM * 128;
      // One branch per count of used slices (slice 1 is used only if slice 0 is), each a straight
      // run of wgmmas: a branch between two wgmmas makes ptxas fence the warpgroup before each.
      if (slice_used[Shape::kSlices - 1]) {
        wgmma_fence();  // inside each branch: ptxas fences again at a branch after the fence
#pragma unroll
        for (int ks = 0; ks < kGroupedTileK / 16; ++ks) {
#pragma unroll
          for (int sl = 0; sl < Shape::kSlices; ++sl) {
            const std::uint32_t a_rows = stage + (2 * sl + consumer) * 64 * 128;
            wgmma_m64n128k16<T>(acc[sl], wgmma_descriptor_128b(a_rows + ks * 32),
                                wgmma_descriptor_128b(b_rows + ks * 32));
          }
        }
      } else if (slice_used[0]) {
        wgmma_fence();
        const std::uint32_t a_rows = stage + consumer * 64 * 128;
#pragma unroll
        for (int ks = 0; ks < kGroupedTileK / 16; ++ks) {
          wgmma_m64n128k16<T>(acc[0], wgmma_descriptor_128b(a_rows + ks * 32),
                              wgmma_descriptor_128b(b_rows + ks * 32));
        }
      }
      wgmma_commit();
      // Chunk c − 1's group is done: its stage goes back to the producer. Chunk c's group still
      // owns `acc`: nothing may touch it before the next wgmma or the final wait.
      wgmma_wait<1>();
      if (c > 0 && releases) mbarrier_arrive(empty_bar((c - 1) % Shape::kStages));
    }
    wgmma_wait<0>();
#pragma unroll
    for (int sl = 0; sl < Shape::kSlices; ++sl) wgmma_pin(acc[sl]);

    // Epilogue through shared memory: once both consumers' wgmmas are done with the stages, each
    // consumer parks its accumulators there; every warpgroup then stores them from a loop (below).
    // Unrolled over the accumulator registers instead (grouped_wgmma_store), Kimi-K3's activation
    // (two tanh, an exp, three divisions) would be inlined 128 times: 200 KB of code that every
    // block fetches again (docs/layer.md).
    named_barrier_sync(kWsStagesFreeBarrier, Shape::kConsumers * 128);
    float* const consumer_parked = parked + consumer * Shape::kParkedFloats;
    const int lane = tid % 32;
    const int row_in_slice = (tid / 32 % 4) * 16 + lane / 4;
#pragma unroll
    for (int sl = 0; sl < Shape::kSlices; ++sl) {
#pragma unroll
      for (int j = 0; j < Shape::kBRows / 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = sl * 64 + row_in_slice + 8 * half;
          *reinterpret_cast<float2*>(consumer_parked + row * Shape::kParkedPitch + 8 * j +
                                     2 * (lane % 4)) =
              make_float2(acc[sl][4 * j + 2 * half], acc[sl][4 * j + 2 * half + 1]);
        }
      }
    }
  }
  // Every warpgroup: the parked accumulators to C (one copy of this code, run under the producer's
  // register limit too).
  named_barrier_sync(kWsParkedBarrier, Shape::kThreads);
  grouped_ws_store_parked<T, Shape>(p, tile, parked);
#else
  (void)p;
  (void)map_b;
  (void)map_b2;
  (void)map_a;
  (void)a_by_tma;
  __trap();  // no wgmma on this architecture: the host never launches it here
#endif
}

}  // namespace lmoe::cuda
