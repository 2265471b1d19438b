// The CPU executor of the layer's stages before the tail (OpenBLAS GEMMs), following the layer's
// numerics contract (docs/numerics.md, "The layer").
#pragma once

#include <memory>

#include "core/layer_executor.hpp"

namespace lmoe {

// `weights` are validated by the caller; dense ones are converted to fp32 once, here, and packed
// MXFP4 experts are kept packed and dequantized one expert at a time when a token needs it.
std::unique_ptr<LayerExecutor> make_cpu_layer_executor(const LayerConfig& config, DType dtype,
                                                       int tp, const LayerWeights& weights);

}  // namespace lmoe
