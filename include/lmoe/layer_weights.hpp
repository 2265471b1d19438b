// The weights of one latent MoE layer as one rank holds them: the router, the latent down- and
// up-projection and the norm replicated; every routed expert's and the shared experts'
// intermediate dimension sliced over the tp ranks (rank r holds rows [r·I/tp, (r+1)·I/tp) of the
// gate and up projections and the same columns of the down projection).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "lmoe/dims.hpp"
#include "lmoe/tensor.hpp"

namespace lmoe {

struct LayerWeights {
  HostTensor router_weight;  // [E, d] f32
  HostTensor router_bias;    // [E] f32; empty (shape []) when the router has no correction bias
  HostTensor latent_down;    // [l, d]
  HostTensor expert_gate;    // [E, I/tp, l]; empty for a non-gated activation
  HostTensor expert_up;      // [E, I/tp, l]
  HostTensor expert_down;    // [E, l, I/tp]
  HostTensor shared_gate;    // [S/tp, d]; empty for a non-gated activation (S = shared width)
  HostTensor shared_up;      // [S/tp, d]
  HostTensor shared_down;    // [d, S/tp]
  HostTensor latent_norm;    // [l] (gamma of the tail's RMSNorm)
  HostTensor latent_up;      // [d, l]
};

// Each tensor's name (the LayerWeights member), expected shape and dtype for rank `rank` of tp:
// f32 for the router, `dtype` for everything else.
struct WeightSlot {
  const char* name;
  HostTensor LayerWeights::*member;
  std::vector<std::int64_t> shape;  // empty: the tensor must be absent
  DType dtype;
};
std::vector<WeightSlot> layer_weight_slots(const LayerConfig& config, DType dtype, int tp);

// The first weight whose shape or dtype is not what layer_weight_slots says, as a message that
// names it and what was expected; nullopt when all match.
std::optional<std::string> validate_layer_weights(const LayerConfig& config, DType dtype, int tp,
                                                  const LayerWeights& weights);

// Random weights for benchmarks and tests, rank `rank` of tp. Every element's value depends only
// on `seed` and its index in the full (unsliced) tensor, so the slices of all ranks of a tp run
// are exactly the tp = 1 weights. Scales keep every stage O(1): projections ~ U(±sqrt(3/fan_in)),
// the correction bias ~ U(±0.05), gamma ~ 1 + U(±0.1).
LayerWeights make_random_layer_weights(const LayerConfig& config, DType dtype, int tp, int rank,
                                       std::uint64_t seed);

// A random layer input x [T, d] ~ U(±sqrt(3)) (unit variance), stored in `dtype`.
HostTensor make_random_layer_input(std::int64_t d_model, std::int64_t num_tokens, DType dtype,
                                   std::uint64_t seed);

// Loads layer `layer` of the checkpoint in directory `dir` by the model's tensor names (its
// *.safetensors files, found through model.safetensors.index.json when there is one), converted
// to `dtype` (f32 for the router and its bias) and sliced for rank `rank` of tp. Dense weights may
// be BF16, F16 or F32; with names.experts_mxfp4 the routed experts are MXFP4 blocks, dequantized
// exactly (e2m1 value · 2^(scale − 127)) before the conversion to `dtype`. Only the bytes this rank
// needs are read where they are contiguous (row slices). Throws lmoe::Error naming the tensor
// when one is missing or has the wrong shape or dtype.
LayerWeights load_layer_weights(const std::string& dir, const LayerTensorNames& names, int layer,
                                const LayerConfig& config, DType dtype, int tp, int rank);

// The value of one MXFP4 element: `nibble` (the low 4 bits: sign, 2 exponent bits, 1 mantissa
// bit; e2m1) scaled by the E8M0 `scale` byte (2^(scale − 127); 255 is NaN).
float mxfp4_value(std::uint8_t nibble, std::uint8_t scale);

}  // namespace lmoe
