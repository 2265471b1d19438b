#include "lmoe/layer_weights.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/fast_random.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

// Uniform in [-1, 1) from (seed, tensor, index): SplitMix64's index-th value of the stream
// seeded by seed and tensor, so any slice of a tensor can be filled without the rest.
float uniform_pm1(std::uint64_t stream, std::uint64_t index) {
  SplitMix64 generator{stream + index * 0x9e3779b97f4a7c15ull};
  return generator.uniform() * 2.0f - 1.0f;
}

std::uint64_t stream_of(std::uint64_t seed, std::uint64_t tensor) {
  SplitMix64 mixer{seed ^ (tensor * 0xd1b54a32d192ed03ull)};
  return mixer.next();
}

// Fills `tensor` (already shaped): element i gets center + amplitude · u(full_index(i)).
template <typename FullIndex>
void fill(HostTensor& tensor, std::uint64_t stream, float center, float amplitude,
          FullIndex full_index) {
  const std::int64_t count = tensor.numel();
  for (std::int64_t i = 0; i < count; ++i) {
    tensor.set(i, center + amplitude * uniform_pm1(stream, full_index(i)));
  }
}

float fan_in_amplitude(std::int64_t fan_in) { return std::sqrt(3.0f / static_cast<float>(fan_in)); }

std::string shape_and_dtype(const std::vector<std::int64_t>& shape, std::string_view dtype) {
  return shape.empty() ? std::string("absent") : shape_string(shape) + " " + std::string(dtype);
}

// Why a packed weight held in `slot` does not fit it (its shape, and its bytes for that shape).
std::optional<std::string> packed_mismatch(const WeightSlot& slot, const Mxfp4Tensor& packed) {
  if (packed.shape == slot.shape) {
    const std::int64_t count =
        packed.empty() ? 0 : packed.shape[0] * packed.shape[1] * packed.shape[2];
    if (packed.blocks.size() == static_cast<std::size_t>(count / 2) &&
        packed.scales.size() == static_cast<std::size_t>(count / 32))
      return std::nullopt;
    return "blocks of " + std::to_string(packed.blocks.size()) + " bytes and scales of " +
           std::to_string(packed.scales.size()) + ", expected " + std::to_string(count / 2) +
           " and " + std::to_string(count / 32);
  }
  return "expected " + shape_and_dtype(slot.shape, "MXFP4") + ", got " +
         shape_and_dtype(packed.shape, "MXFP4");
}

}  // namespace

Mxfp4Tensor::Mxfp4Tensor(std::vector<std::int64_t> shape_in) : shape(std::move(shape_in)) {
  LMOE_CHECK(
      shape.size() == 3 && shape[0] >= 0 && shape[1] >= 0 && shape[2] >= 0 && shape[2] % 32 == 0,
      "MXFP4 tensor: expected a shape [E, R, C] with C a multiple of 32, got " +
          shape_string(shape));
  const auto count = static_cast<std::size_t>(shape[0] * shape[1] * shape[2]);
  blocks.assign(count / 2, 0);
  scales.assign(count / 32, 0);
}

void Mxfp4Tensor::dequantize_matrix(std::int64_t expert, DType dtype, float* out) const {
  static constexpr float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const std::int64_t elements = shape[1] * shape[2];
  const std::uint8_t* block = blocks.data() + expert * elements / 2;
  const std::uint8_t* scale = scales.data() + expert * elements / 32;
  for (std::int64_t b = 0; b < elements / 32; ++b) {
    if (scale[b] == 0xff) {  // NaN, as mxfp4_value says (a load refuses it)
      std::fill_n(out + b * 32, 32, round_to(dtype, std::numeric_limits<float>::quiet_NaN()));
      continue;
    }
    // 2^(scale − 127) is exact in fp32, and so is its product with an e2m1 value (at most two
    // significant bits) unless it overflows: the value mxfp4_value gives, before rounding.
    const float factor = std::ldexp(1.0f, static_cast<int>(scale[b]) - 127);
    for (int j = 0; j < 16; ++j) {
      const std::uint8_t byte = block[b * 16 + j];
      out[b * 32 + 2 * j] = round_to(dtype, kE2m1[byte & 0x0fu] * factor);
      out[b * 32 + 2 * j + 1] = round_to(dtype, kE2m1[byte >> 4] * factor);
    }
  }
}

HostTensor Mxfp4Tensor::dequantize(DType dtype) const {
  if (empty()) return {};
  HostTensor dense(dtype, shape);
  std::vector<float> matrix(static_cast<std::size_t>(shape[1] * shape[2]));
  for (std::int64_t e = 0; e < shape[0]; ++e) {
    dequantize_matrix(e, dtype, matrix.data());
    const std::int64_t first = e * static_cast<std::int64_t>(matrix.size());
    for (std::size_t i = 0; i < matrix.size(); ++i)
      dense.set(first + static_cast<std::int64_t>(i), matrix[i]);
  }
  return dense;
}

bool is_routed_expert_weight(HostTensor LayerWeights::*member) {
  return member == &LayerWeights::expert_gate || member == &LayerWeights::expert_up ||
         member == &LayerWeights::expert_down;
}

Mxfp4Tensor& packed_expert_weight(LayerWeights& weights, HostTensor LayerWeights::*member) {
  if (member == &LayerWeights::expert_gate) return weights.expert_gate_mxfp4;
  if (member == &LayerWeights::expert_up) return weights.expert_up_mxfp4;
  LMOE_CHECK(member == &LayerWeights::expert_down,
             "packed_expert_weight: expected expert_gate, expert_up or expert_down");
  return weights.expert_down_mxfp4;
}

const Mxfp4Tensor& packed_expert_weight(const LayerWeights& weights,
                                        HostTensor LayerWeights::*member) {
  return packed_expert_weight(const_cast<LayerWeights&>(weights), member);
}

const HostTensor& dense_expert_weight(const LayerWeights& weights, HostTensor LayerWeights::*member,
                                      DType dtype, HostTensor& scratch) {
  const Mxfp4Tensor& packed = packed_expert_weight(weights, member);
  if (!weights.experts_packed()) return weights.*member;
  scratch = packed.dequantize(dtype);
  return scratch;
}

LayerWeightBytes layer_weight_bytes(const LayerWeights& weights, DType dtype) {
  LayerWeightBytes bytes;
  bytes.experts_packed = weights.experts_packed();
  for (HostTensor LayerWeights::*member :
       {&LayerWeights::router_weight, &LayerWeights::router_bias, &LayerWeights::latent_down,
        &LayerWeights::shared_gate, &LayerWeights::shared_up, &LayerWeights::shared_down,
        &LayerWeights::latent_norm, &LayerWeights::latent_up}) {
    bytes.other += (weights.*member).nbytes();
  }
  for (HostTensor LayerWeights::*member :
       {&LayerWeights::expert_gate, &LayerWeights::expert_up, &LayerWeights::expert_down}) {
    const Mxfp4Tensor& packed = packed_expert_weight(weights, member);
    const HostTensor& dense = weights.*member;
    bytes.routed_experts += dense.nbytes() + packed.nbytes();
    const auto values =
        static_cast<std::size_t>(packed.empty() ? dense.numel() : 2 * packed.blocks.size());
    bytes.routed_experts_dequantized += values * dtype_size(dtype);
    bytes.routed_experts_mxfp4 += values / 2 + values / 32;
  }
  return bytes;
}

std::vector<WeightSlot> layer_weight_slots(const LayerConfig& config, DType dtype, int tp) {
  const std::int64_t d = config.d_model, l = config.d_latent, experts = config.router.num_experts;
  const std::int64_t inter = config.expert_intermediate / tp;
  const std::int64_t shared = config.shared_width() / tp;
  const bool gated = is_gated(config.activation);
  using Shape = std::vector<std::int64_t>;
  return {
      {"router_weight", &LayerWeights::router_weight, {experts, d}, DType::f32},
      {"router_bias", &LayerWeights::router_bias,
       config.router.correction_bias ? Shape{experts} : Shape{}, DType::f32},
      {"latent_down", &LayerWeights::latent_down, {l, d}, dtype},
      {"expert_gate", &LayerWeights::expert_gate, gated ? Shape{experts, inter, l} : Shape{},
       dtype},
      {"expert_up", &LayerWeights::expert_up, {experts, inter, l}, dtype},
      {"expert_down", &LayerWeights::expert_down, {experts, l, inter}, dtype},
      {"shared_gate", &LayerWeights::shared_gate, gated ? Shape{shared, d} : Shape{}, dtype},
      {"shared_up", &LayerWeights::shared_up, {shared, d}, dtype},
      {"shared_down", &LayerWeights::shared_down, {d, shared}, dtype},
      {"latent_norm", &LayerWeights::latent_norm, {l}, dtype},
      {"latent_up", &LayerWeights::latent_up, {d, l}, dtype},
  };
}

std::optional<std::string> validate_layer_weights(const LayerConfig& config, DType dtype, int tp,
                                                  const LayerWeights& weights) {
  if (auto error = validate_layer_config(config, tp)) return error;
  const bool packed = weights.experts_packed();
  for (const WeightSlot& slot : layer_weight_slots(config, dtype, tp)) {
    const HostTensor& tensor = weights.*slot.member;
    const bool expert = is_routed_expert_weight(slot.member);
    if (expert) {
      const Mxfp4Tensor& mxfp4 = packed_expert_weight(weights, slot.member);
      if (!packed && !mxfp4.empty()) {
        return std::string("layer weight ") + slot.name +
               "_mxfp4: held without expert_up_mxfp4 (the routed experts are packed all three "
               "or none)";
      }
      if (packed) {
        if (!tensor.shape().empty()) {
          return std::string("layer weight ") + slot.name +
                 ": expected absent (the experts are "
                 "packed), got " +
                 shape_and_dtype(tensor.shape(), dtype_name(tensor.dtype()));
        }
        if (auto why = packed_mismatch(slot, mxfp4)) {
          return std::string("layer weight ") + slot.name + "_mxfp4: " + *why + " (tp " +
                 std::to_string(tp) + ")";
        }
        continue;
      }
    }
    const bool absent = tensor.shape().empty() && slot.shape.empty();
    if (absent) continue;
    if (tensor.shape() != slot.shape || tensor.dtype() != slot.dtype) {
      return std::string("layer weight ") + slot.name + ": expected " +
             shape_and_dtype(slot.shape, dtype_name(slot.dtype)) + " (tp " + std::to_string(tp) +
             "), got " + shape_and_dtype(tensor.shape(), dtype_name(tensor.dtype()));
    }
  }
  return std::nullopt;
}

LayerWeights make_random_layer_weights(const LayerConfig& config, DType dtype, int tp, int rank,
                                       std::uint64_t seed) {
  if (auto error = validate_layer_config(config, tp)) throw Error(*error);
  LMOE_CHECK(rank >= 0 && rank < tp,
             "rank: expected 0 … " + std::to_string(tp - 1) + ", got " + std::to_string(rank));
  LayerWeights weights;
  for (const WeightSlot& slot : layer_weight_slots(config, dtype, tp)) {
    if (!slot.shape.empty()) weights.*slot.member = HostTensor(slot.dtype, slot.shape);
  }
  const std::int64_t d = config.d_model, l = config.d_latent;
  const std::int64_t inter = config.expert_intermediate, inter_r = inter / tp;
  const std::int64_t shared = config.shared_width(), shared_r = shared / tp;
  const std::int64_t first_inter = rank * inter_r, first_shared = rank * shared_r;
  auto same = [](std::int64_t i) { return static_cast<std::uint64_t>(i); };

  fill(weights.router_weight, stream_of(seed, 1), 0.0f, fan_in_amplitude(d), same);
  if (config.router.correction_bias)
    fill(weights.router_bias, stream_of(seed, 2), 0.0f, 0.05f, same);
  fill(weights.latent_down, stream_of(seed, 3), 0.0f, fan_in_amplitude(d), same);

  // [E, I/tp, l] slice of [E, I, l]: rows first_inter … of every expert.
  auto row_slice = [&](std::int64_t i) {
    const std::int64_t col = i % l, row = (i / l) % inter_r, expert = i / (l * inter_r);
    return static_cast<std::uint64_t>((expert * inter + first_inter + row) * l + col);
  };
  if (is_gated(config.activation)) {
    fill(weights.expert_gate, stream_of(seed, 4), 0.0f, fan_in_amplitude(l), row_slice);
  }
  fill(weights.expert_up, stream_of(seed, 5), 0.0f, fan_in_amplitude(l), row_slice);
  // [E, l, I/tp] slice of [E, l, I]: columns first_inter … of every row.
  fill(weights.expert_down, stream_of(seed, 6), 0.0f, fan_in_amplitude(inter), [&](std::int64_t i) {
    const std::int64_t col = i % inter_r, row = i / inter_r;
    return static_cast<std::uint64_t>(row * inter + first_inter + col);
  });

  if (shared_r > 0) {
    // [S/tp, d] slice of [S, d]; [d, S/tp] slice of [d, S].
    auto shared_rows = [&](std::int64_t i) {
      return static_cast<std::uint64_t>(first_shared * d + i);
    };
    if (is_gated(config.activation)) {
      fill(weights.shared_gate, stream_of(seed, 7), 0.0f, fan_in_amplitude(d), shared_rows);
    }
    fill(weights.shared_up, stream_of(seed, 8), 0.0f, fan_in_amplitude(d), shared_rows);
    fill(weights.shared_down, stream_of(seed, 9), 0.0f, fan_in_amplitude(shared),
         [&](std::int64_t i) {
           const std::int64_t col = i % shared_r, row = i / shared_r;
           return static_cast<std::uint64_t>(row * shared + first_shared + col);
         });
  }
  fill(weights.latent_norm, stream_of(seed, 10), 1.0f, 0.1f, same);
  fill(weights.latent_up, stream_of(seed, 11), 0.0f, fan_in_amplitude(l), same);
  return weights;
}

HostTensor make_random_layer_input(std::int64_t d_model, std::int64_t num_tokens, DType dtype,
                                   std::uint64_t seed) {
  HostTensor x(dtype, {num_tokens, d_model});
  fill(x, stream_of(seed, 100), 0.0f, std::sqrt(3.0f),
       [](std::int64_t i) { return static_cast<std::uint64_t>(i); });
  return x;
}

}  // namespace lmoe
