// Launcher of the fused tier's chained path (cuda/fused_chained.cuh). One rank (tp = 1, the
// expert-parallel layout): two kernels chained by programmatic dependent launch,
//
//   1. N = round(rmsnorm(routed)) into the workspace (launch_rms_norm: the register kernel of
//      cuda/rms_norm.cuh, the canonical order), which lets the second start at once;
//   2. Y = round(round(N · w_upᵀ) + shared) on wgmma tensor cores, whose weight copies start while
//      the first still runs and which waits for N only before its first copy of N.
//
// Several ranks (launch_fused_chained_ranks): the exchange kernel of
// cuda/fused_chained_exchange.cuh in place of the norm kernel, the same up-projection over the
// rank's stripe, and a gather kernel.
//
// Compute 9.0 (wgmma) only, bf16 or f16, T ≤ kFusedChainedMaxTokens. Host code only.
#pragma once

#include <cuda.h>  // CUtensorMap (the type only)
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/comm/p2p_types.hpp"
#include "cuda/fused/fused_tail_types.hpp"
#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

// The most tokens a chained call carries: wgmma's N of 128.
inline constexpr std::int64_t kFusedChainedMaxTokens = 128;
// Where the chained path runs, the decode kernel keeps only the calls of up to this many rows,
// where it measured at least as fast (docs/fused.md, "Which path runs a call"). One rank: none,
// since the chained path's norm kernel is launched programmatically. 2 … 7 ranks: 4. From 8 ranks
// all 16 of the decode kernel, until 8 GPUs measure its one-shot exchange against the chained
// path's two shots. With one rank the decode kernel's pair instance takes up to 4 rows where it
// runs (FusedTail::decode_pair_tokens: a block's share of w_up is one group of 8 rows).
constexpr std::int64_t fused_decode_beside_chained_tokens(int tp) {
  return tp == 1 ? 0 : tp < 8 ? 4 : 16;
}

// A block: a producer warpgroup (one thread issues the copies of w_up and N, one paces the first
// round's, two warps copy the block's slice of `shared` for the finish) and two more warpgroups,
// which multiply a tile of 64 or 128 rows of w_up (wgmma's M) by every token — each 64 rows of a
// tile of 128, or the first alone all of a tile of 64 while the second only helps finish; 64
// elements of K per stage. A tile is split over K by the blocks of one cluster: a power of two, at
// most kChainedMaxSplits, the portable cluster size (the plan asks the device whether the tiles'
// clusters fit at once, and takes fewer splits where they do not). Clusters of 16 (non-portable)
// measured no faster on a stripe of 896 rows in tiles of 128: the stream shortens, the reduction
// lengthens (docs/fused.md).
inline constexpr int kChainedThreads = 384;
inline constexpr int kChainedTileK = 64;
inline constexpr int kChainedMaxSplits = 8;
// N's rows per copy: one box of the call's token class (16, 32, 64 or 128 rows: wgmma's N).
inline constexpr int kChainedTokenClasses = 4;

// The kernel's arguments (passed as a __grid_constant__ parameter: the tensor maps must live in
// parameter space).
struct FusedChainedParams {
  CUtensorMap w_map;  // w_up [rows, l], boxes of 64 k × the tile's rows, 128-byte swizzle
  // N [capacity, l], boxes of 64 k × 16 · 2^c rows for token class c, 128-byte swizzle
  CUtensorMap n_maps[kChainedTokenClasses];
  std::int64_t tokens = 0;                      // T, when tokens_device is null
  const std::int32_t* tokens_device = nullptr;  // T on the device (graph replays), ≤ the bound
  std::int64_t l = 0;                           // d_latent
  std::int64_t rows = 0;                        // w_up's rows (d at tp 1, the stripe at tp > 1)
  // The added rows [T, rows] and the output [T, rows], their rows shared_pitch and out_pitch
  // elements apart: at tp 1 the caller's `shared` and Y (pitch d); at tp > 1 this rank's stripe of
  // the shared sum in its workspace (pitch rows) and Y's columns of its stripe (pitch d).
  const void* shared = nullptr;
  void* out = nullptr;
  std::int64_t shared_pitch = 0, out_pitch = 0;
  // tp > 1: every output vector also goes to each peer as LL lines (cuda/fused_ll.cuh), into the
  // peer's workspace at lines_offset (parity 0; parities lines_parity_bytes apart), this rank's
  // slot of lines_slot elements ([capacity, rows]); the call's epoch is *epoch + 1 (this rank's
  // FusedFlags::epoch, which the call's last kernel advances).
  int rank = 0, tp = 1;
  std::byte* workspace[kP2pMaxRanks] = {};
  std::int64_t lines_offset = 0, lines_parity_bytes = 0, lines_slot = 0;
  const std::uint32_t* epoch = nullptr;
  std::uint32_t* calls = nullptr;  // the calls counted (for tests)
  // The ring's first round (the weights asked for before N exists) issued by a thread of its own,
  // pace_burst copies at once, then one every pace_cycles SM clocks; 0: all at once by the
  // producer (FusedTail chooses: paced with one rank).
  int pace_cycles = 0, pace_burst = 0;
  int tiles = 0, splits = 1;  // the grid: tiles × splits blocks, clusters of `splits`
  // LMOE_FUSED_TRACE: when each block reached each of the kChainedTracePoints points of the last
  // call (global timer, ns), [grid][kChainedTracePoints]; null normally.
  std::uint64_t* trace = nullptr;
  // Where a T read on the device past the bound is recorded: this rank's record and abort flag
  // with one rank; null with several (the exchange kernel, the call's first, records it).
  volatile P2pStatus* status = nullptr;
  volatile std::int32_t* abort_flag = nullptr;
};

// The rate (bytes per ns) at which the chained path's grid streams w_up from its entry on an H200
// (K3 at tp 1, 112 blocks: the rate of a plain read of the same bytes), from which its first
// round's pace follows: one box a block every grid · box / rate ns (docs/fused.md, "The chained
// path").
inline constexpr double kChainedStreamBytesPerNs = 112.0 * 8192.0 / 250.0;

// The up-projection kernel's trace points, in order.
enum ChainedTracePoint : int {
  kChainedTraceEntry,
  kChainedTraceNReady,      // the producer past griddepcontrol.wait: the norm kernel has ended
  kChainedTraceMultiplied,  // the consumers' last wgmma done
  kChainedTracePartials,    // the slice's partials of every split in the block's memory
  kChainedTraceStored,      // a thread's parking stores issued (before the block barrier)
  kChainedTraceParked,      // round(U) of the block's slice parked in shared memory
  kChainedTraceEnd,         // the block's last store
  kChainedTracePoints
};

// How the chained path runs on one device: tiles of tile_rows (64 or 128) rows of w_up, each split
// over `splits` ranges of K (tiles × splits blocks, at most one per SM: split K fills the SMs the
// tiles leave idle; K3 at tp 1: 112 tiles of 64 × 1, a stripe of 896 rows: 14 × 8).
struct FusedChainedPlan {
  int tile_rows = 0, tiles = 0, splits = 0;
};

// Why the chained path cannot run calls of up to `max_tokens` rows with `rows` rows of w_up and
// latent width l on the current device: compute 9.0 only (wgmma), bf16/f16, rows % 8, l % 8 and
// l ≤ 16384 (the norm kernel's registers), a driver that encodes tensor maps, the stages in a
// block's shared memory; nullptr when it can, after filling *plan and raising the kernels'
// shared-memory limit on this device. tile_rows: 64 or 128 to ask for that tile (for
// measurements), 0 for the plan's choice: the tile whose plan has more blocks within one wave
// (at equal blocks, fewer splits, then 128). A static string.
const char* fused_chained_plan(std::int64_t rows, std::int64_t l, std::int64_t max_tokens,
                               DType dtype, int tile_rows, FusedChainedPlan* plan);

// The tensor maps of w_up [rows, l] (boxes of the plan's tile_rows) and of N [capacity, l] (both
// 16-byte aligned) into params.
cudaError_t fused_chained_maps(FusedChainedParams* params, DType dtype, const void* w_up,
                               const void* normed, std::int64_t capacity, int tile_rows);

// Launches the norm kernel (routed [T, l] → normed, the map's buffer) and the up-projection
// kernel for calls of up to max_tokens rows (≤ kFusedChainedMaxTokens), p.tokens or
// p.tokens_device rows. Queries nothing (it may run inside a graph capture).
cudaError_t launch_fused_chained(const FusedChainedParams& p, const void* routed,
                                 const float* gamma, float eps, void* normed,
                                 std::int64_t max_tokens, DType dtype, const FusedChainedPlan& plan,
                                 cudaStream_t stream);

// With several ranks (p2p, every rank's workspace in x; x.cx_rows ≥ max_tokens): the exchange
// kernel (two-shot all-reduce of the latent with the norm between the shots, the reduce-scatter of
// `shared`: cuda/fused_chained_exchange.cuh), the up-projection of this rank's stripe (p: rows =
// the stripe, shared = the stripe's shared sum, out = Y's columns of the stripe, its vectors also
// sent to the peers as lines) and the gather of the peers' stripes, which closes the call; the
// second and third start early (programmatic dependent launch). exchange_grid: blocks of the first
// and third kernels. Queries nothing (it may run inside a graph capture).
cudaError_t launch_fused_chained_ranks(const FusedTailParams& x, int exchange_grid,
                                       const FusedChainedParams& p, std::int64_t max_tokens,
                                       DType dtype, const FusedChainedPlan& plan,
                                       cudaStream_t stream);

}  // namespace lmoe::cuda
