// The fused tier's LL line exchange (cuda/fused/fused_ll.cuh) on its own, for its soak test:
// every rank sends lines to every peer and takes theirs, call after call, with payloads that
// change every call (−0, subnormal and NaN patterns among them, and data equal to a flag), with
// epochs the test chooses (up to and across their wrap), with the number of lines a call uses
// changing, and with a late sender in every call. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/comm/p2p_types.hpp"

namespace lmoe::cuda {

struct FusedLlSoak {
  int rank = 0;
  int tp = 1;
  // Every rank's region of lines as this rank's kernels address it: per parity (parity_bytes
  // apart), a slot of `lines` 16-byte lines per sending rank, started by start_ll_lines.
  std::byte* regions[kP2pMaxRanks] = {};
  std::int64_t lines = 0;
  std::int64_t parity_bytes = 0;  // at least tp · lines · 16
  // Call i of the run has epoch first_epoch + i (mod 2^32). A launch runs calls
  // [first_call, first_call + calls) of the run; launches follow each other on the stream.
  std::uint32_t first_epoch = 1;
  std::int64_t first_call = 0;
  int calls = 0;
  // Calls before widen_at use the first half of the lines only; calls widen_at and widen_at + 1
  // use all of them (so the second half's first reads, one per parity, are there), later calls a
  // count in (lines / 2, lines] that changes every call.
  std::int64_t widen_at = 0;
  std::uint64_t seed = 0;  // the payloads' stream
  // In the call of epoch e, rank e mod tp waits this long before it sends: its peers then poll
  // lines it has not written yet.
  std::uint64_t late_sender_ns = 0;
  // Where a wait that fails reports (the p2p group's record, abort flag and timeout).
  volatile P2pStatus* status = nullptr;
  volatile std::int32_t* abort_flag = nullptr;
  std::uint64_t timeout_ns = 0;
  // += the lines taken, and those whose data differ from what their sender stored (device
  // memory).
  unsigned long long* taken = nullptr;
  unsigned long long* wrong = nullptr;
};

// The bytes of one parity of a region for `tp` ranks of `lines` lines each.
inline std::int64_t fused_ll_soak_parity_bytes(int tp, std::int64_t lines) {
  return static_cast<std::int64_t>(tp) * lines * 16;
}

// Runs soak.calls calls of the exchange on this rank (a grid of the same few blocks on every
// rank: all ranks' blocks must be resident at once). A failed wait ends the launch, reported in
// soak.status as the fused kernels report theirs.
cudaError_t launch_fused_ll_soak(const FusedLlSoak& soak, cudaStream_t stream);

}  // namespace lmoe::cuda
