#include "lmoe/dtype.hpp"

#include <string>

#include "lmoe/error.hpp"

namespace lmoe {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
  }
  throw Error("invalid DType value " + std::to_string(static_cast<int>(dtype)));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  throw Error("invalid DType value " + std::to_string(static_cast<int>(dtype)));
}

std::string_view safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "F32";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
  }
  throw Error("invalid DType value " + std::to_string(static_cast<int>(dtype)));
}

DType parse_dtype(std::string_view name) {
  if (name == "f32" || name == "F32" || name == "fp32" || name == "float32") return DType::f32;
  if (name == "f16" || name == "F16" || name == "fp16" || name == "float16") return DType::f16;
  if (name == "bf16" || name == "BF16" || name == "bfloat16") return DType::bf16;
  throw Error("unknown dtype '" + std::string(name) + "': expected bf16, f16 or f32");
}

}  // namespace lmoe
