// The CUDA executor of the layer's stages before the tail: the same dataflow and formulas as the
// CPU executor (src/cpu/cpu_layer_executor.cpp), on the current GPU. docs/layer.md describes it.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "core/layer_executor.hpp"

namespace lmoe {

// Why the CUDA executor cannot run `config` (nullopt when it can). The tail's own limits
// (cuda_tier_limit) are checked by LatentTail.
std::optional<std::string> cuda_layer_limit(const LayerConfig& config);

// `weights` are validated by the caller; they are copied to the current device, here. Forwards
// read the routing on the host (to size the experts' GEMMs), so they cannot be captured in a CUDA
// graph: a forward on a capturing stream is refused with an lmoe::Error.
std::unique_ptr<LayerExecutor> make_cuda_layer_executor(const LayerConfig& config, DType dtype,
                                                        int tp, const LayerWeights& weights);

}  // namespace lmoe
