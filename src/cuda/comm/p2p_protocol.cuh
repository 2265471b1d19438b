// The P2P workspace's synchronization protocol, device side. Host side:
// src/comm/p2p_communicator.cpp; the protocol is described in docs/p2p.md.
//
// Every collective is a sequence of *rounds*; a round is one launch of a fixed number of blocks on
// every rank. Block b of every rank owns the same slice of the round's data, so block b only waits
// for block b of its peers: there is no grid-wide barrier. Per block b each rank keeps
//   epoch[b]            the rounds this block has completed (device memory, never host)
//   arrive[b][peer]     the latest round that `peer`'s block b has staged (low 32 bits) and that
//                       round's tag (high 32 bits: the collective, dtype and element count it
//                       belongs to, p2p_round_tag), written by the peer in one store
// and each round e = epoch[b] + 1:
//   1. stages its slice into its own region b of its data buffer of parity e & 1;
//   2. publishes arrive[b][me] = (tag, e) into every peer's workspace (release, system scope);
//   3. waits until every peer's arrive[b][peer] has reached e (acquire, system scope, bounded); a
//      peer that arrived at e with another tag fails the round (kP2pMismatch) instead of pairing
//      two collectives' data;
//   4. reads its peers' slices of the same parity and writes its output.
// A peer can be at most one round ahead (round e + 1 needs our arrival for e + 1), and it writes
// the other parity, so the two buffers are enough; `arrive` is compared as a wrapping difference (≥
// e, not == e) because a peer one round ahead has already overwritten e with e + 1 (and its tag
// with the next round's: that peer compared the tags of round e itself, and passed). The tag costs
// nothing on the way: it travels in the store that publishes the arrival. Spins are bounded by a
// wall-clock budget (%globaltimer); a timeout, or a group abort set by the host or by another
// rank's timeout, makes the round write a status record the host turns into an lmoe::Error, and
// raises the group abort flag so that every peer stops spinning too.
#pragma once

#include <cstdint>

#include "cuda/comm/p2p_types.hpp"

namespace lmoe::cuda {

__device__ inline std::uint64_t p2p_clock_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ inline void p2p_store_release(std::uint32_t* address, std::uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ inline void p2p_store_release(std::uint64_t* address, std::uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

__device__ inline std::uint32_t p2p_load_acquire(const std::uint32_t* address) {
  std::uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ inline std::uint64_t p2p_load_acquire(const std::uint64_t* address) {
  std::uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

// The abort flag lives in host-mapped memory (the host raises it at any time), and a read of it
// crosses PCIe: reads from many blocks at once serialize there (docs/p2p.md). So a wait reads it
// only once it has waited this long, which a healthy peer never makes it do at decode sizes, and
// the host checks the group's status before every call anyway.
inline constexpr std::uint64_t kP2pAbortPollAfterNs = 50000;

// Where a kernel that waits for its peers reports a failure (the p2p rounds and the fused tail):
// this rank's status record and the group's abort flag, both host-mapped, and the wait's budget.
struct P2pFailureReport {
  volatile P2pStatus* status;
  volatile std::int32_t* abort_flag;
  std::uint64_t timeout_ns;
};

// Records the first failure of this rank and aborts the group so that peers stop waiting. The
// record's code is made visible before the abort flag, and a wait that sees the flag fences before
// it reads the code (p2p_wait_expired): a thread that stops because of another's failure then finds
// that failure's record and leaves it alone. (Without the two fences a thread of another block,
// aborted by the first failure, could still find the code unset and write its own peer, -1, into
// the record: "waited more than 500 ms for rank -1".)
// A mismatch (kP2pMismatch) also records both ranks' round tags.
__device__ inline void p2p_fail(const P2pFailureReport& report, std::int32_t code, int peer,
                                std::uint32_t round, std::uint32_t own_tag = 0,
                                std::uint32_t peer_tag = 0) {
  if (report.status->code == kP2pOk) {
    report.status->peer = peer;
    report.status->block = static_cast<std::int32_t>(blockIdx.x);
    report.status->round = static_cast<std::int32_t>(round);
    report.status->own_tag = own_tag;
    report.status->peer_tag = peer_tag;
    __threadfence_system();
    report.status->code = code;
    __threadfence_system();
  }
  *report.abort_flag = 1;
  __threadfence_system();
}

// A spinning wait's periodic check, since `start`: true, with the failure reported, once the group
// was aborted (the host-mapped flag is read only after kP2pAbortPollAfterNs, and only when
// `may_read_abort`) or the wait ran past the timeout (naming `peer`). `round` is the call the wait
// belongs to, for the report.
__device__ inline bool p2p_wait_expired(const P2pFailureReport& report, std::uint64_t start,
                                        bool may_read_abort, int peer, std::uint32_t round) {
  const std::uint64_t waited = p2p_clock_ns() - start;
  if (may_read_abort && waited > kP2pAbortPollAfterNs && *report.abort_flag) {
    __threadfence_system();  // the record of the failure that raised the flag, if any, is seen
    p2p_fail(report, kP2pAborted, -1, round);
    return true;
  }
  if (waited > report.timeout_ns) {
    p2p_fail(report, kP2pTimeout, peer, round);
    return true;
  }
  return false;
}

// Waits (one thread) until *counter has reached target, compared as a wrapping difference (a
// counter one step ahead counts); false, with the failure reported, on a timeout (naming `peer`)
// or a group abort (p2p_wait_expired). A 64-bit word counts in its low 32 bits (the arrivals: the
// high ones hold the round's tag); `seen`, when given, receives the word that ended the wait.
template <typename Word>
__device__ inline bool p2p_wait_until(const P2pFailureReport& report, const Word* counter,
                                      std::uint32_t target, int peer, std::uint32_t round,
                                      Word* seen = nullptr) {
  const std::uint64_t start = p2p_clock_ns();
  for (std::uint32_t spins = 0;; ++spins) {
    const Word word = p2p_load_acquire(counter);
    if (static_cast<std::int32_t>(static_cast<std::uint32_t>(word) - target) >= 0) {
      if (seen) *seen = word;
      return true;
    }
    if ((spins & 63) == 63 && p2p_wait_expired(report, start, true, peer, round)) return false;
  }
}

__device__ inline P2pFailureReport p2p_report_of(const P2pDeviceHandle& h) {
  return {h.status, h.abort_flag, h.timeout_ns};
}

// Step 2: this block's arrival at round `round` and the round's tag, one word, into `peer`'s flags.
__device__ inline void p2p_publish_arrival(const P2pDeviceHandle& h, int peer, std::uint32_t round,
                                           std::uint32_t tag) {
  p2p_store_release(&h.flags[peer]->arrive[blockIdx.x][h.rank],
                    static_cast<std::uint64_t>(tag) << 32 | round);
}

// Step 3: waits until `peer`'s block has arrived at round `round` (see p2p_wait_until), then
// compares the tag it published with this rank's `tag`: false, with a kP2pMismatch record naming
// both, when the peer's round belongs to another collective. A peer already one round ahead has
// overwritten the word with its next round's; it has compared this round's tags itself (the
// comparison is symmetric), and a peer that fails a round does not go on to the next one.
__device__ inline bool p2p_wait_arrival(const P2pDeviceHandle& h, int peer, std::uint32_t round,
                                        std::uint32_t tag) {
  std::uint64_t word = 0;
  if (!p2p_wait_until(p2p_report_of(h), &h.flags[h.rank]->arrive[blockIdx.x][peer], round, peer,
                      round, &word)) {
    return false;
  }
  const auto peer_tag = static_cast<std::uint32_t>(word >> 32);
  if (static_cast<std::uint32_t>(word) != round || peer_tag == tag) return true;
  p2p_fail(p2p_report_of(h), kP2pMismatch, peer, round, tag, peer_tag);
  return false;
}

}  // namespace lmoe::cuda
