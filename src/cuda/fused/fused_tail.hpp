// The fused decode tail on one rank: its workspace (shared with the peers), its grid, and the call
// (kernels: cuda/fused_tail.cuh, the general one, cuda/fused_decode.cuh for T ≤ 16, and
// cuda/fused_chained.cuh (with cuda/fused_chained_exchange.cuh at tp > 1) for T ≤ 128; protocol:
// docs/fused.md). Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "cuda/fused/fused_chained_launch.hpp"
#include "cuda/fused/fused_decode_launch.hpp"
#include "cuda/fused/fused_settings.hpp"
#include "cuda/fused/fused_tail_types.hpp"
#include "cuda/runtime/device_buffer.hpp"
#include "cuda/runtime/mapped_host_buffer.hpp"
#include "lmoe/communicator.hpp"
#include "lmoe/dims.hpp"

namespace lmoe {
class P2pPeerAccess;
class P2pSharedBuffer;
}  // namespace lmoe

namespace lmoe::cuda {

// Which kernel a call runs: `decode` (cuda/fused_decode.cuh: T ≤ 16, a GEMV-like stream of the
// stripe's rows; with one rank no workspace), `chained` (T ≤ 128 on compute 9.0:
// cuda/fused_chained.cuh's wgmma up-projection of the rank's stripe behind a norm kernel with one
// rank, between the exchange and gather kernels of cuda/fused_chained_exchange.cuh with several;
// chained by programmatic dependent launch) or `general` (cuda/fused_tail.cuh: T ≤ 256, tensor-core
// tiles). With several ranks every kernel follows the workspace protocol (cuda/fused_protocol.cuh).
enum class FusedKernel { general, decode, chained };

// The kernel a call whose rows are bounded by `tokens` runs, from the bounds each path takes here
// (FusedTail's decode_max_tokens, decode_pair_tokens and chained_max_tokens; 0: it does not run):
// decode up to its bound, where the chained path runs only up to fused_decode_beside_chained_tokens
// or the pair instance's bound if more; chained up to its bound; general otherwise. The same on
// every rank (the bounds are agreed at construction).
constexpr FusedKernel fused_kernel_for(std::int64_t tokens, int tp, std::int64_t decode_max,
                                       std::int64_t pair_tokens, std::int64_t chained_max) {
  if (tokens < 1) return FusedKernel::general;
  const std::int64_t decode_bound =
      chained_max > 0
          ? std::min(decode_max, std::max(fused_decode_beside_chained_tokens(tp), pair_tokens))
          : decode_max;
  if (tokens <= decode_bound) return FusedKernel::decode;
  return tokens <= chained_max ? FusedKernel::chained : FusedKernel::general;
}

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
  // settings: the fused tier's knobs (cuda/fused/fused_settings.hpp); without them, this process's
  // environment's.
  FusedTail(Communicator& comm, TailDims dims, DType dtype, bool latent_norm, float eps,
            const void* w_stripe, const float* gamma, std::int64_t max_tokens,
            FusedSettings settings);
  FusedTail(Communicator& comm, TailDims dims, DType dtype, bool latent_norm, float eps,
            const void* w_stripe, const float* gamma, std::int64_t max_tokens);
  ~FusedTail();
  FusedTail(const FusedTail&) = delete;
  FusedTail& operator=(const FusedTail&) = delete;

  // Why the kernel cannot use these buffers (its 16-byte vector accesses need aligned starts);
  // nullopt when it can.
  static std::optional<std::string> buffers_limit(const void* routed, const void* shared,
                                                  const void* out);

  std::int64_t capacity() const { return capacity_; }
  const FusedSettings& settings() const { return settings_; }
  int grid() const { return params_.grid; }
  std::int64_t splits() const { return params_.splits; }  // ranges of K per column tile

  // The kernel a call whose rows are bounded by `tokens` runs (the call's T, or with tokens_device
  // the bound passed to run()): fused_kernel_for with this tail's bounds.
  FusedKernel kernel_for(std::int64_t tokens) const {
    return fused_kernel_for(tokens, params_.tp, decode_max_tokens_, decode_pair_tokens(),
                            chained_max_tokens_);
  }
  // The largest bound the decode kernel can take here (0: it does not run; see decode_limit()).
  std::int64_t decode_max_tokens() const { return decode_max_tokens_; }
  // Why the decode kernel does not run here, or stops short of 16 rows (and of the workspace's
  // rows); nullopt when it takes every call of up to min(16, capacity()) rows.
  const std::optional<std::string>& decode_limit() const { return decode_limit_; }
  // Whether the decode kernel is launched programmatically here (it may start as the stream's
  // previous kernel's blocks leave, its first weights streaming before it waits for that kernel):
  // with one rank unless LMOE_FUSED_DECODE_PROGRAMMATIC=0; with several only where it is 1 and each
  // rank has a GPU of its own.
  bool decode_programmatic() const { return decode_programmatic_; }
  // Calls of up to this many rows run the decode kernel's pair instance (two blocks an SM, so that
  // the next call's blocks enter beside this one's; FusedDecodePlan::pair_tokens): with one rank,
  // launched programmatically, where a block's share of w_up is one group of 8 rows and two blocks
  // fit on an SM, unless LMOE_FUSED_DECODE_PAIR=0. 0 where it does not run.
  std::int64_t decode_pair_tokens() const { return decode_plan_.pair_tokens; }
  // How many blocks of the decode kernel a call of up to `tokens` rows launches fit on an SM at
  // once (the occupancy calculator; 2 for the pair instance); 0 where it does not run.
  int decode_resident_blocks(std::int64_t tokens) const;
  // The largest bound the chained path takes here (0: it does not run; see chained_limit()).
  std::int64_t chained_max_tokens() const { return chained_max_tokens_; }
  // Why the chained path does not run here (not compute 9.0, turned off, one rank without the
  // latent norm, another rank's, …); nullopt when it takes every call of up to min(128,
  // capacity()) rows that decode does not.
  const std::optional<std::string>& chained_limit() const { return chained_limit_; }
  // The chained path's tile of w_up (64 or 128 rows) and its blocks per tile (the splits of K over
  // a cluster); 0 where it does not run.
  int chained_tile_rows() const { return chained_max_tokens_ > 0 ? chained_plan_.tile_rows : 0; }
  int chained_splits() const { return chained_max_tokens_ > 0 ? chained_plan_.splits : 0; }
  // Calls the chained path ran (counted on the device). Synchronizes the device.
  std::uint32_t chained_calls() const;
  // Calls of this rank the general kernel completed (counted in its workspace; the decode kernel
  // does not count there), for tests that prove which kernel ran. Synchronizes the device.
  std::uint32_t general_calls() const;
  // How long a kernel's wait lasts before the call fails: the p2p group's timeout, with one rank
  // that of a p2p communicator, else the settings' (LMOE_P2P_TIMEOUT_MS, or 10 s).
  std::chrono::milliseconds wait_timeout() const;

  // out [T, d] = the tail of routed [T, l] and shared [T, d] (this rank's partials; contiguous,
  // 16-byte aligned), T ≤ capacity(). tokens_device, when given, holds T on the device instead
  // (read by the kernel at run time, so a captured graph can be replayed with another T ≤ tokens;
  // buffers must hold `tokens` rows). Throws on a device failure recorded by an earlier call.
  // With one rank a decode call touches no workspace state, so two of them at once (or one beside a
  // general call) are harmless; otherwise the kernels' in_use check catches two calls at once.
  void run(const void* routed, const void* shared, void* out, std::int64_t tokens,
           cudaStream_t stream, const std::int32_t* tokens_device = nullptr);

 private:
  // The general kernel's grid on this device, before the ranks agree on it.
  struct FusedGrid {
    int sms = 0;
    int sharing = 1;  // ranks on this GPU
    int grid = 0;
    std::int64_t col_tiles = 0;
    std::int64_t most_splits = 1;
    // The splits of K per column tile that a grid of `blocks` fills.
    std::int64_t splits_for(int blocks) const {
      return std::clamp<std::int64_t>(blocks / col_tiles, 1, most_splits);
    }
  };
  static void check_weights_device(int device, const void* w_stripe, const float* gamma);
  FusedGrid choose_grid(int device, TailDims dims, int tp) const;
  // Sets the workspace's offsets in params_ and returns its bytes.
  std::int64_t lay_out_workspace(TailDims dims, int tp, int device, const FusedGrid& g);
  void allocate_workspace(std::int64_t bytes);
  void use_status_record();
  // Collective with several ranks: the smallest grid of any rank.
  int agree_grid(int grid);
  void choose_decode(int sms, int sharing);
  void choose_chained(int sms, int sharing);
  std::optional<std::string> chained_reason(int sms, int sharing);
  void throw_if_failed();
  // The workspace's parameters with one call's buffers and T.
  FusedTailParams call_params(const void* routed, const void* shared, void* out,
                              std::int64_t tokens, const std::int32_t* tokens_device) const;
  void print_trace() noexcept;

  Communicator& comm_;
  P2pPeerAccess* peers_ = nullptr;  // the p2p communicator's, with several ranks
  DType dtype_;
  FusedSettings settings_;
  std::int64_t capacity_ = 0;
  DeviceBuffer workspace_;  // one rank: its own workspace
  std::unique_ptr<P2pSharedBuffer>
      shared_workspace_;         // several: every rank's, from the communicator
  DeviceBuffer trace_;           // LMOE_FUSED_TRACE only: the general kernel's points
  DeviceBuffer decode_trace_;    // and the decode kernel's
  DeviceBuffer chained_trace_;   // and the chained path's up-projection kernel's
  DeviceBuffer exchange_trace_;  // and its exchange and gather kernels' (several ranks)
  FusedTailParams params_;
  // The decode kernel: calls bounded by decode_max_tokens_ rows, as decode_plan_ says.
  std::int64_t decode_max_tokens_ = 0;
  int decode_local_norm_rows_ = 0;  // several ranks: calls every block normalizes itself
  // The decode kernel launched programmatically, its gamma and first weight items asked for before
  // it waits for the kernel before it (FusedDecodeParams).
  bool decode_programmatic_ = false;
  int decode_early_items_ = -1;  // < 0: the instance's default
  std::optional<std::string> decode_limit_;
  FusedDecodePlan decode_plan_;
  // The chained path: calls bounded by chained_max_tokens_ rows, its plan, its
  // arguments (the tensor maps of w_up and of N in the rank's workspace) and its calls counter.
  std::int64_t chained_max_tokens_ = 0;
  std::optional<std::string> chained_limit_;
  FusedChainedPlan chained_plan_;
  FusedChainedParams chained_params_;
  DeviceBuffer chained_workspace_;
  int chained_exchange_grid_ = 0;  // several ranks: blocks of the exchange and gather kernels
  // With one rank there is no p2p group: the kernels report into this rank's own record
  // (P2pMappedStatus: its first record and the abort flag).
  MappedHostBuffer own_record_;
};

}  // namespace lmoe::cuda
