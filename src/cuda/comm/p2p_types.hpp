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
  // The fused tier's kernels (cuda/fused/), which report into the same records: a call's T.
  kFusedTokensMismatch = 4,    // a peer ran the call with another T
  kFusedTokensOutOfRange = 5,  // T read on the device outside [0, the call's bound]
};

struct P2pStatus {
  std::int32_t code;
  std::int32_t peer;  // the peer waited for (timeout) or whose T differs, else -1
  std::int32_t block;
  std::int32_t round;  // the epoch of the failed round
  // A fused call's check of T: this rank's T, and what it was compared with: the peer's T
  // (kFusedTokensMismatch) or the call's bound (kFusedTokensOutOfRange). Written before the code.
  std::int32_t tokens;
  std::int32_t compared_tokens;
};

// Per rank, in its device's memory (zeroed at creation).
struct P2pFlags {
  std::uint32_t arrive[kP2pMaxBlocks][kP2pMaxRanks];  // written by peers
  std::uint32_t epoch[kP2pMaxBlocks];                 // own rounds completed, per block
  std::uint32_t in_use[kP2pMaxBlocks];                // a round of this block is running
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
