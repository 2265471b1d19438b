// The fused decode tail: one kernel per rank does the whole tail for T ≤ 256 tokens,
//
//   Y = round(round(N · w_upᵀ) + round(Σ_r shared_r)),  N = round(rmsnorm(round(Σ_r routed_r)))
//
// exchanging data with its peers through their workspaces (docs/fused.md). Device code only.
//
// A call of epoch e on rank r, with G blocks of 256 threads on every rank:
//   0. every block prefetches its part of w_up's stripe into L2 (the weights stream while the
//      peers are still on their way);
//   1. stage: block 0 sends T to every peer (a line, cuda/fused_ll.cuh); the blocks copy routed
//      [T, l] and shared [T, d] into r's workspace (parity e & 1), and each block then adds 1 to
//      inputs_arrived[r] in every peer's flags (release, system);
//   2. norm: once every peer's inputs_arrived[p] reached the call's target (the grids of the
//      calls before it plus G, cuda/fused_protocol.cuh), and every peer's T is r's (else the call
//      fails on every rank, naming both), block b reduces rows t ≡ b (mod G)
//      of the latent over the ranks in rank order, rounds, and normalizes them in the canonical
//      order of cuda/rms_norm.cuh into N (r's own memory); then rows_done += 1;
//   3. stripe: once rows_done reached the target (every row of N is there), block b computes
//      block-tiles b, b + G, … of r's stripe of output columns: N · w_stripeᵀ on tensor cores
//      (mma.sync m16n8k16, fp32 accumulate, the K range split over the 8 warps and summed in warp
//      order), rounded, plus the rank-order sum of the peers' shared columns, rounded, into Y's
//      columns of the stripe and into r's staged stripe; then stripes_arrived[r] += 1 in every
//      peer's flags;
//   4. gather: once stripes_arrived[p] reached the target, the blocks copy peer p's staged stripe
//      into Y.
//   The last block to finish stores epoch = e and the counters' new base, and frees the workspace.
// Two parities suffice: a peer can be at most one call ahead (call e + 1 needs our inputs of
// e + 1, staged only after our call e has finished reading everything of e), and it writes the
// other parity. Every wait is bounded and fails into the p2p group's status record and abort flag.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/fused/fused_ll.cuh"
#include "cuda/fused/fused_protocol.cuh"
#include "cuda/fused/fused_tail_types.hpp"
#include "cuda/gemm/warp_mma.cuh"
#include "cuda/runtime/dtype.cuh"
#include "cuda/tail/rms_norm.cuh"

namespace lmoe::cuda {

// Phase 2 for one row t: latent = round(Σ_r routed_r[t]) in rank order, N[t] =
// round(rmsnorm(latent)). Every thread of the block calls it (the sum of squares holds a barrier).
template <typename T>
__device__ void fused_norm_row(const FusedTailParams& p, std::int64_t t, std::uint32_t parity,
                               float* lane_sums) {
  const int lane = static_cast<int>(threadIdx.x);
  const std::int64_t chunks = p.l / kNormChunk;
  T* normed = fused_at<T>(p, p.rank, p.normed_offset, 0) + t * p.l;
  float lane_sum = 0.0f;
  for (std::int64_t c = lane; c < chunks; c += kNormLanes) {
    float acc[kNormChunk];
    const std::int64_t at = t * p.l + c * kNormChunk;
    {
      const Vec16<T> v0 =
          p.tp == 1 ? reinterpret_cast<const Vec16<T>*>(static_cast<const T*>(p.routed) + at)[0]
                    : fused_load_cg(fused_at<T>(p, 0, p.routed_offset, parity) + at);
#pragma unroll
      for (int k = 0; k < kNormChunk; ++k) acc[k] = Storage<T>::load(v0.v[k]);
    }
    for (int r = 1; r < p.tp; ++r) {
      const Vec16<T> v = fused_load_cg(fused_at<T>(p, r, p.routed_offset, parity) + at);
#pragma unroll
      for (int k = 0; k < kNormChunk; ++k) acc[k] = __fadd_rn(acc[k], Storage<T>::load(v.v[k]));
    }
    NormChunk<T> chunk;
#pragma unroll
    for (int k = 0; k < kNormChunk; ++k) chunk.at(k) = Storage<T>::store(acc[k]);
    if (p.latent_norm) lane_sum = add_chunk_squares(lane_sum, chunk);
    chunk.store(normed + c * kNormChunk);  // the reduced latent; normalized in place below
  }
  if (!p.latent_norm)
    return;  // N is the reduced latent (the same for every block: no barrier skipped unevenly)
  const float rstd =
      rms_norm_rstd(row_sum_of_squares<8>(lane_sum, lane_sums), static_cast<int>(p.l), p.eps);
  for (std::int64_t c = lane; c < chunks; c += kNormLanes) {
    NormChunk<T> chunk;
    chunk.load(normed + c * kNormChunk);  // this thread's own stores
    normalize_chunk(chunk, p.gamma + c * kNormChunk, rstd);
    chunk.store(normed + c * kNormChunk);
  }
  __syncthreads();  // lane_sums is reused by the next row
}

// ---- Phase 3: the stripe product --------------------------------------------------------------
//
// A work item is one tile of kFusedTileCols stripe columns for every row over one split of K. Its
// block streams N's rows and the tile's weights through shared memory kFusedTileK at a time
// (cp.async, kStages deep), and its warps multiply them on tensor cores (ldmatrix + mma.sync
// m16n8k16, fp32 accumulate). The shapes below split the 8 warps between rows and columns by the
// most rows a call may bring; m-tiles past T are neither loaded nor multiplied.
template <int kRowsMax>
struct FusedShape {
  static_assert(kRowsMax == 16 || kRowsMax == 32 || kRowsMax == 64 || kRowsMax == 128 ||
                kRowsMax == 256);
  static constexpr int kWarpsM = kRowsMax <= 32    ? 1
                                 : kRowsMax <= 128 ? 2
                                                   : 4;    // warps along the rows
  static constexpr int kMTiles = kRowsMax / 16 / kWarpsM;  // m-tiles per warp
  static constexpr int kWarpsN = kFusedWarps / kWarpsM;
  static constexpr int kNTiles = kFusedTileCols / 8 / kWarpsN;  // n-tiles of 8 per warp
  // Deeper for few rows: the weights are then nearly all of a stage, and bytes in flight set the
  // pace.
  static constexpr int kStages = kRowsMax <= 32 ? 6 : 4;
  static constexpr int kRowBytes = kFusedTileK * 2;  // one row of a stage: 64 elements of 16 bits
  static constexpr int kStageBytes = (kRowsMax + kFusedTileCols) * kRowBytes;
  static constexpr int kSharedBytes = kStages * kStageBytes;
};

// Y's element (t, col) of this rank's stripe (stripe-local col) from its product u: round(u) plus
// the rounded rank-order sum of the shared columns (phase 2's shared stripe; with one rank the
// input itself), rounded; into out and, for the peers, the staged stripe.
template <typename T>
__device__ inline void fused_finish_element(const FusedTailParams& p, std::int64_t t,
                                            std::int64_t col, float u, std::uint32_t parity) {
  const std::int64_t global_col = static_cast<std::int64_t>(p.rank) * p.stripe + col;
  // Through L2 with several ranks: other blocks of this kernel wrote the shared stripe.
  const float shared_sum =
      p.tp == 1 ? Storage<T>::load(static_cast<const T*>(p.shared)[t * p.d + global_col])
                : fused_load_cg_scalar(fused_at<T>(p, p.rank, p.shared_sum_offset, 0) +
                                       t * p.stripe + col);
  const T y = Storage<T>::store(__fadd_rn(Storage<T>::load(Storage<T>::store(u)), shared_sum));
  static_cast<T*>(p.out)[t * p.d + global_col] = y;
  if (p.tp > 1) fused_at<T>(p, p.rank, p.stripe_offset, parity)[t * p.stripe + col] = y;
}

// Phase 2b (tp > 1): this rank's stripe of round(Σ_r shared_r), rank order, 16-byte vectors over
// every block (the epilogue then reads it from this rank's own memory).
template <typename T>
__device__ void fused_reduce_shared_stripe(const FusedTailParams& p, std::int64_t tokens,
                                           std::uint32_t parity) {
  using V = Vec16<T>;
  const std::int64_t row_vectors = p.stripe / V::kSize;
  T* sums = fused_at<T>(p, p.rank, p.shared_sum_offset, 0);
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < tokens * row_vectors; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / row_vectors, v = i % row_vectors;
    const std::int64_t at = t * p.d + static_cast<std::int64_t>(p.rank) * p.stripe + v * V::kSize;
    float acc[V::kSize];
    const V first = fused_load_cg(fused_at<T>(p, 0, p.shared_offset, parity) + at);
#pragma unroll
    for (int k = 0; k < V::kSize; ++k) acc[k] = Storage<T>::load(first.v[k]);
    for (int r = 1; r < p.tp; ++r) {
      const V x = fused_load_cg(fused_at<T>(p, r, p.shared_offset, parity) + at);
#pragma unroll
      for (int k = 0; k < V::kSize; ++k) acc[k] = __fadd_rn(acc[k], Storage<T>::load(x.v[k]));
    }
    V out;
#pragma unroll
    for (int k = 0; k < V::kSize; ++k) out.v[k] = Storage<T>::store(acc[k]);
    reinterpret_cast<V*>(sums + t * p.stripe)[v] = out;
  }
}

// The first and one-past-last K chunk of split s.
__device__ inline void fused_split_chunks(const FusedTailParams& p, std::int64_t s,
                                          std::int64_t& c0, std::int64_t& c1) {
  const std::int64_t chunks = (p.l + kFusedTileK - 1) / kFusedTileK;
  c0 = s * chunks / p.splits;
  c1 = (s + 1) * chunks / p.splits;
}

// Issues the copies of K chunk c into one stage: rows [0, rows) of N, and the tile's
// kFusedTileCols rows of weights (separately: the weights do not wait for N).
template <typename T, int kRowsMax>
__device__ inline void fused_load_rows(const FusedTailParams& p, const T* normed,
                                       std::int64_t tokens, int rows, std::int64_t c,
                                       std::uint32_t stage) {
  const std::int64_t k0 = c * kFusedTileK;
  for (int i = static_cast<int>(threadIdx.x); i < rows * 8; i += kFusedThreads) {
    const int row = i >> 3, chunk = i & 7;
    const std::int64_t k = k0 + chunk * 8;
    const bool valid = row < tokens && k < p.l;
    cp_async16(stage + swizzle128(row, chunk), valid ? normed + row * p.l + k : normed, valid);
  }
}
template <typename T, int kRowsMax>
__device__ inline void fused_load_weights(const FusedTailParams& p, std::int64_t col0,
                                          std::int64_t c, std::uint32_t stage) {
  const std::int64_t k0 = c * kFusedTileK;
  const T* w = static_cast<const T*>(p.w_stripe);
  const std::uint32_t weights = stage + kRowsMax * FusedShape<kRowsMax>::kRowBytes;
  for (int i = static_cast<int>(threadIdx.x); i < kFusedTileCols * 8; i += kFusedThreads) {
    const int row = i >> 3, chunk = i & 7;
    const std::int64_t k = k0 + chunk * 8, col = col0 + row;
    const bool valid = col < p.stripe && k < p.l;
    cp_async16(weights + swizzle128(row, chunk), valid ? w + col * p.l + k : w, valid);
  }
}

// The weights of an item's first kStages - 1 chunks, as one cp.async group: issued at the start of
// the kernel for a block's first item, so that they stream in while the inputs are staged, the
// peers arrive and the norm runs (fused_stripe_item then skips them).
template <typename T, int kRowsMax>
__device__ inline void fused_prologue_weights(const FusedTailParams& p, std::int64_t tile,
                                              std::int64_t s, std::uint32_t smem) {
  using Shape = FusedShape<kRowsMax>;
  std::int64_t c0, c1;
  fused_split_chunks(p, s, c0, c1);
  for (int i = 0; i < Shape::kStages - 1 && c0 + i < c1; ++i) {
    fused_load_weights<T, kRowsMax>(p, tile * kFusedTileCols, c0 + i,
                                    smem + i * Shape::kStageBytes);
  }
  cp_async_commit();
}

// One work item: tile `tile` (columns [tile·64, tile·64 + 64) of the stripe), split s of K.
// weights_issued: fused_prologue_weights already issued this item's first weights. general_e: the
// general kernel's calls so far + 1 (each tile's split counter gains `splits` per call).
template <typename T, int kRowsMax>
__device__ void fused_stripe_item(const FusedTailParams& p, std::int64_t tokens, std::int64_t tile,
                                  std::int64_t s, bool weights_issued, std::uint32_t general_e,
                                  std::uint32_t parity, std::uint32_t smem, int* s_last) {
  using Shape = FusedShape<kRowsMax>;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int wm = warp / Shape::kWarpsN, wn = warp % Shape::kWarpsN;
  const int g = lane / 4, q = lane % 4;  // groupID and thread-in-group of the mma fragments
  const T* normed = fused_at<T>(p, p.rank, p.normed_offset, 0);
  const std::int64_t col0 = tile * kFusedTileCols;
  const int m_used = static_cast<int>((tokens + 15) / 16);  // m-tiles holding rows < T
  const int rows = m_used * 16;
  std::int64_t c0, c1;
  fused_split_chunks(p, s, c0, c1);
  const int n = static_cast<int>(c1 - c0);

  float acc[Shape::kMTiles][Shape::kNTiles][4] = {};
  // The first kStages - 1 chunks, then all of them landed before the loop; chunk i ≥ kStages - 1
  // was committed by iteration i - kStages + 1, and at most kStages - 2 groups came after it.
#pragma unroll
  for (int i = 0; i < Shape::kStages - 1; ++i) {
    if (i < n) {
      if (!weights_issued)
        fused_load_weights<T, kRowsMax>(p, col0, c0 + i, smem + i * Shape::kStageBytes);
      fused_load_rows<T, kRowsMax>(p, normed, tokens, rows, c0 + i, smem + i * Shape::kStageBytes);
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
  for (int i = 0; i < n; ++i) {
    cp_async_wait<Shape::kStages - 2>();
    __syncthreads();  // chunk i is in every thread's view; every warp is done with chunk i - 1's
                      // stage
    const int next = i + Shape::kStages - 1;
    if (next < n) {
      const std::uint32_t stage = smem + (next % Shape::kStages) * Shape::kStageBytes;
      fused_load_weights<T, kRowsMax>(p, col0, c0 + next, stage);
      fused_load_rows<T, kRowsMax>(p, normed, tokens, rows, c0 + next, stage);
    }
    cp_async_commit();
    const std::uint32_t a_stage = smem + (i % Shape::kStages) * Shape::kStageBytes;
    const std::uint32_t b_stage = a_stage + kRowsMax * Shape::kRowBytes;
#pragma unroll
    for (int ks = 0; ks < kFusedTileK / 16; ++ks) {
      std::uint32_t b[Shape::kNTiles][2];
#pragma unroll
      for (int nt = 0; nt < Shape::kNTiles; ++nt) {
        const int row = (wn * Shape::kNTiles + nt) * 8 + (lane & 7);
        ldmatrix_x2(b[nt], b_stage + swizzle128(row, 2 * ks + ((lane >> 3) & 1)));
      }
#pragma unroll
      for (int mt = 0; mt < Shape::kMTiles; ++mt) {
        const int m_tile = wm * Shape::kMTiles + mt;
        if (m_tile >= m_used) continue;  // the same for the whole warp
        std::uint32_t a[4];
        ldmatrix_x4(a, a_stage + swizzle128(m_tile * 16 + (lane & 15), 2 * ks + (lane >> 4)));
#pragma unroll
        for (int nt = 0; nt < Shape::kNTiles; ++nt) mma_m16n8k16<T>(acc[mt][nt], a, b[nt]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the stages are free for the next item

  // Fragment element j of (mt, nt): row m_tile·16 + g (+8 for j ≥ 2), column 2q + (j & 1).
  if (p.splits == 1) {
#pragma unroll
    for (int mt = 0; mt < Shape::kMTiles; ++mt) {
      const int m_tile = wm * Shape::kMTiles + mt;
      if (m_tile >= m_used) continue;
#pragma unroll
      for (int nt = 0; nt < Shape::kNTiles; ++nt) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const std::int64_t t = m_tile * 16 + g + (j >= 2 ? 8 : 0);
          const std::int64_t col = col0 + (wn * Shape::kNTiles + nt) * 8 + 2 * q + (j & 1);
          if (t < tokens && col < p.stripe)
            fused_finish_element<T>(p, t, col, acc[mt][nt][j], parity);
        }
      }
    }
    return;
  }

  // Split K: leave this split's partial, count it, and let the tile's last split finish the tile.
  float* partials = reinterpret_cast<float*>(p.workspace[p.rank] + p.partials_offset);
  float* mine = partials + ((tile * p.splits + s) * p.capacity) * kFusedTileCols;
#pragma unroll
  for (int mt = 0; mt < Shape::kMTiles; ++mt) {
    const int m_tile = wm * Shape::kMTiles + mt;
    if (m_tile >= m_used) continue;
#pragma unroll
    for (int nt = 0; nt < Shape::kNTiles; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const std::int64_t t = m_tile * 16 + g + half * 8;
        if (t < tokens) {
          const int c = (wn * Shape::kNTiles + nt) * 8 + 2 * q;
          __stcg(reinterpret_cast<float2*>(mine + t * kFusedTileCols + c),
                 make_float2(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]));
        }
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    std::uint32_t* arrived =
        reinterpret_cast<std::uint32_t*>(p.workspace[p.rank] + p.tile_arrived_offset) + tile;
    const std::uint32_t before = atomicAdd(arrived, 1u);
    *s_last = before + 1u == general_e * static_cast<std::uint32_t>(p.splits);
    __threadfence();
  }
  __syncthreads();
  if (!*s_last) return;
  const float* tile_partials = partials + tile * p.splits * p.capacity * kFusedTileCols;
  for (std::int64_t i = threadIdx.x; i < tokens * kFusedTileCols; i += kFusedThreads) {
    const std::int64_t t = i / kFusedTileCols, c = i % kFusedTileCols;
    if (col0 + c >= p.stripe) continue;
    float u = __ldcg(tile_partials + t * kFusedTileCols + c);
    for (std::int64_t split = 1; split < p.splits; ++split) {
      u = __fadd_rn(u, __ldcg(tile_partials + (split * p.capacity + t) * kFusedTileCols + c));
    }
    fused_finish_element<T>(p, t, col0 + c, u, parity);
  }
  __syncthreads();  // s_last is reused by the next item
}

// LMOE_FUSED_TRACE: the time thread 0 of this block reached point i (nothing when not tracing).
__device__ inline void fused_trace(const FusedTailParams& p, int point) {
  if (p.trace != nullptr && threadIdx.x == 0)
    p.trace[blockIdx.x * kFusedTracePoints + point] = p2p_clock_ns();
}

template <typename T, int kRowsMax>
__global__ void __launch_bounds__(kFusedThreads, 1) fused_tail_kernel(FusedTailParams p) {
  __shared__ FusedCall call;
  __shared__ int s_last;
  __shared__ float lane_sums[kNormLanes];
  extern __shared__ __align__(128) std::byte fused_stages[];  // FusedShape<kRowsMax>::kSharedBytes
  const std::uint32_t smem = static_cast<std::uint32_t>(__cvta_generic_to_shared(fused_stages));

  fused_trace(p, kTraceEntry);
  // The launch's bound (p.tokens with T on the device) sized its shape and the caller's buffers.
  const int tokens = fused_call_tokens(p.tokens_device, p.tokens, p.tokens, fused_report(p),
                                       blockIdx.x == 0 && threadIdx.x == 0);
  if (tokens < 0) return;  // the same for every block
  const std::int64_t items = p.col_tiles * p.splits;
  if (!fused_begin(p, &call)) return;
  // 0. The weights of this block's items, into L2 while the peers arrive (a row of a tile per
  // thread).
  if (p.prefetch_weights && threadIdx.x < kFusedTileCols) {
    for (std::int64_t item = blockIdx.x; item < items; item += gridDim.x) {
      const std::int64_t col = item / p.splits * kFusedTileCols + threadIdx.x;
      if (col >= p.stripe) continue;
      std::int64_t c0, c1;
      fused_split_chunks(p, item % p.splits, c0, c1);
      const std::int64_t k0 = c0 * kFusedTileK,
                         k1 = c1 * kFusedTileK < p.l ? c1 * kFusedTileK : p.l;
      const T* address = static_cast<const T*>(p.w_stripe) + col * p.l + k0;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(address),
                   "r"(static_cast<std::uint32_t>((k1 - k0) * static_cast<std::int64_t>(sizeof(T))))
                   : "memory");
    }
  }
  // The weights of this block's first item start streaming into shared memory now.
  if (static_cast<std::int64_t>(blockIdx.x) < items) {
    fused_prologue_weights<T, kRowsMax>(p, blockIdx.x / p.splits, blockIdx.x % p.splits, smem);
  }
  fused_trace(p, kTraceEpoch);
  const std::uint32_t parity = call.parity;

  if (p.tp > 1) {
    // 1. Stage the inputs; publish to every peer once this block's part is stored. The peers'
    //    rows are read only where every peer ran this call with this rank's T.
    fused_send_tokens(p, tokens, call);
    fused_stage_inputs<T>(p, tokens, call);
    fused_trace(p, kTraceStaged);
    if (!fused_wait_peers(p, fused_flags(p, p.rank)->inputs_arrived, &call))
      return cp_async_wait<0>();
    fused_compare_tokens(p, tokens, &call);
    if (fused_block_failed(p, tokens, &call)) return cp_async_wait<0>();
    fused_trace(p, kTraceInputsArrived);
  }

  // 2. Rows of N, and this rank's stripe of the shared sum.
  for (std::int64_t t = blockIdx.x; t < tokens; t += gridDim.x)
    fused_norm_row<T>(p, t, parity, lane_sums);
  if (p.tp > 1) fused_reduce_shared_stripe<T>(p, tokens, parity);
  fused_trace(p, kTraceNormed);
  if (!fused_grid_barrier(p, &call)) return cp_async_wait<0>();
  fused_trace(p, kTraceRowsDone);

  // 3. The stripe's output columns, item by item (tile-major: a tile's splits go to neighbouring
  // blocks).
  for (std::int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    fused_stripe_item<T, kRowsMax>(p, tokens, item / p.splits, item % p.splits, item == blockIdx.x,
                                   call.general_e, parity, smem, &s_last);
  }

  fused_trace(p, kTraceItemsDone);
  if (p.tp > 1) {
    // 4. Publish this block's stripe columns, then gather every peer's.
    if (!fused_gather_stripes<T>(p, tokens, &call)) return cp_async_wait<0>();
    fused_trace(p, kTraceStripesArrived);
  }

  // The last block out closes the call.
  fused_end(p, call, true);
  fused_trace(p, kTraceEnd);
}

}  // namespace lmoe::cuda
