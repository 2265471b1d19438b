#include "lmoe/layer_weights.hpp"

#include <cmath>

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

}  // namespace

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
  for (const WeightSlot& slot : layer_weight_slots(config, dtype, tp)) {
    const HostTensor& tensor = weights.*slot.member;
    const bool absent = tensor.shape().empty() && slot.shape.empty();
    if (absent) continue;
    if (tensor.shape() != slot.shape || tensor.dtype() != slot.dtype) {
      const std::string expected =
          slot.shape.empty() ? std::string("absent")
                             : shape_string(slot.shape) + " " + std::string(dtype_name(slot.dtype));
      const std::string got = tensor.shape().empty() ? std::string("absent")
                                                     : tensor.shape_string() + " " +
                                                           std::string(dtype_name(tensor.dtype()));
      return std::string("layer weight ") + slot.name + ": expected " + expected + " (tp " +
             std::to_string(tp) + "), got " + got;
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
