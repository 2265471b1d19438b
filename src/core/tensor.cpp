#include "lmoe/tensor.hpp"

#include <algorithm>
#include <limits>

#include "lmoe/error.hpp"

namespace lmoe {

std::string shape_string(std::span<const std::int64_t> shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

HostTensor::HostTensor(DType dtype, std::vector<std::int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)) {
  std::size_t count = 1;
  for (std::int64_t extent : shape_) {
    LMOE_CHECK(extent >= 0,
               "tensor shape " + lmoe::shape_string(shape_) + " has a negative extent");
    const auto uextent = static_cast<std::size_t>(extent);
    LMOE_CHECK(uextent == 0 || count <= std::numeric_limits<std::size_t>::max() / uextent / 4,
               "tensor shape " + lmoe::shape_string(shape_) + " is too large");
    count *= uextent;
  }
  bytes_.resize(count * dtype_size(dtype));
}

std::int64_t HostTensor::numel() const {
  return static_cast<std::int64_t>(bytes_.size() / dtype_size(dtype_));
}

void HostTensor::fill_bytes(std::byte pattern) { std::fill(bytes_.begin(), bytes_.end(), pattern); }

bool same_bits(const HostTensor& a, const HostTensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::ranges::equal(a.bytes(), b.bytes());
}

std::string HostTensor::shape_string() const { return lmoe::shape_string(shape_); }

MatrixView HostTensor::matrix() {
  const std::int64_t cols = shape_.empty() ? 1 : shape_.back();
  const std::int64_t rows = cols == 0 ? 0 : numel() / cols;
  return {data(), dtype_, rows, cols, cols, MemorySpace::host};
}

ConstMatrixView HostTensor::matrix() const {
  auto view = const_cast<HostTensor*>(this)->matrix();
  return as_const(view);
}

MatrixView HostTensor::slice_matrix(std::int64_t index) {
  LMOE_CHECK(shape_.size() >= 2, "slice_matrix needs a tensor of rank >= 2, got " + shape_string());
  LMOE_CHECK(index >= 0 && index < shape_[0],
             "slice " + std::to_string(index) + " is outside " + shape_string());
  const std::int64_t cols = shape_.back();
  std::int64_t rows = 1;
  for (std::size_t i = 1; i + 1 < shape_.size(); ++i) rows *= shape_[i];
  const std::size_t slice_bytes = static_cast<std::size_t>(rows * cols) * dtype_size(dtype_);
  return {data() + static_cast<std::size_t>(index) * slice_bytes,
          dtype_,
          rows,
          cols,
          cols,
          MemorySpace::host};
}

ConstMatrixView HostTensor::slice_matrix(std::int64_t index) const {
  return as_const(const_cast<HostTensor*>(this)->slice_matrix(index));
}

}  // namespace lmoe
