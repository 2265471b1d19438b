// The CUDA layer's latent down-projection stage: z = round(x · W_downᵀ) [T, l], replicated on every
// rank. Host code only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/layer_executor.hpp"
#include "cuda/gemm/cublaslt_gemm.hpp"
#include "cuda/layer/layer_stage_support.hpp"

namespace lmoe::cuda {

class LatentDownProjection {
 public:
  LatentDownProjection(const LayerConfig& config, DType dtype, const LayerWeights& weights)
      : config_(config), dtype_(dtype), latent_down_(upload(weights.latent_down)) {}

  // Workspace for `rows` tokens (the caller has waited for the work that used the old one).
  void reserve(std::int64_t rows) {
    latent_ = DeviceBuffer(static_cast<std::size_t>(rows * config_.d_latent) * dtype_size(dtype_));
  }

  void run(ConstMatrixView x, CublasLtGemm& gemm, cudaStream_t stream) {
    gemm.run(x.data, latent_down_.data(), config_.d_model, latent_.data(), config_.d_latent, x.rows,
             config_.d_latent, config_.d_model, dtype_, dtype_, stream);
  }

  const DeviceBuffer& latent() const { return latent_; }  // [T, l] z

 private:
  LayerConfig config_;
  DType dtype_;
  DeviceBuffer latent_down_;  // [l, d]
  DeviceBuffer latent_;       // [T, l] z
};

}  // namespace lmoe::cuda
