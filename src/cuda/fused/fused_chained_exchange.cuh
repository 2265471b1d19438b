// The chained path with several ranks (sm_90a; launcher: cuda/fused_chained_launch.cu): the two
// kernels around the up-projection of cuda/fused_chained.cuh, which exchange what the ranks hold as
// lines that carry their own flags (cuda/fused_ll.cuh):
//
//   1. fused_chained_exchange_kernel, before it: a two-shot all-reduce of the latent with the norm
//      between the shots — row t belongs to rank t mod tp, which sums the row's partials of every
//      rank (rank order, rounded once), normalizes it (the canonical order of cuda/rms_norm.cuh)
//      and sends N's row to every rank — and the reduce-scatter of `shared` by stripes (each rank
//      sums its stripe's columns over the ranks). It leaves N [T, l] and the stripe's shared sum
//      [T, stripe] in this rank's workspace, where the up-projection reads them. T goes to every
//      peer first, and a peer's other T fails the call (fused_compare_tokens).
//   2. (the up-projection: Y's columns of this rank's stripe, and each vector to every peer.)
//   3. fused_chained_gather_kernel, after it: every peer's stripe from its lines into Y, then the
//      call is closed (epoch, counters' bases, the workspace freed).
//
// Why two shots where the decode kernel takes one: a one-shot exchange sends each rank's whole
// latent to every peer, (tp − 1)·T·l elements, where the two shots send 2·(tp − 1)/tp·T·l: half
// the NVLink time from tp 4 on (docs/fused.md). Lines double the bytes but need no fence, counter
// or read across NVLink.
//
// Lines leave an SM across NVLink slowly, so both kernels spread their lines over every SM they
// have: with one rank per GPU a block per SM (FusedTail::chained_reason), and a row of N over
// several blocks. The ranks'
// blocks of kernel 1 wait for each other, so with ranks sharing a GPU every one of them must be
// resident at once: small grids there, and the up-projection started only after kernel 1.
// Device code only.
#pragma once

#include <cstdint>

#include "cuda/fused/fused_ll.cuh"
#include "cuda/fused/fused_protocol.cuh"
#include "cuda/fused/fused_tail_types.hpp"
#include "cuda/runtime/dtype.cuh"
#include "cuda/runtime/hopper_async.cuh"
#include "cuda/tail/rms_norm.cuh"

namespace lmoe::cuda {

// The call's T (fused_call_tokens), within the launch's bound and the exchange's rows; -1 (no rows)
// past them, which the exchange kernel, the call's first, records.
__device__ inline int chained_call_tokens(const FusedTailParams& x, bool reporter) {
  const std::int64_t bound = x.tokens < x.cx_rows ? x.tokens : x.cx_rows;
  return fused_call_tokens(x.tokens_device, x.tokens, bound, fused_report(x), reporter);
}

// Row t of this rank's latent to its owner (rank t mod tp; not this rank's own rows) and this
// rank's columns of every peer's stripe of `shared`, as lines into the receivers' workspaces. Grid
// stride over every line: one SM stores across NVLink slowly (docs/fused.md), so every SM takes a
// share.
template <typename T>
__device__ void chained_push_inputs(const FusedTailParams& x, int tokens, const FusedCall& call) {
  const T* routed = static_cast<const T*>(x.routed);
  const T* shared = static_cast<const T*>(x.shared);
  const unsigned first = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
  const unsigned latent_units = static_cast<unsigned>(x.l / 4);  // per row
  for (unsigned i = first; i < static_cast<unsigned>(tokens) * latent_units; i += stride) {
    const unsigned t = i / latent_units, c = (i - t * latent_units) * 4;
    const int owner = static_cast<int>(t % static_cast<unsigned>(x.tp));
    if (owner == x.rank) continue;
    ll_store(ll_line_in(x.workspace[owner], x.cx_latent_offset, x.cx_parity_bytes, call.parity,
                        x.rank, x.cx_owner_rows * x.l,
                        static_cast<std::int64_t>(t / static_cast<unsigned>(x.tp)) * x.l + c),
             *reinterpret_cast<const uint2*>(routed + static_cast<std::int64_t>(t) * x.l + c),
             call.e);
  }
  const unsigned stripe_units = static_cast<unsigned>(x.stripe / 4);
  const unsigned per_peer = static_cast<unsigned>(tokens) * stripe_units;
  for (unsigned i = first; i < per_peer * static_cast<unsigned>(x.tp); i += stride) {
    const int r = static_cast<int>(i / per_peer);
    if (r == x.rank) continue;
    const unsigned u = i - static_cast<unsigned>(r) * per_peer, t = u / stripe_units;
    const std::int64_t c = (u - t * stripe_units) * 4;
    ll_store(ll_line_in(x.workspace[r], x.cx_shared_offset, x.cx_parity_bytes, call.parity, x.rank,
                        x.cx_rows * x.stripe, static_cast<std::int64_t>(t) * x.stripe + c),
             *reinterpret_cast<const uint2*>(shared + static_cast<std::int64_t>(t) * x.d +
                                             static_cast<std::int64_t>(r) * x.stripe + c),
             call.e);
  }
}

// Lines a thread waits for at once (ll_load_lines): units of 4 elements, or 2 chunks of 8.
inline constexpr int kCxBatch = 4;

// Rank r's 4 elements of each of a batch's units into its fp32 sums, in rank order: rank 0's value
// starts the sum (the contract's rank sum: fp32 from rank 0's value, rounded once at the end).
template <typename T>
__device__ inline void cx_add_rank(float (&acc)[kCxBatch][4], const uint2 (&bits)[kCxBatch],
                                   int r) {
#pragma unroll
  for (int k = 0; k < kCxBatch; ++k) {
    const T* v = reinterpret_cast<const T*>(&bits[k]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float value = Storage<T>::load(v[e]);
      acc[k][e] = r == 0 ? value : __fadd_rn(acc[k][e], value);
    }
  }
}

__device__ inline void cx_trace(const FusedTailParams& x, int point) {
  if (x.trace != nullptr && threadIdx.x == 0)
    x.trace[blockIdx.x * kCxTracePoints + point] = p2p_clock_ns();
}

// Row t, one of this rank's own (t mod tp = rank): Σ_r of the row's partials in rank order,
// rounded, normalized (unless the tail has no latent norm), into this rank's N and as lines into
// every peer's. A lane takes the chunks c ≡ lane (mod 256) of 8 elements (the canonical order's
// lanes), two at a time: a peer's four lines of them are loaded at once. The row's `parts` blocks
// all compute it (the same bits: the order is fixed) and send its chunks c ≡ part (mod parts)
// each, so that its lines leave from several SMs; part 0 writes this rank's N. False when a wait
// failed (reported). Every thread of the block calls it.
template <typename T>
__device__ bool chained_own_row(const FusedTailParams& x, int t, int part, int parts,
                                FusedCall* call, float* lane_sums, NormChunk<T>* sums) {
  const int lane = static_cast<int>(threadIdx.x);
  const std::int64_t chunks = x.l / kNormChunk;
  const T* routed = static_cast<const T*>(x.routed) + static_cast<std::int64_t>(t) * x.l;
  T* normed = reinterpret_cast<T*>(x.workspace[x.rank] + x.normed_offset) +
              static_cast<std::int64_t>(t) * x.l;
  const std::int64_t slot = x.cx_owner_rows * x.l, at = (t / x.tp) * x.l;
  float lane_sum = 0.0f;
  bool ok = true;
  for (std::int64_t c0 = lane; c0 < chunks && ok; c0 += 2 * kNormLanes) {
    const bool second = c0 + kNormLanes < chunks;  // the pair's second chunk exists
    const unsigned wanted = second ? 0xfu : 0x3u;  // lines k: chunk k / 2, half k % 2
    float acc[kCxBatch][4];
    for (int r = 0; r < x.tp && ok; ++r) {
      uint2 bits[kCxBatch];
      if (r == x.rank) {
#pragma unroll
        for (int k = 0; k < kCxBatch; ++k) {
          if (wanted >> k & 1u) {
            bits[k] = *reinterpret_cast<const uint2*>(
                routed + (c0 + (k / 2) * kNormLanes) * kNormChunk + 4 * (k % 2));
          }
        }
      } else {
        std::byte* lines[kCxBatch];
        int peers[kCxBatch];
#pragma unroll
        for (int k = 0; k < kCxBatch; ++k) {
          lines[k] =
              ll_line_in(x.workspace[x.rank], x.cx_latent_offset, x.cx_parity_bytes, call->parity,
                         r, slot, at + (c0 + (k / 2) * kNormLanes) * kNormChunk + 4 * (k % 2));
          peers[k] = r;
        }
        ok = ll_load_lines<kCxBatch>(x, lines, wanted, call->e, peers, call, bits);
      }
      cx_add_rank<T>(acc, bits, r);
    }
    for (int j = 0; j < (second ? 2 : 1); ++j) {
      NormChunk<T> chunk;
#pragma unroll
      for (int k = 0; k < kNormChunk; ++k)
        chunk.at(k) = Storage<T>::store(acc[2 * j + k / 4][k % 4]);
      if (x.latent_norm)
        lane_sum = add_chunk_squares(lane_sum, chunk);  // increasing j: c0, c0 + 256
      sums[c0 + j * kNormLanes] =
          chunk;  // the block's own copy (parts race on N): normalized below
    }
  }
  // A failed wait leaves the row unfinished; the block still takes the barriers below with the
  // others, and the caller leaves after them.
  const float rstd = x.latent_norm ? rms_norm_rstd(row_sum_of_squares<8>(lane_sum, lane_sums),
                                                   static_cast<int>(x.l), x.eps)
                                   : 0.0f;
  __syncthreads();  // lane_sums is reused by the next row; call->failed is seen by every thread
  if (call->failed) return false;
  for (std::int64_t c = lane; c < chunks; c += kNormLanes) {
    NormChunk<T> chunk = sums[c];  // this thread's own stores
    if (x.latent_norm) normalize_chunk(chunk, x.gamma + c * kNormChunk, rstd);
    if (part == 0) chunk.store(normed + c * kNormChunk);
    if (c % parts != part) continue;
    const uint4 bits = *reinterpret_cast<const uint4*>(&chunk);
    for (int r = 0; r < x.tp; ++r) {
      if (r == x.rank) continue;
      std::byte* line =
          ll_line_in(x.workspace[r], x.cx_normed_offset, x.cx_parity_bytes, call->parity, 0, 0,
                     static_cast<std::int64_t>(t) * x.l + c * kNormChunk);
      ll_store(line, make_uint2(bits.x, bits.y), call->e);
      ll_store(line + 16, make_uint2(bits.z, bits.w), call->e);
    }
  }
  return true;
}

// This rank's stripe of the shared sum: units of 4 columns, kCxBatch per thread at a time (grid
// stride), each summed over the ranks in rank order (a peer's lines of the batch loaded at once).
template <typename T>
__device__ bool chained_shared_sums(const FusedTailParams& x, int tokens, FusedCall* call) {
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const T* shared = static_cast<const T*>(x.shared);
  T* shared_sum = reinterpret_cast<T*>(x.workspace[x.rank] + x.shared_sum_offset);
  const std::int64_t stripe_units = x.stripe / 4, units = tokens * stripe_units;
  for (std::int64_t base = first; base < units; base += kCxBatch * stride) {
    std::int64_t index[kCxBatch];  // t · stripe + the unit's first column
    unsigned wanted = 0;
#pragma unroll
    for (int k = 0; k < kCxBatch; ++k) {
      const std::int64_t i = base + k * stride, t = i / stripe_units;
      index[k] = t * x.stripe + (i - t * stripe_units) * 4;
      if (i < units) wanted |= 1u << k;
    }
    float acc[kCxBatch][4];
    for (int r = 0; r < x.tp; ++r) {
      uint2 bits[kCxBatch];
      if (r == x.rank) {
#pragma unroll
        for (int k = 0; k < kCxBatch; ++k) {
          if (wanted >> k & 1u) {
            const std::int64_t t = index[k] / x.stripe, c = index[k] - t * x.stripe;
            bits[k] = *reinterpret_cast<const uint2*>(shared + t * x.d + x.rank * x.stripe + c);
          }
        }
      } else {
        std::byte* lines[kCxBatch];
        int peers[kCxBatch];
#pragma unroll
        for (int k = 0; k < kCxBatch; ++k) {
          lines[k] = ll_line_in(x.workspace[x.rank], x.cx_shared_offset, x.cx_parity_bytes,
                                call->parity, r, x.cx_rows * x.stripe, index[k]);
          peers[k] = r;
        }
        if (!ll_load_lines<kCxBatch>(x, lines, wanted, call->e, peers, call, bits)) return false;
      }
      cx_add_rank<T>(acc, bits, r);
    }
#pragma unroll
    for (int k = 0; k < kCxBatch; ++k) {
      if (!(wanted >> k & 1u)) continue;
      Vec4<T> out;
#pragma unroll
      for (int e = 0; e < 4; ++e) out.v[e] = Storage<T>::store(acc[k][e]);
      *reinterpret_cast<uint2*>(shared_sum + index[k]) = *reinterpret_cast<const uint2*>(&out);
    }
  }
  return true;
}

// The other owners' rows of N from their lines into this rank's N, kCxBatch units of 4 elements per
// thread at a time (grid stride over every row's units, this rank's own rows skipped).
template <typename T>
__device__ bool chained_other_rows(const FusedTailParams& x, int tokens, FusedCall* call) {
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  T* normed = reinterpret_cast<T*>(x.workspace[x.rank] + x.normed_offset);
  const std::int64_t row_units = x.l / 4, units = tokens * row_units;
  for (std::int64_t base = first; base < units; base += kCxBatch * stride) {
    std::byte* lines[kCxBatch];
    int peers[kCxBatch];
    unsigned wanted = 0;
#pragma unroll
    for (int k = 0; k < kCxBatch; ++k) {
      const std::int64_t i = base + k * stride, t = i / row_units;
      peers[k] = static_cast<int>(t % x.tp);
      lines[k] = ll_line_in(x.workspace[x.rank], x.cx_normed_offset, x.cx_parity_bytes,
                            call->parity, 0, 0, i * 4);  // i · 4 = t · l + the unit's first element
      if (i < units && peers[k] != x.rank) wanted |= 1u << k;
    }
    uint2 bits[kCxBatch];
    if (!ll_load_lines<kCxBatch>(x, lines, wanted, call->e, peers, call, bits)) return false;
#pragma unroll
    for (int k = 0; k < kCxBatch; ++k) {
      if (wanted >> k & 1u) *reinterpret_cast<uint2*>(normed + (base + k * stride) * 4) = bits[k];
    }
  }
  return true;
}

// Kernel 1 (kNormThreads threads a block; the host's grid, small enough for every rank's blocks on
// a GPU to be resident at once).
template <typename T>
__global__ void __launch_bounds__(kNormThreads, 3)
    fused_chained_exchange_kernel(const __grid_constant__ FusedTailParams x) {
  __shared__ FusedCall call;
  __shared__ float lane_sums[kNormLanes];
  extern __shared__ __align__(16) unsigned char cx_smem[];  // the row being normalized: l elements
  cx_trace(x, kCxTraceEntry);
  // With one rank per GPU the up-projection may start at once: its weights do not depend on this
  // kernel (it waits for this kernel's end before its first copy of N). Ranks sharing a GPU let it
  // start only once this kernel has ended: its blocks, waiting, would hold the SMs that another
  // rank's exchange blocks, which this rank's wait for, need.
  if (x.cx_early_up) pdl_launch_dependents();
  const int tokens = chained_call_tokens(x, blockIdx.x == 0 && threadIdx.x == 0);
  if (tokens < 0) return;  // the same for every block
  if (!fused_begin(x, &call)) return;
  // 1. Send: T to every peer, every row's latent to its owner, every peer's stripe columns of
  //    `shared` to the peer.
  fused_send_tokens(x, tokens, call);
  chained_push_inputs<T>(x, tokens, call);
  cx_trace(x, kCxTracePushed);
  // The peers' T (sent before their rows): where one differs, the rows it did not send are not
  // waited for, and the call fails below.
  fused_compare_tokens(x, tokens, &call);
  // 2. This rank's own rows: sum, normalize, send N's row to every rank; a row over several
  //    blocks where the grid has more blocks than rows.
  const int own_rows = tokens > x.rank ? (tokens - x.rank + x.tp - 1) / x.tp : 0;
  const int parts = own_rows > 0 ? max(1, static_cast<int>(gridDim.x) / own_rows) : 1;
  for (int item = static_cast<int>(blockIdx.x); item < own_rows * parts;
       item += static_cast<int>(gridDim.x)) {
    if (!chained_own_row<T>(x, x.rank + item / parts * x.tp, item % parts, parts, &call, lane_sums,
                            reinterpret_cast<NormChunk<T>*>(cx_smem))) {
      break;
    }
  }
  if (fused_block_failed(x, tokens, &call)) return;
  cx_trace(x, kCxTraceOwnRows);
  // 3. This rank's stripe of the shared sum (its peers' columns arrived in step 1), then N's rows
  //    of the other owners into this rank's N.
  if (!chained_shared_sums<T>(x, tokens, &call)) return;
  cx_trace(x, kCxTraceSharedSums);
  if (!chained_other_rows<T>(x, tokens, &call)) return;
  cx_trace(x, kCxTraceOtherRows);
}

// Kernel 3: every peer's stripe of Y from its lines (pushed by the peer's up-projection) into Y,
// then, once this rank's up-projection has ended, the call closed. The kernel may start while the
// up-projection runs (programmatic dependent launch) and poll meanwhile. Its blocks also count in
// rows_done, whose base (arrivals) grows by every call's grid.
template <typename T>
__global__ void __launch_bounds__(kNormThreads, 3)
    fused_chained_gather_kernel(const __grid_constant__ FusedTailParams x) {
  __shared__ FusedCall call;
  cx_trace(x, kCxTraceGatherEntry);
  const int tokens = chained_call_tokens(x, false);
  if (tokens < 0) return;  // the exchange kernel recorded it and ran nothing
  // The exchange took the workspace; nothing advances the epoch before this kernel's end.
  fused_begin(x, &call, /*take_workspace=*/false);
  const std::int64_t stripe_units = x.stripe / 4, per_peer = tokens * stripe_units;
  const std::int64_t units = per_peer * x.tp;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  T* out = static_cast<T*>(x.out);
  for (std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       base < units; base += kCxBatch * stride) {
    std::byte* lines[kCxBatch];
    int peers[kCxBatch];
    std::int64_t at[kCxBatch];  // the unit's first element in Y
    unsigned wanted = 0;
#pragma unroll
    for (int k = 0; k < kCxBatch; ++k) {
      const std::int64_t i = base + k * stride;
      const int r = static_cast<int>(i / per_peer);
      const std::int64_t u = i - r * per_peer, t = u / stripe_units, c = (u - t * stripe_units) * 4;
      peers[k] = r;
      lines[k] = ll_line_in(x.workspace[x.rank], x.cx_out_offset, x.cx_parity_bytes, call.parity, r,
                            x.cx_rows * x.stripe, t * x.stripe + c);
      at[k] = t * x.d + r * x.stripe + c;
      if (i < units && r != x.rank) wanted |= 1u << k;
    }
    uint2 bits[kCxBatch];
    if (!ll_load_lines<kCxBatch>(x, lines, wanted, call.e, peers, &call, bits)) return;
#pragma unroll
    for (int k = 0; k < kCxBatch; ++k) {
      if (wanted >> k & 1u) *reinterpret_cast<uint2*>(out + at[k]) = bits[k];
    }
  }
  cx_trace(x, kCxTraceGathered);
  pdl_wait();  // this rank's up-projection has ended (it read the epoch this closes)
  if (threadIdx.x == 0) atomicAdd(&fused_flags(x, x.rank)->rows_done, 1u);
  fused_end(x, call, false);
  cx_trace(x, kCxTraceClosed);
}

}  // namespace lmoe::cuda
