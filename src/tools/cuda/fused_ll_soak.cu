#include "cuda/fused/fused_ll.cuh"
#include "tools/bench_values.hpp"
#include "tools/cuda/fused_ll_soak.hpp"

namespace lmoe::cuda {

namespace {

// A few blocks, resident with every peer's on a shared GPU; 256 threads: a thread per line and
// peer up to 1024 lines.
constexpr int kBlocks = 4;
constexpr int kThreads = 256;

// What rank `from` sends rank `to` in line `index` of the call of epoch e: a fresh value every
// call, with patterns a protocol that compared its data would mistake (data equal to a flag) or
// alter (−0, subnormals, NaNs) among them.
__device__ uint2 ll_soak_payload(std::uint64_t seed, std::uint32_t e, int from, int to,
                                 std::int64_t index) {
  const std::uint64_t pair = static_cast<std::uint64_t>(from) << 8 | static_cast<std::uint64_t>(to);
  const std::uint64_t bits =
      bench::mix64(bench::mix64(seed ^ (static_cast<std::uint64_t>(e) << 16) ^ pair) +
                   static_cast<std::uint64_t>(index));
  switch (bits & 7) {
    case 0: return make_uint2(e, e);                      // the call's own flag
    case 1: return make_uint2(e - 2u, e - 2u);            // the flag of this parity's last call
    case 2: return make_uint2(0x80008000u, 0x80000000u);  // −0: two bf16 or f16, one f32
    case 3: return make_uint2(0x00010001u, 0x00000001u);  // the smallest subnormals
    case 4: return make_uint2(0xffffffffu, 0x7fc00000u);  // NaNs
    default:
      return make_uint2(static_cast<std::uint32_t>(bits >> 32), static_cast<std::uint32_t>(bits));
  }
}

// The lines call `call` of the run (epoch e) uses (FusedLlSoak::widen_at).
__device__ std::int64_t ll_soak_lines(const FusedLlSoak& s, std::int64_t call, std::uint32_t e) {
  const std::int64_t half = s.lines / 2;
  if (call < s.widen_at) return half;
  if (call < s.widen_at + 2) return s.lines;
  const std::uint64_t pick = bench::mix64(s.seed ^ 0x6c696e6573ull ^ e);
  return half + 1 + static_cast<std::int64_t>(pick % static_cast<std::uint64_t>(s.lines - half));
}

__global__ void __launch_bounds__(kThreads) fused_ll_soak_kernel(const FusedLlSoak s) {
  FusedTailParams x;  // what fused_ll.cuh reads: ranks, regions, parities' distance, reporting
  x.rank = s.rank;
  x.tp = s.tp;
  for (int r = 0; r < s.tp; ++r) x.workspace[r] = s.regions[r];
  x.ll_parity_bytes = s.parity_bytes;
  x.status = s.status;
  x.abort_flag = s.abort_flag;
  x.timeout_ns = s.timeout_ns;
  __shared__ FusedCall call;
  if (threadIdx.x == 0) {
    call.failed = 0;
    call.mismatched_peer = kP2pMaxRanks;
  }
  const std::int64_t slot_elements = 4 * s.lines;  // a line carries 4 elements of 2 bytes
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  unsigned long long taken = 0, wrong = 0;
  for (int k = 0; k < s.calls; ++k) {
    const std::int64_t index = s.first_call + k;
    const std::uint32_t e = s.first_epoch + static_cast<std::uint32_t>(index);
    const std::uint32_t parity = e & 1u;
    // Block b sends and takes the same lines on every rank, so the one-call-ahead rule of
    // fused_ll.cuh holds per block: its reads of the last call end before it sends this call's.
    __syncthreads();
    const bool stop = call.failed;
    __syncthreads();
    if (stop) break;
    const std::int64_t used = ll_soak_lines(s, index, e);
    if (s.late_sender_ns &&
        static_cast<std::uint32_t>(s.rank) == e % static_cast<std::uint32_t>(s.tp)) {
      const std::uint64_t until = p2p_clock_ns() + s.late_sender_ns;
      while (p2p_clock_ns() < until) {
      }
    }
    for (std::int64_t i = first; i < used; i += stride) {
      for (int peer = 0; peer < s.tp; ++peer) {
        if (peer == s.rank) continue;
        ll_store(ll_line(x, peer, 0, parity, s.rank, slot_elements, 4 * i),
                 ll_soak_payload(s.seed, e, s.rank, peer, i), e);
      }
    }
    bool ok = true;
    for (std::int64_t i = first; ok && i < used; i += stride) {
      // Odd calls take the lines as the decode kernel's batched loads do, even calls one by one.
      for (int base = 0; ok && base < s.tp; base += (k & 1) ? 4 : 1) {
        std::byte* lines[4] = {};
        int peers[4] = {};
        uint2 data[4] = {};
        unsigned wanted = 0;
        for (int q = 0; q < ((k & 1) ? 4 : 1); ++q) {
          const int peer = base + q;
          peers[q] = peer;
          if (peer >= s.tp || peer == s.rank) continue;
          lines[q] = ll_line(x, s.rank, 0, parity, peer, slot_elements, 4 * i);
          wanted |= 1u << q;
        }
        ok = ll_load_lines<4>(x, lines, wanted, e, peers, &call, data);
        for (int q = 0; ok && q < 4; ++q) {
          if (!(wanted >> q & 1u)) continue;
          const uint2 sent = ll_soak_payload(s.seed, e, peers[q], s.rank, i);
          ++taken;
          wrong += data[q].x != sent.x || data[q].y != sent.y;
        }
      }
    }
  }
  atomicAdd(s.taken, taken);
  if (wrong) atomicAdd(s.wrong, wrong);
}

}  // namespace

cudaError_t launch_fused_ll_soak(const FusedLlSoak& soak, cudaStream_t stream) {
  if (soak.tp < 1 || soak.tp > kP2pMaxRanks || soak.rank < 0 || soak.rank >= soak.tp ||
      soak.lines < 2 || soak.calls < 0 ||
      soak.parity_bytes < fused_ll_soak_parity_bytes(soak.tp, soak.lines)) {
    return cudaErrorInvalidValue;
  }
  if (soak.calls == 0) return cudaSuccess;
  fused_ll_soak_kernel<<<kBlocks, kThreads, 0, stream>>>(soak);
  return cudaGetLastError();
}

}  // namespace lmoe::cuda
