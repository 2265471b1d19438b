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

// Why the routed experts cannot take the device path (sort and grouped GEMMs on the GPU, no host
// read: capturable in a CUDA graph) for `config` at `tp` in `dtype`, or nullopt when they can.
std::optional<std::string> cuda_device_experts_limit(const LayerConfig& config, DType dtype,
                                                     int tp);

// Set to 1, the environment variable LMOE_LAYER_DEVICE_EXPERTS makes eager forwards take the
// device path too (read when the executor is built); forwards on a capturing stream always do.
inline constexpr const char* kDeviceExpertsEnv = "LMOE_LAYER_DEVICE_EXPERTS";
// Set to 1: the shared experts run after the routed experts instead of beside them (on the side
// stream, joined as usual), so that every stage's time is its own and not shared with another's
// contention. For measuring stages (lmoe layer); a forward takes longer (docs/layer.md).
inline constexpr const char* kSerialStagesEnv = "LMOE_LAYER_SERIAL_STAGES";

// `weights` are validated by the caller; they are copied to the current device, here. Eager
// forwards read the routing on the host and launch one cuBLASLt GEMM per active expert (unless
// LMOE_LAYER_DEVICE_EXPERTS=1); forwards on a capturing stream take the device path, which needs
// workspaces for T tokens already there: max_tokens > 0 allocates them here, else an eager forward
// of at least T tokens must come first (a capture that would grow them is refused).
// device_experts: eager forwards take the device path too, as with LMOE_LAYER_DEVICE_EXPERTS=1.
std::unique_ptr<LayerExecutor> make_cuda_layer_executor(const LayerConfig& config, DType dtype,
                                                        int tp, const LayerWeights& weights,
                                                        std::int64_t max_tokens = 0,
                                                        bool device_experts = false);

}  // namespace lmoe
