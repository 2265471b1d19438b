// The fused decode tail's shared types: what the host sets up and the kernel reads (plain,
// trivially copyable; host and device code). Kernel: src/cuda/fused_tail.cuh; host side:
// src/cuda/fused_tail.cpp; protocol: docs/fused.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/comm/p2p_types.hpp"

namespace lmoe::cuda {

// The most tokens one fused call carries (the workspace's rows; a larger T is declined).
inline constexpr std::int64_t kFusedMaxTokens = 256;
inline constexpr int kFusedThreads = 256;  // 8 warps: the RMSNorm's 256 lanes
inline constexpr int kFusedWarps = kFusedThreads / 32;
// The stripe product's work item: kFusedTileCols output columns of the stripe for every row, over
// one range of K (a split), streamed through shared memory kFusedTileK at a time.
inline constexpr int kFusedTileCols = 64;
inline constexpr int kFusedTileK = 64;

// Per rank, at the start of its workspace (zeroed at creation). Counters only grow, modulo 2^32,
// and are compared as wrapping differences against a call's target: a base (the sum of the grids
// of the calls before it that counted there) plus its own grid G, which every rank agrees on (each
// kernel's grid is agreed at construction, and the ranks run the same kernel for a call). The
// decode kernel's calls count in rows_done and blocks_done only (their data carry their own flags:
// fused_ll.cuh); with one rank they use no workspace and count nowhere.
struct FusedFlags {
  std::uint32_t inputs_arrived[kP2pMaxRanks];  // += 1 per block of peer p once it staged the call
  std::uint32_t
      stripes_arrived[kP2pMaxRanks];  // += 1 per block of peer p once its stripe rows are out
  std::uint32_t epoch;                // calls this rank completed (the staged parity)
  std::uint32_t in_use;               // a call of this rank is running on the workspace
  std::uint32_t rows_done;            // this rank's blocks past the norm phase
  std::uint32_t blocks_done;          // this rank's blocks finished
  std::uint32_t arrivals;       // Σ G over the calls completed: rows_done's and blocks_done's base
  std::uint32_t general_calls;  // calls of the general kernel (its split counters)
  // Σ G over the general kernel's calls: inputs_arrived's and stripes_arrived's base.
  std::uint32_t general_arrivals;
};

// Where a block is in a call, for LMOE_FUSED_TRACE (docs/fused.md).
enum FusedTracePoint : int {
  kTraceEntry,           // thread 0 starts
  kTraceEpoch,           // epoch read, in_use taken (block 0), weights' first stages issued
  kTraceStaged,          // inputs staged and published to the peers (tp > 1)
  kTraceInputsArrived,   // every peer's inputs are there (tp > 1)
  kTraceNormed,          // this block's rows of N and its part of the shared stripe are written
  kTraceRowsDone,        // every block of this rank is past the norm (grid barrier)
  kTraceItemsDone,       // this block's stripe items (product and epilogue) are done
  kTraceStripesArrived,  // every peer's stripe is there (tp > 1)
  kTraceEnd,             // gathered, counted out
  kFusedTracePoints
};

// Where the blocks of the chained path's exchange and gather kernels are in a call, for
// LMOE_FUSED_TRACE (cuda/fused_chained_exchange.cuh; both kernels have the same grid).
enum ChainedExchangeTracePoint : int {
  kCxTraceEntry,        // the exchange kernel's block starts
  kCxTracePushed,       // its latent rows and shared columns sent
  kCxTraceOwnRows,      // its share of this rank's rows of N summed, normalized and sent
  kCxTraceSharedSums,   // its units of the stripe's shared sum written
  kCxTraceOtherRows,    // its units of the other owners' rows of N in place
  kCxTraceGatherEntry,  // the gather kernel's block starts
  kCxTraceGathered,     // its units of the peers' stripes in Y
  kCxTraceClosed,       // past the up-projection's end, counted out
  kCxTracePoints
};

struct FusedTailParams {
  int rank = 0;
  int tp = 1;
  std::int64_t tokens = 0;                      // T, when tokens_device is null
  const std::int32_t* tokens_device = nullptr;  // T read on the device (graph replays with new T)
  std::int64_t d = 0, l = 0;                    // d_model, d_latent
  std::int64_t stripe = 0;         // this rank's output columns: [rank·stripe, (rank+1)·stripe)
  const void* routed = nullptr;    // own input [T, l]
  const void* shared = nullptr;    // own input [T, d]
  void* out = nullptr;             // [T, d]
  const void* w_stripe = nullptr;  // [stripe, l]: w_up's rows of this rank's stripe
  const float* gamma = nullptr;    // [l], fp32
  float eps = 0;
  bool latent_norm = true;        // false: N = the reduced latent itself (no RMSNorm)
  int grid = 1;                   // G, the same on every rank
  bool prefetch_weights = false;  // issue the stripe's L2 prefetch before waiting for peers
  // The stripe product: col_tiles tiles of kFusedTileCols columns, each split over `splits` ranges
  // of K; with splits > 1 the blocks of one tile leave fp32 partials (own workspace,
  // partials_offset: [col_tiles][splits][capacity][kFusedTileCols]) and the last to arrive
  // (tile_arrived_offset: col_tiles counters, += 1 per split per call) sums them in split order.
  std::int64_t col_tiles = 0;
  std::int64_t splits = 1;
  std::int64_t tile_arrived_offset = 0, partials_offset = 0;  // bytes into this rank's workspace
  // Diagnostics (LMOE_FUSED_TRACE): per block, %globaltimer at each FusedTracePoint of the last
  // call, [grid][kFusedTracePoints], in host-mapped memory; null normally.
  std::uint64_t* trace = nullptr;
  std::int64_t shared_sum_offset =
      0;  // this rank's own [capacity, stripe]: round(Σ_r shared_r) of its stripe
  // Every rank's workspace (peers' through peer access or the same GPU): FusedFlags, then per
  // parity the staged routed [cap, l], shared [cap, d] and output stripe [cap, stripe] rows; the
  // normalized rows [cap, l] are this rank's own (not read by peers).
  std::byte* workspace[kP2pMaxRanks] = {};
  std::int64_t capacity = 0;  // rows of every staged buffer
  std::int64_t routed_offset = 0, shared_offset = 0, stripe_offset = 0, normed_offset = 0;  // bytes
  std::int64_t parity_bytes = 0;  // distance between the two parities of one staged buffer
  // The decode kernel's exchange (cuda/fused_ll.cuh): per parity, in every rank's workspace, one
  // slot per sending rank of its latent rows [ll_rows, l], of its columns of the receiver's stripe
  // of `shared` [ll_rows, stripe] and of its output stripe [ll_rows, stripe], as LL lines (4 bytes
  // per element); before them, one line per sending rank with the call's T, which every kernel's
  // call sends (fused_send_tokens). Offsets in bytes to parity 0; absent (ll_rows 0) with one rank.
  std::int64_t ll_rows = 0;
  std::int64_t ll_tokens_offset = 0, ll_latent_offset = 0, ll_shared_offset = 0,
               ll_stripe_offset = 0, ll_parity_bytes = 0;
  // The chained path's exchange with several ranks (cuda/fused_chained_exchange.cuh), LL lines
  // too: per parity, in every rank's workspace, the latent rows this rank owns (row t belongs to
  // rank t mod tp) from every sender [cx_owner_rows, l] per sender; N's rows from their owners
  // [cx_rows, l]; the columns of this rank's stripe of `shared` from every sender [cx_rows,
  // stripe] per sender; the output stripes from every sender [cx_rows, stripe] per sender. Offsets
  // in bytes to parity 0; absent (cx_rows 0) where the chained path does not run with several
  // ranks.
  std::int64_t cx_rows = 0, cx_owner_rows = 0;
  // One rank per GPU: the up-projection is launched while the exchange runs; ranks sharing a GPU
  // launch it after (cuda/fused_chained_exchange.cuh).
  bool cx_early_up = false;
  std::int64_t cx_latent_offset = 0, cx_normed_offset = 0, cx_shared_offset = 0, cx_out_offset = 0,
               cx_parity_bytes = 0;
  // Failure reporting: the p2p group's record and abort flag, or with one rank the FusedTail's own.
  volatile P2pStatus* status = nullptr;
  volatile std::int32_t* abort_flag = nullptr;
  std::uint64_t timeout_ns = 0;
};

}  // namespace lmoe::cuda
