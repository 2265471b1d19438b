// The fused decode tail on one rank: its workspace (shared with the peers), its grid, and the call
// (kernel: cuda/fused_tail.cuh; protocol: docs/fused.md). Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "cuda/device_buffer.hpp"
#include "cuda/fused_tail_types.hpp"
#include "lmoe/communicator.hpp"
#include "lmoe/dims.hpp"

namespace lmoe {
class P2pPeerAccess;
class P2pSharedBuffer;
}

namespace lmoe::cuda {

class FusedTail {
 public:
  // Why the fused kernel cannot run the tail for this communicator, dims and dtype; nullopt when it
  // can. With one rank any device communicator serves (nothing is exchanged); with several, the
  // ranks' kernels read each other's workspaces, which the p2p communicator provides.
  static std::optional<std::string> unavailable(Communicator& comm, TailDims dims, DType dtype);
  // The part of that which depends only on the problem (dtype, dims, tp), for callers that have no
  // communicator at hand (cuda_tier_limit).
  static std::optional<std::string> problem_limit(TailDims dims, DType dtype, int tp);

  // Collective with several ranks (they exchange workspace addresses and agree on a grid).
  // w_stripe: this rank's rows of w_up [stripe, l] on the device; gamma: fp32 [l] on the device;
  // both must outlive this object. max_tokens: 0 or more than kFusedMaxTokens gives the workspace
  // kFusedMaxTokens rows.
  // latent_norm false: N = round(Σ_r routed_r), no RMSNorm (gamma unused).
  FusedTail(Communicator& comm, TailDims dims, DType dtype, bool latent_norm, float eps, const void* w_stripe,
            const float* gamma, std::int64_t max_tokens);
  ~FusedTail();
  FusedTail(const FusedTail&) = delete;
  FusedTail& operator=(const FusedTail&) = delete;

  // Why the kernel cannot use these buffers (its 16-byte vector accesses need aligned starts);
  // nullopt when it can.
  static std::optional<std::string> buffers_limit(const void* routed, const void* shared, const void* out);

  std::int64_t capacity() const { return capacity_; }
  int grid() const { return params_.grid; }
  std::int64_t splits() const { return params_.splits; }  // ranges of K per column tile

  // out [T, d] = the tail of routed [T, l] and shared [T, d] (this rank's partials; contiguous,
  // 16-byte aligned), T ≤ capacity(). tokens_device, when given, holds T on the device instead
  // (read by the kernel at run time, so a captured graph can be replayed with another T ≤ tokens;
  // buffers must hold `tokens` rows). Throws on a device failure recorded by an earlier call.
  void run(const void* routed, const void* shared, void* out, std::int64_t tokens, cudaStream_t stream,
           const std::int32_t* tokens_device = nullptr);

 private:
  void throw_if_failed();
  void print_trace() noexcept;

  Communicator& comm_;
  P2pPeerAccess* peers_ = nullptr;  // the p2p communicator's, with several ranks
  DType dtype_;
  std::int64_t capacity_ = 0;
  DeviceBuffer workspace_;                              // one rank: its own workspace
  std::unique_ptr<P2pSharedBuffer> shared_workspace_;   // several: every rank's, from the communicator
  DeviceBuffer trace_;  // LMOE_FUSED_TRACE only
  FusedTailParams params_;
  // With one rank there is no p2p group: the kernel reports into this rank's own mapped record.
  P2pStatus* own_status_ = nullptr;
  std::int32_t* own_abort_ = nullptr;
};

}  // namespace lmoe::cuda
