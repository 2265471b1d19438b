// The CUDA layer's shared-experts stage: shared [T, d] = round(round(act(x · G_sᵀ, x · U_sᵀ)) ·
// D_sᵀ) on a stream of its own (the executor's side stream, beside the routed path); +0 without
// shared experts. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "core/layer_executor.hpp"
#include "cuda/gemm/cublaslt_gemm.hpp"
#include "cuda/layer/layer_stage_support.hpp"

namespace lmoe::cuda {

class SharedExperts {
 public:
  // `shared_width`: this rank's slice of the shared experts' intermediate dim.
  SharedExperts(const LayerConfig& config, DType dtype, std::int64_t shared_width,
                const LayerWeights& weights);

  // Workspaces for `rows` tokens (the caller has waited for the work that used the old ones).
  void reserve(std::int64_t rows);
  void run(ConstMatrixView x, MatrixView shared, cudaStream_t stream);

 private:
  std::size_t bytes(std::int64_t elements) const {
    return static_cast<std::size_t>(elements) * dtype_size(dtype_);
  }

  LayerConfig config_;
  DType dtype_;
  std::int64_t shared_width_;    // this rank's slice of the shared experts' intermediate dim
  DeviceExpertWeights weights_;  // gate [S_r, d] or empty, up [S_r, d], down [d, S_r]
  // The side stream runs at the same time as the main one: a GEMM workspace of its own.
  std::unique_ptr<CublasLtGemm> gemm_;

  DeviceBuffer shared_up_acc_;    // [T, S_r] fp32
  DeviceBuffer shared_gate_acc_;  // [T, S_r] fp32 (gated)
  DeviceBuffer shared_hidden_;    // [T, S_r] storage dtype
};

}  // namespace lmoe::cuda
