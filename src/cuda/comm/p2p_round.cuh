// The round kernel of the P2P collectives (protocol: p2p_protocol.cuh). Device code only.
#pragma once

#include <cstdint>

#include "cuda/comm/p2p_protocol.cuh"
#include "cuda/runtime/dtype.cuh"

namespace lmoe::cuda {

inline constexpr int kP2pThreads = 512;

// Block b's slice [first, last) of n staged elements. Slice boundaries are multiples of 8 elements,
// so every slice of an aligned buffer starts 16-byte aligned in every dtype. The host cuts rounds
// and picks grids so that a slice fits in a block's region (P2pDeviceHandle::block_bytes).
struct P2pSlice {
  std::int64_t first, last;
};
__device__ inline P2pSlice p2p_block_slice(std::int64_t n) {
  const std::int64_t per_block = (n + gridDim.x - 1) / gridDim.x;
  const std::int64_t length = (per_block + 7) / 8 * 8;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * length;
  return {first < n ? first : n, first + length < n ? first + length : n};
}

// Peer data is read through L2 only (.cg): L1 is not coherent with the peer's writes of a later
// round, and each element is read once.
template <typename T>
__device__ inline T p2p_load(const T* p) {
  if constexpr (sizeof(T) == 2) {
    const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
    return *reinterpret_cast<const T*>(&bits);
  } else {
    return __ldcg(p);
  }
}
template <typename T>
__device__ inline Vec16<T> p2p_load_vector(const T* p) {
  const uint4 bits = __ldcg(reinterpret_cast<const uint4*>(p));
  return *reinterpret_cast<const Vec16<T>*>(&bits);
}

// Loads in flight per thread in the vector loops. A round's grid is at most kP2pMaxBlocks blocks
// (they share the GPU with the GEMM the collective overlaps), and a peer's memory is a NVLink round
// trip away (~1-2 µs): with one 16-byte load per thread in flight, 32 blocks of 512 threads keep
// 256 KB outstanding, too little to fill the link at large T (docs/perf.md). Issuing kP2pUnroll
// loads before the first store multiplies that.
inline constexpr int kP2pUnroll = 4;

// dst[i] = src[i] for i < n (src read through L2 when it is a peer's).
template <typename T, bool kVector, bool kPeerSource>
__device__ inline void p2p_copy(const T* src, T* dst, std::int64_t n) {
  std::int64_t done = 0;
  if constexpr (kVector) {
    using V = Vec16<T>;
    const std::int64_t vectors = n / V::kSize;
    const auto load = [&](std::int64_t i) {
      return kPeerSource ? p2p_load_vector(src + i * V::kSize) : reinterpret_cast<const V*>(src)[i];
    };
    const std::int64_t stride = blockDim.x;
    const std::int64_t unrolled = vectors / (stride * kP2pUnroll) * (stride * kP2pUnroll);
    for (std::int64_t i = threadIdx.x; i < unrolled; i += stride * kP2pUnroll) {
      V v[kP2pUnroll];
#pragma unroll
      for (int u = 0; u < kP2pUnroll; ++u) v[u] = load(i + u * stride);
#pragma unroll
      for (int u = 0; u < kP2pUnroll; ++u) reinterpret_cast<V*>(dst)[i + u * stride] = v[u];
    }
    for (std::int64_t i = unrolled + threadIdx.x; i < vectors; i += stride)
      reinterpret_cast<V*>(dst)[i] = load(i);
    done = vectors * V::kSize;
  }
  for (std::int64_t i = done + threadIdx.x; i < n; i += blockDim.x)
    dst[i] = kPeerSource ? p2p_load(src + i) : src[i];
}

// reduce_scatter rounds: block b's slice of piece q is p2p_block_slice(piece_count[q]); the
// slices of every piece sit one after another in the block's region (each at a whole number of
// 8-element slots, the same formula on every rank, so a peer finds piece q where it was staged).
struct P2pPieceSlot {
  P2pSlice slice;   // within the piece
  std::int64_t at;  // where the slice starts in the block's region
};
__device__ inline P2pPieceSlot p2p_piece_slot(const P2pRound& round, int q) {
  std::int64_t at = 0;
  for (int p = 0; p < q; ++p) {
    const std::int64_t per_block = (round.piece_count[p] + gridDim.x - 1) / gridDim.x;
    at += (per_block + 7) / 8 * 8;
  }
  return {p2p_block_slice(round.piece_count[q]), at};
}

// Rank r's staging region of this block for a round of parity `parity`.
template <typename T>
__device__ inline T* p2p_region(const P2pDeviceHandle& h, int r, std::uint32_t parity) {
  return reinterpret_cast<T*>(
      h.data[r] + (static_cast<std::int64_t>(parity) * h.max_blocks + blockIdx.x) * h.block_bytes);
}

// out[i] = round(Σ_r in_r[i]) in rank order, fp32, starting from rank 0's value; in_r is rank r's
// region from element `first` of the block's slice on.
template <typename T, bool kVector>
__device__ inline void p2p_reduce(const P2pDeviceHandle& h, std::uint32_t parity,
                                  std::int64_t first, T* out, std::int64_t n) {
  using S = Storage<T>;
  auto input = [&](int r) { return p2p_region<T>(h, r, parity) + first; };
  std::int64_t done = 0;
  if constexpr (kVector) {
    using V = Vec16<T>;
    const std::int64_t vectors = n / V::kSize;
    // kU vectors per thread per step: every rank's kU loads are issued before they are summed (the
    // sum itself stays in rank order, element by element).
    const auto reduce_step = [&]<int kU>(std::int64_t i, std::int64_t stride) {
      float acc[kU][V::kSize];
      V v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) v[u] = p2p_load_vector(input(0) + (i + u * stride) * V::kSize);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
#pragma unroll
        for (int k = 0; k < V::kSize; ++k) acc[u][k] = S::load(v[u].v[k]);
      }
      for (int r = 1; r < h.size; ++r) {
#pragma unroll
        for (int u = 0; u < kU; ++u) v[u] = p2p_load_vector(input(r) + (i + u * stride) * V::kSize);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
#pragma unroll
          for (int k = 0; k < V::kSize; ++k) acc[u][k] = __fadd_rn(acc[u][k], S::load(v[u].v[k]));
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        V result;
#pragma unroll
        for (int k = 0; k < V::kSize; ++k) result.v[k] = S::store(acc[u][k]);
        reinterpret_cast<V*>(out)[i + u * stride] = result;
      }
    };
    const std::int64_t stride = blockDim.x;
    const std::int64_t unrolled = vectors / (stride * kP2pUnroll) * (stride * kP2pUnroll);
    for (std::int64_t i = threadIdx.x; i < unrolled; i += stride * kP2pUnroll)
      reduce_step.template operator()<kP2pUnroll>(i, stride);
    for (std::int64_t i = unrolled + threadIdx.x; i < vectors; i += stride)
      reduce_step.template operator()<1>(i, stride);
    done = vectors * V::kSize;
  }
  for (std::int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    float acc = S::load(p2p_load(input(0) + i));
    for (int r = 1; r < h.size; ++r) acc = __fadd_rn(acc, S::load(p2p_load(input(r) + i)));
    out[i] = S::store(acc);
  }
}

// kVector: send, out and every reduce/gather start are 16-byte aligned (checked by the launcher).
template <typename T, bool kVector>
__global__ void __launch_bounds__(kP2pThreads) p2p_round_kernel(P2pDeviceHandle h, P2pRound round) {
  __shared__ std::uint32_t epoch;
  __shared__ int failed;
  const int block = static_cast<int>(blockIdx.x);
  P2pFlags* own = h.flags[h.rank];
  if (threadIdx.x == 0) {
    failed = 0;
    epoch = own->epoch[block] + 1;
    // No read of the abort flag here (host-mapped: see kP2pAbortPollAfterNs); a round that starts
    // after a failure finds it in its first long wait.
    if (atomicExch(&own->in_use[block], 1u) != 0u) {
      // Another round of this rank holds the block: two collectives overlap on one workspace.
      p2p_fail(p2p_report_of(h), kP2pConcurrentUse, -1, epoch);
      failed = 1;
    } else {
      own->entered[block] =
          epoch;  // after the abort check: a round that starts after a failure is not counted
    }
  }
  __syncthreads();
  if (failed) return;
  const std::uint32_t e = epoch;
  const std::uint32_t parity = e & 1u;

  // 1. Stage this block's slice of the send buffer (of every piece) into its region.
  if (round.op == P2pOp::reduce_scatter) {
    for (int q = 0; q < h.size; ++q) {
      const P2pPieceSlot slot = p2p_piece_slot(round, q);
      p2p_copy<T, kVector, false>(
          static_cast<const T*>(round.send) + round.piece_offset[q] + slot.slice.first,
          p2p_region<T>(h, h.rank, parity) + slot.at, slot.slice.last - slot.slice.first);
    }
  } else {
    const P2pSlice s = p2p_block_slice(round.stage_count[h.rank]);
    p2p_copy<T, kVector, false>(static_cast<const T*>(round.send) + s.first,
                                p2p_region<T>(h, h.rank, parity), s.last - s.first);
  }
  __syncthreads();  // the block's stores happen before the release below (cumulativity)
  // 2. Publish, 3. wait (and compare tags): thread r talks to rank r.
  if (threadIdx.x < h.size) {
    const int peer = static_cast<int>(threadIdx.x);
    p2p_publish_arrival(h, peer, e, round.tag);
    if (!p2p_wait_arrival(h, peer, e, round.tag)) failed = 1;
  }
  __syncthreads();
  if (!failed) {
    // 4. Output from the peers' slices of the same parity.
    T* out = static_cast<T*>(round.out);
    if (round.op == P2pOp::reduce_scatter) {
      const P2pPieceSlot slot = p2p_piece_slot(round, h.rank);
      if (slot.slice.first < slot.slice.last) {
        p2p_reduce<T, kVector>(h, parity, slot.at, out + slot.slice.first,
                               slot.slice.last - slot.slice.first);
      }
    } else if (round.op == P2pOp::reduce) {
      const P2pSlice s = p2p_block_slice(round.stage_count[h.rank]);
      const std::int64_t lo = max(s.first, round.reduce_first);
      const std::int64_t hi = min(s.last, round.reduce_first + round.reduce_count);
      if (lo < hi)
        p2p_reduce<T, kVector>(h, parity, lo - s.first, out + (lo - round.reduce_first), hi - lo);
    } else {
      for (int r = 0; r < h.size; ++r) {
        if (r == h.rank && round.skip_own_gather) continue;
        const P2pSlice s = p2p_block_slice(round.stage_count[r]);
        p2p_copy<T, kVector, true>(p2p_region<T>(h, r, parity),
                                   out + round.gather_offset[r] + s.first, s.last - s.first);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (!failed) own->epoch[block] = e;
    own->in_use[block] = 0u;
  }
}

}  // namespace lmoe::cuda
