// The fused tier's chained up-projection at tp = 1 (sm_90a only): the second of two kernels chained
// by programmatic dependent launch (cuda/fused_chained_launch.hpp; the first writes N),
//
//   Y = round(round(N · w_upᵀ) + shared)   (DESIGN.md §3 `fused` with one rank)
//
// At T ≤ 128 the product is a stream of w_up (K3: 51 MB, ~12 µs at the measured copy rate) with
// little arithmetic per byte, so it is built as a skinny GEMM with the weights as wgmma's M and
// the tokens as its N ("swap AB": the tokens, too few for an M of 64, fill an N of 16 … 128):
//
// - A block owns 128 rows of w_up (a tile) and one range of K: split K over the blocks of a
//   cluster (tiles × splits blocks, at most one per SM, so that the SMs the tiles leave idle still
//   stream; K3 at tp 1: 56 tiles × 2). Warpgroup 0's first thread produces: it copies each 64-wide
//   chunk of K of the tile's rows and of N's rows (one box each: the copy engine's time goes by
//   boxes more than by bytes, measured) into a ring of stages with the copy engine (TMA, 128-byte
//   swizzle: the layout wgmma's descriptors read), completing on the stage's full mbarrier.
//   Warpgroups 1 and 2 consume: each multiplies its 64-row half of the tile by N's rows (four
//   m64nNk16 per chunk, fp32 accumulators in registers), keeps one wgmma group in flight and hands
//   the previous stage back through its empty mbarrier. No block-wide barrier in the main loop.
// - The weights do not depend on the first kernel: the producer issues the first ring of weight
//   copies before griddepcontrol.wait, so they stream while the norm still runs; N's copies follow
//   the wait.
// - Split K: the cluster's other blocks store their fp32 accumulators into block 0's (idle) stages
//   through distributed shared memory, and block 0 adds them in split order (a fixed order: the
//   bits do not depend on timing). Through global memory instead (partials, a fence and an arrival
//   counter) the finish took 2–9 µs at K3, T = 17 … 128 (the fence waits behind the weight stream).
// - The finish: block 0's consumers park round(U) in its stages as [token][row], and its threads
//   then store 16-byte vectors of round(round(U) + shared) along Y's rows (`shared` brought into
//   L2 by the producer's idle threads during the stream). Tokens ≥ T are never stored (their
//   columns of the product, from whatever N's unused rows hold, are dropped).
//
// The mma's K order is free under the contract (it bounds the product, not its order). Device code
// only.
#pragma once

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>

#include "cuda/dtype.cuh"
#include "cuda/fused_chained_launch.hpp"
#include "cuda/hopper_async.cuh"
#include "cuda/p2p_protocol.cuh"
#include "cuda/warpgroup_mma.cuh"

namespace lmoe::cuda {

__device__ inline void chained_trace(const FusedChainedParams& p, int point) {
  if (p.trace != nullptr) p.trace[blockIdx.x * kChainedTracePoints + point] = p2p_clock_ns();
}

template <int kN>
struct ChainedShape {
  static_assert(kN == 16 || kN == 32 || kN == 64 || kN == 128);
  static constexpr int kRowBytes = kChainedTileK * 2;  // 64 elements of 16 bits
  static constexpr int kWeightBytes = kChainedTileRows * kRowBytes;
  static constexpr int kStageBytes = kWeightBytes + kN * kRowBytes;
  // As many stages as ~192 KB hold, at most 8: room beside a norm block on the SM.
  static constexpr int kStages = std::min(8, 192 * 1024 / kStageBytes);
  static constexpr int kSharedBytes = kStages * kStageBytes + 1024;  // + alignment to 1024
  // A consumer thread's accumulators as float4 units (the partials' layout: [unit][256 threads]).
  static constexpr int kUnits = kN / 8;
  static constexpr int kPartialBytes = kUnits * 256 * 16;
  // The finish's parked round(U): a token's tile rows, padded by 16 bytes so that the fragment's
  // stores of one warp spread over the banks; after the other splits' partials.
  static constexpr int kParkPitch = kChainedTileRows * 2 + 16;
  static constexpr int kParkOffset = (kChainedMaxSplits - 1) * kPartialBytes;
  static_assert(kStageBytes % 1024 == 0, "1024-byte swizzle atoms");
  static_assert(kParkOffset + kN * kParkPitch <= kStages * kStageBytes,
                "partials and parking in the stages");
};

// kN: the wgmma N, the most tokens this instance serves.
template <typename T, int kN>
__global__ void __launch_bounds__(kChainedThreads, 1)
    fused_chained_up_kernel(const __grid_constant__ FusedChainedParams p) {
#if LMOE_HAS_WGMMA
  using Shape = ChainedShape<kN>;
  constexpr int kFragments = kN / 8;  // acc[4j … 4j + 3] holds tokens 8j … 8j + 7
  extern __shared__ __align__(1024) unsigned char chained_smem[];
  __shared__ StageBarriers<Shape::kStages> bars;
  const int tid = static_cast<int>(threadIdx.x);
  const auto full_bar = [&](int s) { return bars.full(s); };
  const auto empty_bar = [&](int s) { return bars.empty(s); };
  // The cluster's blocks are the tile's splits, in order (the launch's cluster size is p.splits).
  const int tile = static_cast<int>(blockIdx.x) / p.splits;
  const int split = static_cast<int>(blockIdx.x) % p.splits;
  const int chunks = static_cast<int>((p.l + kChainedTileK - 1) / kChainedTileK);
  const int c0 = split * chunks / p.splits;
  const int n = (split + 1) * chunks / p.splits - c0;
  // The bound is the host's contract; the clamp keeps a wrong T inside the stages.
  const std::int64_t t_read = p.tokens_device ? *p.tokens_device : p.tokens;
  const int tokens = static_cast<int>(t_read < 0 ? 0 : t_read > kN ? kN : t_read);
  if (tid == 0) {
    chained_trace(p, kChainedTraceEntry);
    for (int s = 0; s < Shape::kStages; ++s) {
      mbarrier_init(full_bar(s), 1);       // the producer's arrive.expect_tx
      mbarrier_init(empty_bar(s), 2 * 4);  // lane 0 of each consumer warp
    }
    mbarrier_init_fence();
    if (blockIdx.x == 0) atomicAdd(p.calls, 1u);
  }
  __syncthreads();
  const std::uint32_t smem_base =
      static_cast<std::uint32_t>(__cvta_generic_to_shared(chained_smem));
  const std::uint32_t smem = (smem_base + 1023u) & ~1023u;
  unsigned char* const park = chained_smem + (smem - smem_base);
  const auto stage_at = [&](int s) {
    return smem + static_cast<std::uint32_t>(s * Shape::kStageBytes);
  };
  // Uniform over the warp for the compiler (a wgmma under a branch it takes for divergent makes
  // ptxas serialize every wgmma of the kernel).
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
  float acc[kN / 2];

  if (warpgroup == 0) {
    if (tid == 0) {
      const CUtensorMap* n_map = &p.n_maps[kN == 16 ? 0 : kN == 32 ? 1 : kN == 64 ? 2 : 3];
      const int first = n < Shape::kStages ? n : Shape::kStages;
      const int row0 = tile * kChainedTileRows;
      const auto copy_weights = [&](int i) {
        const int s = i % Shape::kStages;
        mbarrier_arrive_expect_tx(full_bar(s), Shape::kStageBytes);
        tma_load_2d(stage_at(s), &p.w_map, full_bar(s), (c0 + i) * kChainedTileK, row0);
      };
      // N's kN rows (those past T hold whatever an earlier call left: their products are dropped).
      const auto copy_rows = [&](int i) {
        const int s = i % Shape::kStages;
        tma_load_2d(stage_at(s) + Shape::kWeightBytes, n_map, full_bar(s), (c0 + i) * kChainedTileK,
                    0);
      };
      // The first ring of weights, before N exists; then N, once the norm kernel has ended. (Two
      // stages before the wait instead of the ring: N ready at 1.8 µs instead of 4.1 at K3,
      // T = 17, as the norm's reads no longer queue behind the weights, but no faster overall.)
      for (int i = 0; i < first; ++i) copy_weights(i);
      pdl_wait();
      chained_trace(p, kChainedTraceNReady);
      for (int i = 0; i < first; ++i) copy_rows(i);
      for (int i = first; i < n; ++i) {
        // The consumers released the stage's previous round (round i / kStages − 1).
        mbarrier_wait(empty_bar(i % Shape::kStages),
                      static_cast<std::uint32_t>(i / Shape::kStages - 1) & 1u);
        copy_weights(i);
        copy_rows(i);
      }
    }
    __syncwarp();
    // The other producer threads bring the tile's columns of `shared` into L2 meanwhile, for the
    // finish's loads (two 128-byte lines per token: 256 bytes of a 128-row tile).
    if (tid >= 32) {
      const T* shared = static_cast<const T*>(p.shared);
      constexpr int kLines = kChainedTileRows * 2 / 128;
      for (int i = tid - 32; split == 0 && i < tokens * kLines; i += 96) {
        const std::int64_t row =
            static_cast<std::int64_t>(tile) * kChainedTileRows + i % kLines * 64;
        if (row < p.rows) {
          asm volatile("prefetch.global.L2 [%0];" ::"l"(shared + (i / kLines) * p.d + row));
        }
      }
    }
  } else {
    const int consumer = warpgroup - 1;
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) acc[i] = 0.0f;
    wgmma_pin(acc);
    const bool releases = tid % 32 == 0;
    for (int i = 0; i < n; ++i) {
      const int s = i % Shape::kStages;
      mbarrier_wait(full_bar(s), static_cast<std::uint32_t>(i / Shape::kStages) & 1u);
      const std::uint32_t a_rows =
          stage_at(s) + static_cast<std::uint32_t>(consumer * 64 * Shape::kRowBytes);
      const std::uint32_t b_rows = stage_at(s) + Shape::kWeightBytes;
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kChainedTileK / 16; ++ks) {
        wgmma_m64nk16<T, kN>(acc, wgmma_descriptor_128b(a_rows + ks * 32),
                             wgmma_descriptor_128b(b_rows + ks * 32));
      }
      wgmma_commit();
      // Chunk i − 1's group is done: its stage goes back to the producer.
      wgmma_wait<1>();
      if (i > 0 && releases) mbarrier_arrive(empty_bar((i - 1) % Shape::kStages));
    }
    wgmma_wait<0>();
    wgmma_pin(acc);
    if (tid == 128) chained_trace(p, kChainedTraceMultiplied);
  }
  // Every wgmma of the block is done with its stages and every copy has landed (each was waited
  // for): the stages hold the partials and the parked outputs from here.
  __syncthreads();

  const int consumer_tid = tid - 128;  // 0 … 255 in the consumers
  const int fragments = (tokens + 7) / 8;
  if (p.splits > 1) {
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // block 0's stages are free for the others' partials
    if (split > 0) {
      float4* theirs = cluster.map_shared_rank(
          reinterpret_cast<float4*>(park + (split - 1) * Shape::kPartialBytes), 0);
      if (warpgroup > 0) {
#pragma unroll
        for (int j = 0; j < kFragments; ++j) {
          if (j < fragments) {
            theirs[j * 256 + consumer_tid] =
                make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
          }
        }
      }
      cluster.sync();  // the partials are in block 0's memory
      if (tid == 0) chained_trace(p, kChainedTraceEnd);
      return;
    }
    cluster.sync();
    if (warpgroup > 0) {
      // Split 0's sums (in registers) plus splits 1, 2, … in order.
      for (int s = 1; s < p.splits; ++s) {
        const float4* split_units =
            reinterpret_cast<const float4*>(park + (s - 1) * Shape::kPartialBytes) + consumer_tid;
#pragma unroll
        for (int j = 0; j < kFragments; ++j) {
          if (j < fragments) {
            const float4 v = split_units[j * 256];
            acc[4 * j] = __fadd_rn(acc[4 * j], v.x),
                    acc[4 * j + 1] = __fadd_rn(acc[4 * j + 1], v.y);
            acc[4 * j + 2] = __fadd_rn(acc[4 * j + 2], v.z);
            acc[4 * j + 3] = __fadd_rn(acc[4 * j + 3], v.w);
          }
        }
      }
    }
  }
  unsigned char* const parked = park + Shape::kParkOffset;
  if (warpgroup > 0) {
    // acc[4j + e]: row 64·consumer + 16·(warp % 4) + lane / 4 + 8·(e / 2), token 8j + 2·(lane % 4)
    // + e % 2; parked as round(U) at token · kParkPitch + 2 · row.
    const int lane = tid % 32;
    const int row = (warpgroup - 1) * 64 + (tid / 32 % 4) * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < kFragments; ++j) {
      if (j < fragments) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int token = 8 * j + 2 * (lane % 4) + e % 2;
          *reinterpret_cast<T*>(parked + token * Shape::kParkPitch + 2 * (row + 8 * (e / 2))) =
              Storage<T>::store(acc[4 * j + e]);
        }
      }
    }
  }
  __syncthreads();
  constexpr int kVectors = kChainedTileRows / 8;  // 16-byte vectors of a token's tile row
  const std::int64_t tile_row0 = static_cast<std::int64_t>(tile) * kChainedTileRows;
  const T* shared = static_cast<const T*>(p.shared);
  T* out = static_cast<T*>(p.out);
  // A thread's vectors i = tid + 384·k, kBatch at a time: their loads of `shared` (in L2: the
  // producer's threads prefetched them) issued before the first add.
  constexpr int kBatch = 2;
  const int units = tokens * kVectors;
#pragma unroll 1
  for (int first = tid; first < units; first += kBatch * kChainedThreads) {
    Vec16<T> s[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = first + k * kChainedThreads, t = i / kVectors, v = i % kVectors;
      const std::int64_t row = tile_row0 + 8 * v;
      // rows % 8 == 0: a vector is all inside or all past
      if (i < units && row < p.rows)
        s[k] = *reinterpret_cast<const Vec16<T>*>(shared + t * p.d + row);
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = first + k * kChainedThreads, t = i / kVectors, v = i % kVectors;
      const std::int64_t row = tile_row0 + 8 * v;
      if (i >= units || row >= p.rows) continue;
      const Vec16<T> u =
          *reinterpret_cast<const Vec16<T>*>(parked + t * Shape::kParkPitch + 16 * v);
      Vec16<T> y;
#pragma unroll
      for (int e = 0; e < Vec16<T>::kSize; ++e) {
        y.v[e] =
            Storage<T>::store(__fadd_rn(Storage<T>::load(u.v[e]), Storage<T>::load(s[k].v[e])));
      }
      *reinterpret_cast<Vec16<T>*>(out + t * p.d + row) = y;
    }
  }
  if (tid == 0) chained_trace(p, kChainedTraceEnd);
#else
  (void)p;
  __trap();  // no wgmma on this architecture: the host never launches it here
#endif
}

}  // namespace lmoe::cuda
