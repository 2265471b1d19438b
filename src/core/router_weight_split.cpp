#include "core/router_weight_split.hpp"

#include <bit>
#include <cmath>
#include <cstdint>

#include "lmoe/dtype.hpp"
#include "lmoe/error.hpp"

namespace lmoe {

namespace {

// x with the low 16 bits of its fp32 encoding cleared: a bf16 value of the same sign, never larger
// in magnitude (rounding to nearest could carry past the largest finite bf16 into infinity).
float truncated_to_bf16(float x) {
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(x) & 0xffff0000u);
}

}  // namespace

HostTensor split_router_weight_bf16(const HostTensor& weight) {
  LMOE_CHECK(weight.dtype() == DType::f32 && weight.shape().size() == 2,
             "router weight: expected a 2-D f32 tensor [E, d], got " +
                 std::string(dtype_name(weight.dtype())) + " " + weight.shape_string());
  const std::int64_t count = weight.numel();
  HostTensor parts(DType::bf16, {3 * weight.shape()[0], weight.shape()[1]});
  for (std::int64_t i = 0; i < count; ++i) {
    const float w = weight.get(i);
    const float high = std::isfinite(w) ? truncated_to_bf16(w) : w;
    const float rest = std::isfinite(w) ? w - high : 0.0f;  // exact: w's low 16 bits
    const float middle = truncated_to_bf16(rest);
    const float low = rest - middle;  // exact, and at most 8 significant bits: a bf16 value
    parts.set(i, high);
    parts.set(count + i, middle);
    parts.set(2 * count + i, low);
  }
  return parts;
}

}  // namespace lmoe
