// Tensor views (non-owning, 2-D, row-major with a row stride) and an owning host tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "lmoe/dtype.hpp"

namespace lmoe {

enum class MemorySpace : std::uint8_t { host, device };

// An opaque stream handle (cudaStream_t on CUDA backends); host code ignores it.
using StreamHandle = void*;

// A row-major matrix [rows, cols] whose rows start `ld` elements apart (ld >= cols).
// Strided views let a rank address its column stripe of a [T, d] tensor without a copy.
template <typename Pointer>
struct BasicMatrixView {
  Pointer data = nullptr;
  DType dtype = DType::f32;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t ld = 0;
  MemorySpace space = MemorySpace::host;

  // A mutable view converts to a read-only one.
  operator BasicMatrixView<const void*>() const
      requires(!std::is_const_v<std::remove_pointer_t<Pointer>>) {
    return {data, dtype, rows, cols, ld, space};
  }

  std::size_t element_size() const { return dtype_size(dtype); }
  bool contiguous() const { return ld == cols || rows <= 1; }
  // Element offset of (row, col).
  std::size_t offset(std::int64_t row, std::int64_t col) const {
    return static_cast<std::size_t>(row * ld + col);
  }
  Pointer row_ptr(std::int64_t row) const {
    using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Pointer>>,
                                    const std::byte, std::byte>;
    return static_cast<Byte*>(data) + static_cast<std::size_t>(row * ld) * element_size();
  }
  // Rows [first, first + count).
  BasicMatrixView row_block(std::int64_t first, std::int64_t count) const {
    BasicMatrixView block = *this;
    block.data = row_ptr(first);
    block.rows = count;
    return block;
  }
  // Columns [first, first + count), same rows, same ld.
  BasicMatrixView col_block(std::int64_t first, std::int64_t count) const {
    using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Pointer>>,
                                    const std::byte, std::byte>;
    BasicMatrixView block = *this;
    block.data = static_cast<Byte*>(data) + static_cast<std::size_t>(first) * element_size();
    block.cols = count;
    return block;
  }
};

using MatrixView = BasicMatrixView<void*>;
using ConstMatrixView = BasicMatrixView<const void*>;

inline ConstMatrixView as_const(const MatrixView& view) {
  return {view.data, view.dtype, view.rows, view.cols, view.ld, view.space};
}

// An owning host tensor of any rank, bytes in row-major order.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<std::int64_t> shape);

  DType dtype() const { return dtype_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t numel() const;
  std::size_t nbytes() const { return bytes_.size(); }
  std::byte* data() { return bytes_.data(); }
  const std::byte* data() const { return bytes_.data(); }
  std::span<std::byte> bytes() { return bytes_; }
  std::span<const std::byte> bytes() const { return bytes_; }

  float get(std::int64_t index) const {
    return load_as_float(data(), static_cast<std::size_t>(index), dtype_);
  }
  void set(std::int64_t index, float value) {
    store_from_float(data(), static_cast<std::size_t>(index), dtype_, value);
  }
  // Fills every byte with `pattern` (poisoning outputs before a run).
  void fill_bytes(std::byte pattern);

  // The tensor as a matrix [prod(shape[:-1]), shape[-1]]; a 1-D tensor is one row.
  MatrixView matrix();
  ConstMatrixView matrix() const;
  // Slice `index` of the first dimension, as a matrix of the remaining dims.
  MatrixView slice_matrix(std::int64_t index);
  ConstMatrixView slice_matrix(std::int64_t index) const;

  std::string shape_string() const;

 private:
  DType dtype_ = DType::f32;
  std::vector<std::int64_t> shape_;
  std::vector<std::byte> bytes_;
};

std::string shape_string(std::span<const std::int64_t> shape);

// True when a and b have the same dtype, shape and bytes (what "ranks agree bit for bit" means;
// empty tensors compare equal without touching their null data).
bool same_bits(const HostTensor& a, const HostTensor& b);

}  // namespace lmoe
