// LatentTail: the object a user holds for one layer's tail. It owns the replicated weights and
// runs, per call, the tier the policy picks (or the one the caller forces) on its backend.
//
//   Y = RMSNorm(Σ_r routed_r; gamma, eps) · w_upᵀ + Σ_r shared_r      → [T, d], identical on all
//   ranks
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lmoe/backend.hpp"
#include "lmoe/backend_registry.hpp"
#include "lmoe/communicator.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/fused_defaults.hpp"
#include "lmoe/tail_options.hpp"
#include "lmoe/tensor.hpp"
#include "lmoe/tier.hpp"
#include "lmoe/tier_policy.hpp"

namespace lmoe {

// The built-in breakpoints (with_rank_defaults, fused_defaults.hpp), asking fused_decode_limit()
// and fused_chained_limit() for these dims, dtype and ranks when it matters (cuda, fewer than
// kFusedDefaultMinRanks ranks, the built-in breakpoint); with one rank and without the latent norm
// the chained path does not run.
PolicyConfig with_rank_defaults(PolicyConfig policy, Backend backend, int ranks, TailDims dims,
                                DType dtype, bool latent_norm = true);
// Why the fused tier's decode kernel cannot take the default calls (kFusedDefaultTp1Tokens rows at
// one rank, kFusedDefaultDecodeTokens at several) over one rank's stripe of w_up (d / ranks rows)
// at these dims and dtype on the current CUDA device with a block per SM (e.g. more than 8 groups
// of 8 rows per SM, or too little shared memory), or in this build, or with the kernel turned off;
// nullopt when it can.
std::optional<std::string> fused_decode_limit(TailDims dims, DType dtype, int ranks = 1);
// Why the fused tier's chained path (compute 9.0: cuda/fused_chained_launch.hpp) cannot take calls
// of up to kFusedDefaultTp1ChainedTokens rows (one rank) or kFusedDefaultChainedTokens (several)
// over one rank's stripe of w_up (d / ranks rows) at these dims and dtype on the current CUDA
// device, or in this build, or turned off; nullopt when it can.
std::optional<std::string> fused_chained_limit(TailDims dims, DType dtype, int ranks = 1);

// Whether a fused call of T rows on `backend` exchanges the latent in two shots (a reduce-scatter
// to the rows' owners, then N's rows back: the chained path with several ranks, on cuda where
// fused_chained_limit() is empty, for the rows above cuda::fused_decode_beside_chained_tokens(tp)
// up to 128 — 5 … 128 at tp 2 … 7, 17 … 128 from tp 8 — or 1 … 128 where fused_decode_limit() is
// not empty) rather than one (every rank's latent to every peer: the decode and general kernels).
// Where the decode kernel takes only 8 rows of a stripe from tp 8, its 9 … 16 are counted as one
// shot.
bool fused_runs_two_shot(Backend backend, TailDims dims, DType dtype, int tp,
                         std::int64_t num_tokens);

// Which tiers a backend can run for T tokens at these dims, without building a tail (for
// `lmoe explain`); a LatentTail may decline more (e.g. a workspace too small).
TierSupport tier_support(Backend backend, std::int64_t num_tokens, TailDims dims, DType dtype,
                         int tp);

class TailExecutor;

class LatentTail {
 public:
  // norm_weight: l values ([l] or [1, l]); up_proj_weight: [d, l] (row-major, out × in). Both in
  // host memory and in options.dtype; they are copied. `comm` must outlive the LatentTail.
  // Throws lmoe::Error on every rank when ranks were constructed with different configurations.
  LatentTail(TailOptions options, Communicator& comm, ConstMatrixView norm_weight,
             ConstMatrixView up_proj_weight);
  ~LatentTail();
  LatentTail(const LatentTail&) = delete;
  LatentTail& operator=(const LatentTail&) = delete;

  const TailOptions& options() const;
  int tp_rank() const;
  int tp_size() const;

  // Which tiers can run T tokens here, and why not where they cannot.
  TierSupport support(std::int64_t num_tokens) const;
  TierDecision decide(std::int64_t num_tokens) const;
  std::string explain(std::int64_t num_tokens) const;
  // Why the policy's measured table may not hold here (e.g. another driver); empty when it does or
  // there is no measured table. explain() lists them too.
  const std::vector<std::string>& table_warnings() const;

  // routed: [T, l], this rank's partial; shared: [T, d], this rank's partial, which the call may
  // overwrite (the column tier accumulates into it, as the reference system does); out: [T, d]
  // (may be the same buffer as shared). Runs `tier` when given (an error if it cannot run), else
  // the policy's choice. Returns the tier that ran; nullopt for T = 0, which runs nothing.
  std::optional<TailTier> forward(ConstMatrixView routed, MatrixView shared, MatrixView out,
                                  std::optional<TailTier> tier = std::nullopt,
                                  StreamHandle stream = nullptr);

  // The tail with T read on the device (cuda backend, TailOptions::max_tokens = M > 0;
  // docs/graphs.md): routed [M, l], shared [M, d] and out [M, d] hold M rows, and T is
  // *tokens_device (int32, device memory) when the work runs, so that a CUDA graph captured around
  // this call replays correctly for any 0 ≤ T ≤ M written there before each replay. T runs in its
  // bucket (device_token_buckets): rows < T of out get the tail; rows in [T, bucket's max_tokens)
  // of out and shared hold unspecified values; rows from the bucket's max_tokens on are not
  // touched. T = 0 runs nothing. `tier`: that tier in every bucket where it can run (none
  // elsewhere), else the policy's choice.
  //   Under capture: host work only (validation, the ranks' agreement exchange): a selector kernel
  //   and one conditional body per bucket. A replay whose T is outside [0, M], or in a bucket no
  //   tier runs, runs nothing and records the error for check_device_tokens(). Outside capture:
  //   reads T with one copy to the host (waits for the stream) and runs what a replay would; a T it
  //   cannot run throws on every rank. The first such call also runs every bucket's GEMMs once,
  //   which a capture cannot do: call it once before capturing.
  void forward_device_tokens(ConstMatrixView routed, MatrixView shared, MatrixView out,
                             const std::int32_t* tokens_device,
                             std::optional<TailTier> tier = std::nullopt,
                             StreamHandle stream = nullptr);
  // The buckets forward_device_tokens runs, ascending, covering 1 … max_tokens.
  std::vector<DeviceTokenBucket> device_token_buckets(
      std::optional<TailTier> tier = std::nullopt) const;
  // Throws lmoe::Error when a replay since the last check read a T it could not run (and ran
  // nothing), naming T; clears the record. forward and forward_device_tokens check first. Does not
  // wait for the GPU: synchronize with the replays' stream before.
  void check_device_tokens();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lmoe
