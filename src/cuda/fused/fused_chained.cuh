// The fused tier's chained up-projection (sm_90a only): the kernel after the one that writes N,
// chained by programmatic dependent launch (cuda/fused_chained_launch.hpp),
//
//   Y = round(round(N · w_upᵀ) + shared)   (DESIGN.md §3 `fused` with one rank)
//
// With several ranks it multiplies the rank's stripe of w_up, `shared` is the stripe's rank sum
// (the exchange kernel's, cuda/fused_chained_exchange.cuh) and each output vector also goes to
// every peer as lines for the gather kernel after it.
//
// At T ≤ 128 the product is a stream of w_up (K3: 51 MB) with
// little arithmetic per byte, so it is built as a skinny GEMM with the weights as wgmma's M and
// the tokens as its N ("swap AB": the tokens, too few for an M of 64, fill an N of 16 … 128):
//
// - A block owns a tile of 64 or 128 rows of w_up and one range of K: split K over the blocks of
//   a cluster (tiles × splits blocks, at most one per SM, so that the SMs the tiles leave idle
//   still stream; the plan, cuda/fused_chained_launch.hpp, takes the tile that puts more SMs to
//   work: K3 at tp 1 112 tiles of 64 rows, a stripe of 896 rows 14 × 8 splits). Warpgroup 0's first
//   thread produces: it copies each 64-wide chunk of K of the tile's rows and of N's rows (one box
//   each: the copy engine's time goes by boxes more than by bytes, measured) into a ring of stages
//   with the copy engine (TMA, 128-byte swizzle: the layout wgmma's descriptors read), completing
//   on the stage's full mbarrier.
//   Consumers: in a tile of 128 rows warpgroups 1 and 2 each multiply a 64-row half by N's rows
//   (four m64nNk16 per chunk); in a tile of 64 warpgroup 1 alone multiplies all of it (four
//   m64nNk16 a chunk keep ahead of the stream) and warpgroup 2 only helps finish, so that no
//   partial sums of the block's own are stored and added (docs/fused.md, "The chained path"); fp32
//   accumulators in registers, one wgmma group in flight, the previous stage handed back through
//   its empty mbarrier. No block-wide barrier in the main loop.
// - The weights do not depend on the first kernel: the first ring of weight copies is issued
//   before griddepcontrol.wait, so they stream while the norm still runs; N's copies follow the
//   wait. Paced (pace_cycles > 0; one rank by default): a thread of its own issues them one box
//   every pace_cycles at about the rate the memory serves the grid, instead of the producer all at
//   once, so that the memory's queue holds what keeps it busy and not the whole grid's first round
//   ahead of the norm kernel's reads (N is ready sooner: docs/fused.md).
// - Split K over the S blocks of a cluster (S a power of two ≤ 8; a narrow stripe such as K3's 896
//   rows at tp 8: 8), summed as a reduce-scatter through distributed shared memory: block q of the
//   cluster finishes the tile's q-th slice of tile / S rows; every consumer stores its fp32
//   accumulators of each slice into the slice owner's (idle) stages, and all of q's threads add
//   the partials of its slice in a fixed order (splits in order: the bits do not depend on
//   timing; like the mma's K order, the partition of K is the plan's).
//   Where they fit (up to 64 tokens in tiles of 64, 32 in tiles of 128) the partials have shared
//   memory of their own beside the ring, so the blocks store them as soon as they are done
//   multiplying and one cluster barrier closes the exchange (with the partials in the stages it
//   takes a barrier before the stores as well). Global memory is no way around it: its fence waits
//   behind the weight stream (docs/fused.md).
// - The finish: each block parks round(U) of its slice in its stages as [token][row], and its
//   threads then store 16-byte vectors of round(round(U) + shared) along Y's rows, the block's
//   slice of `shared` copied into shared memory during the stream (cp.async, by two producer
//   warps once the kernels before have ended). Tokens ≥ T are never stored (their columns
//   of the product, from whatever N's unused rows hold, are dropped).
//
// The mma's K order is free under the contract (it bounds the product, not its order). Device code
// only.
#pragma once

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>

#include "cuda/comm/p2p_protocol.cuh"
#include "cuda/fused/fused_chained_launch.hpp"
#include "cuda/fused/fused_ll.cuh"
#include "cuda/fused/fused_protocol.cuh"
#include "cuda/gemm/warp_mma.cuh"
#include "cuda/gemm/warpgroup_mma.cuh"
#include "cuda/runtime/dtype.cuh"
#include "cuda/runtime/hopper_async.cuh"

namespace lmoe::cuda {

__device__ inline void chained_trace(const FusedChainedParams& p, int point) {
  if (p.trace != nullptr) p.trace[blockIdx.x * kChainedTracePoints + point] = p2p_clock_ns();
}

template <int kN, int kTileRows>
struct ChainedShape {
  static_assert(kN == 16 || kN == 32 || kN == 64 || kN == 128);
  static_assert(kTileRows == 64 || kTileRows == 128);
  static constexpr int kTileShift = kTileRows == 128 ? 7 : 6;
  // The warpgroups that multiply: one in a tile of 64 (all rows, all of K: four m64nNk16 a chunk
  // keep ahead of the stream at every N, and no partial sums of the block's own are stored and
  // added), two in a tile of 128 (64 rows each).
  static constexpr int kConsumers = kTileRows == 64 ? 1 : 2;
  // Every consumer multiplies its rows over all of the chunk's K (its own 64 rows of a tile of
  // 128, or all of a tile of 64), so a block holds one partial sum of each row: with split K the
  // cluster's blocks add theirs, in split order.
  static constexpr int kStepsPerConsumer = kChainedTileK / 16;  // k16 wgmmas a chunk
  static constexpr int kRowBytes = kChainedTileK * 2;           // 64 elements of 16 bits
  static constexpr int kWeightBytes = kTileRows * kRowBytes;
  static constexpr int kStageBytes = kWeightBytes + kN * kRowBytes;
  // The block's slice of `shared` (kN tokens × its rows, at most a whole tile's), copied into
  // shared memory while the block streams (the finish adds it from there).
  static constexpr int kSliceBytes = kN * kTileRows * 2;
  // As many stages as ~192 KB hold, at most 8 of 128 rows (16 of 64: the same weight bytes in
  // flight), and fewer where the slice would not fit beside them in 220 KB (128 tokens in tiles of
  // 128: 5 stages): room beside a norm block on the SM.
  static constexpr int kStages = std::min({kTileRows == 128 ? 8 : 16, 192 * 1024 / kStageBytes,
                                           (220 * 1024 - 1024 - kSliceBytes) / kStageBytes});
  static constexpr int kRingBytes = kStages * kStageBytes;
  // The partials of a block's slice, [part][fragment][slot] float2 (part = split), slot = 4 · (row
  // in the slice) + lane % 4: S parts × kN / 8 fragments × 4 · kTileRows / S slots, whatever S.
  static constexpr int kPartialBytes = kTileRows * kN * 4;
  // Where ring, partials and slice fit in 220 KB (up to 64 tokens in tiles of 64, 32 in tiles of
  // 128) the partials have a region of their own past the ring: the cluster's blocks may then store
  // into it while its owner still multiplies, and the reduction takes one cluster barrier instead
  // of two. Larger classes keep them in the stages.
  static constexpr bool kOwnPartials =
      kRingBytes + kPartialBytes + kSliceBytes + 1024 <= 220 * 1024;
  static constexpr int kPartialOffset = kOwnPartials ? kRingBytes : 0;
  static constexpr int kSliceOffset = kRingBytes + (kOwnPartials ? kPartialBytes : 0);
  static constexpr int kSharedBytes = kSliceOffset + kSliceBytes + 1024;  // + alignment to 1024
  // The finish's parked round(U) of the block's slice: a token's rows, padded by 16 bytes so that
  // the fragment's stores of one warp spread over the banks; in the stages, past the partials
  // where they are there too.
  static constexpr int kParkPitch = kTileRows * 2 + 16;
  static constexpr int kParkOffset = kOwnPartials ? 0 : kPartialBytes;
  static_assert(kStageBytes % 1024 == 0, "1024-byte swizzle atoms");
  static_assert(kParkOffset + kN * kParkPitch <= kRingBytes, "parking in the stages");
};

// kN: the wgmma N, the most tokens this instance serves; kTileRows: rows of w_up per tile (64 or
// 128, the plan's).
template <typename T, int kN, int kTileRows>
__global__ void __launch_bounds__(kChainedThreads, 1)
    fused_chained_up_kernel(const __grid_constant__ FusedChainedParams p) {
#if LMOE_HAS_WGMMA
  using Shape = ChainedShape<kN, kTileRows>;
  constexpr int kFragments = kN / 8;  // acc[4j … 4j + 3] holds tokens 8j … 8j + 7
  extern __shared__ __align__(1024) unsigned char chained_smem[];
  __shared__ StageBarriers<Shape::kStages> bars;
  __shared__ std::uint32_t call_epoch;  // tp > 1: the call's epoch, for the output's lines
  __shared__ alignas(8) std::uint64_t slice_bar;  // the slice of `shared` has landed
  __shared__ int call_tokens;                     // T, for the finish
  // The stream's next kernel may start at once: with several ranks the call's last kernel (the
  // gather of the peers' stripes), which waits for this one before it closes the call; with one
  // rank the next call's norm kernel, launched programmatically (launch_fused_chained), so that
  // this kernel's successor streams its weights as soon as this one's blocks leave their SMs.
  pdl_launch_dependents();
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  constexpr int kSliceCopiers = 64;  // threads 64 … 127 copy the slice of `shared`
  const auto full_bar = [&](int s) { return bars.full(s); };
  const auto slice_addr = [&] {
    return static_cast<std::uint32_t>(__cvta_generic_to_shared(&slice_bar));
  };
  const auto empty_bar = [&](int s) { return bars.empty(s); };
  // The cluster's blocks are the tile's splits, in order (the launch's cluster size is p.splits).
  const int tile = static_cast<int>(blockIdx.x) / p.splits;
  const int split = static_cast<int>(blockIdx.x) % p.splits;
  // The block finishes its slice of the tile: rows [split · R, split · R + R), R = kTileRows /
  // splits. splits is a power of two: shifts and masks below, as a division by a value known only
  // at run time costs ~20 instructions, which the finish's parking of fragments felt.
  const int slice_shift = Shape::kTileShift - (31 - __clz(p.splits));  // R = 1 << slice_shift
  const int slice_rows = 1 << slice_shift;
  const int chunks = static_cast<int>((p.l + kChainedTileK - 1) / kChainedTileK);
  const int c0 = split * chunks / p.splits;
  const int n = (split + 1) * chunks / p.splits - c0;
  // T, read once the kernels before this one have ended (griddepcontrol.wait: with one rank the
  // norm kernel may itself have started before the kernel that wrote T ended), within the launch's
  // bound (the caller's rows) and the instance's; a T past them runs no rows, recorded here with
  // one rank (with several the exchange kernel records it).
  const auto read_tokens = [&] {
    const std::int64_t bound = p.tokens < kN ? p.tokens : kN;
    const int t = fused_call_tokens(p.tokens_device, p.tokens, bound, {p.status, p.abort_flag, 0},
                                    blockIdx.x == 0 && tid == 64);
    return t < 0 ? 0 : t;
  };

  // The finish's vectors: a token's slice is `vectors` of 16 bytes.
  const int vectors_shift = slice_shift - 3,
            vectors = 1 << vectors_shift;  // a token's 16-byte vectors
  const std::int64_t slice_row0 = static_cast<std::int64_t>(tile) * kTileRows + split * slice_rows;
  T* out = static_cast<T*>(p.out);
  // The ring's first round, asked for before N exists: `first` stages.
  const int first = n < Shape::kStages ? n : Shape::kStages;
  const bool paced = p.pace_cycles > 0;
  if (tid == 0) {
    chained_trace(p, kChainedTraceEntry);
    for (int s = 0; s < Shape::kStages; ++s) {
      mbarrier_init(full_bar(s), 1);                       // the producer's arrive.expect_tx
      mbarrier_init(empty_bar(s), Shape::kConsumers * 4);  // lane 0 of each consumer warp
    }
    mbarrier_init(slice_addr(), kSliceCopiers);  // each copier once its copies have landed
    mbarrier_init_fence();
    // Paced (below): the first round's bytes are expected before any thread issues its copies.
    if (paced) {
      for (int i = 0; i < first; ++i) mbarrier_arrive_expect_tx(full_bar(i), Shape::kStageBytes);
    }
    if (blockIdx.x == 0) atomicAdd(p.calls, 1u);
  }
  // Split K with the partials in a region of their own: this block has started (the finish's
  // first cluster wait proves it for every block before any stores into another's memory).
  if (Shape::kOwnPartials && p.splits > 1) cluster_arrive_relaxed();
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
    const int row0 = tile * kTileRows;
    const auto issue_weights = [&](int i) {
      const int s = i % Shape::kStages;
      tma_load_2d(stage_at(s), &p.w_map, full_bar(s), (c0 + i) * kChainedTileK, row0);
    };
    if (tid == 0) {
      const CUtensorMap* n_map = &p.n_maps[kN == 16 ? 0 : kN == 32 ? 1 : kN == 64 ? 2 : 3];
      const auto copy_weights = [&](int i) {
        mbarrier_arrive_expect_tx(full_bar(i % Shape::kStages), Shape::kStageBytes);
        issue_weights(i);
      };
      // N's kN rows (those past T hold whatever an earlier call left: their products are dropped).
      const auto copy_rows = [&](int i) {
        const int s = i % Shape::kStages;
        tma_load_2d(stage_at(s) + Shape::kWeightBytes, n_map, full_bar(s), (c0 + i) * kChainedTileK,
                    0);
      };
      // The first ring of weights, before N exists; then N, once the norm kernel has ended (fewer
      // stages before the wait make N ready sooner but the call no faster: docs/fused.md).
      if (!paced) {
        for (int i = 0; i < first; ++i) copy_weights(i);
      }
      pdl_wait();
      chained_trace(p, kChainedTraceNReady);
      if (p.tp > 1)
        call_epoch = *p.epoch + 1;  // the exchange kernel has ended: nothing advances it
      for (int i = 0; i < first; ++i) copy_rows(i);
      for (int i = first; i < n; ++i) {
        // The consumers released the stage's previous round (round i / kStages − 1).
        mbarrier_wait(empty_bar(i % Shape::kStages),
                      static_cast<std::uint32_t>(i / Shape::kStages - 1) & 1u);
        copy_weights(i);
        copy_rows(i);
      }
    } else {
      if (tid == 32 && paced) {
        // The first round paced: pace_burst copies at once, then one every pace_cycles, so that
        // the memory's queue holds about what keeps it busy rather than every block's whole first
        // round — the norm kernel's reads of the rows, issued once the kernel before it has
        // ended, queue behind whatever is asked for ahead of them, and N waits for them.
        const long long start = clock64();
        for (int i = 0; i < first; ++i) {
          const long long due = static_cast<long long>(i - p.pace_burst + 1) * p.pace_cycles;
          while (i >= p.pace_burst && clock64() - start < due) {
          }
          issue_weights(i);
        }
      }
      if (tid >= 64) {
        // The block's slice of `shared` [T, slice rows] into shared memory, once the kernels
        // before this one have ended (with several ranks `shared` is the exchange kernel's; T may
        // be the kernel's before the norm kernel), by the producer's last two warps: 16-byte
        // cp.asyncs, each thread's landed copies one arrival on slice_bar. Not loads into
        // registers: the compiler unpacks a loaded vector at once, so a load is waited for where
        // it is issued and the finish would wait for them. Not bulk copies of a token's rows: a
        // narrow stripe's split blocks copy only 16 bytes a token.
        pdl_wait();
        const int t_count = read_tokens();
        if (tid == 64) call_tokens = t_count;
        const T* shared = static_cast<const T*>(p.shared);
        for (int i = tid - 64; i < t_count * vectors; i += kSliceCopiers) {
          const int t = i >> vectors_shift, v = i & (vectors - 1);
          const std::int64_t row = slice_row0 + 8 * v;  // rows % 8 == 0: whole vectors
          if (row < p.rows) {
            cp_async16(smem + Shape::kSliceOffset + static_cast<std::uint32_t>(16 * i),
                       shared + t * p.shared_pitch + row, true);
          }
        }
        cp_async_mbarrier_arrive_noinc(slice_addr());
      }
    }
  } else if (warpgroup <= Shape::kConsumers) {
    const int consumer = warpgroup - 1;
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) acc[i] = 0.0f;
    wgmma_pin(acc);
    const bool releases = tid % 32 == 0;
    for (int i = 0; i < n; ++i) {
      const int s = i % Shape::kStages;
      mbarrier_wait(full_bar(s), static_cast<std::uint32_t>(i / Shape::kStages) & 1u);
      // The consumer's 64 rows (a tile of 128: its half; of 64: all), all of K (32 bytes of a
      // swizzled row per k16 step).
      const std::uint32_t a_rows = stage_at(s) + consumer * 64 * Shape::kRowBytes;
      const std::uint32_t b_rows = stage_at(s) + Shape::kWeightBytes;
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < Shape::kStepsPerConsumer; ++ks) {
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
  const int tokens = call_tokens;
  const int units = tokens * vectors;

  const int fragments = (tokens + 7) / 8;
  // acc[4j + 2h + e] (h, e ∈ {0, 1}): tile row `fragment_row` + 8h, token 8j + 2 · (lane % 4) + e.
  const int fragment_row = (warpgroup - 1) * 64 + (tid / 32 % 4) * 16 + lane / 4;
  unsigned char* const parked = park + Shape::kParkOffset;
  // round(U) of (token, tile row) into the parking: token · kParkPitch + 2 · (row in the slice).
  const auto park_u = [&](int token, int row, float u) {
    *reinterpret_cast<T*>(parked + token * Shape::kParkPitch + 2 * (row & (slice_rows - 1))) =
        Storage<T>::store(u);
  };
  const int parts = p.splits;
  if (parts == 1) {
    if (tid == 0) chained_trace(p, kChainedTracePartials);
    if (warpgroup > 0 && warpgroup <= Shape::kConsumers) {  // the multiplying warpgroups
      // The slice is the tile: the thread's first element's address once, the others at offsets
      // known when compiling (with park_u's address computed for every element, parking 128
      // tokens took ~700 instructions a thread).
      unsigned char* const mine = parked + 2 * (lane % 4) * Shape::kParkPitch + 2 * fragment_row;
#pragma unroll
      for (int j = 0; j < kFragments; ++j) {
        if (j < fragments) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              *reinterpret_cast<T*>(mine + (8 * j + e) * Shape::kParkPitch + 16 * h) =
                  Storage<T>::store(acc[4 * j + 2 * h + e]);
            }
          }
        }
      }
      if (tid == 128) chained_trace(p, kChainedTraceStored);
    }
  } else {
    // Every consumer stores each fragment pair into the memory of the slice's owner (its own
    // block's when it owns the slice, or when the tile is not split),
    // [part][fragment][slot] (part = split), slot = 4 · (row in the slice) + lane % 4; then all of
    // the owner's threads sum the parts of its slice in split order and park round(U).
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    float2* const partials = reinterpret_cast<float2*>(park + Shape::kPartialOffset);
    const int slots_shift = slice_shift + 2, slots = 1 << slots_shift;  // 4 · R
    if (p.splits > 1) {
      // The owners' partials may be written once every block of the cluster has started (a region
      // of its own) or is done with its stages (partials in the stages). One block: its own
      // stages are free since the barrier above.
      if (!Shape::kOwnPartials) cluster_arrive_release();
      cluster_wait();
    }
    if (warpgroup > 0 && warpgroup <= Shape::kConsumers) {  // the multiplying warpgroups
      const int part = split;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = fragment_row + 8 * h, owner = row >> slice_shift;
        float2* const mine =
            partials + part * kFragments * slots + (row & (slice_rows - 1)) * 4 + lane % 4;
        float2* const theirs = p.splits > 1 ? cluster.map_shared_rank(mine, owner) : mine;
#pragma unroll
        for (int j = 0; j < kFragments; ++j) {
          if (j < fragments)
            theirs[j * slots] = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        }
      }
    }
    // The slices' partials are in their owners' memory.
    if (p.splits > 1) {
      cluster_arrive_release();
      cluster_wait();
    } else {
      __syncthreads();
    }
    if (tid == 0) chained_trace(p, kChainedTracePartials);
    const int pairs = fragments * slots;
    for (int i = tid; i < pairs; i += kChainedThreads) {
      float2 sum = partials[i];
      for (int s = 1; s < parts; ++s) {
        const float2 v = partials[s * kFragments * slots + i];
        sum.x = __fadd_rn(sum.x, v.x);
        sum.y = __fadd_rn(sum.y, v.y);
      }
      const int j = i >> slots_shift, slot = i & (slots - 1);
      const int token = 8 * j + 2 * (slot & 3), row = slot >> 2;
      park_u(token, row, sum.x);
      park_u(token + 1, row, sum.y);
    }
    if (tid == 0) chained_trace(p, kChainedTraceStored);
  }
  __syncthreads();
  if (tid == 0) chained_trace(p, kChainedTraceParked);
  mbarrier_wait(slice_addr(), 0);  // the slice of `shared` has landed
  const unsigned char* const slice = park + Shape::kSliceOffset;
#pragma unroll 1
  for (int i = tid; i < units; i += kChainedThreads) {
    const int t = i >> vectors_shift, v = i & (vectors - 1);
    const std::int64_t row = slice_row0 + 8 * v;
    if (row >= p.rows) continue;
    const Vec16<T> u = *reinterpret_cast<const Vec16<T>*>(parked + t * Shape::kParkPitch + 16 * v);
    const Vec16<T> a = *reinterpret_cast<const Vec16<T>*>(slice + 16 * i);
    Vec16<T> y;
#pragma unroll
    for (int e = 0; e < Vec16<T>::kSize; ++e)
      y.v[e] = Storage<T>::store(__fadd_rn(Storage<T>::load(u.v[e]), Storage<T>::load(a.v[e])));
    *reinterpret_cast<Vec16<T>*>(out + t * p.out_pitch + row) = y;
    // tp > 1: and to every peer, two lines of 4 elements each (its gather copies them into its
    // Y).
    const uint4 bits = *reinterpret_cast<const uint4*>(&y);
    for (int r = 0; r < p.tp; ++r) {
      if (r == p.rank) continue;
      std::byte* line = ll_line_in(p.workspace[r], p.lines_offset, p.lines_parity_bytes,
                                   call_epoch & 1u, p.rank, p.lines_slot, t * p.rows + row);
      ll_store(line, make_uint2(bits.x, bits.y), call_epoch);
      ll_store(line + 16, make_uint2(bits.z, bits.w), call_epoch);
    }
  }
  if (tid == 0) chained_trace(p, kChainedTraceEnd);
#else
  (void)p;
  __trap();  // no wgmma on this architecture: the host never launches it here
#endif
}

}  // namespace lmoe::cuda
