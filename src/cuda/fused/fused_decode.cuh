// The fused tier's decode kernel: T ≤ 16, the whole tail in one launch,
//
//   Y = round(round(N · w_upᵀ) + round(Σ_r shared_r)),  N = round(rmsnorm(round(Σ_r routed_r)))
//
// (DESIGN.md §3 `fused`). With one rank (the rank sums are the inputs themselves): no workspace,
// no flags, no grid barrier; a block needs nothing from any other block. With several, the blocks
// multiply this rank's stripe of w_up's rows; the call's T, the inputs and output stripes travel as
// lines that carry their own flags (cuda/fused_ll.cuh: decode_push_inputs, decode_exchange and
// decode_gather_stripes below), and the call's epoch, N's grid barrier and its end follow the
// general kernel's protocol (cuda/fused_protocol.cuh). Device code only.
//
// At decode sizes the tail is a stream of w_up (K3: 51 MB), so
// the kernel is built around reading it. Each warp streams its own share through a ring of its own
// in shared memory: a lane copies 16 bytes per item with cp.async into a slot of its own, keeps
// kDepth items in flight (one commit group each) and reads back only what it copied itself, so no
// lane, warp or block ever waits for another during the stream (no barrier, no mbarrier, no
// producer warp). benchmarks/stream_probe.cu measures this walk against the alternatives (loads
// into registers, shared-memory rings shared by a block): it streams fastest (docs/fused.md).
//
// The product is the plain one, tokens × weights: Uᵀ's tile is the mma's C with the tokens as M
// (one m-tile of 16 rows; tokens ≥ T are never stored) and 8 weight rows as N. So a block's work
// comes in groups of 8 rows of w_up, and d's groups are dealt evenly over one block per SM (K3:
// 896 groups over 132 SMs, 6 or 7 each; the weight bytes per SM differ by at most one group).
//
// Each of the 16 warps takes a fixed, contiguous share of K (K3: 7 of the 112 steps of 32) in
// every group of its block; an item is one step of one group, and lane (g, q) = (lane / 4,
// lane % 4) copies the 16 bytes of weight row g at k = step·32 + 8q. The mma's K order is free (the
// fused contract bounds the product; it does not fix its order), so a 16-byte vector is two mma
// steps: its first 4 elements sit in the fragment slots of k ∈ {2q, 2q+1, 2q+8, 2q+9} of one mma,
// its last 4 in those of the next, and N's fragment takes the same 8 elements of the token rows g
// and g + 8. A group's accumulators stay in registers; after the stream the warps' fp32 partials
// are summed through shared memory by a fixed tree, one warp per 8 outputs (results do not depend
// on scheduling).
//
// N: every block normalizes the T rows itself in shared memory in the canonical order of
// cuda/rms_norm.cuh (bit-identical to the CPU). Gamma is copied in (cp.async) first, the rows once
// the kernels before have ended, the first kDepth − 1 items of every warp flying meanwhile. With
// one rank the kernel is launched programmatically (it may start while the previous call's kernel
// finishes) and asks for p.early_items of those first items before its griddepcontrol.wait, so
// that they stream during the previous call's end; the rest follow the rows, which then do not
// queue behind them where nothing ran before.
//
// The pair instance (one rank, up to 4 rows, where a block's share of w_up is one group of 8 rows:
// K3's 896-row stripe at tp 8 as one GPU's whole d): shared memory sized to the block's items, two
// blocks an SM, all of a warp's items asked for before the wait, and the next call let in once this
// one's inputs have landed, so that the next call's blocks enter beside this call's and their
// weights land while it normalizes, multiplies and stores (FusedDecodePlan::pair_tokens).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/comm/p2p_protocol.cuh"
#include "cuda/fused/fused_decode_launch.hpp"
#include "cuda/fused/fused_ll.cuh"
#include "cuda/fused/fused_protocol.cuh"
#include "cuda/gemm/warp_mma.cuh"
#include "cuda/runtime/dtype.cuh"
#include "cuda/runtime/hopper_async.cuh"
#include "cuda/tail/rms_norm.cuh"

namespace lmoe::cuda {

static_assert(kDecodeThreads == 2 * kNormLanes, "two rows of the norm at a time, one per half");

// Items each lane keeps in flight: 16 warps × kDepth × 512 bytes per SM (128 KB for calls of up to
// 8 rows, 64 KB for 16, whose normalized rows take twice the room; less where a warp has fewer
// items: DecodeLayout::ring_slots).
template <int kMaxTokens>
inline constexpr int kDecodeDepth = kMaxTokens <= 8 ? 16 : 8;

// The block's dynamic shared memory, in this order: the norm's lane sums (256 per row), gamma
// (fp32), the block's slice of `shared` (the T rows × its groups, 16 bytes per group), N's rows,
// the warps' rings (warp w's `slots` slots of 512 bytes, lane l's 16 bytes at 16 l of a slot).
// After the stream the rings hold the warps' fp32 partials ([group][token][slot][8], warp w in
// slot w ^ (token % 4)). Every part a multiple of 16 bytes. max_tokens and max_groups are the
// kernel instance's (its rows of N and groups of 8 weight rows a block).
struct DecodeLayout {
  static constexpr std::size_t kSlotBytes = 32 * 16;

  // N's row pitch: ≡ 64 (mod 128) bytes, so that the two token rows one phase of a 16-byte
  // shared load reads (8 lanes: 2 rows × 64 bytes) fall in different banks.
  __host__ __device__ static constexpr std::size_t normed_pitch(std::int64_t l) {
    return (static_cast<std::size_t>(l) * 2 + 127) / 128 * 128 + 64;
  }
  __host__ __device__ static constexpr std::size_t gamma_offset(int max_tokens) {
    return static_cast<std::size_t>(max_tokens) * kNormLanes * sizeof(float);
  }
  __host__ __device__ static constexpr std::size_t shared_offset(std::int64_t l, int max_tokens) {
    return gamma_offset(max_tokens) + static_cast<std::size_t>(l) * sizeof(float);
  }
  __host__ __device__ static constexpr std::size_t normed_offset(std::int64_t l, int max_tokens,
                                                                 int max_groups) {
    return shared_offset(l, max_tokens) + static_cast<std::size_t>(max_tokens) * max_groups * 16;
  }
  __host__ __device__ static constexpr std::size_t ring_offset(std::int64_t l, int max_tokens,
                                                               int max_groups) {
    return normed_offset(l, max_tokens, max_groups) +
           static_cast<std::size_t>(max_tokens) * normed_pitch(l);
  }
  // A warp's slots: kDepth, or fewer where no warp of the grid has that many items (a block's
  // groups × a warp's steps of 32; a narrow stripe such as K3's 896 rows at tp 8: 1 × 7), so that
  // a block takes only the shared memory it streams through. The same on the host and the device.
  __host__ __device__ static constexpr int ring_slots(std::int64_t rows, std::int64_t l, int grid,
                                                      int depth) {
    const std::int64_t groups = (rows / 8 + grid - 1) / grid;
    const std::int64_t steps = ((l + 31) / 32 + kDecodeWarps - 1) / kDecodeWarps;
    return groups * steps < depth ? static_cast<int>(groups * steps) : depth;
  }
  // At least the partials' bytes (which take the rings' place after the stream).
  __host__ __device__ static constexpr std::size_t ring_bytes(int max_tokens, int max_groups,
                                                              int slots) {
    const std::size_t ring = static_cast<std::size_t>(kDecodeWarps) * slots * kSlotBytes;
    const std::size_t partials = partial_bytes(max_tokens, max_groups);
    return ring > partials ? ring : partials;
  }
  __host__ __device__ static constexpr std::size_t partial_bytes(int max_tokens, int max_groups) {
    return static_cast<std::size_t>(max_groups) * kDecodeWarps * max_tokens * 8 * sizeof(float);
  }
  __host__ __device__ static constexpr std::size_t bytes(std::int64_t l, int max_tokens,
                                                         int max_groups, int slots) {
    return ring_offset(l, max_tokens, max_groups) + ring_bytes(max_tokens, max_groups, slots);
  }
};

__device__ inline uint4 load_shared16(std::uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address));
  return v;
}

// N's rows in place: the latent rows as copied, normalized in the canonical order. The block's two
// halves take rows h, h + 2, … (half h = threadIdx.x / 256, 256 lanes each: the order's lanes):
// every row's lane sums, one barrier, then each row's tree and outputs. The loops are kept rolled:
// the code runs once per call, so each of its instructions is fetched cold (unrolled, or with
// every row's chunks held in registers, it was slower). It is still the slowest part at T = 16:
// why is open, docs/fused.md. Every thread of the block calls it.
template <typename T>
__device__ inline void decode_norm_rows(std::int64_t l, float eps, std::byte* normed,
                                        std::size_t pitch, const float* gamma, int tokens,
                                        float* lane_sums) {
  const int half = static_cast<int>(threadIdx.x) / kNormLanes;
  const int lane = static_cast<int>(threadIdx.x) % kNormLanes;
  const int chunks = static_cast<int>(l / kNormChunk);
  const auto row = [&](int t) { return reinterpret_cast<T*>(normed + t * pitch); };
#pragma unroll 1
  for (int t = half; t < tokens; t += 2) {
    float sum = 0.0f;
#pragma unroll 1
    for (int c = lane; c < chunks; c += kNormLanes) {
      NormChunk<T> chunk;
      chunk.load(row(t) + c * kNormChunk);
      sum = add_chunk_squares(sum, chunk);
    }
    lane_sums[t * kNormLanes + lane] = sum;
  }
  __syncthreads();
#pragma unroll 1
  for (int t = half; t < tokens; t += 2) {
    const float rstd =
        rms_norm_rstd(tree_of_lane_sums<8>(lane_sums + t * kNormLanes), static_cast<int>(l), eps);
#pragma unroll 1
    for (int c = lane; c < chunks; c += kNormLanes) {
      NormChunk<T> chunk;
      chunk.load(row(t) + c * kNormChunk);  // this thread's own elements
      normalize_chunk(chunk, gamma + c * kNormChunk, rstd);
      chunk.store(row(t) + c * kNormChunk);
    }
  }
}

__device__ inline void decode_trace(const FusedDecodeParams& p, int point) {
  if (p.trace != nullptr && threadIdx.x == 0) {
    p.trace[blockIdx.x * kDecodeTracePoints + point] = p2p_clock_ns();
  }
}

// With several ranks, this call's inputs go straight into the peers' workspaces as LL lines
// (cuda/fused_ll.cuh), before any weight is requested: the latent rows to every peer, and to peer r
// its stripe's columns of `shared`. Grid-stride over this rank's blocks. Every thread calls it.
template <typename T>
__device__ void decode_push_inputs(const FusedDecodeParams& p, int tokens, const FusedCall& call) {
  const FusedTailParams& x = p.protocol;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t latent_units = tokens * p.l / 4;  // 4 elements per line; l % 16 == 0
  const std::int64_t row_units = x.stripe / 4, shared_units = tokens * row_units;
  const T* routed = static_cast<const T*>(p.routed);
  const T* shared = static_cast<const T*>(p.shared);
  for (std::int64_t i = first; i < latent_units * x.tp; i += stride) {
    const int r = static_cast<int>(i / latent_units);
    if (r == x.rank) continue;
    const std::int64_t index = i % latent_units * 4;  // the slot's rows have the latent's pitch
    ll_store(ll_line(x, r, x.ll_latent_offset, call.parity, x.rank, x.ll_rows * p.l, index),
             *reinterpret_cast<const uint2*>(routed + index), call.e);
  }
  for (std::int64_t i = first; i < shared_units * x.tp; i += stride) {
    const int r = static_cast<int>(i / shared_units);
    if (r == x.rank) continue;
    const std::int64_t t = i % shared_units / row_units, c = i % shared_units % row_units * 4;
    ll_store(ll_line(x, r, x.ll_shared_offset, call.parity, x.rank, x.ll_rows * x.stripe,
                     t * x.stripe + c),
             *reinterpret_cast<const uint2*>(shared + t * p.d + r * x.stripe + c), call.e);
  }
}

// With several ranks, what one rank's inputs give the block at tp = 1 (N's T rows in shared memory,
// and the block's columns of the shared sum in its slice), from this rank's inputs and the lines
// its peers pushed (decode_push_inputs). Calls of up to p.local_norm_rows rows: every block sums
// and normalizes all of them itself (no grid barrier, no N in global memory). Larger calls: rows
// t ≡ b (mod G) summed and normalized by block b and stored in this rank's workspace, a barrier of
// the grid, then every row of N copied in. Either way the block's own columns of the shared sum
// (no barrier: its own). False (reported) when a wait failed. Every thread calls it.
template <typename T>
__device__ bool decode_exchange(const FusedDecodeParams& p, int tokens, std::int64_t row_first,
                                int groups, std::byte* normed, std::size_t pitch, float* lane_sums,
                                std::byte* shared_slice, FusedCall* call) {
  const FusedTailParams& x = p.protocol;
  const int tid = static_cast<int>(threadIdx.x);
  // The peers' T first (their lines were sent before their rows): where one differs its missing
  // rows are not waited for (the flag stops the waits below), and the call fails.
  fused_compare_tokens(x, tokens, call);
  const int row_units = static_cast<int>(p.l / 4);
  const bool local = tokens <= p.local_norm_rows;
  // This block's rows of the latent: all of them, or rows b, b + G, … (row k of `normed`).
  const int block = local ? 0 : static_cast<int>(blockIdx.x);
  const int grid = local ? 1 : static_cast<int>(gridDim.x);
  const int mine = tokens > block ? (tokens - 1 - block) / grid + 1 : 0;
  const T* routed = static_cast<const T*>(p.routed);
  for (int i = tid; i < mine * row_units; i += kDecodeThreads) {
    const int k = i / row_units, u = i % row_units;
    const std::int64_t index = (block + static_cast<std::int64_t>(k) * grid) * p.l + u * 4;
    uint2 sum;
    if (!ll_rank_sum4<T>(x, x.ll_latent_offset, x.ll_parity_bytes, x.ll_rows * p.l, index,
                         routed + index, call, &sum))
      break;
    *reinterpret_cast<uint2*>(normed + k * pitch + u * 8) = sum;
  }
  // The slice: 16 bytes per (token, group), two lines each; unit i = (t, h) covers the stripe's
  // columns row_first + 4h … + 3.
  const T* shared = static_cast<const T*>(p.shared);
  for (int i = tid; i < tokens * groups * 2; i += kDecodeThreads) {
    const int t = i / (groups * 2), h = i % (groups * 2);
    const std::int64_t c = row_first + h * 4;
    uint2 sum;
    if (!ll_rank_sum4<T>(x, x.ll_shared_offset, x.ll_parity_bytes, x.ll_rows * x.stripe,
                         t * x.stripe + c, shared + t * p.d + p.col0 + c, call, &sum))
      break;
    reinterpret_cast<uint2*>(shared_slice)[i] = sum;
  }
  if (fused_block_failed(x, tokens, call)) return false;
  decode_trace(p, kDecodeTraceInputsLanded);

  if (p.latent_norm && mine > 0)
    decode_norm_rows<T>(p.l, p.eps, normed, pitch, p.gamma, mine, lane_sums);
  __syncthreads();
  if (local) {
    // N is whole in this block. rows_done still counts the block (its base, `arrivals`, grows by
    // the grid at every call), with nothing to wait for.
    if (tid == 0) atomicAdd(&fused_flags(x, x.rank)->rows_done, 1u);
    return true;
  }
  T* n_global = fused_at<T>(x, x.rank, x.normed_offset, 0);
  const int row_vectors = static_cast<int>(p.l / 8);
  for (int i = tid; i < mine * row_vectors; i += kDecodeThreads) {
    const int k = i / row_vectors, v = i % row_vectors;
    const std::int64_t t = block + static_cast<std::int64_t>(k) * grid;
    *reinterpret_cast<uint4*>(n_global + t * p.l + v * 8) =
        *reinterpret_cast<const uint4*>(normed + k * pitch + v * 16);
  }
  __threadfence();  // this thread's rows of N, before the barrier lets the other blocks read them
  if (!fused_grid_barrier(x, call)) return false;

  const std::uint32_t normed_s = static_cast<std::uint32_t>(__cvta_generic_to_shared(normed));
  for (int i = tid; i < tokens * row_vectors; i += kDecodeThreads) {
    const int t = i / row_vectors, v = i % row_vectors;
    cp_async16(normed_s + static_cast<std::uint32_t>(t * pitch + v * 16),
               n_global + static_cast<std::int64_t>(t) * p.l + v * 8, true);
  }
  cp_async_commit();
  cp_async_wait<0>();  // the weights' first items too: issued long before
  __syncthreads();
  return true;
}

// With several ranks, after this rank's blocks pushed their output rows to every peer (the
// epilogue): every peer's stripe into Y as its lines arrive. Grid-stride. False (reported) when a
// wait failed. Every thread calls it.
template <typename T>
__device__ bool decode_gather_stripes(const FusedDecodeParams& p, int tokens, FusedCall* call) {
  const FusedTailParams& x = p.protocol;
  const std::int64_t row_units = x.stripe / 4, per_peer = tokens * row_units;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < per_peer * x.tp; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(i / per_peer);
    if (r == x.rank) continue;
    const std::int64_t t = i % per_peer / row_units, c = i % per_peer % row_units * 4;
    uint2 bits;
    if (!ll_load(x,
                 ll_line(x, x.rank, x.ll_stripe_offset, call->parity, r, x.ll_rows * x.stripe,
                         t * x.stripe + c),
                 call->e, r, call, &bits))
      break;
    *reinterpret_cast<uint2*>(static_cast<T*>(p.out) + t * p.d + r * x.stripe + c) = bits;
  }
  __syncthreads();
  return !call->failed;
}

// kMaxTokens rows of N (4, 8 or 16), at most kMaxGroups groups of 8 weight rows a block, and
// kMinBlocks blocks an SM asked of the compiler's registers: the pair instance (4 rows, one group,
// two blocks an SM: FusedDecodePlan::pair_tokens) lets the next call's blocks in beside this one's,
// so that their weights land while this call runs.
template <typename T, int kMaxTokens, int kMaxGroups, int kMinBlocks>
__global__ void __launch_bounds__(kDecodeThreads, kMinBlocks)
    fused_decode_kernel(FusedDecodeParams p) {
  static_assert(kMaxTokens == 4 || kMaxTokens == 8 || kMaxTokens == 16);
  static_assert(kMaxGroups >= 1 && kMaxGroups <= kDecodeMaxGroups);
  constexpr int kDepth = kDecodeDepth<kMaxTokens>;
  extern __shared__ __align__(128) std::byte decode_smem[];
  __shared__ FusedCall call;  // several ranks only
  // The pair instance runs with one rank only (launch_fused_decode refuses it with several), so
  // its exchange is compiled out: a shorter kernel, the one-rank path laid out in one piece.
  const bool exchange = kMinBlocks == 1 && p.protocol.tp > 1;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, q = lane % 4;  // groupID and thread-in-group of the mma fragments
  decode_trace(p, kDecodeTraceEntry);
  // The stream's next kernel may start as this one's blocks leave their SMs (where it is launched
  // programmatically: with one rank, the next call's decode kernel), so that its weights stream
  // while this call finishes. The pair instance lets it in only once its own inputs have landed
  // (below): its blocks would enter beside these at once, and the call after it too, whose weights
  // then stood ahead of the next call's inputs in the memory's queue.
  if constexpr (kMinBlocks == 1) pdl_launch_dependents();

  // The block's groups of 8 rows of w_up (this rank's stripe): [group_first, group_first + groups),
  // dealt evenly (at least one and at most kDecodeMaxGroups: the plan's grid ensures it).
  // In 32 bits: the plan keeps rows / 8 ≤ kDecodeMaxGroups · grid, and a 64-bit division by a
  // value known only at run time costs ~100 instructions in every warp.
  const unsigned all_groups = static_cast<unsigned>(p.rows / 8);
  const unsigned group_first = blockIdx.x * all_groups / gridDim.x;
  const int groups = static_cast<int>((blockIdx.x + 1) * all_groups / gridDim.x - group_first);
  if (groups == 0) return;  // the same for every thread of the block
  const std::int64_t row_first = static_cast<std::int64_t>(group_first) * 8;

  float* lane_sums = reinterpret_cast<float*>(decode_smem);
  float* gamma = reinterpret_cast<float*>(decode_smem + DecodeLayout::gamma_offset(kMaxTokens));
  std::byte* shared_slice = decode_smem + DecodeLayout::shared_offset(p.l, kMaxTokens);
  std::byte* normed = decode_smem + DecodeLayout::normed_offset(p.l, kMaxTokens, kMaxGroups);
  std::byte* rings = decode_smem + DecodeLayout::ring_offset(p.l, kMaxTokens, kMaxGroups);
  const int slots = DecodeLayout::ring_slots(p.rows, p.l, static_cast<int>(gridDim.x), kDepth);
  float* partials = reinterpret_cast<float*>(rings);  // after the stream
  const std::size_t pitch = DecodeLayout::normed_pitch(p.l);
  const std::uint32_t normed_s = static_cast<std::uint32_t>(__cvta_generic_to_shared(normed));

  // This warp's share of K: steps [step_first, step_first + steps) of 32, in every group. Item i
  // of the warp is (group i / steps, step i % steps), in slot i % kDepth of the warp's ring (of
  // `slots` ≤ kDepth: items ≥ slots exist only where slots = kDepth).
  // l % 16 == 0, so a thread's 8 elements are all inside K or all past it: of an l with
  // l % 32 == 16 the last step's lanes q = 2, 3 copy nothing (zeros) and multiply zeros.
  const int all_steps = static_cast<int>((p.l + 31) / 32);
  const int step_first = warp * all_steps / kDecodeWarps;
  const int steps = (warp + 1) * all_steps / kDecodeWarps - step_first;
  const int items = groups * steps;
  const int k_steps = static_cast<int>((p.l - 8 * q + 31) / 32) - step_first;  // 32 s + 8 q < l
  const int valid_steps = k_steps < 0 ? 0 : k_steps > steps ? steps : k_steps;
  constexpr int kStepBytes = 32 * static_cast<int>(sizeof(T));
  const std::int64_t group_jump = 8 * p.l * static_cast<std::int64_t>(sizeof(T)) -
                                  static_cast<std::int64_t>(steps) * kStepBytes;
  const char* copy_at =
      static_cast<const char*>(p.w_up) +
      ((row_first + g) * p.l + static_cast<std::int64_t>(step_first) * 32 + 8 * q) *
          static_cast<std::int64_t>(sizeof(T));
  const std::uint32_t my_slots = static_cast<std::uint32_t>(__cvta_generic_to_shared(rings)) +
                                 static_cast<std::uint32_t>((warp * slots * 32 + lane) * 16);
  int issued = 0, copy_step = 0;
  const auto issue_item = [&] {
    if (issued < items) {
      cp_async16(
          my_slots + static_cast<std::uint32_t>((issued % kDepth) * DecodeLayout::kSlotBytes),
          copy_at, copy_step < valid_steps);
      copy_at += kStepBytes;
      if (++copy_step == steps) copy_step = 0, copy_at += group_jump;
    }
    ++issued;
  };
  // One commit group per item, empty past the last, so that "item i has landed" is always
  // cp.async.wait_group(kDepth - 1) after issuing item i + kDepth - 1 (once the inputs' group,
  // wherever it lies among them, has been waited for).
  const auto issue_next = [&] {
    issue_item();
    cp_async_commit();
  };
  // Whole: every warp of the grid has at most kDepth − 1 items (the ring's slots are the most items
  // of a warp where fewer than kDepth; a narrow stripe: K3's 896 rows at tp 8 take one group of 7
  // steps a warp), so the first ring is all of them: they are asked for in two commit groups (the
  // early ones, the rest after the inputs) and multiplied once all have landed, without the
  // per-item commits, waits and refills of the stream, which cost ~45 instructions an item in
  // every warp (Nsight Compute's source counters) where the product itself is two mma.
  const bool whole = slots < kDepth;
  // 1. Gamma and the weights depend on nothing the kernels before write: one rank's gamma (fp32,
  //    at K3 twice the bytes of a latent row) and `early` of each warp's first kDepth − 1 items
  //    are asked for before waiting for those kernels (the rest of the items after the inputs, so
  //    that those do not wait behind them where nothing ran before). One commit group each.
  if (!exchange && p.latent_norm) {
    const std::uint32_t gamma_s = static_cast<std::uint32_t>(__cvta_generic_to_shared(gamma));
    for (int v = tid; v < p.l / 4; v += kDecodeThreads) {
      cp_async16(gamma_s + static_cast<std::uint32_t>(v * 16), p.gamma + v * 4, true);
    }
  }
  cp_async_commit();
  // Launched without the attribute the kernel starts once the kernels before have ended, so
  // nothing is gained by asking early and the inputs (with several ranks their push to the peers)
  // would wait behind the weights.
  const int asked = p.programmatic ? p.early_items : 0;
  const int early = asked < 0 ? 0 : asked > kDepth - 1 ? kDepth - 1 : asked;
  if (whole) {
#pragma unroll 1
    for (int k = 0; k < early; ++k) issue_item();
    cp_async_commit();
  } else {
#pragma unroll 1
    for (int k = 0; k < early; ++k) issue_next();
  }
  pdl_wait();  // the kernels before this one have ended (a no-op when launched without it)
  decode_trace(p, kDecodeTraceReleased);

  // The launch's bound (p.tokens with T on the device: the rows of the caller's buffers), within
  // the instance's rows and the exchange's slots; a T read past it runs no rows (recorded).
  std::int64_t bound = p.tokens < kMaxTokens ? p.tokens : kMaxTokens;
  if (exchange && p.protocol.ll_rows < bound) bound = p.protocol.ll_rows;
  const int tokens = fused_call_tokens(p.tokens_device, p.tokens, bound, fused_report(p.protocol),
                                       blockIdx.x == 0 && tid == 0);
  // The same for every block. With several ranks a call of no rows still runs (below): its peers
  // compare their T with it.
  if (tokens < 0 || (tokens == 0 && !exchange)) return cp_async_wait<0>();
  if (exchange) {
    // Several ranks: T and the inputs pushed to the peers before any further weight is requested
    // (behind the weights' first items they would leave later: LMOE_FUSED_TRACE shows it).
    if (!fused_begin(p.protocol, &call)) return cp_async_wait<0>();
    fused_send_tokens(p.protocol, tokens, call);
    decode_push_inputs<T>(p, tokens, call);
  }

  // 2. One rank: the inputs: the T latent rows into N and this block's columns of `shared` (16
  //    bytes per token and group). One commit group. (Several: decode_exchange below, once the
  //    weights are in flight.)
  if (!exchange) {
    const int row_vectors = static_cast<int>(p.l / 8);
    const char* routed = static_cast<const char*>(p.routed);
    for (int i = tid; i < tokens * row_vectors; i += kDecodeThreads) {
      const int t = i / row_vectors, v = i % row_vectors;
      cp_async16(normed_s + static_cast<std::uint32_t>(t * pitch + v * 16),
                 routed + (static_cast<std::int64_t>(t) * p.l + v * 8) * sizeof(T), true);
    }
    const std::uint32_t slice_s =
        static_cast<std::uint32_t>(__cvta_generic_to_shared(shared_slice));
    const T* shared_in = static_cast<const T*>(p.shared);
    for (int i = tid; i < tokens * groups; i += kDecodeThreads) {
      const int t = i / groups, j = i % groups;
      cp_async16(slice_s + static_cast<std::uint32_t>(i * 16),
                 shared_in + t * p.d + p.col0 + row_first + j * 8, true);
    }
    cp_async_commit();
  }
  if (whole) {
#pragma unroll 1
    for (int k = early; k < items; ++k) issue_item();
    cp_async_commit();
  } else {
#pragma unroll 1
    for (int k = early; k < kDepth - 1; ++k) issue_next();
  }

  // 3. N (the inputs' group, and gamma's before it, have landed once at most the kDepth − 1 −
  //    early groups after it are pending; whole: the one group of the remaining items).
  if (!exchange) {
    if (whole) {
      cp_async_wait<1>();
    } else {
      cp_async_wait_at_most<kDepth - 1>(kDepth - 1 - early);
    }
    __syncthreads();
    decode_trace(p, kDecodeTraceInputsLanded);
    if constexpr (kMinBlocks > 1) pdl_launch_dependents();
    if (p.latent_norm) {
      decode_norm_rows<T>(p.l, p.eps, normed, pitch, gamma, tokens, lane_sums);
      __syncthreads();
    }
  } else if (!decode_exchange<T>(p, tokens, row_first, groups, normed, pitch, lane_sums,
                                 shared_slice, &call)) {
    return cp_async_wait<0>();
  }
  if (tokens == 0) {  // several ranks, every one with no rows: nothing to multiply, the call closed
    cp_async_wait<0>();
    fused_end(p.protocol, call, false);
    return;
  }
  decode_trace(p, kDecodeTraceNormed);

  // 4. The stream. A fragment's token rows past T read row T - 1 (never stored). Slot i % kDepth
  //    is refilled (with item i + kDepth) only after item i was multiplied.
  const int token_lo = g < tokens ? g : tokens - 1;
  const int token_hi = g + 8 < tokens ? g + 8 : tokens - 1;
  const std::uint32_t n_lo =
      normed_s + static_cast<std::uint32_t>(token_lo * pitch + step_first * 64 + q * 16);
  const std::uint32_t n_hi =
      normed_s + static_cast<std::uint32_t>(token_hi * pitch + step_first * 64 + q * 16);
  float acc[kMaxGroups][4] = {};
  int item = 0;
  // One item's product: its weights (slot item % kDepth) by the tokens' 8 elements of step s.
  const auto multiply = [&](float(&c)[4], int s) {
    const uint4 w = load_shared16(
        my_slots + static_cast<std::uint32_t>((item % kDepth) * DecodeLayout::kSlotBytes));
    uint4 lo = make_uint4(0, 0, 0, 0), hi = make_uint4(0, 0, 0, 0);
    if (s < valid_steps) {
      lo = load_shared16(n_lo + static_cast<std::uint32_t>(s * 64));
      if constexpr (kMaxTokens == 16) hi = load_shared16(n_hi + static_cast<std::uint32_t>(s * 64));
    }
    const std::uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y}, b0[2] = {w.x, w.y};
    const std::uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w}, b1[2] = {w.z, w.w};
    mma_m16n8k16<T>(c, a0, b0);
    mma_m16n8k16<T>(c, a1, b1);
  };
  if (whole) {
    cp_async_wait<0>();  // every item (and the block's inputs) landed
    decode_trace(p, kDecodeTraceLanded);
    // Rolled, one accumulator: the chain of dependent mma is not what this phase waits on, so
    // unrolling over several accumulators does not shorten it (docs/fused.md).
#pragma unroll
    for (int j = 0; j < kMaxGroups; ++j) {
      if (j < groups) {
#pragma unroll 1
        for (int s = 0; s < steps; ++s, ++item) multiply(acc[j], s);
      }
    }
  }
  if (!whole) decode_trace(p, kDecodeTraceLanded);  // the stream's start: its items land in turn
#pragma unroll
  for (int j = 0; j < kMaxGroups; ++j) {
    if (!whole && j < groups) {
      // Not unrolled: with the groups unrolled (their accumulators are registers) an unrolled step
      // loop made the kernel large enough for its 16 warps to wait on instruction fetches (Nsight
      // Compute: "no instruction" was the largest stall).
#pragma unroll 1
      for (int s = 0; s < steps; ++s, ++item) {
        issue_next();
        cp_async_wait<kDepth - 1>();
        multiply(acc[j], s);
      }
    }
  }
  decode_trace(p, kDecodeTraceMultiplied);
  cp_async_wait<0>();  // only empty groups are left
  __syncthreads();     // every warp is done with its ring: the partials take their place
  decode_trace(p, kDecodeTraceStreamed);

  // C's fragment: acc[j][0, 1] token g, rows 2q and 2q + 1 of group j; acc[j][2, 3] token g + 8.
  // A warp with no K (l < 16 · 32) writes its zeros too. Tokens ≥ kMaxTokens have no unit.
#pragma unroll
  for (int j = 0; j < kMaxGroups; ++j) {
    if (j < groups && g < kMaxTokens) {
      // Unit (j, token) holds the 16 warps' 8 partials, warp w's in slot w ^ (token % 4): a warp's
      // stores then spread over four 32-byte bank windows instead of one (2 wavefronts a store,
      // not 8).
      float* lo = partials + ((j * kMaxTokens + g) * kDecodeWarps + (warp ^ (g & 3))) * 8;
      *reinterpret_cast<float2*>(lo + 2 * q) = make_float2(acc[j][0], acc[j][1]);
      if constexpr (kMaxTokens == 16) {
        float* hi = partials + ((j * kMaxTokens + g + 8) * kDecodeWarps + (warp ^ (g & 3))) * 8;
        *reinterpret_cast<float2*>(hi + 2 * q) = make_float2(acc[j][2], acc[j][3]);
      }
    }
  }
  __syncthreads();
  decode_trace(p, kDecodeTracePartials);

  // 5. Each of the T × groups units (8 consecutive elements of one output row) is one warp's: lane
  //    i reads slot i / 2's half i % 2 (its 512 bytes in one pass, no bank conflict), the 16 slots
  //    are summed by an xor butterfly over lanes (the fixed tree ((w0 + w1) + (w2 + w3)) + …:
  //    partner sets do not depend on the slot swizzle, and fp32 addition is commutative, so the
  //    bits do not depend on scheduling), then lanes 0 and 1 store round(round(u) + shared) for
  //    elements 0–3 and 4–7. (One thread per unit summing the warps in turn would read 128
  //    scalars through 7- to 8-way bank conflicts.)
#pragma unroll 1
  for (int u = warp; u < tokens * groups; u += kDecodeWarps) {
    const int t = u / groups, j = u % groups;
    float4 v =
        reinterpret_cast<const float4*>(partials + (j * kMaxTokens + t) * kDecodeWarps * 8)[lane];
#pragma unroll
    for (int m = 2; m < 32; m *= 2) {
      v.x = __fadd_rn(v.x, __shfl_xor_sync(0xffffffffu, v.x, m));
      v.y = __fadd_rn(v.y, __shfl_xor_sync(0xffffffffu, v.y, m));
      v.z = __fadd_rn(v.z, __shfl_xor_sync(0xffffffffu, v.z, m));
      v.w = __fadd_rn(v.w, __shfl_xor_sync(0xffffffffu, v.w, m));
    }
    if (lane < 2) {
      const T* s = reinterpret_cast<const Vec16<T>*>(shared_slice)[u].v + 4 * lane;
      const float sum[4] = {v.x, v.y, v.z, v.w};
      Vec4<T> y;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        y.v[e] = Storage<T>::store(
            __fadd_rn(Storage<T>::load(Storage<T>::store(sum[e])), Storage<T>::load(s[e])));
      }
      const std::int64_t row = row_first + j * 8 + 4 * lane;  // of the stripe
      *reinterpret_cast<Vec4<T>*>(static_cast<T*>(p.out) + t * p.d + p.col0 + row) = y;
      if (exchange) {  // and to every peer
        const FusedTailParams& x = p.protocol;
        for (int r = 0; r < x.tp; ++r) {
          if (r == x.rank) continue;
          ll_store(ll_line(x, r, x.ll_stripe_offset, call.parity, x.rank, x.ll_rows * x.stripe,
                           t * x.stripe + row),
                   *reinterpret_cast<const uint2*>(&y), call.e);
        }
      }
    }
  }
  if (exchange) {
    // 6. Every peer's stripe into Y, and the call closed.
    if (!decode_gather_stripes<T>(p, tokens, &call)) return;
    fused_end(p.protocol, call, false);
  }
  decode_trace(p, kDecodeTraceEnd);
}

}  // namespace lmoe::cuda
