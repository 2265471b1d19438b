// The up-projection GEMM through cuBLASLt: D[M, N] (row-major, row stride ldd) = A[M, K] · W[N,
// K]ᵀ, storage-dtype operands, fp32 accumulation, D in the storage dtype (rounded once) or in fp32.
//
// No beta = 1 epilogue: cuBLASLt's D = A·Wᵀ + C with bf16 or f16 C does not equal
// round(fp32 acc + C) — outside the contract's bound, and bits differ on exact inputs — so the
// column tier takes fp32 D and adds it itself (docs/numerics.md).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <compare>
#include <cstdint>
#include <map>
#include <memory>

#include "lmoe/dtype.hpp"

namespace lmoe::cuda {

class CublasLtGemm {
 public:
  // One handle and one workspace per executor (a rank's calls are ordered on its streams). Not
  // thread-safe: one object per rank thread.
  explicit CublasLtGemm(std::size_t workspace_bytes = std::size_t{32} << 20);
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // a: [m, k] contiguous and w: [n, k] with row stride ldw, both in `dtype`; d: [m, n] with row
  // stride ldd in `out_dtype` (dtype, or f32 for the unrounded accumulator). The first call of a
  // shape builds its descriptors and asks the heuristic; later calls of that shape (and pointer
  // alignments) only enqueue the matmul, so they cost little host time and are graph-capturable.
  void run(const void* a, const void* w, std::int64_t ldw, void* d, std::int64_t ldd,
           std::int64_t m, std::int64_t n, std::int64_t k, DType dtype, DType out_dtype,
           cudaStream_t stream);

  // How many (shape, alignment) plans are cached.
  std::size_t cached_plans() const;

 private:
  // What the heuristic's choice depends on: the shape, the dtypes and the operands' alignments.
  struct PlanKey {
    std::int64_t m, n, k, ldw, ldd;
    DType dtype, out_dtype;
    std::uint32_t align_w, align_a, align_d;
    auto operator<=>(const PlanKey&) const = default;
  };
  struct Plan;  // descriptors, layouts and the chosen algorithm (cublaslt_gemm.cpp)
  const Plan& plan_for(const PlanKey& key);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
};

}  // namespace lmoe::cuda
