#include "core/rank_order_reduce.hpp"

#include <cstdint>
#include <cstring>
#include <string>

#include "lmoe/error.hpp"

namespace lmoe {

namespace {

template <typename Load, typename Store>
void reduce_with(std::span<const void* const> inputs, void* out, std::size_t count, Load load,
                 Store store) {
  constexpr std::size_t kBlock = 1024;  // accumulate a block in fp32 to stay in cache
  float acc[kBlock];
  for (std::size_t begin = 0; begin < count; begin += kBlock) {
    const std::size_t n = std::min(kBlock, count - begin);
    for (std::size_t i = 0; i < n; ++i) acc[i] = load(inputs[0], begin + i);
    for (std::size_t r = 1; r < inputs.size(); ++r) {
      for (std::size_t i = 0; i < n; ++i) acc[i] += load(inputs[r], begin + i);
    }
    for (std::size_t i = 0; i < n; ++i) store(out, begin + i, acc[i]);
  }
}

}  // namespace

void reduce_in_rank_order(std::span<const void* const> inputs, void* out, std::size_t count,
                          DType dtype) {
  if (inputs.empty() || count == 0) return;
  switch (dtype) {
    case DType::f32:
      reduce_with(
          inputs, out, count,
          [](const void* p, std::size_t i) { return static_cast<const float*>(p)[i]; },
          [](void* p, std::size_t i, float v) { static_cast<float*>(p)[i] = v; });
      return;
    case DType::bf16:
      reduce_with(
          inputs, out, count,
          [](const void* p, std::size_t i) {
            return bf16_bits_to_float(static_cast<const std::uint16_t*>(p)[i]);
          },
          [](void* p, std::size_t i, float v) {
            static_cast<std::uint16_t*>(p)[i] = float_to_bf16_bits(v);
          });
      return;
    case DType::f16:
      reduce_with(
          inputs, out, count,
          [](const void* p, std::size_t i) {
            return f16_bits_to_float(static_cast<const std::uint16_t*>(p)[i]);
          },
          [](void* p, std::size_t i, float v) {
            static_cast<std::uint16_t*>(p)[i] = float_to_f16_bits(v);
          });
      return;
  }
}

std::vector<std::size_t> even_split_offsets(std::size_t count, int parts) {
  LMOE_CHECK(parts >= 1, "even_split_offsets: parts must be >= 1, got " + std::to_string(parts));
  std::vector<std::size_t> offsets(static_cast<std::size_t>(parts) + 1, 0);
  const std::size_t base = count / static_cast<std::size_t>(parts);
  const std::size_t extra = count % static_cast<std::size_t>(parts);
  for (std::size_t p = 0; p < static_cast<std::size_t>(parts); ++p) {
    offsets[p + 1] = offsets[p] + base + (p < extra ? 1 : 0);
  }
  return offsets;
}

}  // namespace lmoe
