// The fused tier's protocol between ranks, shared by its two kernels (cuda/fused_tail.cuh, any T,
// and cuda/fused_decode.cuh, T ≤ 16): a call's epoch and counter targets, staging the inputs and
// publishing them to the peers, waiting for every peer, gathering the peers' output stripes, and
// closing the call (docs/fused.md). Device code only.
//
// A counter of FusedFlags gains exactly one per block of the grid of every call that counts there,
// on every rank (the grid of the kernel the call runs, which the ranks agree on), so a call's
// target is the sum of the grids of those calls before it plus its own grid: FusedFlags::arrivals
// for rows_done and blocks_done (every call), general_arrivals for the peers' inputs_arrived and
// stripes_arrived (the general kernel's calls; the decode kernel's data carry their own flags,
// cuda/fused_ll.cuh). The two kernels may then take turns on one workspace: a call's grid need not
// be the previous call's.
#pragma once

#include <cstdint>

#include "cuda/comm/p2p_protocol.cuh"
#include "cuda/fused/fused_tail_types.hpp"
#include "cuda/runtime/dtype.cuh"

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
__device__ inline T* fused_at(const FusedTailParams& p, int rank, std::int64_t offset,
                              std::uint32_t parity) {
  return reinterpret_cast<T*>(p.workspace[rank] + offset +
                              static_cast<std::int64_t>(parity) * p.parity_bytes);
}

__device__ inline FusedFlags* fused_flags(const FusedTailParams& p, int rank) {
  return reinterpret_cast<FusedFlags*>(p.workspace[rank]);
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
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < vectors; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    reinterpret_cast<V*>(dst)[i] =
        peer_source ? fused_load_cg(src + i * V::kSize) : reinterpret_cast<const V*>(src)[i];
  }
}

// One call as every block of this rank sees it (read by thread 0 at entry, kept in shared memory).
struct FusedCall {
  std::uint32_t e;            // this call's epoch: the rank's calls so far + 1
  std::uint32_t parity;       // e & 1: the half of the staged buffers this call writes
  std::uint32_t target;       // rows_done's and blocks_done's value once every block added 1
  std::uint32_t peer_target;  // the same for a peer's inputs_arrived and stripes_arrived
  std::uint32_t general_e;    // the general kernel's calls so far + 1 (its split counters)
  int failed;                 // a wait of this block failed (reported), or a peer's T differs
  // Peers whose T differs from this rank's (fused_compare_tokens): the lowest, and each one's T.
  int mismatched_peer;
  int peer_tokens[kP2pMaxRanks];
};

// Records a failure of a call's T: the two values first, then the code (p2p_fail). Blocks that
// find the same failure record the same values, so the record never mixes two failures.
__device__ inline void fused_fail_tokens(const P2pFailureReport& report, std::int32_t code,
                                         int peer, std::uint32_t call, std::int64_t tokens,
                                         std::int64_t compared_tokens) {
  if (report.status->code == kP2pOk) {
    report.status->tokens = static_cast<std::int32_t>(tokens);
    report.status->compared_tokens = static_cast<std::int32_t>(compared_tokens);
  }
  p2p_fail(report, code, peer, call);
}

// The call's T: *tokens_device where the call reads T on the device (a graph replay), else the
// host's `tokens`. `bound` is the rows the launch and the caller's buffers were sized for: a T read
// past it (or below 0) would read and write past them, so it is recorded (by the one thread that
// is `reporter`, where the report has a record) and every thread gets -1: the call runs no rows.
__device__ inline int fused_call_tokens(const std::int32_t* tokens_device, std::int64_t tokens,
                                        std::int64_t bound, const P2pFailureReport& report,
                                        bool reporter) {
  const std::int64_t t = tokens_device ? *tokens_device : tokens;
  if (t >= 0 && t <= bound) return static_cast<int>(t);
  if (reporter && report.status != nullptr)
    fused_fail_tokens(report, kFusedTokensOutOfRange, -1, 0, t, bound);
  return -1;
}

// Starts a call: the epoch and targets, and (block 0, with take_workspace) the workspace taken, or
// the failure reported when another call of this rank holds it. A call's later kernel (the chained
// path's gather) reads the same epoch and its own grid's targets without taking the workspace
// again. Every thread calls it; true to go on.
__device__ inline bool fused_begin(const FusedTailParams& p, FusedCall* call,
                                   bool take_workspace = true) {
  if (threadIdx.x == 0) {
    const FusedFlags* own = fused_flags(p, p.rank);
    call->failed = 0;
    call->mismatched_peer = kP2pMaxRanks;
    call->e = own->epoch + 1;
    call->parity = call->e & 1u;
    call->target = own->arrivals + gridDim.x;
    call->peer_target = own->general_arrivals + gridDim.x;
    call->general_e = own->general_calls + 1;
    // No read of the host-mapped abort flag here (see kP2pAbortPollAfterNs): the host checks the
    // group's status before every call, and a wait finds a later abort.
    if (take_workspace && blockIdx.x == 0 &&
        atomicExch(&fused_flags(p, p.rank)->in_use, 1u) != 0u) {
      p2p_fail(fused_report(p), kP2pConcurrentUse, -1, call->e);
      call->failed = 1;
    }
  }
  __syncthreads();
  return !call->failed;
}

// Thread i < tp waits until counters[i] (one per peer, in this rank's flags: inputs_arrived or
// stripes_arrived) reached the call's peer target. Every thread calls it; true when every peer
// arrived, false (reported) otherwise.
__device__ inline bool fused_wait_peers(const FusedTailParams& p, const std::uint32_t* counters,
                                        FusedCall* call) {
  if (threadIdx.x < static_cast<unsigned>(p.tp)) {
    if (!p2p_wait_until(fused_report(p), &counters[threadIdx.x], call->peer_target,
                        static_cast<int>(threadIdx.x), call->e)) {
      call->failed = 1;
    }
  }
  __syncthreads();
  return !call->failed;
}

// Adds this block to every peer's counter of this rank (member `counters` of their flags), after
// everything the block stored before is visible to them. Every thread calls it.
template <std::uint32_t (FusedFlags::*kCounters)[kP2pMaxRanks]>
__device__ inline void fused_publish(const FusedTailParams& p) {
  __syncthreads();
  if (threadIdx.x < static_cast<unsigned>(p.tp)) {
    __threadfence_system();
    fused_add_release(&(fused_flags(p, static_cast<int>(threadIdx.x))->*kCounters)[p.rank], 1u);
  }
}

// 1. The call's inputs into this rank's staged buffers (parity), then published to every peer.
template <typename T>
__device__ inline void fused_stage_inputs(const FusedTailParams& p, std::int64_t tokens,
                                          const FusedCall& call) {
  fused_copy(static_cast<const T*>(p.routed), fused_at<T>(p, p.rank, p.routed_offset, call.parity),
             tokens * p.l, false);
  fused_copy(static_cast<const T*>(p.shared), fused_at<T>(p, p.rank, p.shared_offset, call.parity),
             tokens * p.d, false);
  fused_publish<&FusedFlags::inputs_arrived>(p);
}

// A barrier of this rank's grid: true once every block of the call added itself to rows_done.
__device__ inline bool fused_grid_barrier(const FusedTailParams& p, FusedCall* call) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    std::uint32_t* rows_done = &fused_flags(p, p.rank)->rows_done;
    atomicAdd(rows_done, 1u);
    if (!p2p_wait_until(fused_report(p), rows_done, call->target, p.rank, call->e))
      call->failed = 1;
  }
  __syncthreads();
  return !call->failed;
}

// 4. This block's stripe rows are in Y and in the staged stripe: publish them, wait for every
//    peer's, and copy the peers' stripes into Y (grid-stride). True unless a wait failed.
template <typename T>
__device__ inline bool fused_gather_stripes(const FusedTailParams& p, std::int64_t tokens,
                                            FusedCall* call) {
  fused_publish<&FusedFlags::stripes_arrived>(p);
  if (!fused_wait_peers(p, fused_flags(p, p.rank)->stripes_arrived, call)) return false;
  using V = Vec16<T>;
  const std::int64_t row_vectors = p.stripe / V::kSize;
  const std::int64_t per_peer = tokens * row_vectors;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < per_peer * p.tp; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(i / per_peer);
    if (r == p.rank) continue;
    const std::int64_t t = (i % per_peer) / row_vectors, v = (i % per_peer) % row_vectors;
    const T* src = fused_at<T>(p, r, p.stripe_offset, call->parity) + t * p.stripe + v * V::kSize;
    reinterpret_cast<V*>(static_cast<T*>(p.out) + t * p.d + r * p.stripe)[v] = fused_load_cg(src);
  }
  return true;
}

// The last block out closes the call: epoch, the counters' bases, (general kernel) its own count,
// and the workspace freed. Every thread calls it.
__device__ inline void fused_end(const FusedTailParams& p, const FusedCall& call, bool general) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    FusedFlags* own = fused_flags(p, p.rank);
    if (atomicAdd(&own->blocks_done, 1u) == call.target - 1u) {
      own->epoch = call.e;
      own->arrivals = call.target;
      if (general) {
        own->general_calls = call.general_e;
        own->general_arrivals = call.peer_target;
      }
      __threadfence();
      atomicExch(&own->in_use, 0u);
    }
  }
}

}  // namespace lmoe::cuda
