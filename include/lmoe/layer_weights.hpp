// The weights of one latent MoE layer as one rank holds them: the router, the latent down- and
// up-projection and the norm replicated; every routed expert's and the shared experts'
// intermediate dimension sliced over the tp ranks (rank r holds rows [r·I/tp, (r+1)·I/tp) of the
// gate and up projections and the same columns of the down projection). MXFP4 routed experts may
// be kept packed, as the checkpoint ships them (docs/layer.md, "Packed experts").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "lmoe/dims.hpp"
#include "lmoe/tensor.hpp"

namespace lmoe {

// One MXFP4 weight of every routed expert, as the checkpoint ships it: logical shape [E, R, C]
// with C a multiple of 32. For expert e and row r, byte j of the row's blocks holds the e2m1 values
// of columns 2j (low nibble) and 2j + 1 (high nibble); each 32 columns share one E8M0 scale byte.
// A value is e2m1 · 2^(scale − 127), exact in bf16 and f32 (f16 rounds those below its range).
struct Mxfp4Tensor {
  std::vector<std::int64_t> shape;   // [E, R, C]; empty: absent
  std::vector<std::uint8_t> blocks;  // [E, R, C/2]
  std::vector<std::uint8_t> scales;  // [E, R, C/32]

  Mxfp4Tensor() = default;
  // Zeroed blocks and scales for `shape`; throws lmoe::Error unless it is [E, R, C], C % 32 == 0.
  explicit Mxfp4Tensor(std::vector<std::int64_t> shape);

  bool empty() const { return shape.empty(); }
  std::size_t nbytes() const { return blocks.size() + scales.size(); }
  // Expert `expert`'s matrix [R, C] as the fp32 values of `dtype` (each value rounded to it once,
  // as a dequantizing load stores it), into `out` [R·C].
  void dequantize_matrix(std::int64_t expert, DType dtype, float* out) const;
  // The whole weight [E, R, C] in `dtype`: bit for bit what loading it dequantized gives.
  HostTensor dequantize(DType dtype) const;
};

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
  // The routed experts kept as MXFP4 (load_layer_weights with keep_experts_packed): expert_gate,
  // expert_up and expert_down are then absent and these hold their values, with their shapes.
  Mxfp4Tensor expert_gate_mxfp4;  // [E, I/tp, l]; absent for a non-gated activation
  Mxfp4Tensor expert_up_mxfp4;    // [E, I/tp, l]
  Mxfp4Tensor expert_down_mxfp4;  // [E, l, I/tp]: this rank's 32-column blocks of every row

  bool experts_packed() const { return !expert_up_mxfp4.empty(); }
};

// A routed expert weight (`member`: &LayerWeights::expert_gate, expert_up or expert_down) as a
// dense tensor in `dtype`, for a backend without a packed path: the tensor held, or, when the
// experts are packed, the packed one dequantized into `scratch` (one weight at a time, so a caller
// that uploads each holds at most one dequantized copy).
const HostTensor& dense_expert_weight(const LayerWeights& weights, HostTensor LayerWeights::*member,
                                      DType dtype, HostTensor& scratch);
// Whether `member` is one of expert_gate, expert_up and expert_down.
bool is_routed_expert_weight(HostTensor LayerWeights::*member);
// The packed counterpart of `member` (expert_gate_mxfp4 for expert_gate, …).
const Mxfp4Tensor& packed_expert_weight(const LayerWeights& weights,
                                        HostTensor LayerWeights::*member);
Mxfp4Tensor& packed_expert_weight(LayerWeights& weights, HostTensor LayerWeights::*member);

// The bytes a rank's weights hold: the routed experts as held (packed or dense), what they take
// dequantized to the layer's dtype and as MXFP4 (blocks and scales), and everything else.
struct LayerWeightBytes {
  std::size_t routed_experts = 0;
  std::size_t routed_experts_dequantized = 0;
  std::size_t routed_experts_mxfp4 = 0;
  std::size_t other = 0;
  bool experts_packed = false;
  std::size_t total() const { return routed_experts + other; }
};
LayerWeightBytes layer_weight_bytes(const LayerWeights& weights, DType dtype);

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
// names it and what was expected; nullopt when all match. Packed experts must have the dense
// slots' shapes (and those slots be absent), with blocks and scales of the sizes the shape says.
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

struct LayerLoadOptions {
  // With names.experts_mxfp4: keep the routed experts' blocks and scales as they are
  // (LayerWeights::expert_*_mxfp4) instead of dequantizing them. Off by default: the dense form is
  // what every backend has a GEMM for; the cpu backend runs from packed experts (dequantizing an
  // expert on use) and the cuda backend keeps them packed on the GPU, its grouped GEMM dequantizing
  // them in its main loop (docs/layer.md). Dense experts (names.experts_mxfp4 false) load as
  // always.
  bool keep_experts_packed = false;
};

// Loads layer `layer` of the checkpoint in directory `dir` by the model's tensor names (its
// *.safetensors files, found through model.safetensors.index.json when there is one), converted
// to `dtype` (f32 for the router and its bias) and sliced for rank `rank` of tp. Dense weights may
// be BF16, F16 or F32; with names.experts_mxfp4 the routed experts are MXFP4 blocks, dequantized
// exactly (e2m1 value · 2^(scale − 127)) before the conversion to `dtype`, or kept packed (then
// each rank's slice of the intermediate dim, I/tp, must be a multiple of 32: down's slice is
// whole blocks of its rows). Either way a NaN scale (255) or a value beyond `dtype`'s range is
// refused, naming the tensor, row and block. Only the bytes this rank needs are read where they
// are contiguous (row slices). Throws lmoe::Error naming the tensor when one is missing or has
// the wrong shape or dtype.
LayerWeights load_layer_weights(const std::string& dir, const LayerTensorNames& names, int layer,
                                const LayerConfig& config, DType dtype, int tp, int rank,
                                const LayerLoadOptions& options = {});

// The value of one MXFP4 element: `nibble` (the low 4 bits: sign, 2 exponent bits, 1 mantissa
// bit; e2m1) scaled by the E8M0 `scale` byte (2^(scale − 127); 255 is NaN).
float mxfp4_value(std::uint8_t nibble, std::uint8_t scale);

}  // namespace lmoe
