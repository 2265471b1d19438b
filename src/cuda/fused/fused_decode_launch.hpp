// Launcher of the fused tier's decode kernel (cuda/fused_decode.cuh): T ≤ 16, the whole tail in
// one launch (with one rank no workspace; the design is described at the top of the kernel file).
// Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/fused/fused_tail_types.hpp"
#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

// The most tokens a decode call carries: the 16 rows of the mma's M.
inline constexpr std::int64_t kFusedDecodeMaxTokens = 16;
// 16 warps: two rows of the RMSNorm's 256 lanes at a time, and each warp a sixteenth of K.
inline constexpr int kDecodeThreads = 512;
inline constexpr int kDecodeWarps = kDecodeThreads / 32;
// A block's groups of 8 rows of w_up, at most (their accumulators stay in registers): K3's 896
// groups need 7 per SM on 132 SMs.
inline constexpr int kDecodeMaxGroups = 8;
// The pair instance's bound: calls of up to 4 rows, where a block's share of w_up is one group of
// 8 rows, run with two blocks an SM (FusedDecodePlan::pair_tokens).
inline constexpr std::int64_t kFusedDecodePairTokens = 4;
// More weight items than any warp asks for before its inputs: all of its first ring.
inline constexpr int kFusedDecodeMaxEarlyItems = 64;

struct FusedDecodeParams {
  std::int64_t tokens = 0;  // T, when tokens_device is null
  // T read on the device (graph replays); at most the launch's bound.
  const std::int32_t* tokens_device = nullptr;
  std::int64_t d = 0, l = 0;     // d_model, d_latent
  std::int64_t rows = 0;         // w_up's rows this rank multiplies: d / tp (its stripe)
  std::int64_t col0 = 0;         // the output column of the stripe's first row: rank · rows
  const void* routed = nullptr;  // [T, l]
  const void* shared = nullptr;  // [T, d]
  void* out = nullptr;           // [T, d]
  const void* w_up = nullptr;    // the stripe's rows [rows, l], 16-byte aligned
  const float* gamma = nullptr;  // [l], fp32, 16-byte aligned
  float eps = 0;
  bool latent_norm = true;  // false: N = the latent itself
  // LMOE_FUSED_TRACE: when each block reached each of the kDecodeTracePoints points of the last
  // call (global timer, ns), [grid][kDecodeTracePoints]; null normally.
  std::uint64_t* trace = nullptr;
  // Several ranks (protocol.tp > 1): the workspaces, offsets and failure reporting of the general
  // kernel's protocol, with this call's routed, shared, out and T. With one rank only its failure
  // record, where a T read on the device past the bound is reported (none: not reported).
  FusedTailParams protocol;
  // Several ranks: calls of at most this many rows have every block sum and normalize all of N
  // itself (no grid barrier); larger calls share the rows out (decode_exchange).
  int local_norm_rows = 0;
  // Launched programmatically (FusedTail::decode_programmatic): the kernel may then start while
  // the stream's previous kernel still runs, and asks for `early_items` of each warp's first
  // weight items before it waits for that kernel to end (the rest after its inputs; < 0: the
  // instance's default, 4 or, in the pair instance, all). Without it early_items is not used:
  // every weight follows the inputs.
  bool programmatic = false;
  int early_items = -1;
};

// The decode kernel's trace points, in order.
enum DecodeTracePoint : int {
  kDecodeTraceEntry,
  kDecodeTraceReleased,  // past griddepcontrol.wait: the kernels before have ended
  // The latent rows, gamma and the shared slice in shared memory (several ranks: the block's sums
  // over the ranks of its rows of the latent and of its slice, from every peer's lines).
  kDecodeTraceInputsLanded,
  kDecodeTraceNormed,  // N in shared memory, the first items of every warp in flight
  // Warp 0 (thread 0's stamps): its items landed (where a warp's items all fit in its first ring,
  // the "whole" path; else when its streaming loop starts), and all of them multiplied.
  kDecodeTraceLanded,
  kDecodeTraceMultiplied,
  kDecodeTraceStreamed,  // every warp's items multiplied
  kDecodeTracePartials,  // every warp's fp32 partials in shared memory (a block barrier after them)
  kDecodeTraceEnd,       // thread 0's outputs stored
  kDecodeTracePoints
};

// How the decode kernel runs on one device for one FusedTail: its grid (at most one block per SM,
// each an even share of the stripe's groups of 8 rows, at most one block per group and
// kDecodeMaxGroups per block).
struct FusedDecodePlan {
  int grid = 0;
  // Calls of up to this many rows (kFusedDecodePairTokens, or 0) launched programmatically run the
  // pair instance: a block's share of w_up is one group of 8 rows and two blocks fit on an SM
  // (shared memory, threads, registers), so the next call's blocks enter beside this one's and
  // ask for their weights while it runs.
  std::int64_t pair_tokens = 0;
};

// Why the decode kernel cannot run calls of up to `max_tokens` rows with `rows` rows of w_up (the
// stripe; d with one rank) on at most `max_grid` blocks (0: one per SM) of the current device:
// bf16/f16 only, rows % 8 and l % 16, at most kDecodeMaxGroups groups of 8 rows per block, and the
// norm's lane sums, gamma, the shared slice, the normalized rows and the weight rings must fit in a
// block's shared memory;
// nullptr when it can, after filling *plan (pair_tokens where two blocks fit on an SM) and raising
// its kernels' shared-memory limit on this device (required before launch_fused_decode). A static
// string.
const char* fused_decode_plan(std::int64_t rows, std::int64_t l, std::int64_t max_tokens,
                              DType dtype, FusedDecodePlan* plan, int max_grid = 0);

// How many blocks of the instance a call of up to `max_tokens` rows launches (the pair instance
// where `programmatic` and the plan allows it) are resident on an SM at once with this plan, by the
// occupancy calculator (after fused_decode_plan); 0 when it cannot tell.
int fused_decode_resident_blocks(std::int64_t rows, std::int64_t l, std::int64_t max_tokens,
                                 DType dtype, const FusedDecodePlan& plan, bool programmatic);

// Launches the decode kernel for calls of up to `max_tokens` (≤ kFusedDecodeMaxTokens) rows with a
// plan from fused_decode_plan() for that bound (or a larger one) on the current device; dtype bf16
// or f16. Queries nothing (it may run inside a graph capture).
cudaError_t launch_fused_decode(const FusedDecodeParams& p, std::int64_t max_tokens, DType dtype,
                                const FusedDecodePlan& plan, cudaStream_t stream);

}  // namespace lmoe::cuda
