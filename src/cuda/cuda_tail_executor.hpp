// The CUDA executor of the tail tiers, and what LatentTail asks the CUDA backend before building it.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "core/tail_executor.hpp"
#include "lmoe/latent_tail.hpp"

namespace lmoe {

// GPUs visible to this process; 0 when there is no driver or no GPU. Never throws.
int cuda_device_count();

// nullopt when the CUDA backend can run `tier` for `problem`; otherwise why not.
std::optional<std::string> cuda_tier_limit(TailTier tier, const TailProblem& problem);

// What LatentTail::forward_device_tokens needs from the CUDA executor (T read on the device; one
// CUDA graph for every T, docs/graphs.md). The CUDA executor implements it next to TailExecutor.
class DeviceTokensRunner {
 public:
  virtual ~DeviceTokensRunner() = default;
  // nullopt when `tier` can run inside a CUDA graph conditional body with this communicator; else why not.
  virtual std::optional<std::string> device_tokens_limit(TailTier tier) const = 0;
  virtual bool capturing(StreamHandle stream) const = 0;
  // T as *tokens_device holds it once the stream's earlier work is done (waits for the stream).
  virtual std::int64_t read_device_tokens(const std::int32_t* tokens_device, StreamHandle stream) = 0;
  // Runs the GEMMs of every bucket once, outside any collective (every rank at the same call).
  virtual void warm_up_buckets(const std::vector<DeviceTokenBucket>& buckets, StreamHandle stream) = 0;
  // Bucket `tier` on the views' rows (the bucket's max_tokens); the fused tier reads T from tokens_device.
  virtual void run_bucket(TailTier tier, ConstMatrixView routed, MatrixView shared, MatrixView out,
                          const std::int32_t* tokens_device, StreamHandle stream) = 0;
  // Under capture on `stream`: the selector and one body per bucket (views of max_tokens rows).
  virtual void capture_buckets(const std::vector<DeviceTokenBucket>& buckets, ConstMatrixView routed,
                               MatrixView shared, MatrixView out, const std::int32_t* tokens_device,
                               StreamHandle stream) = 0;
  // What a replay could not run since the last call (and clears the record): the last such T, and
  // whether it was outside [0, max_tokens] (else it fell in a bucket no tier runs).
  struct Failure {
    bool out_of_range = false;
    std::int64_t tokens = 0;
  };
  virtual std::optional<Failure> take_device_tokens_failure() = 0;
};

// Copies the weights to the current device. `comm` must be a device communicator. max_tokens > 0:
// every workspace is allocated now, for that many tokens, so forwards can be captured in CUDA graphs
// (when the communicator's collectives can be); 0: workspaces grow on demand. latent_norm false:
// N = round(Σ_r routed_r), no RMSNorm (norm_weight unused).
std::unique_ptr<TailExecutor> make_cuda_tail_executor(Communicator& comm, TailDims dims, DType dtype,
                                                      bool latent_norm, float eps, ConstMatrixView norm_weight,
                                                      ConstMatrixView up_proj_weight, std::int64_t max_tokens);

}  // namespace lmoe
