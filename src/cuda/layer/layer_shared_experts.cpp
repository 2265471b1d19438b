#include "cuda/layer/layer_shared_experts.hpp"

#include "cuda/layer/layer_kernels.hpp"

namespace lmoe::cuda {

SharedExperts::SharedExperts(const LayerConfig& config, DType dtype, std::int64_t shared_width,
                             const LayerWeights& weights)
    : config_(config),
      dtype_(dtype),
      shared_width_(shared_width),
      weights_(weights.shared_gate, weights.shared_up, weights.shared_down),
      gemm_(std::make_unique<CublasLtGemm>()) {}

void SharedExperts::reserve(std::int64_t rows) {
  const bool gated = is_gated(config_.activation);
  shared_up_acc_ = DeviceBuffer(floats(rows * shared_width_));
  shared_gate_acc_ = gated ? DeviceBuffer(floats(rows * shared_width_)) : DeviceBuffer();
  shared_hidden_ = DeviceBuffer(bytes(rows * shared_width_));
}

void SharedExperts::run(ConstMatrixView x, MatrixView shared, cudaStream_t stream) {
  const std::int64_t tokens = x.rows, d = config_.d_model;
  if (shared_width_ == 0) {
    LMOE_CUDA_CHECK(cudaMemsetAsync(shared.data, 0, bytes(tokens * d), stream));
    return;
  }
  gemm_->run(x.data, weights_.up.data(), d, shared_up_acc_.data(), shared_width_, tokens,
             shared_width_, d, dtype_, DType::f32, stream);
  if (is_gated(config_.activation)) {
    gemm_->run(x.data, weights_.gate.data(), d, shared_gate_acc_.data(), shared_width_, tokens,
               shared_width_, d, dtype_, DType::f32, stream);
  }
  check(launch_activation(static_cast<const float*>(shared_gate_acc_.data()),
                          static_cast<const float*>(shared_up_acc_.data()), shared_hidden_.data(),
                          tokens * shared_width_, config_, dtype_, stream),
        "launch_activation");
  gemm_->run(shared_hidden_.data(), weights_.down.data(), shared_width_, shared.data, d, tokens, d,
             shared_width_, dtype_, dtype_, stream);
}

}  // namespace lmoe::cuda
