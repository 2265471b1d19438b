// The decode kernel's exchange between ranks (cuda/fused_decode.cuh), and every fused call's T:
// data that carry their own flags, after the "LL" (low-latency) protocol of NCCL. Device code
// only.
//
// A sender stores 8 bytes of data (4 elements of a 16-bit dtype) straight into the receiver's
// workspace as one 16-byte line {data[0:4], e, data[4:8], e}, where e is the call's epoch (the same
// on every rank: every rank counts the same calls). Each 8-byte half is stored at once (NCCL's LL
// relies on the same), so a receiver that reads e in both halves of a line has its 8 bytes: no
// fence, no counter, no read across NVLink — one one-way trip, where staging, a system-scope fence,
// a remote counter and a remote read cost several. The data's bits are never compared (−0,
// subnormals and NaNs pass through), and the flags need no reset: a line written for an earlier
// call holds an earlier epoch.
//
// Two parities, as for the staged buffers: the call of epoch e writes parity e & 1. A sender can be
// at most one call ahead of a receiver (its call e + 1 needs the receiver's data of e + 1, which
// the receiver sends after its own call e has ended), so it never overwrites lines the receiver has
// yet to read.
#pragma once

#include <cstdint>

#include "cuda/comm/p2p_protocol.cuh"
#include "cuda/fused/fused_protocol.cuh"
#include "cuda/fused/fused_tail_types.hpp"
#include "cuda/runtime/dtype.cuh"

namespace lmoe::cuda {

// The line of element `index` (a multiple of 4) of sender `from`'s slot of `slot_elements` in the
// exchange region at `region` (bytes into a workspace, parity 0) of rank `at`'s workspace.
// The same in any exchange region of a workspace: its parities `parity_bytes` apart.
__device__ inline std::byte* ll_line_in(std::byte* workspace, std::int64_t region,
                                        std::int64_t parity_bytes, std::uint32_t parity, int from,
                                        std::int64_t slot_elements, std::int64_t index) {
  return workspace + region + static_cast<std::int64_t>(parity) * parity_bytes +
         (from * slot_elements + index) * 4;
}
__device__ inline std::byte* ll_line(const FusedTailParams& x, int at, std::int64_t region,
                                     std::uint32_t parity, int from, std::int64_t slot_elements,
                                     std::int64_t index) {
  return ll_line_in(x.workspace[at], region, x.ll_parity_bytes, parity, from, slot_elements, index);
}

// One read of a line, past L1 (a peer writes it).
__device__ inline uint4 ll_read(const std::byte* line) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(line)
               : "memory");
  return v;
}

__device__ inline void ll_store(std::byte* line, uint2 data, std::uint32_t e) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(line), "r"(data.x), "r"(e),
               "r"(data.y), "r"(e)
               : "memory");
}

// Waits until the line carries epoch e in both halves and returns its data in *data. Bounded as
// p2p_wait_until (timeout, group abort); a failure is reported (peer, call e; the group's first
// report is kept) and sets call->failed, which also stops this block's other threads' waits. False
// when it failed. The abort flag is host-mapped and its reads serialize on PCIe (~1 µs each), so
// after the first 50 µs each waiting thread reads it at one check in kLlAbortStride, phased by its
// index: a block then reads it at most twice per check however many of its threads wait (up to
// 512), and a peer that is merely late (an imbalanced layer before the tail) does not set off a
// storm of host reads that would delay this block once the lines arrive.
__device__ inline bool ll_load(const FusedTailParams& x, const std::byte* line, std::uint32_t e,
                               int peer, FusedCall* call, uint2* data) {
  const volatile int* failed = &call->failed;
  constexpr std::uint32_t kLlAbortStride = 256;
  std::uint64_t start = 0;
  for (std::uint32_t spins = 0;; ++spins) {
    const uint4 v = ll_read(line);
    if (v.y == e && v.w == e) {
      *data = make_uint2(v.x, v.z);
      return true;
    }
    if (spins == 0) {
      start = p2p_clock_ns();
    } else if ((spins & 63) == 0) {
      if (*failed) return false;
      const bool my_turn = ((spins >> 6) + threadIdx.x) % kLlAbortStride == 0;
      if (p2p_wait_expired(fused_report(x), start, my_turn, peer, e)) {
        call->failed = 1;
        return false;
      }
    }
  }
}

// The call's T travels as a line too: every kernel's call sends it to every peer as it starts,
// one line per sender in each receiver's workspace (per parity, at ll_tokens_offset), and every
// block compares its peers' T with its own before it relies on their rows. Ranks whose T differ in
// one call (a graph replayed with another T written on one rank) then fail on every rank, naming
// both T, instead of summing rows a peer never sent or waiting for them until the timeout.
__device__ inline std::byte* fused_tokens_line(const FusedTailParams& x, int at,
                                               std::uint32_t parity, int from) {
  return ll_line(x, at, x.ll_tokens_offset, parity, from, 4, 0);  // a slot of one line a sender
}

// Block 0's thread r sends this rank's T to peer r. Every thread may call it.
__device__ inline void fused_send_tokens(const FusedTailParams& x, int tokens,
                                         const FusedCall& call) {
  const int peer = static_cast<int>(threadIdx.x);
  if (blockIdx.x != 0 || peer >= x.tp || peer == x.rank) return;
  const auto t = static_cast<unsigned>(tokens);
  ll_store(fused_tokens_line(x, peer, call.parity, x.rank), make_uint2(t, t), call.e);
}

// Thread r waits for peer r's T (no other thread waits) and, where it is not this rank's, flags
// the block's call failed (the block's other waits then stop) with the peer and its T, for
// fused_block_failed to record. No barrier.
__device__ inline void fused_compare_tokens(const FusedTailParams& x, int tokens, FusedCall* call) {
  const int peer = static_cast<int>(threadIdx.x);
  if (peer >= x.tp || peer == x.rank) return;
  uint2 line;
  if (!ll_load(x, fused_tokens_line(x, x.rank, call->parity, peer), call->e, peer, call, &line))
    return;
  if (static_cast<int>(line.x) == tokens) return;
  call->peer_tokens[peer] = static_cast<int>(line.x);
  atomicMin(&call->mismatched_peer, peer);
  call->failed = 1;
}

// A barrier of the block, then true when the call failed here: a wait failed (reported) or a
// peer's T differed, which thread 0 records, for the lowest such peer, so that every block records
// the same failure. Every thread calls it.
__device__ inline bool fused_block_failed(const FusedTailParams& x, int tokens, FusedCall* call) {
  __syncthreads();
  if (!call->failed) return false;
  const int peer = call->mismatched_peer;
  if (threadIdx.x == 0 && peer < x.tp) {
    fused_fail_tokens(fused_report(x), kFusedTokensMismatch, peer, call->e, tokens,
                      call->peer_tokens[peer]);
  }
  return true;
}

// Up to kLines lines at once (those whose bit is set in `wanted`): every load issued before any
// is checked, so that their latencies overlap; a line not there yet is then waited for as ll_load
// does (peers[k]: its sender, for the report). False when a wait failed (reported).
template <int kLines>
__device__ inline bool ll_load_lines(const FusedTailParams& x, std::byte* const (&lines)[kLines],
                                     unsigned wanted, std::uint32_t e, const int (&peers)[kLines],
                                     FusedCall* call, uint2 (&data)[kLines]) {
  uint4 v[kLines];
#pragma unroll
  for (int k = 0; k < kLines; ++k) {
    if (wanted >> k & 1u) v[k] = ll_read(lines[k]);
  }
#pragma unroll
  for (int k = 0; k < kLines; ++k) {
    if (!(wanted >> k & 1u)) continue;
    if (v[k].y == e && v[k].w == e) {
      data[k] = make_uint2(v[k].x, v[k].z);
    } else if (!ll_load(x, lines[k], e, peers[k], call, &data[k])) {
      return false;
    }
  }
  return true;
}

// Σ over the ranks, in rank order from rank 0's value and rounded once (the contract's rank sum),
// of the 4 elements at `index` of a slot of `slot_elements`: this rank's own from `own`, every
// peer's from its line in this rank's region (parities `parity_bytes` apart; waited for). False
// when a wait failed (reported).
template <typename T>
__device__ inline bool ll_rank_sum4(const FusedTailParams& x, std::int64_t region,
                                    std::int64_t parity_bytes, std::int64_t slot_elements,
                                    std::int64_t index, const T* own, FusedCall* call, uint2* sum) {
  float acc[4];
  for (int r = 0; r < x.tp; ++r) {
    uint2 bits;
    if (r == x.rank) {
      bits = *reinterpret_cast<const uint2*>(own);
    } else if (!ll_load(x,
                        ll_line_in(x.workspace[x.rank], region, parity_bytes, call->parity, r,
                                   slot_elements, index),
                        call->e, r, call, &bits)) {
      return false;
    }
    const T* v = reinterpret_cast<const T*>(&bits);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      acc[k] = r == 0 ? Storage<T>::load(v[k]) : __fadd_rn(acc[k], Storage<T>::load(v[k]));
  }
  Vec4<T> out;
#pragma unroll
  for (int k = 0; k < 4; ++k) out.v[k] = Storage<T>::store(acc[k]);
  *sum = *reinterpret_cast<const uint2*>(&out);
  return true;
}

}  // namespace lmoe::cuda
