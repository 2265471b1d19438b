// Reference math: the numerics contract computed from all ranks' inputs in one place, the same
// math in fp64, and the comparison every backend and tier is judged by (docs/numerics.md).
#pragma once

#include <cstdint>
#include <vector>

#include "lmoe/dims.hpp"
#include "lmoe/tensor.hpp"
#include "lmoe/tier.hpp"

namespace lmoe {

// All ranks' inputs of one tail call, in host memory and one storage dtype.
struct TailCase {
  TailDims dims;
  float eps = 1e-5f;
  bool latent_norm = true;  // false: N = round(Σ routed_r), no RMSNorm (TailOptions::latent_norm)
  DType dtype = DType::bf16;
  int tp = 1;
  std::int64_t num_tokens = 0;
  HostTensor routed;          // [tp, T, l]
  HostTensor shared;          // [tp, T, d]
  HostTensor norm_weight;     // [l]
  HostTensor up_proj_weight;  // [d, l]
};

// Fresh random inputs (fixed by `seed`) at realistic scales: routed and shared partials ~ N(0, 1),
// gamma ~ 1 + N(0, 0.1), w_up ~ N(0, 1/l) so that the up-projection is O(1).
TailCase make_random_case(TailDims dims, float eps, DType dtype, int tp, std::int64_t num_tokens,
                          std::uint64_t seed);
// Inputs whose every intermediate is exact in fp32 in any summation order (eps = 0, the reduced
// latent is ±2 everywhere, integer gamma and weights): every correct implementation of a
// contract must match its reference bit for bit.
TailCase make_exact_case(TailDims dims, DType dtype, int tp, std::int64_t num_tokens,
                         std::uint64_t seed);

// The two contracts of DESIGN.md §3: fused, overlap and token share the first; column has its own.
enum class Contract : std::uint8_t { reduce_then_add, column };
Contract contract_of(TailTier tier);

// How the implementation under test sums across ranks (docs/numerics.md).
enum class ReductionOrder : std::uint8_t {
  // The contract's rank sum: fp32 in rank order, rounded once (threads, mpi, cuda-threads).
  rank_order,
  // Any order, each partial sum rounded to the storage dtype (NCCL): the bound widens by what tp −
  // 1
  // such roundings of the latent and of `shared` can change, carried through the norm and the GEMM.
  unspecified,
};

struct ContractReference {
  HostTensor y;               // [T, d]: the contract's result (the CPU's fp32 GEMM order)
  std::vector<double> bound;  // [T, d]: the largest difference a correct implementation may show
};
ContractReference reference_tail(const TailCase& c, Contract contract,
                                 ReductionOrder reductions = ReductionOrder::rank_order);

// Y in fp64 from the same storage-dtype inputs, with no intermediate rounding: [T, d].
std::vector<double> exact_tail(const TailCase& c);

struct Comparison {
  std::int64_t elements = 0;
  std::int64_t bit_mismatches = 0;  // elements whose bits differ from the reference
  std::int64_t beyond_bound = 0;  // elements farther from the reference than its bound (NaN counts)
  double max_error_over_bound = 0;  // max |y − ref| / bound (0 when bitwise equal)
  double normwise_error = 0;        // ‖y − exact‖ / ‖exact‖ against fp64 math
  double normwise_tolerance = 0;    // fp64_tolerance(dtype)
  bool ok() const { return beyond_bound == 0 && normwise_error <= normwise_tolerance; }
};

// Normwise tolerance against fp64 math: 1e-2 for bf16, 2e-3 for f16, 1e-4 for f32.
double fp64_tolerance(DType dtype);

Comparison compare(ConstMatrixView y, const ContractReference& reference,
                   const std::vector<double>& exact);

}  // namespace lmoe
