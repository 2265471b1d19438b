#include "cuda/gemm/cublaslt_gemm.hpp"

#include <memory>
#include <string>

#include "cuda/runtime/cuda_check.hpp"

namespace lmoe::cuda {

namespace {

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return CUDA_R_32F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
  }
  return CUDA_R_32F;
}

// The largest power of two (≤ 256) that divides the address: what cuBLASLt may assume.
std::uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* p) const { cublasLtMatmulDescDestroy(p); }
  void operator()(cublasLtMatrixLayoutOpaque_t* p) const { cublasLtMatrixLayoutDestroy(p); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, DescDeleter>;

Layout make_layout(cudaDataType_t type, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  LMOE_CUDA_CHECK(cublasLtMatrixLayoutCreate(&layout, type, static_cast<std::uint64_t>(rows),
                                             static_cast<std::uint64_t>(cols), ld));
  return Layout(layout);
}

}  // namespace

CublasLtGemm::CublasLtGemm(std::size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  LMOE_CUDA_CHECK(cublasLtCreate(&handle_));
  if (const cudaError_t status = cudaMalloc(&workspace_, workspace_bytes_); status != cudaSuccess) {
    cublasLtDestroy(handle_);
    check(status, "cudaMalloc(gemm workspace)");
  }
}

CublasLtGemm::~CublasLtGemm() {
  cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

// Everything one shape needs to enqueue its matmul: built once, reused by every later call.
struct CublasLtGemm::Plan {
  MatmulDesc desc;
  Layout w_layout, a_layout, d_layout;
  cublasLtMatmulAlgo_t algo{};
};

// A serving process sees one T per batch size; past this many shapes the cache starts over rather
// than grow without bound (a rebuilt plan costs one heuristic query).
constexpr std::size_t kMaxCachedPlans = 512;

const CublasLtGemm::Plan& CublasLtGemm::plan_for(const PlanKey& key) {
  if (const auto found = plans_.find(key); found != plans_.end()) return *found->second;
  if (plans_.size() >= kMaxCachedPlans) plans_.clear();

  auto plan = std::make_unique<Plan>();
  // Row-major D[m, n] is column-major Dᵀ[n, m] = W · Aᵀ: W (column-major [k, n], ld ldw)
  // transposed, A (column-major [k, m], ld k) as is — the "TN" layout cuBLASLt serves best.
  const cudaDataType_t type = cuda_type(key.dtype);
  cublasLtMatmulDesc_t raw_desc = nullptr;
  // CUBLAS_COMPUTE_32F, not its TF32 variant: operands are converted exactly and products are
  // accumulated in full fp32, as the contract requires.
  LMOE_CUDA_CHECK(cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  plan->desc = MatmulDesc(raw_desc);
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  LMOE_CUDA_CHECK(cublasLtMatmulDescSetAttribute(plan->desc.get(), CUBLASLT_MATMUL_DESC_TRANSA,
                                                 &transpose, sizeof(transpose)));
  LMOE_CUDA_CHECK(cublasLtMatmulDescSetAttribute(plan->desc.get(), CUBLASLT_MATMUL_DESC_TRANSB,
                                                 &keep, sizeof(keep)));

  plan->w_layout = make_layout(type, key.k, key.n, key.ldw);
  plan->a_layout = make_layout(type, key.k, key.m, key.k);
  plan->d_layout = make_layout(cuda_type(key.out_dtype), key.n, key.m, key.ldd);

  cublasLtMatmulPreference_t raw_pref = nullptr;
  LMOE_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref));
  Preference pref(raw_pref);
  LMOE_CUDA_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes_, sizeof(workspace_bytes_)));
  // A column stripe of shared starts at an arbitrary element: tell the heuristic the real alignment
  // (it assumes 256 bytes otherwise and may pick a kernel that faults on the stripe). The
  // alignments are part of the key, so a cached algorithm never meets a less aligned pointer than
  // it was chosen for.
  LMOE_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_w, sizeof(key.align_w)));
  LMOE_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_a, sizeof(key.align_a)));
  LMOE_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_d, sizeof(key.align_d)));
  LMOE_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_d, sizeof(key.align_d)));

  // Split-K partial sums must stay fp32: the in-place and output-type reduction schemes add parts
  // in the storage dtype (a bf16 rounding per part), which the contract forbids.
  const std::uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  LMOE_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.get(),
                                                       CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                       &reduction_mask, sizeof(reduction_mask)));

  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  LMOE_CUDA_CHECK(cublasLtMatmulAlgoGetHeuristic(
      handle_, plan->desc.get(), plan->w_layout.get(), plan->a_layout.get(), plan->d_layout.get(),
      plan->d_layout.get(), pref.get(), 1, &heuristic, &found));
  if (found == 0) {
    throw Error("cuBLASLt has no algorithm for the up-projection m=" + std::to_string(key.m) +
                " n=" + std::to_string(key.n) + " k=" + std::to_string(key.k) +
                " dtype=" + std::string(dtype_name(key.dtype)));
  }
  plan->algo = heuristic.algo;
  return *plans_.emplace(key, std::move(plan)).first->second;
}

std::size_t CublasLtGemm::cached_plans() const { return plans_.size(); }

void CublasLtGemm::run(const void* a, const void* w, std::int64_t ldw, void* d, std::int64_t ldd,
                       std::int64_t m, std::int64_t n, std::int64_t k, DType dtype, DType out_dtype,
                       cudaStream_t stream) {
  if (m == 0 || n == 0) return;
  const Plan& plan = plan_for(PlanKey{m, n, k, ldw, ldd, dtype, out_dtype, alignment_of(w),
                                      alignment_of(a), alignment_of(d)});
  const float alpha = 1.0f, beta = 0.0f;
  LMOE_CUDA_CHECK(cublasLtMatmul(handle_, plan.desc.get(), &alpha, w, plan.w_layout.get(), a,
                                 plan.a_layout.get(), &beta, d, plan.d_layout.get(), d,
                                 plan.d_layout.get(), &plan.algo, workspace_, workspace_bytes_,
                                 stream));
}

}  // namespace lmoe::cuda
