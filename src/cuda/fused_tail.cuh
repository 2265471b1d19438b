// The fused decode tail: one kernel per rank does the whole tail for T ≤ 256 tokens,
//
//   Y = round(round(N · w_upᵀ) + round(Σ_r shared_r)),  N = round(rmsnorm(round(Σ_r routed_r)))
//
// exchanging data with its peers through their workspaces (docs/fused.md). Device code only.
//
// A call of epoch e on rank r, with G blocks of 256 threads on every rank:
//   0. every block prefetches its part of w_up's stripe into L2 (the weights stream while the
//      peers are still on their way);
//   1. stage: the blocks copy routed [T, l] and shared [T, d] into r's workspace (parity e & 1),
//      and each block then adds 1 to inputs_arrived[r] in every peer's flags (release, system);
//   2. norm: once inputs_arrived[p] ≥ e·G for every peer p, block b reduces rows t ≡ b (mod G)
//      of the latent over the ranks in rank order, rounds, and normalizes them in the canonical
//      order of cuda/rms_norm.cuh into N (r's own memory); then rows_done += 1;
//   3. stripe: once rows_done ≥ e·G (every row of N is there), block b computes block-tiles
//      b, b + G, … of r's stripe of output columns: N · w_stripeᵀ on tensor cores (mma.sync
//      m16n8k16, fp32 accumulate, the K range split over the 8 warps and summed in warp order),
//      rounded, plus the rank-order sum of the peers' shared columns, rounded, into Y's columns of
//      the stripe and into r's staged stripe; then stripes_arrived[r] += 1 in every peer's flags;
//   4. gather: once stripes_arrived[p] ≥ e·G, the blocks copy peer p's staged stripe into Y.
//   The last block to finish stores epoch = e and frees the workspace (in_use = 0).
// Two parities suffice: a peer can be at most one call ahead (call e + 1 needs our inputs of
// e + 1, staged only after our call e has finished reading everything of e), and it writes the
// other parity. Every wait is bounded and fails into the p2p group's status record and abort flag.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/dtype.cuh"
#include "cuda/fused_tail_types.hpp"
#include "cuda/p2p_protocol.cuh"
#include "cuda/rms_norm.cuh"

namespace lmoe::cuda {

__device__ inline void fused_add_release(std::uint32_t* address, std::uint32_t value) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

// Where this rank's waits report a failure: the p2p group's record and abort flag, or (one rank,
// no group) the FusedTail's own (both always set by the host).
__device__ inline P2pFailureReport fused_report(const FusedTailParams& p) {
  return {p.status, p.abort_flag, p.timeout_ns};
}

template <typename T>
__device__ inline T* fused_at(const FusedTailParams& p, int rank, std::int64_t offset, std::uint32_t parity) {
  return reinterpret_cast<T*>(p.workspace[rank] + offset + static_cast<std::int64_t>(parity) * p.parity_bytes);
}

// Peer (or own staged) data through L2: L1 is not coherent with a peer's writes.
template <typename T>
__device__ inline Vec16<T> fused_load_cg(const T* address) {
  const uint4 bits = __ldcg(reinterpret_cast<const uint4*>(address));
  return *reinterpret_cast<const Vec16<T>*>(&bits);
}
template <typename T>
__device__ inline float fused_load_cg_scalar(const T* address) {
  const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(address));
  return Storage<T>::load(*reinterpret_cast<const T*>(&bits));
}

// dst[i] = src[i], 16-byte vectors (n a multiple of the vector size), grid-stride over all blocks.
template <typename T>
__device__ inline void fused_copy(const T* src, T* dst, std::int64_t n, bool peer_source) {
  using V = Vec16<T>;
  const std::int64_t vectors = n / V::kSize;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    reinterpret_cast<V*>(dst)[i] = peer_source ? fused_load_cg(src + i * V::kSize) : reinterpret_cast<const V*>(src)[i];
  }
}

// One tensor-core step: c[16 × 8] += a[16 × 16] · b[16 × 8] (fragments as the PTX ISA lays out
// mma.m16n8k16: a row-major, b column-major, i.e. 8 rows of w_up with 16 consecutive k each).
template <typename T>
__device__ inline void fused_mma(float (&c)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Two consecutive 16-bit elements: the weights through the read-only path, N through L2 (other
// blocks wrote it during this kernel, and L1 is not coherent with their stores).
__device__ inline std::uint32_t fused_load_weights(const void* address) {
  return __ldg(reinterpret_cast<const unsigned int*>(address));
}
__device__ inline std::uint32_t fused_load_normed(const void* address) {
  return __ldcg(reinterpret_cast<const unsigned int*>(address));
}

// Phase 2 for one row t: latent = round(Σ_r routed_r[t]) in rank order, N[t] = round(rmsnorm(latent)).
// Every thread of the block calls it (the sum of squares holds a barrier).
template <typename T>
__device__ void fused_norm_row(const FusedTailParams& p, std::int64_t t, std::uint32_t parity, float* lane_sums) {
  const int lane = static_cast<int>(threadIdx.x);
  const std::int64_t chunks = p.l / kNormChunk;
  T* normed = fused_at<T>(p, p.rank, p.normed_offset, 0) + t * p.l;
  float lane_sum = 0.0f;
  for (std::int64_t c = lane; c < chunks; c += kNormLanes) {
    float acc[kNormChunk];
    const std::int64_t at = t * p.l + c * kNormChunk;
    {
      const Vec16<T> v0 = p.tp == 1 ? reinterpret_cast<const Vec16<T>*>(static_cast<const T*>(p.routed) + at)[0]
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
    lane_sum = add_chunk_squares(lane_sum, chunk);
    chunk.store(normed + c * kNormChunk);  // the reduced latent; normalized in place below
  }
  const float rstd = rms_norm_rstd(row_sum_of_squares<8>(lane_sum, lane_sums), static_cast<int>(p.l), p.eps);
  for (std::int64_t c = lane; c < chunks; c += kNormLanes) {
    NormChunk<T> chunk;
    chunk.load(normed + c * kNormChunk);  // this thread's own stores
    normalize_chunk(chunk, p.gamma + c * kNormChunk, rstd);
    chunk.store(normed + c * kNormChunk);
  }
  __syncthreads();  // lane_sums is reused by the next row
}

// Phase 3 for one block-tile of kNt·8 stripe columns starting at column `col0` (stripe-local):
// every m-group of kMg·16 tokens, each warp sums its k-steps, the block adds the 8 warps' partials
// in warp order, and the epilogue adds the reduced shared columns.
//
// Bytes in flight decide the speed at decode sizes (the kernel streams the stripe): a warp issues
// the loads of a whole batch of k-steps before its first mma (the loads and the mma are volatile
// asm, which the compiler keeps in program order, so a load after an mma would wait for it).
template <int kNt, int kMg>
struct FusedBatch {
  static constexpr int kSteps = kNt * kMg >= 4 ? 2 : (kNt * kMg == 2 ? 4 : 8);
};

template <typename T, int kNt, int kMg>
__device__ void fused_stripe_tile(const FusedTailParams& p, std::int64_t tokens, std::int64_t col0,
                                  std::uint32_t parity, float* partials) {
  constexpr int kSteps = FusedBatch<kNt, kMg>::kSteps;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, q = lane % 4;  // groupID and thread-in-group of the mma fragments
  const T* normed = fused_at<T>(p, p.rank, p.normed_offset, 0);
  const T* w = static_cast<const T*>(p.w_stripe);
  const std::int64_t k_steps = p.l / 16;
  const std::int64_t mtiles = (tokens + 15) / 16;
  for (std::int64_t m0 = 0; m0 < mtiles; m0 += kMg) {
    float acc[kMg][kNt][4] = {};
    // Rows of N this thread's A fragments read (a row ≥ T reads as zeros).
    std::int64_t rows[kMg][2];
#pragma unroll
    for (int m = 0; m < kMg; ++m) {
      rows[m][0] = (m0 + m) * 16 + g;
      rows[m][1] = rows[m][0] + 8;
    }
    // Warp w takes k-steps w, w + 8, w + 16, …, kSteps at a time.
    for (std::int64_t first = warp; first < k_steps; first += kFusedWarps * kSteps) {
      std::uint32_t b[kSteps][kNt][2];
      std::uint32_t a[kSteps][kMg][4];
#pragma unroll
      for (int i = 0; i < kSteps; ++i) {
        const std::int64_t ks = first + i * kFusedWarps;
        if (ks < k_steps) {
          const std::int64_t k = ks * 16 + 2 * q;
#pragma unroll
          for (int n = 0; n < kNt; ++n) {
            const T* w_row = w + (col0 + n * 8 + g) * p.l + k;
            b[i][n][0] = fused_load_weights(w_row);
            b[i][n][1] = fused_load_weights(w_row + 8);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kSteps; ++i) {
        const std::int64_t ks = first + i * kFusedWarps;
        if (ks < k_steps) {
          const std::int64_t k = ks * 16 + 2 * q;
#pragma unroll
          for (int m = 0; m < kMg; ++m) {
            a[i][m][0] = rows[m][0] < tokens ? fused_load_normed(normed + rows[m][0] * p.l + k) : 0u;
            a[i][m][1] = rows[m][1] < tokens ? fused_load_normed(normed + rows[m][1] * p.l + k) : 0u;
            a[i][m][2] = rows[m][0] < tokens ? fused_load_normed(normed + rows[m][0] * p.l + k + 8) : 0u;
            a[i][m][3] = rows[m][1] < tokens ? fused_load_normed(normed + rows[m][1] * p.l + k + 8) : 0u;
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kSteps; ++i) {
        if (first + i * kFusedWarps < k_steps) {
#pragma unroll
          for (int m = 0; m < kMg; ++m) {
#pragma unroll
            for (int n = 0; n < kNt; ++n) fused_mma<T>(acc[m][n], a[i][m], b[i][n]);
          }
        }
      }
    }
    // partials[warp][m][n][lane][4]
#pragma unroll
    for (int m = 0; m < kMg; ++m) {
#pragma unroll
      for (int n = 0; n < kNt; ++n) {
        reinterpret_cast<float4*>(partials)[((warp * kMg + m) * kNt + n) * 32 + lane] =
            make_float4(acc[m][n][0], acc[m][n][1], acc[m][n][2], acc[m][n][3]);
      }
    }
    __syncthreads();
    // Epilogue: element i = ((m·kNt + n)·32 + fragment lane)·4 + j of the group.
    constexpr int kElements = kMg * kNt * 128;
    for (int i = static_cast<int>(threadIdx.x); i < kElements; i += kFusedThreads) {
      const int j = i % 4, frag_lane = (i / 4) % 32, mn = i / 128;
      const int m = mn / kNt, n = mn % kNt;
      const std::int64_t t = (m0 + m) * 16 + frag_lane / 4 + (j >= 2 ? 8 : 0);
      if (t >= tokens) continue;
      const std::int64_t col = col0 + n * 8 + 2 * (frag_lane % 4) + (j % 2);  // stripe-local
      float u = 0.0f;
      for (int w8 = 0; w8 < kFusedWarps; ++w8) u = __fadd_rn(u, partials[(((w8 * kMg + m) * kNt + n) * 32 + frag_lane) * 4 + j]);
      const std::int64_t global_col = static_cast<std::int64_t>(p.rank) * p.stripe + col;
      float shared_sum;
      if (p.tp == 1) {
        shared_sum = Storage<T>::load(static_cast<const T*>(p.shared)[t * p.d + global_col]);
      } else {
        shared_sum = fused_load_cg_scalar(fused_at<T>(p, 0, p.shared_offset, parity) + t * p.d + global_col);
        for (int r = 1; r < p.tp; ++r) {
          shared_sum = __fadd_rn(shared_sum,
                                 fused_load_cg_scalar(fused_at<T>(p, r, p.shared_offset, parity) + t * p.d + global_col));
        }
      }
      const T y = Storage<T>::store(
          __fadd_rn(Storage<T>::load(Storage<T>::store(u)), Storage<T>::load(Storage<T>::store(shared_sum))));
      static_cast<T*>(p.out)[t * p.d + global_col] = y;
      if (p.tp > 1) fused_at<T>(p, p.rank, p.stripe_offset, parity)[t * p.stripe + col] = y;
    }
    __syncthreads();  // partials is reused by the next group
  }
}

template <typename T, int kNt, int kMg>
__global__ void __launch_bounds__(kFusedThreads) fused_tail_kernel(FusedTailParams p) {
  __shared__ std::uint32_t s_epoch;
  __shared__ int s_failed;
  __shared__ float lane_sums[kNormLanes];
  extern __shared__ float4 fused_partials_storage[];
  float* partials = reinterpret_cast<float*>(fused_partials_storage);

  FusedFlags* own = reinterpret_cast<FusedFlags*>(p.workspace[p.rank]);
  const std::uint32_t grid = static_cast<std::uint32_t>(gridDim.x);
  const std::int64_t tokens = p.tokens_device ? *p.tokens_device : p.tokens;
  const std::int64_t block_tiles = p.stripe / (8 * kNt);

  if (threadIdx.x == 0) {
    s_failed = 0;
    s_epoch = own->epoch + 1;
    // No read of the host-mapped abort flag here (see kP2pAbortPollAfterNs): the host checks the
    // group's status before every call, and a wait finds a later abort.
    if (blockIdx.x == 0 && atomicExch(&own->in_use, 1u) != 0u) {
      p2p_fail(fused_report(p), kP2pConcurrentUse, -1, s_epoch);
      s_failed = 1;
    }
    // 0. The stripe's rows this block will multiply, into L2 while the peers arrive.
    if (p.prefetch_weights && !s_failed) {
      const std::int64_t tile_bytes = 8 * kNt * p.l * static_cast<std::int64_t>(sizeof(T));
      for (std::int64_t bt = blockIdx.x; bt < block_tiles; bt += gridDim.x) {
        const char* address = static_cast<const char*>(p.w_stripe) + bt * tile_bytes;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(address), "r"(static_cast<std::uint32_t>(tile_bytes))
                     : "memory");
      }
    }
  }
  __syncthreads();
  if (s_failed) return;
  const std::uint32_t e = s_epoch;
  const std::uint32_t parity = e & 1u;
  const std::uint32_t all_blocks = e * grid;  // a counter's value once every block of call e added 1

  if (p.tp > 1) {
    // 1. Stage the inputs; publish to every peer once this block's part is stored.
    fused_copy(static_cast<const T*>(p.routed), fused_at<T>(p, p.rank, p.routed_offset, parity), tokens * p.l, false);
    fused_copy(static_cast<const T*>(p.shared), fused_at<T>(p, p.rank, p.shared_offset, parity), tokens * p.d, false);
    __syncthreads();
    if (threadIdx.x < static_cast<unsigned>(p.tp)) {
      __threadfence_system();
      fused_add_release(&reinterpret_cast<FusedFlags*>(p.workspace[threadIdx.x])->inputs_arrived[p.rank], 1u);
    }
    if (threadIdx.x < static_cast<unsigned>(p.tp)) {
      if (!p2p_wait_until(fused_report(p), &own->inputs_arrived[threadIdx.x], all_blocks, static_cast<int>(threadIdx.x), e)) s_failed = 1;
    }
    __syncthreads();
    if (s_failed) return;
  }

  // 2. Rows of N.
  for (std::int64_t t = blockIdx.x; t < tokens; t += gridDim.x) fused_norm_row<T>(p, t, parity, lane_sums);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(&own->rows_done, 1u);
    if (!p2p_wait_until(fused_report(p), &own->rows_done, all_blocks, p.rank, e)) s_failed = 1;
  }
  __syncthreads();
  if (s_failed) return;

  // 3. The stripe's output columns.
  for (std::int64_t bt = blockIdx.x; bt < block_tiles; bt += gridDim.x) {
    fused_stripe_tile<T, kNt, kMg>(p, tokens, bt * 8 * kNt, parity, partials);
  }

  if (p.tp > 1) {
    // 4. Publish this block's stripe columns, then gather every peer's.
    __syncthreads();
    if (threadIdx.x < static_cast<unsigned>(p.tp)) {
      __threadfence_system();
      fused_add_release(&reinterpret_cast<FusedFlags*>(p.workspace[threadIdx.x])->stripes_arrived[p.rank], 1u);
      if (!p2p_wait_until(fused_report(p), &own->stripes_arrived[threadIdx.x], all_blocks, static_cast<int>(threadIdx.x), e)) s_failed = 1;
    }
    __syncthreads();
    if (s_failed) return;
    using V = Vec16<T>;
    const std::int64_t row_vectors = p.stripe / V::kSize;
    const std::int64_t per_peer = tokens * row_vectors;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < per_peer * p.tp;
         i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
      const int r = static_cast<int>(i / per_peer);
      if (r == p.rank) continue;
      const std::int64_t t = (i % per_peer) / row_vectors, v = (i % per_peer) % row_vectors;
      const T* src = fused_at<T>(p, r, p.stripe_offset, parity) + t * p.stripe + v * V::kSize;
      reinterpret_cast<V*>(static_cast<T*>(p.out) + t * p.d + r * p.stripe)[v] = fused_load_cg(src);
    }
  }

  // The last block out closes the call.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&own->blocks_done, 1u) == all_blocks - 1u) {
      own->epoch = e;
      __threadfence();
      atomicExch(&own->in_use, 0u);
    }
  }
}

}  // namespace lmoe::cuda
