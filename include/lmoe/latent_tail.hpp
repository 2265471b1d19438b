// LatentTail: the object a user holds for one layer's tail. It owns the replicated weights and
// runs, per call, the tier the policy picks (or the one the caller forces) on its backend.
//
//   Y = RMSNorm(Σ_r routed_r; gamma, eps) · w_upᵀ + Σ_r shared_r      → [T, d], identical on all ranks
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lmoe/communicator.hpp"
#include "lmoe/dims.hpp"
#include "lmoe/tensor.hpp"
#include "lmoe/tier.hpp"
#include "lmoe/tier_policy.hpp"

namespace lmoe {

enum class Backend : std::uint8_t { cpu, cuda };
std::string_view backend_name(Backend backend);
Backend parse_backend(std::string_view name);
// Whether this build and machine can run the backend (cuda: compiled in and a GPU present).
bool backend_available(Backend backend);

// The built-in breakpoints for `backend` on `ranks` ranks, on cuda, below kFusedDefaultMinRanks
// ranks: fused_max_tokens becomes the fused kernels' measured range where they run (docs/fused.md)
// and 0 where they do not (`decode_limit` says why: the general kernel measured slower than
// `overlap` there). One rank: kFusedDefaultTp1ChainedTokens where the chained path runs
// (`chained_limit` empty: the chained path from 1 row, the decode kernel not at all; at K3 dims on
// an H200 with cold weights, `lmoe bench --cold-l2`, faster than `overlap` at every T it takes,
// 1 … 128 — per tail in graphs of 8 layers 18.4 / 21.7 µs at T = 64, 19.7 / 22.5 at 96,
// 20.0 / 23.8 at 128; as graph replays 22.6 / 23.0, 23.0 / 23.9 and 23.5 / 25.0; session 23 —
// 64 from session 19 to 22, when it was slower above), else kFusedDefaultTp1Tokens (the decode
// kernel alone: as fast as `overlap` at 6 tokens, faster below and slower from 8). Two to seven
// ranks: kFusedDefaultChainedTokens where the chained path runs (`chained_limit` empty; K3 tp 2,
// one rank per H200, cold weights: the decode kernel up to 4 tokens and the chained path from
// 5, 22.1–38.1 µs at T = 1–64 against overlap's 32.6–38.4 and column's 31.0–40.1, slower from 96),
// else kFusedDefaultDecodeTokens (the decode kernel: 24.8–27.6 µs against overlap's 32.0–32.7 at T
// ≤ 16; the general kernel at 32 slower than overlap). From kFusedDefaultMinRanks the reference
// system's 128 stays until eight GPUs measure it. Settings from a table, the environment or the
// caller are kept. LatentTail applies it at construction; explain() names it as the setting's
// origin.
inline constexpr int kFusedDefaultMinRanks = 8;
inline constexpr int kFusedDefaultTp1Tokens = 6;
inline constexpr int kFusedDefaultTp1ChainedTokens = 128;
inline constexpr int kFusedDefaultDecodeTokens = 16;
inline constexpr int kFusedDefaultChainedTokens = 64;
PolicyConfig with_rank_defaults(PolicyConfig policy, Backend backend, int ranks,
                                const std::optional<std::string>& decode_limit,
                                const std::optional<std::string>& chained_limit);
// The same, asking fused_decode_limit() and fused_chained_limit() for these dims, dtype and ranks
// when it matters (cuda, fewer than kFusedDefaultMinRanks ranks, the built-in breakpoint); with
// one rank and without the latent norm the chained path does not run.
PolicyConfig with_rank_defaults(PolicyConfig policy, Backend backend, int ranks, TailDims dims,
                                DType dtype, bool latent_norm = true);
// Why the fused tier's decode kernel is turned off in this process (LMOE_FUSED_DECODE=0; read as a
// flag, anything but 1/0, true/false, yes/no, on/off is an error naming it); nullopt when it is on.
std::optional<std::string> fused_decode_turned_off();
// The same for the chained path (LMOE_FUSED_CHAINED=0: the decode and general kernels take its
// calls).
std::optional<std::string> fused_chained_turned_off();
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
TierSupport tier_support(Backend backend, std::int64_t num_tokens, TailDims dims, DType dtype, int tp);

struct TailOptions {
  TailDims dims;
  float rms_norm_eps = 1e-5f;
  // false: N = round(Σ_r routed_r), no RMSNorm (Nemotron 3 feeds the routed sum straight to its
  // latent up-projection); norm_weight is then ignored. Both backends, every tier.
  bool latent_norm = true;
  DType dtype = DType::bf16;
  Backend backend = Backend::cpu;
  // Built-in defaults; load_policy_config(process_environment()) adds a table and the environment.
  // A measured table (policy.table) must fit this tail: construction throws lmoe::Error when it was
  // measured on another GPU or for other dims, dtype, tp, backend or comm (match_tier_table), and
  // records a warning when only software versions differ (table_warnings()).
  PolicyConfig policy;
  // Before each forward, ranks exchange a fingerprint of the call (T, tier, configuration, local
  // validation result) so that a rank with bad input or a different configuration makes every
  // rank fail with the same error instead of leaving its peers waiting in a collective.
  // Must be the same on every rank (it decides whether the exchange happens at all).
  bool check_ranks_agree = true;
  // The most tokens a forward may carry. > 0: workspaces are allocated once, at construction, and
  // never move, which CUDA-graph capture requires (a larger T is an error). 0: they grow on demand
  // (a grow waits for the stream), and forwards cannot be captured.
  std::int64_t max_tokens = 0;
};

class TailExecutor;

// A range of T that LatentTail::forward_device_tokens runs alike: every T in [min_tokens,
// max_tokens] runs `tier` on max_tokens rows (the fused tier reads T itself and runs T rows).
struct DeviceTokenBucket {
  std::int64_t min_tokens = 0, max_tokens = 0;
  std::optional<TailTier> tier;  // nullopt: no tier runs these T (a replay with one runs nothing and records an error)
  std::string reason;            // why no tier (empty when one runs)
};

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
                   std::optional<TailTier> tier = std::nullopt, StreamHandle stream = nullptr);

  // The tail with T read on the device (cuda backend, TailOptions::max_tokens = M > 0; docs/graphs.md):
  // routed [M, l], shared [M, d] and out [M, d] hold M rows, and T is *tokens_device (int32, device
  // memory) when the work runs, so that a CUDA graph captured around this call replays correctly for
  // any 0 ≤ T ≤ M written there before each replay. T runs in its bucket (device_token_buckets):
  // rows < T of out get the tail; rows in [T, bucket's max_tokens) of out and shared hold
  // unspecified values; rows from the bucket's max_tokens on are not touched. T = 0 runs nothing.
  // `tier`: that tier in every bucket where it can run (none elsewhere), else the policy's choice.
  //   Under capture: host work only (validation, the ranks' agreement exchange): a selector kernel
  //   and one conditional body per bucket. A replay whose T is outside [0, M], or in a bucket no tier
  //   runs, runs nothing and records the error for check_device_tokens().
  //   Outside capture: reads T with one copy to the host (waits for the stream) and runs what a
  //   replay would; a T it cannot run throws on every rank. The first such call also runs every
  //   bucket's GEMMs once, which a capture cannot do: call it once before capturing.
  void forward_device_tokens(ConstMatrixView routed, MatrixView shared, MatrixView out,
                             const std::int32_t* tokens_device, std::optional<TailTier> tier = std::nullopt,
                             StreamHandle stream = nullptr);
  // The buckets forward_device_tokens runs, ascending, covering 1 … max_tokens.
  std::vector<DeviceTokenBucket> device_token_buckets(std::optional<TailTier> tier = std::nullopt) const;
  // Throws lmoe::Error when a replay since the last check read a T it could not run (and ran
  // nothing), naming T; clears the record. forward and forward_device_tokens check first. Does not
  // wait for the GPU: synchronize with the replays' stream before.
  void check_device_tokens();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lmoe
