// The P2P workspace's shared types: what the host sets up and the round kernels read (plain,
// trivially copyable structs; host and device code). The protocol: src/cuda/p2p_protocol.cuh.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lmoe::cuda {

inline constexpr int kP2pMaxRanks = 16;
inline constexpr int kP2pMaxBlocks = 32;

// Status codes a round writes into its rank's status record (host-mapped memory).
enum P2pStatusCode : std::int32_t {
  kP2pOk = 0,
  kP2pTimeout = 1,        // a peer did not arrive within the budget
  kP2pAborted = 2,        // the group was aborted (by the host, or by a peer's failure)
  kP2pConcurrentUse = 3,  // two rounds of one rank ran at the same time on one workspace
  kP2pMismatch = 4,       // a peer's round belongs to another collective (its tag differs)
  // The fused tier's kernels (cuda/fused/), which report into the same records: a call's T.
  kFusedTokensMismatch = 5,    // a peer ran the call with another T
  kFusedTokensOutOfRange = 6,  // T read on the device outside [0, the call's bound]
};

// Which collective a round belongs to, as every rank must issue it alike, in the 32 bits beside
// the round's epoch in its arrival word (P2pFlags::arrive), so that peers compare it as they pair
// up and collectives issued in another order, size or dtype on different ranks fail instead of
// mixing their data. Bits 0-1: the operation; 2-3: the dtype (lmoe::DType's value); 5-31: the
// collective's element count (the whole collective's, so that every round of it carries the same
// tag), or with bit 4 set, for counts of 2^27 and more, a hash of it.
enum class P2pCollective : std::uint32_t { none, all_reduce, reduce_scatter, all_gather };
inline constexpr std::uint64_t kP2pTagExactCounts = std::uint64_t{1} << 27;
constexpr std::uint32_t p2p_round_tag(P2pCollective collective, std::uint32_t dtype,
                                      std::uint64_t count) {
  const std::uint32_t counted =
      count < kP2pTagExactCounts
          ? static_cast<std::uint32_t>(count) << 5
          : 16u | static_cast<std::uint32_t>((count * 0x9e3779b97f4a7c15ull) >> 37) << 5;
  return static_cast<std::uint32_t>(collective) | (dtype & 3u) << 2 | counted;
}

struct P2pStatus {
  std::int32_t code;
  // The peer waited for (timeout), paired with (mismatch) or whose T differs, else -1.
  std::int32_t peer;
  std::int32_t block;
  std::int32_t round;     // the epoch of the failed round
  std::uint32_t own_tag;  // kP2pMismatch: this rank's round tag (p2p_round_tag) and the peer's
  std::uint32_t peer_tag;
  // A fused call's check of T: this rank's T, and what it was compared with: the peer's T
  // (kFusedTokensMismatch) or the call's bound (kFusedTokensOutOfRange). Written before the code.
  std::int32_t tokens;
  std::int32_t compared_tokens;
};

// Per rank, in its device's memory (zeroed at creation).
struct P2pFlags {
  // Written by peers: the latest round each peer's block has staged (low 32 bits) and that round's
  // tag (high 32 bits), in one store.
  std::uint64_t arrive[kP2pMaxBlocks][kP2pMaxRanks];
  std::uint32_t epoch[kP2pMaxBlocks];    // own rounds completed, per block
  std::uint32_t in_use[kP2pMaxBlocks];   // a round of this block is running
  std::uint32_t entered[kP2pMaxBlocks];  // the last round this block started (diagnostics)
};

// Everything a round kernel needs about its group, by value (trivially copyable, kernel parameter).
struct P2pDeviceHandle {
  int rank;
  int size;
  // A rank's data buffer: two parities, each of max_blocks regions of block_bytes, one per block.
  // Block b always stages into its own region, so the one-round-ahead argument of the protocol
  // holds per block whatever the sizes and grids of successive rounds.
  std::int64_t block_bytes;
  int max_blocks;                     // no round uses more blocks
  std::byte* data[kP2pMaxRanks];      // every rank's data buffer (peers' through P2P/same GPU)
  P2pFlags* flags[kP2pMaxRanks];      // every rank's flags
  volatile P2pStatus* status;         // this rank's status record (host-mapped)
  volatile std::int32_t* abort_flag;  // the group's abort flag (host-mapped)
  std::uint64_t timeout_ns;
};

// One round of a collective on one rank (see p2p_protocol.cuh). Every rank stages
// stage_count[rank] elements from `send` into its own buffer; then
//   reduce: out[i] = round(Σ_r staged_r[reduce_first + i]) in rank order, i < reduce_count;
//   gather: out[gather_offset[r] + i] = staged_r[i] for every rank r, i < stage_count[r].
//   reduce_scatter: every rank stages one piece per rank q, piece_count[q] elements from
//     send + piece_offset[q] (the same counts on every rank), and
//     out[i] = round(Σ_r piece_r,rank[i]) in rank order, i < piece_count[rank]:
//   every rank reduces its own piece in the same round, and every block holds a slice of every
//   piece, so that all blocks of all ranks read at once (p2p_round.cuh).
enum class P2pOp : std::int32_t { reduce, gather, reduce_scatter };

struct P2pRound {
  std::uint32_t tag;  // the collective this round belongs to (p2p_round_tag)
  P2pOp op;
  const void* send;
  void* out;
  std::int64_t stage_count[kP2pMaxRanks];
  std::int64_t reduce_first;
  std::int64_t reduce_count;
  std::int64_t gather_offset[kP2pMaxRanks];
  bool skip_own_gather;  // in-place all-gather: this rank's block of out is its send already
  std::int64_t
      piece_offset[kP2pMaxRanks];  // reduce_scatter: piece q starts at send + piece_offset[q]
  std::int64_t piece_count[kP2pMaxRanks];  // reduce_scatter: its elements (the same on every rank)
};

}  // namespace lmoe::cuda
