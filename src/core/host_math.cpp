#include "core/host_math.hpp"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "lmoe/error.hpp"

namespace lmoe::cpu {

void set_blas_threads(int num_threads) {
  openblas_set_num_threads(num_threads < 1 ? 1 : num_threads);
}

std::vector<float> to_float(ConstMatrixView matrix) {
  std::vector<float> values(static_cast<std::size_t>(matrix.rows * matrix.cols));
  for (std::int64_t row = 0; row < matrix.rows; ++row) {
    for (std::int64_t col = 0; col < matrix.cols; ++col) {
      values[static_cast<std::size_t>(row * matrix.cols + col)] =
          load_as_float(matrix.data, matrix.offset(row, col), matrix.dtype);
    }
  }
  return values;
}

float rms_norm_sum_of_squares(std::span<const float> squares) {
  std::array<float, kRmsNormLanes> lane_sums{};  // +0: a sum of squares is never −0
  const std::int64_t cols = static_cast<std::int64_t>(squares.size());
  for (std::int64_t chunk = 0; chunk * kRmsNormChunk < cols; ++chunk) {
    const std::int64_t begin = chunk * kRmsNormChunk;
    const std::int64_t end = std::min<std::int64_t>(begin + kRmsNormChunk, cols);
    float& lane_sum = lane_sums[static_cast<std::size_t>(chunk % kRmsNormLanes)];
    for (std::int64_t j = begin; j < end; ++j) lane_sum += squares[static_cast<std::size_t>(j)];
  }
  for (int half = kRmsNormLanes / 2; half >= 1; half /= 2) {
    for (int i = 0; i < half; ++i) lane_sums[i] += lane_sums[i + half];
  }
  return lane_sums[0];
}

void rms_norm(ConstMatrixView x, std::span<const float> gamma, float eps, MatrixView out) {
  LMOE_CHECK(
      static_cast<std::int64_t>(gamma.size()) == x.cols && out.cols == x.cols && out.rows == x.rows,
      "rms_norm: shape mismatch");
  const std::size_t cols = static_cast<std::size_t>(x.cols);
  std::vector<float> row(cols), squares(cols);
  for (std::int64_t t = 0; t < x.rows; ++t) {
    for (std::size_t j = 0; j < cols; ++j) {
      row[j] = load_as_float(x.data, x.offset(t, static_cast<std::int64_t>(j)), x.dtype);
    }
    // The squares go through memory before they are added: the contract rounds each product, and a
    // compiler allowed to contract (GCC's default for C++ where the target has FMA) could otherwise
    // fuse x·x + s into one FMA.
    for (std::size_t j = 0; j < cols; ++j) squares[j] = row[j] * row[j];
    const float sum_squares = rms_norm_sum_of_squares(squares);
    const float rstd = 1.0f / std::sqrt(sum_squares / static_cast<float>(x.cols) + eps);
    for (std::size_t j = 0; j < cols; ++j) {
      store_from_float(out.data, out.offset(t, static_cast<std::int64_t>(j)), out.dtype,
                       (row[j] * rstd) * gamma[j]);
    }
  }
}

void sgemm_nt(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, const float* w,
              float* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // BLAS may leave C untouched when there is nothing to sum; the sum is +0
    std::fill(c, c + m * n, 0.0f);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), 1.0f, a, static_cast<int>(k), w, static_cast<int>(k), 0.0f, c,
              static_cast<int>(n));
}

std::vector<float> gemm_fp32(ConstMatrixView a, const float* w, std::int64_t n) {
  std::vector<float> acc(static_cast<std::size_t>(a.rows * n));
  if (acc.empty()) return acc;
  const std::vector<float> a32 = to_float(a);
  sgemm_nt(a.rows, n, a.cols, a32.data(), w, acc.data());
  return acc;
}

void up_project(ConstMatrixView a, const float* w, std::int64_t n, MatrixView out,
                bool accumulate) {
  LMOE_CHECK(out.rows == a.rows && out.cols == n, "up_project: shape mismatch");
  const std::vector<float> acc = gemm_fp32(a, w, n);
  for (std::int64_t t = 0; t < a.rows; ++t) {
    for (std::int64_t j = 0; j < n; ++j) {
      float value = acc[static_cast<std::size_t>(t * n + j)];
      if (accumulate) value = load_as_float(out.data, out.offset(t, j), out.dtype) + value;
      store_from_float(out.data, out.offset(t, j), out.dtype, value);
    }
  }
}

void add(ConstMatrixView a, ConstMatrixView b, MatrixView out) {
  LMOE_CHECK(a.rows == b.rows && a.cols == b.cols && out.rows == a.rows && out.cols == a.cols,
             "add: shape mismatch");
  for (std::int64_t t = 0; t < a.rows; ++t) {
    for (std::int64_t j = 0; j < a.cols; ++j) {
      const float sum = load_as_float(a.data, a.offset(t, j), a.dtype) +
                        load_as_float(b.data, b.offset(t, j), b.dtype);
      store_from_float(out.data, out.offset(t, j), out.dtype, sum);
    }
  }
}

void copy(ConstMatrixView src, MatrixView dst) {
  LMOE_CHECK(src.rows == dst.rows && src.cols == dst.cols && src.dtype == dst.dtype,
             "copy: shape mismatch");
  const std::size_t row_bytes = static_cast<std::size_t>(src.cols) * src.element_size();
  for (std::int64_t t = 0; t < src.rows; ++t)
    std::memcpy(dst.row_ptr(t), src.row_ptr(t), row_bytes);
}

}  // namespace lmoe::cpu
