// Host math of the tail, each function following the numerics contract (docs/numerics.md) exactly:
// fp32 compute, one rounding to the storage dtype per produced tensor. The CPU backend runs on it
// and the reference checks against it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/rms_norm_order.hpp"
#include "lmoe/tensor.hpp"

namespace lmoe::cpu {

// OpenBLAS threads used by each GEMM call (process-wide; ranks on threads want 1 each).
void set_blas_threads(int num_threads);

// Exact fp32 copy of a storage-dtype matrix, row-major and contiguous.
std::vector<float> to_float(ConstMatrixView matrix);

// Σ_j squares[j] in the RMSNorm's canonical order (core/rms_norm_order.hpp); squares[j] is the
// fp32-rounded product x_j · x_j.
float rms_norm_sum_of_squares(std::span<const float> squares);

// out[t, :] = round((x[t, :] · rstd_t) · gamma) with rstd_t = 1 / sqrt(Σ_j x[t, j]² / l + eps),
// the sum of squares accumulated in fp32 in the canonical order.
void rms_norm(ConstMatrixView x, std::span<const float> gamma, float eps, MatrixView out);

// c [m, n] = a [m, k] · w [n, k]ᵀ, all fp32 row-major and contiguous, accumulated in fp32 (BLAS
// order), not rounded.
void sgemm_nt(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, const float* w,
              float* c);

// a · wᵀ accumulated in fp32 and not rounded: [M, N] row-major.
std::vector<float> gemm_fp32(ConstMatrixView a, const float* w, std::int64_t n);

// acc = a · wᵀ in fp32 (a: [M, K] in its storage dtype, w: [N, K] fp32 row-major), then
// out = round(acc), or out = round(out + acc) when `accumulate` (a GEMM's beta = 1 epilogue: the
// accumulator is added to C unrounded). out may be a strided view (a column stripe).
void up_project(ConstMatrixView a, const float* w, std::int64_t n, MatrixView out, bool accumulate);

// out = round(a + b), elementwise in fp32.
void add(ConstMatrixView a, ConstMatrixView b, MatrixView out);

// dst = src (same dtype; views may be strided).
void copy(ConstMatrixView src, MatrixView dst);

}  // namespace lmoe::cpu
