// The CUDA executor of the tail tiers, and what LatentTail asks the CUDA backend before building
// it.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "core/tail_executor.hpp"
#include "lmoe/communicator.hpp"
#include "lmoe/tail_options.hpp"

namespace lmoe {

// GPUs visible to this process; 0 when there is no driver or no GPU. Never throws.
int cuda_device_count();

// nullopt when the CUDA backend can run `tier` for `problem`; otherwise why not.
std::optional<std::string> cuda_tier_limit(TailTier tier, const TailProblem& problem);

// Copies the weights to the current device. `comm` must be a device communicator. max_tokens > 0:
// every workspace is allocated now, for that many tokens, so forwards can be captured in CUDA
// graphs (when the communicator's collectives can be); 0: workspaces grow on demand. latent_norm
// false: N = round(Σ_r routed_r), no RMSNorm (norm_weight unused).
std::unique_ptr<TailExecutor> make_cuda_tail_executor(Communicator& comm, TailDims dims,
                                                      DType dtype, bool latent_norm, float eps,
                                                      ConstMatrixView norm_weight,
                                                      ConstMatrixView up_proj_weight,
                                                      std::int64_t max_tokens);

}  // namespace lmoe
