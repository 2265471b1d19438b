// Model dimensions of the latent MoE tail and the named presets (`--preset NAME`).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "lmoe/dtype.hpp"

namespace lmoe {

struct TailDims {
  std::int64_t d_model = 0;   // d: hidden size
  std::int64_t d_latent = 0;  // l: latent size the routed experts work in
};

struct ModelPreset {
  std::string name;         // "kimi-k3"
  std::string description;  // one line for `--help` and tables
  TailDims dims;
  float rms_norm_eps = 1e-5f;
  DType dtype = DType::bf16;
};

// Every preset the models under src/models/ define, in a stable order.
const std::vector<ModelPreset>& model_presets();
// Throws lmoe::Error naming the known presets when `name` is unknown.
const ModelPreset& find_preset(std::string_view name);

}  // namespace lmoe
